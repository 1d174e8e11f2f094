//! The step both roles share once `httparse` took a head: where each field's name and value sit
//! in the read buffer ([`Spans`], offsets recorded while httparse's borrow lasts), and the header
//! map built from the head's bytes once they are split off the buffer, each value sharing them
//! instead of being copied ([`Spans::map`]).

use std::fmt;
use std::mem::MaybeUninit;

use bytes::Bytes;
use http::header::{InvalidHeaderName, InvalidHeaderValue};
use http::{HeaderMap, HeaderName, HeaderValue};

use super::MAX_HEADERS;

/// httparse's field slots, left uninitialised (it writes the ones it fills).
pub(super) type Slots<'b> = [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS];

/// Empty field slots for one parse.
pub(super) fn slots<'b>() -> Slots<'b> {
    [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS]
}

/// Where each field of a head lies: (name offset, name length, value offset, value length),
/// offsets from the start of the buffer httparse read.
pub(super) struct Spans {
    spans: [(u32, u32, u32, u32); MAX_HEADERS],
    count: usize,
}

/// A field that cannot be one of an `http::HeaderMap`, or lies outside the head (which httparse
/// never hands out; checked all the same, so that it is an error and not a panic).
#[derive(Debug)]
pub(super) enum FieldError {
    Outside,
    Name(InvalidHeaderName),
    Value(InvalidHeaderValue),
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Outside => f.write_str("a header field outside the head"),
            Self::Name(error) => error.fmt(f),
            Self::Value(error) => error.fmt(f),
        }
    }
}

impl Spans {
    /// Records where `fields` (httparse's, of `buf`) lie in `buf`.
    pub(super) fn record(buf: &[u8], fields: &[httparse::Header<'_>]) -> Self {
        let start = buf.as_ptr() as usize;
        let at = |slice: &[u8]| {
            u32::try_from((slice.as_ptr() as usize).wrapping_sub(start)).unwrap_or(u32::MAX)
        };
        let length = |slice: &[u8]| u32::try_from(slice.len()).unwrap_or(u32::MAX);
        let mut spans = [(0u32, 0u32, 0u32, 0u32); MAX_HEADERS];
        for (span, field) in spans.iter_mut().zip(fields) {
            let name = field.name.as_bytes();
            *span = (at(name), length(name), at(field.value), length(field.value));
        }
        Self {
            spans,
            count: fields.len().min(MAX_HEADERS),
        }
    }

    /// The head's fields as a header map with room for `room` more, its values sharing `head`'s
    /// bytes. `skip` sees each field's name and value first and drops the field when it says
    /// so (the client's control fields).
    pub(super) fn map<'h>(
        &self,
        head: &'h Bytes,
        room: usize,
        mut skip: impl FnMut(&'h [u8], &'h [u8]) -> bool,
    ) -> Result<HeaderMap, FieldError> {
        let mut headers = HeaderMap::with_capacity(self.count + room);
        for &(name_at, name_len, value_at, value_len) in &self.spans[..self.count] {
            let (name_at, value_at) = (name_at as usize, value_at as usize);
            let name = head
                .get(name_at..name_at + name_len as usize)
                .ok_or(FieldError::Outside)?;
            let value_end = value_at + value_len as usize;
            let value = head.get(value_at..value_end).ok_or(FieldError::Outside)?;
            if skip(name, value) {
                continue;
            }
            let name = HeaderName::from_bytes(name).map_err(FieldError::Name)?;
            let value = if value.is_empty() {
                HeaderValue::from_static("")
            } else {
                HeaderValue::from_maybe_shared(head.slice(value_at..value_end))
                    .map_err(FieldError::Value)?
            };
            headers.append(name, value);
        }
        Ok(headers)
    }
}
