//! A small, allocation-free msgpack reader for the event-plane envelope and ActiveLoad.
//!
//! rmp-serde would do, but the decoders here run on every load sample, must never allocate on a
//! hostile length, and only need unsigned integers, strings, binaries, nil and skipping. Every
//! declared length is checked against the bytes actually present before it is used.

use thiserror::Error;

/// Nesting depth up to which unknown values are skipped.
const MAX_SKIP_DEPTH: u32 = 32;

/// Why a msgpack value could not be read.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackError {
    #[error("msgpack value truncated")]
    Truncated,
    #[error("unexpected msgpack marker {marker:#04x} where {expected} was expected")]
    UnexpectedType { marker: u8, expected: &'static str },
    #[error("negative integer where an unsigned one was expected")]
    NegativeInteger,
    #[error("integer {0} does not fit the field")]
    IntegerOverflow(u64),
    #[error("msgpack nesting deeper than {MAX_SKIP_DEPTH}")]
    TooDeep,
    #[error("field {0} appears twice")]
    DuplicateField(&'static str),
    #[error("required field {0} is missing")]
    MissingField(&'static str),
    #[error("string is not UTF-8")]
    InvalidUtf8,
}

/// A map or an array header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Container {
    Map(usize),
    Array(usize),
}

/// A cursor over one msgpack buffer.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        if n > self.remaining() {
            return Err(MsgpackError::Truncated);
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, MsgpackError> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn peek(&self) -> Result<u8, MsgpackError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(MsgpackError::Truncated)
    }

    /// A map or array header. The declared count is checked against the bytes left (every
    /// element takes at least one byte), so callers may loop over it safely.
    pub fn container(&mut self) -> Result<Container, MsgpackError> {
        let marker = self.byte()?;
        let container = match marker {
            0x80..=0x8f => Container::Map(usize::from(marker & 0x0f)),
            0x90..=0x9f => Container::Array(usize::from(marker & 0x0f)),
            0xdc => Container::Array(self.be(2)? as usize),
            0xdd => Container::Array(self.be(4)? as usize),
            0xde => Container::Map(self.be(2)? as usize),
            0xdf => Container::Map(self.be(4)? as usize),
            _ => {
                return Err(MsgpackError::UnexpectedType {
                    marker,
                    expected: "map or array",
                });
            }
        };
        let min_bytes = match container {
            Container::Map(n) => n.saturating_mul(2),
            Container::Array(n) => n,
        };
        if min_bytes > self.remaining() {
            return Err(MsgpackError::Truncated);
        }
        Ok(container)
    }

    /// Any msgpack integer that is not negative.
    pub fn uint(&mut self) -> Result<u64, MsgpackError> {
        let marker = self.byte()?;
        match marker {
            0x00..=0x7f => Ok(u64::from(marker)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            0xd0..=0xd3 => {
                let width = 1usize << (marker - 0xd0);
                let raw = self.be(width)?;
                let sign_bit = 1u64 << (width * 8 - 1);
                if raw & sign_bit != 0 {
                    Err(MsgpackError::NegativeInteger)
                } else {
                    Ok(raw)
                }
            }
            0xe0..=0xff => Err(MsgpackError::NegativeInteger),
            _ => Err(MsgpackError::UnexpectedType {
                marker,
                expected: "unsigned integer",
            }),
        }
    }

    /// `nil` or an unsigned integer.
    pub fn opt_uint(&mut self) -> Result<Option<u64>, MsgpackError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        self.uint().map(Some)
    }

    /// A string's bytes (not checked for UTF-8: callers compare them to ASCII keys).
    pub fn str_bytes(&mut self) -> Result<&'a [u8], MsgpackError> {
        let marker = self.byte()?;
        let len = match marker {
            0xa0..=0xbf => usize::from(marker & 0x1f),
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => {
                return Err(MsgpackError::UnexpectedType {
                    marker,
                    expected: "string",
                });
            }
        };
        self.take(len)
    }

    pub fn str(&mut self) -> Result<&'a str, MsgpackError> {
        std::str::from_utf8(self.str_bytes()?).map_err(|_| MsgpackError::InvalidUtf8)
    }

    /// A binary's bytes.
    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let marker = self.byte()?;
        let len = match marker {
            0xc4 => self.be(1)? as usize,
            0xc5 => self.be(2)? as usize,
            0xc6 => self.be(4)? as usize,
            _ => {
                return Err(MsgpackError::UnexpectedType {
                    marker,
                    expected: "binary",
                });
            }
        };
        self.take(len)
    }

    /// Skips one value of any type (unknown fields).
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: u32) -> Result<(), MsgpackError> {
        if depth > MAX_SKIP_DEPTH {
            return Err(MsgpackError::TooDeep);
        }
        let marker = self.peek()?;
        let fixed = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Some(1),
            0xcc | 0xd0 => Some(2),
            0xcd | 0xd1 | 0xd4 => Some(3),
            0xd5 => Some(4),
            0xce | 0xd2 | 0xca => Some(5),
            0xd6 => Some(6),
            0xcf | 0xd3 | 0xcb => Some(9),
            0xd7 => Some(10),
            0xd8 => Some(18),
            _ => None,
        };
        if let Some(n) = fixed {
            self.take(n)?;
            return Ok(());
        }
        match marker {
            0xa0..=0xbf | 0xd9..=0xdb => self.str_bytes().map(drop),
            0xc4..=0xc6 => self.bin().map(drop),
            0xc7..=0xc9 => {
                self.pos += 1;
                let len = self.be(1 << (marker - 0xc7))? as usize;
                self.take(len.saturating_add(1)).map(drop)
            }
            0x80..=0x8f | 0x90..=0x9f | 0xdc..=0xdf => {
                let count = match self.container()? {
                    Container::Map(n) => n.saturating_mul(2),
                    Container::Array(n) => n,
                };
                for _ in 0..count {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            // 0xc1 is "never used".
            _ => Err(MsgpackError::UnexpectedType {
                marker,
                expected: "a msgpack value",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width_and_sign_rules() {
        let cases: &[(&[u8], Result<u64, MsgpackError>)] = &[
            (&[0x2a], Ok(42)),
            (&[0xcc, 0xff], Ok(255)),
            (&[0xcd, 0x01, 0x2c], Ok(300)),
            (&[0xce, 0, 1, 0, 0], Ok(65536)),
            (
                &[0xcf, 0x69, 0x4d, 0x98, 0xc5, 0x8f, 0x59, 0x99, 0x13],
                Ok(7587888921470146835),
            ),
            (&[0xd0, 0x05], Ok(5)),
            (&[0xd0, 0xff], Err(MsgpackError::NegativeInteger)),
            (&[0xd3, 0, 0, 0, 0, 0, 0, 0, 9], Ok(9)),
            (&[0xff], Err(MsgpackError::NegativeInteger)),
            (&[0xcf, 0, 0], Err(MsgpackError::Truncated)),
            (&[], Err(MsgpackError::Truncated)),
            (
                &[0xc3],
                Err(MsgpackError::UnexpectedType {
                    marker: 0xc3,
                    expected: "unsigned integer",
                }),
            ),
        ];
        for (bytes, expected) in cases {
            assert_eq!(Reader::new(bytes).uint(), *expected, "{bytes:02x?}");
        }
        assert_eq!(Reader::new(&[0xc0]).opt_uint(), Ok(None));
    }

    #[test]
    fn declared_lengths_beyond_the_buffer_are_truncation() {
        assert_eq!(
            Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']).str_bytes(),
            Err(MsgpackError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xc6, 0xff, 0xff, 0xff, 0xff]).bin(),
            Err(MsgpackError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xdf, 0xff, 0xff, 0xff, 0xff, 0]).container(),
            Err(MsgpackError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xdd, 0, 0, 0, 2, 1]).container(),
            Err(MsgpackError::Truncated)
        );
    }

    #[test]
    fn skip_passes_every_type_and_bounds_depth() {
        // {"a": [1, -1, 1.5f64, "x", bin"yz", nil, true, ext8], "b": {}}
        let value = [
            0x82, 0xa1, b'a', 0x98, 0x01, 0xff, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0xa1, b'x',
            0xc4, 2, b'y', b'z', 0xc0, 0xc3, 0xc7, 1, 5, 0xaa, 0xa1, b'b', 0x80,
        ];
        let mut reader = Reader::new(&value);
        reader.skip().unwrap();
        assert_eq!(reader.position(), value.len());
        let deep = [0x91u8; 64];
        assert!(Reader::new(&deep).skip().is_err());
        assert_eq!(
            Reader::new(&[0xc1]).skip().unwrap_err(),
            MsgpackError::UnexpectedType {
                marker: 0xc1,
                expected: "a msgpack value"
            }
        );
    }
}
