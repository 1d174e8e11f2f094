//! Completion tokens after the answer: the relayed body's `usage` is read as it passes (buffered
//! JSON or the SSE stream's usage chunk) and debited from the key's and the serving backend's
//! tokens-per-minute buckets when the body ends (or the client goes away).
//!
//! The scan is byte-level and bounded: it looks for `"completion_tokens"` (chat, completions) or
//! `"output_tokens"` (native Responses) followed by a number, keeps the last value seen (a stream
//! reporting cumulative usage ends with the total), and carries only the last [`KEEP`] bytes of a
//! chunk over to the next. Bodies are wrapped only when a tokens limit applies.
//!
//! A stream continued after a mid-stream cut ([`Handoffs`]) is split: each backend that was cut
//! is charged the completion tokens the client got from it, the one that finished the rest; the
//! key is charged the whole answer once.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::Response;
use futures::StreamExt;

use crate::proxy::{Proxy, ServedBy};

/// Bytes of a chunk kept to find a field split across two chunks.
const KEEP: usize = 64;
const NEEDLES: [&[u8]; 2] = [b"\"completion_tokens\"", b"\"output_tokens\""];

/// The last completion-token count seen in a body.
#[derive(Debug, Default)]
pub struct UsageScan {
    carry: Vec<u8>,
    last: Option<u64>,
}

impl UsageScan {
    /// Reads one body chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        if !self.carry.is_empty() {
            let mut joint = std::mem::take(&mut self.carry);
            joint.extend_from_slice(&chunk[..chunk.len().min(KEEP)]);
            self.scan(&joint);
        }
        self.scan(chunk);
        self.carry = chunk[chunk.len().saturating_sub(KEEP)..].to_vec();
    }

    /// The count, when the body carried one.
    pub fn completion_tokens(&self) -> Option<u64> {
        self.last
    }

    fn scan(&mut self, bytes: &[u8]) {
        let mut found: Option<(usize, u64)> = None;
        for needle in NEEDLES {
            let starts = bytes.windows(needle.len()).enumerate();
            for at in starts.filter_map(|(at, w)| (w == needle).then_some(at)) {
                if let Some(n) = number_after(&bytes[at + needle.len()..])
                    && found.is_none_or(|(p, _)| at > p)
                {
                    found = Some((at, n));
                }
            }
        }
        if let Some((_, n)) = found {
            self.last = Some(n);
        }
    }
}

