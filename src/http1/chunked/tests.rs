//! The chunked coding's tests: any chunk sizes, extensions, trailers and read boundaries decode
//! to the body; malformed and oversized framing is an error; the encoder writes what the decoder
//! reads.

use bytes::BytesMut;
use proptest::prelude::*;

use super::*;

/// Decodes `wire` fed in pieces at `cuts`; returns the data and whether the body ended, or
/// the error.
fn decode_in_pieces(
    wire: &[u8],
    cuts: &[usize],
) -> Result<(Vec<u8>, bool, Vec<u8>), ProtocolError> {
    let mut decoder = ChunkedDecoder::default();
    let (mut buf, mut out, mut fed) = (BytesMut::new(), Vec::new(), 0);
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    cuts.push(wire.len());
    cuts.sort_unstable();
    for cut in cuts {
        buf.extend_from_slice(&wire[fed..cut.max(fed)]);
        fed = cut.max(fed);
        loop {
            match decoder.decode(&mut buf)? {
                Decoded::Data(data) => {
                    assert!(!data.is_empty());
                    out.extend_from_slice(&data);
                }
                Decoded::NeedMore => break,
                Decoded::End => {
                    // What follows the body: the buffer and what was not fed yet.
                    let mut rest = buf.to_vec();
                    rest.extend_from_slice(&wire[fed..]);
                    return Ok((out, true, rest));
                }
            }
        }
    }
    // Every piece fed and no end seen.
    Ok((out, false, buf.to_vec()))
}

fn encode_chunked(
    data: &[u8],
    sizes: &[usize],
    extension: bool,
    trailer: bool,
    upper: bool,
) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut at = 0;
    let mut sizes = sizes.iter().cycle();
    while at < data.len() {
        let n = (*sizes.next().expect("cycled")).clamp(1, data.len() - at);
        let size = if upper {
            format!("{n:X}")
        } else {
            format!("{n:x}")
        };
        wire.extend_from_slice(size.as_bytes());
        if extension {
            wire.extend_from_slice(b" ;name=\"v\"");
        }
        wire.extend_from_slice(b"\r\n");
        wire.extend_from_slice(&data[at..at + n]);
        wire.extend_from_slice(b"\r\n");
        at += n;
    }
    wire.extend_from_slice(b"0\r\n");
    if trailer {
        wire.extend_from_slice(b"x-trailer: 1\r\nx-other: two\r\n");
    }
    wire.extend_from_slice(b"\r\n");
    wire
}

proptest! {
    /// Whatever the chunk sizes, extensions, trailers and read boundaries, the decoder hands
    /// out exactly the body, ends exactly at its end, and leaves what follows in the buffer.
    #[test]
    fn a_chunked_body_decodes_to_its_data_in_any_read_pieces(
        data in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..300, 1..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        extension in any::<bool>(),
        trailer in any::<bool>(),
        upper in any::<bool>(),
    ) {
        let mut wire = encode_chunked(&data, &sizes, extension, trailer, upper);
        wire.extend_from_slice(b"HTTP/1.1 next");
        let (out, ended, rest) = decode_in_pieces(&wire, &cuts).expect("valid");
        prop_assert!(ended);
        prop_assert_eq!(out, data);
        prop_assert_eq!(&rest[..], b"HTTP/1.1 next");
    }

    /// Any bytes: an error, more wanted or an end — never a panic, and never more data out
    /// than came in.
    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(
        wire in proptest::collection::vec(any::<u8>(), 0..400),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        if let Ok((out, _, _)) = decode_in_pieces(&wire, &cuts) {
            prop_assert!(out.len() <= wire.len());
        }
    }
}

#[test]
fn malformed_chunked_framing_is_an_error() {
    for (bad, what) in [
        (&b"\r\n"[..], "missing chunk size"),
        (b"g\r\n", "missing chunk size"),
        (b"5 5\r\n", "invalid chunk size"),
        (b"5\n", "invalid chunk size"),
        (b"5\r\rhello", "expected LF after a chunk size"),
        (b"2\r\nokX", "expected CRLF after chunk data"),
        (b"2\r\nok\rX", "expected CRLF after chunk data"),
        (b"1;a\nb\r\n", "bare LF in a chunk-size line"),
        (b"11111111111111111\r\n", "chunk size too large"),
        (b"0\r\n\rX", "expected LF at the body's end"),
    ] {
        assert_eq!(
            decode_in_pieces(bad, &[]).unwrap_err(),
            ProtocolError::Chunked(what),
            "{bad:?}"
        );
    }
    let mut long = b"1;".to_vec();
    long.resize(MAX_CHUNK_LINE_BYTES + 1, b'x');
    assert_eq!(
        decode_in_pieces(&long, &[]).unwrap_err(),
        ProtocolError::Chunked("chunk-size line too long")
    );
    let mut trailers = b"0\r\n".to_vec();
    while trailers.len() < MAX_TRAILER_BYTES + 16 {
        trailers.extend_from_slice(b"x-t: 123456789\r\n");
    }
    assert_eq!(
        decode_in_pieces(&trailers, &[]).unwrap_err(),
        ProtocolError::Chunked("trailers too long")
    );
    // Sixteen hex digits is the most a size may have.
    assert!(decode_in_pieces(b"ffffffffffffffff\r\nabc", &[]).is_ok());
}

#[test]
fn sizes_are_written_in_lowercase_hex() {
    assert_eq!(hex(0, &mut [0; 16]), b"0");
    assert_eq!(hex(0x1f2e, &mut [0; 16]), b"1f2e");
    assert_eq!(
        hex(usize::MAX, &mut [0; 16]),
        format!("{:x}", usize::MAX).as_bytes()
    );
}

#[test]
fn what_the_encoder_writes_the_decoder_reads() {
    let mut wire = Vec::new();
    for data in [&b"hello"[..], &[b'x'; 300][..]] {
        push_size(&mut wire, data.len());
        wire.extend_from_slice(data);
        wire.extend_from_slice(DATA_END);
    }
    wire.extend_from_slice(LAST_CHUNK);
    let (out, ended, rest) = decode_in_pieces(&wire, &[3, 7]).expect("valid");
    assert!(ended);
    assert_eq!(out.len(), 305);
    assert!(rest.is_empty());
}
