//! The ingresses' SSE reader: the `data` payloads of a chat-completions event stream, bounded.

/// Splits an SSE byte stream into the `data` payloads of its events (multi-line `data:` fields
/// joined with `\n`; comments, `event:`, `id:` and `retry:` lines ignored). At most `max` bytes
/// of an unfinished line plus the event's data are buffered.
#[derive(Debug)]
pub struct SseDecoder {
    line: Vec<u8>,
    data: Option<Vec<u8>>,
    max: usize,
}

impl SseDecoder {
    pub fn new(max: usize) -> Self {
        Self {
            line: Vec::new(),
            data: None,
            max,
        }
    }

    /// Feeds bytes; returns the payloads of the events they complete. `Err` when an event
    /// outgrows the bound (the decoder is then reset).
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(pos);
            rest = &tail[1..];
            self.line.extend_from_slice(head);
            self.check()?;
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.line_done(&line, &mut out);
        }
        self.line.extend_from_slice(rest);
        self.check()?;
        Ok(out)
    }

    fn check(&mut self) -> Result<(), String> {
        let held = self.line.len() + self.data.as_ref().map_or(0, Vec::len);
        if held > self.max {
            self.line.clear();
            self.data = None;
            return Err(format!("an upstream SSE event exceeds {} bytes", self.max));
        }
        Ok(())
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<Vec<u8>>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                out.push(data);
            }
            return;
        }
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match &mut self.data {
                Some(data) => {
                    data.push(b'\n');
                    data.extend_from_slice(value);
                }
                None => self.data = Some(value.to_vec()),
            }
        }
    }

    /// End of stream: the payload of an event left without its blank line, if any.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let line = std::mem::take(&mut self.line);
        let mut out = Vec::new();
        if !line.is_empty() {
            self.line_done(&line, &mut out);
        }
        self.data.take().or_else(|| out.pop())
    }
}

#[cfg(test)]
mod tests {
    use super::SseDecoder;

    #[test]
    fn sse_events_split_across_chunks_and_lines() {
        let mut d = SseDecoder::new(1024);
        assert!(d.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(
            d.push(b":1}\r\n\r\n: comment\nevent: x\ndata: [DONE]\n\ndata: p\ndata: q\n\n")
                .unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"[DONE]".to_vec(), b"p\nq".to_vec()]
        );
        assert!(d.push(b"data:tail").unwrap().is_empty());
        assert_eq!(d.finish(), Some(b"tail".to_vec()));
        assert_eq!(d.finish(), None);
    }

    #[test]
    fn an_event_over_the_bound_is_refused() {
        let mut d = SseDecoder::new(8);
        assert!(d.push(b"data: 0123456789").is_err());
        assert_eq!(d.push(b"data: ok\n\n").unwrap(), vec![b"ok".to_vec()]);
    }
}
