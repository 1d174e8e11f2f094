//! Relaying an upstream frame without copying it (issue 31's CPU goal): while a frame holds
//! whole events the original stream relays as they are, what leaves is the frame's own prefix,
//! and the caller forwards those bytes untouched (a `Bytes` slice, no copy). A frame that starts
//! inside an event, or an event that is rewritten, dropped or normalised, is copied as
//! [`ChatSplice::feed`] does; both decide the same (a property test compares them).

use super::{ChatSplice, CutReason};

/// What one event becomes on the client stream.
pub(super) enum Relay {
    /// The event as it came (plus its blank line).
    Event,
    /// The one `[DONE]`.
    Done,
    /// Nothing (a second `[DONE]`, anything after it, a comment in a continuation).
    Nothing,
    /// A continuation chunk rewritten to the original stream's identity (the JSON data).
    Rewritten(String),
}

/// `data: [DONE]` as the relay writes it.
const DONE_EVENT: &[u8] = b"data: [DONE]";

impl Relay {
    /// Appends the event's relayed bytes to `out`.
    pub(super) fn write(self, event: &[u8], out: &mut Vec<u8>) {
        match self {
            Self::Event => out.extend_from_slice(event),
            Self::Done => out.extend_from_slice(DONE_EVENT),
            Self::Nothing => return,
            Self::Rewritten(data) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(data.as_bytes());
            }
        }
        out.extend_from_slice(b"\n\n");
    }

    /// Whether the relayed bytes are exactly `event` and its blank line `sep` as they came.
    fn verbatim(&self, event: &[u8], sep: &[u8]) -> bool {
        sep == b"\n\n"
            && match self {
                Self::Event => true,
                Self::Done => event == DONE_EVENT,
                Self::Nothing | Self::Rewritten(_) => false,
            }
    }
}

/// The bytes [`ChatSplice::feed_frame`] relays.
#[derive(Debug, PartialEq, Eq)]
pub enum Relayed {
    /// The frame's first `n` bytes, as they are.
    Prefix(usize),
    /// Bytes built from the frame (and the partial event before it).
    Copied(Vec<u8>),
}

impl Relayed {
    /// Whether nothing is relayed.
    pub fn is_empty(&self) -> bool {
        match self {
            Self::Prefix(n) => *n == 0,
            Self::Copied(out) => out.is_empty(),
        }
    }
}

impl ChatSplice {
    /// [`ChatSplice::feed`] for one upstream frame: the same events read, the same decisions,
    /// the same bytes relayed, but while the frame's events pass as they are the relayed bytes
    /// are named as a prefix of `frame` instead of copied.
    pub fn feed_frame(&mut self, frame: &[u8]) -> (Relayed, Option<CutReason>) {
        if !self.partial.is_empty() {
            let fed = self.feed(frame);
            return (Relayed::Copied(fed.out), fed.cut);
        }
        // `None` while the relayed bytes are `frame[..start]`.
        let mut copied: Option<Vec<u8>> = None;
        let mut start = 0;
        loop {
            // The common event first: a plain content chunk of the stream's shape, matched in
            // one pass (no search for its end, no second one for its data line).
            if let Some(len) = self.read_shaped_event(&frame[start..]) {
                if let Some(out) = &mut copied {
                    out.extend_from_slice(&frame[start..start + len]);
                }
                start += len;
                if start == frame.len() {
                    break;
                }
                continue;
            }
            let Some((end, next)) = super::event_end(&frame[start..]) else {
                break;
            };
            let event = &frame[start..start + end];
            let relay = match self.relay(event) {
                Ok(relay) => relay,
                Err(reason) => return (relayed(copied, start), Some(reason)),
            };
            match &mut copied {
                None if relay.verbatim(event, &frame[start + end..start + next]) => {}
                None => {
                    let mut out = frame[..start].to_vec();
                    relay.write(event, &mut out);
                    copied = Some(out);
                }
                Some(out) => relay.write(event, out),
            }
            start += next;
        }
        let rest = &frame[start..];
        if rest.len() > self.max_event_bytes {
            return (relayed(copied, start), Some(CutReason::Closed));
        }
        self.partial.extend_from_slice(rest);
        (relayed(copied, start), None)
    }
}

fn relayed(copied: Option<Vec<u8>>, start: usize) -> Relayed {
    copied.map_or(Relayed::Prefix(start), Relayed::Copied)
}