/// `: 123` (whitespace allowed) followed by a non-digit; `None` when cut off or not a number.
fn number_after(rest: &[u8]) -> Option<u64> {
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() || digits > 19 {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// The backends of an armed stream (a response extension): those cut mid-answer with the
/// completion tokens each had sent, and the one serving now. The armed stream records each
/// hand-off; the debit reads it when the body ends.
#[derive(Clone, Debug, Default)]
pub struct Handoffs(Arc<Mutex<HandoffLog>>);

#[derive(Debug, Default)]
struct HandoffLog {
    cut: Vec<(Arc<str>, u64)>,
    serving: Option<Arc<str>>,
}

impl Handoffs {
    /// A stream served by `serving` (its `ServedBy`), not cut yet.
    pub fn new(serving: Option<Arc<str>>) -> Self {
        Self(Arc::new(Mutex::new(HandoffLog {
            cut: Vec::new(),
            serving,
        })))
    }

    /// The serving backend was cut after `sent` completion tokens in all (every part so far);
    /// `next` serves the rest.
    pub fn hand_off(&self, sent: u64, next: Option<Arc<str>>) {
        let mut log = self.lock();
        let before: u64 = log.cut.iter().map(|(_, t)| t).sum();
        if let Some(cut) = log.serving.take() {
            log.cut.push((cut, sent.saturating_sub(before)));
        }
        log.serving = next;
    }

    /// `total` completion tokens split over the backends: each cut one its part (capped by what
    /// is left), the serving one the rest.
    pub fn charges(&self, total: u64) -> Vec<(Option<Arc<str>>, u64)> {
        let log = self.lock();
        let mut left = total;
        let mut out = Vec::with_capacity(log.cut.len() + 1);
        for (backend, sent) in &log.cut {
            let part = (*sent).min(left);
            left -= part;
            out.push((Some(backend.clone()), part));
        }
        out.push((log.serving.clone(), left));
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HandoffLog> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Debits the scanned count when dropped (the body ended or was abandoned).
struct Debit {
    scan: UsageScan,
    proxy: Arc<Proxy>,
    key: Option<String>,
    backend: Option<Arc<str>>,
    /// An armed stream's backends (the count is split over them).
    handoffs: Option<Handoffs>,
}

impl Drop for Debit {
    fn drop(&mut self) {
        let Some(tokens) = self.scan.completion_tokens() else {
            return;
        };
        let now = self.proxy.now();
        let limits = self.proxy.limits();
        let key = self.key.as_deref();
        match &self.handoffs {
            None => limits.debit_completion(key, self.backend.as_deref(), now, tokens),
            Some(handoffs) => {
                limits.debit_completion(key, None, now, tokens);
                for (backend, part) in handoffs.charges(tokens) {
                    limits.debit_completion(None, backend.as_deref(), now, part);
                }
            }
        }
    }
}

/// `resp` with its completion tokens debited after the body, when a tokens limit of the key or
/// of the serving backend applies; otherwise `resp` untouched.
pub fn debit_completion(
    proxy: &Arc<Proxy>,
    key: Option<&str>,
    resp: Response<Body>,
) -> Response<Body> {
    if !resp.status().is_success() {
        return resp;
    }
    let backend = resp.extensions().get::<ServedBy>().map(|s| s.0.clone());
    let handoffs = resp.extensions().get::<Handoffs>().cloned();
    let limits = proxy.limits();
    let counted = limits.counts_tokens(key, backend.as_deref())
        || (handoffs.is_some() && limits.counts_any_backend_tokens());
    if !counted {
        return resp;
    }
    let mut debit = Debit {
        scan: UsageScan::default(),
        proxy: proxy.clone(),
        key: key.map(str::to_owned),
        backend,
        handoffs,
    };
    resp.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            if let Ok(bytes) = &chunk {
                debit.scan.push(bytes);
            }
            chunk
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::{Handoffs, UsageScan};

    /// Each cut backend pays for what it sent, the finisher for the rest, never more than the
    /// answer's count in all.
    #[test]
    fn a_continued_answer_is_split_over_its_backends() {
        let name = |s: &str| Some(std::sync::Arc::<str>::from(s));
        let h = Handoffs::new(name("b1"));
        assert_eq!(h.charges(9), vec![(name("b1"), 9)], "not cut: one backend");
        h.hand_off(4, name("b2"));
        h.hand_off(10, name("b3"));
        assert_eq!(
            h.charges(25),
            vec![(name("b1"), 4), (name("b2"), 6), (name("b3"), 15)]
        );
        assert_eq!(
            h.charges(7),
            vec![(name("b1"), 4), (name("b2"), 3), (name("b3"), 0)]
        );
    }

    fn scan(chunks: &[&str]) -> Option<u64> {
        let mut s = UsageScan::default();
        chunks.iter().for_each(|c| s.push(c.as_bytes()));
        s.completion_tokens()
    }

    #[test]
    fn the_last_count_is_read_across_chunk_boundaries() {
        let body = r#"{"usage":{"prompt_tokens":9,"completion_tokens": 1234,"total_tokens":1243}}"#;
        for split in 0..body.len() {
            let (a, b) = body.split_at(split);
            assert_eq!(scan(&[a, b]), Some(1234), "split at {split}");
        }
        assert_eq!(
            scan(&[
                "data: {\"usage\":{\"completion_tokens\":3}}\n\n",
                "data: {\"usage\":{\"completion_tokens\":7}}\n\ndata: [DONE]\n\n"
            ]),
            Some(7)
        );
        assert_eq!(scan(&[r#"{"usage":{"output_tokens":42}}"#]), Some(42));
        assert_eq!(scan(&[r#"{"choices":[]}"#]), None);
        assert_eq!(scan(&[r#"{"completion_tokens":"x"}"#]), None);
    }
}
