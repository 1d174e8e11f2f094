//! The chunked transfer coding (RFC 9112 §7.1): the decoder the client reads a response body
//! with, which consumes framing from the read buffer and hands out every chunk already read
//! without copying, and the encoder the server writes an answer of unknown length with.
//!
//! Both bounded: a chunk-size line and the trailer section have a byte bound, a size has at most
//! sixteen hex digits, and a malformed byte is an error, never a panic.

use bytes::{Buf, Bytes, BytesMut};

use super::ProtocolError;

/// Most bytes of one chunk-size line (the size, extensions and the CRLF).
pub const MAX_CHUNK_LINE_BYTES: usize = 4096;

/// Most bytes of a chunked body's trailer section (read and dropped).
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// What one step of the chunked decoder found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Body bytes (never empty).
    Data(Bytes),
    /// The buffer ends inside framing or before data: read more.
    NeedMore,
    /// The last chunk and the trailers were read: the body ended.
    End,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Reading the size's hex digits (`digits` read so far).
    Size {
        value: u64,
        digits: u8,
    },
    /// Whitespace after the size, before a `;` or the CR.
    SizeWs {
        value: u64,
    },
    /// A chunk extension (read and dropped), up to the CR.
    Extension {
        value: u64,
    },
    /// The LF after a size line's CR.
    SizeLf {
        value: u64,
    },
    /// Inside a chunk's data.
    Data {
        left: u64,
    },
    DataCr,
    DataLf,
    /// At the start of a trailer line (or of the final empty line).
    TrailerStart,
    /// Inside a trailer field.
    TrailerLine,
    /// The LF of the final empty line.
    EndLf,
    Ended,
}

/// The `Transfer-Encoding: chunked` decoder: consumes framing from the read buffer and hands
/// chunk data out of it without copying.
#[derive(Debug)]
pub struct ChunkedDecoder {
    state: State,
    /// Bytes of the current chunk-size line.
    line: usize,
    /// Bytes of the trailer section.
    trailers: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self {
            state: State::Size {
                value: 0,
                digits: 0,
            },
            line: 0,
            trailers: 0,
        }
    }
}

impl ChunkedDecoder {
    /// Decodes from the front of `buf` until it has data to hand out, needs more bytes, or the
    /// body ended.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, ProtocolError> {
        loop {
            if let State::Data { left } = self.state {
                if buf.is_empty() {
                    return Ok(Decoded::NeedMore);
                }
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                let left = left - take as u64;
                self.state = if left == 0 {
                    State::DataCr
                } else {
                    State::Data { left }
                };
                return Ok(Decoded::Data(buf.split_to(take).freeze()));
            }
            if self.state == State::Ended {
                return Ok(Decoded::End);
            }
            let Some(&byte) = buf.first() else {
                return Ok(Decoded::NeedMore);
            };
            buf.advance(1);
            self.step(byte)?;
        }
    }

    /// One framing byte.
    fn step(&mut self, byte: u8) -> Result<(), ProtocolError> {
        match self.state {
            State::Size { .. }
            | State::SizeWs { .. }
            | State::Extension { .. }
            | State::SizeLf { .. } => {
                self.line += 1;
                if self.line > MAX_CHUNK_LINE_BYTES {
                    return Err(ProtocolError::Chunked("chunk-size line too long"));
                }
            }
            State::TrailerStart | State::TrailerLine | State::EndLf => {
                self.trailers += 1;
                if self.trailers > MAX_TRAILER_BYTES {
                    return Err(ProtocolError::Chunked("trailers too long"));
                }
            }
            _ => {}
        }
        self.state = match (self.state, byte) {
            (State::Size { value, digits }, b) if b.is_ascii_hexdigit() => {
                if digits == 16 {
                    return Err(ProtocolError::Chunked("chunk size too large"));
                }
                let digit = u64::from((b as char).to_digit(16).unwrap_or_default());
                State::Size {
                    value: (value << 4) | digit,
                    digits: digits + 1,
                }
            }
            (State::Size { digits: 0, .. }, _) => {
                return Err(ProtocolError::Chunked("missing chunk size"));
            }
            (State::Size { value, .. } | State::SizeWs { value }, b'\r') => State::SizeLf { value },
            (State::Size { value, .. } | State::SizeWs { value }, b' ' | b'\t') => {
                State::SizeWs { value }
            }
            (State::Size { value, .. } | State::SizeWs { value }, b';') => {
                State::Extension { value }
            }
            (State::Size { .. } | State::SizeWs { .. }, _) => {
                return Err(ProtocolError::Chunked("invalid chunk size"));
            }
            (State::Extension { value }, b'\r') => State::SizeLf { value },
            (State::Extension { .. }, b'\n') => {
                return Err(ProtocolError::Chunked("bare LF in a chunk-size line"));
            }
            (State::Extension { value }, _) => State::Extension { value },
            (State::SizeLf { value }, b'\n') => {
                self.line = 0;
                if value == 0 {
                    State::TrailerStart
                } else {
                    State::Data { left: value }
                }
            }
            (State::SizeLf { .. }, _) => {
                return Err(ProtocolError::Chunked("expected LF after a chunk size"));
            }
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataLf, b'\n') => State::Size {
                value: 0,
                digits: 0,
            },
            (State::DataCr | State::DataLf, _) => {
                return Err(ProtocolError::Chunked("expected CRLF after chunk data"));
            }
            (State::TrailerStart, b'\r') => State::EndLf,
            (State::TrailerStart | State::TrailerLine, b'\n') => State::TrailerStart,
            (State::TrailerStart | State::TrailerLine, _) => State::TrailerLine,
            (State::EndLf, b'\n') => State::Ended,
            (State::EndLf, _) => {
                return Err(ProtocolError::Chunked("expected LF at the body's end"));
            }
            (State::Data { .. } | State::Ended, _) => self.state,
        };
        Ok(())
    }
}

/// Appends a chunk's size line (its size in lowercase hexadecimal, CRLF) for `len` data bytes.
pub fn push_size(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(hex(len, &mut [0; 16]));
    out.extend_from_slice(b"\r\n");
}

/// What follows a chunk's data.
pub const DATA_END: &[u8] = b"\r\n";

/// The last chunk, with no trailers: the body's end.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// `n` in lowercase hexadecimal.
fn hex(mut n: usize, digits: &mut [u8; 16]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            return &digits[at..];
        }
    }
}

#[cfg(test)]
mod tests;
