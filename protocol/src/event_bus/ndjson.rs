//! Bounded NDJSON line framing for the control channel.
//!
//! The limit is checked before any byte is copied: a line that would exceed `max_line_bytes`
//! (its newline included) is an error without growing the buffer, so a peer that never sends
//! `\n` costs at most `max_line_bytes` of memory. A `\r` before the `\n` is stripped and empty
//! lines are skipped (keep-alive padding is harmless).

use super::message::DecodeError;

/// Splits a byte stream into lines of at most `max_line_bytes` bytes (newline included).
#[derive(Debug)]
pub struct LineDecoder {
    buf: Vec<u8>,
    max_line_bytes: usize,
    failed: bool,
}

impl LineDecoder {
    pub fn new(max_line_bytes: usize) -> Self {
        Self {
            buf: Vec::new(),
            max_line_bytes: max_line_bytes.max(2),
            failed: false,
        }
    }

    /// Bytes of a partial line held now (never above `max_line_bytes - 1`).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Consumes bytes from the front of `input` up to and including the next newline.
    /// Returns how many bytes were consumed and the completed line, if any (without `\r\n`).
    /// Call again with the rest of `input` until it is empty. After an error every later call
    /// fails too: the stream has lost its framing.
    pub fn decode(&mut self, input: &[u8]) -> Result<(usize, Option<Vec<u8>>), DecodeError> {
        let limit = self.max_line_bytes;
        if self.failed {
            return Err(DecodeError::LineTooLong { limit });
        }
        match input.iter().position(|&b| b == b'\n') {
            Some(end) => {
                if self.buf.len() + end + 1 > limit {
                    return self.fail();
                }
                let mut line = if self.buf.is_empty() {
                    input[..end].to_vec()
                } else {
                    let mut line = std::mem::take(&mut self.buf);
                    line.extend_from_slice(&input[..end]);
                    line
                };
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                let line = (!line.is_empty()).then_some(line);
                Ok((end + 1, line))
            }
            None => {
                // Without its newline the line is still at least one byte longer.
                if self.buf.len() + input.len() + 1 > limit {
                    return self.fail();
                }
                self.buf.extend_from_slice(input);
                Ok((input.len(), None))
            }
        }
    }

    /// Decodes every complete line of `input`, calling `on_line` for each; stops at the first
    /// framing error.
    pub fn decode_all(
        &mut self,
        mut input: &[u8],
        mut on_line: impl FnMut(Vec<u8>),
    ) -> Result<(), DecodeError> {
        while !input.is_empty() {
            let (consumed, line) = self.decode(input)?;
            input = &input[consumed..];
            if let Some(line) = line {
                on_line(line);
            }
        }
        Ok(())
    }

    fn fail(&mut self) -> Result<(usize, Option<Vec<u8>>), DecodeError> {
        self.failed = true;
        self.buf = Vec::new();
        Err(DecodeError::LineTooLong {
            limit: self.max_line_bytes,
        })
    }
}
