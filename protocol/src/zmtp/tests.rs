//! Tests of the ZMTP SUB state machine against hand-built peer bytes.

use proptest::prelude::*;

use super::*;

/// A libzmq 4.3 PUB greeting: version 3.1, NULL, as-server 0.
fn peer_greeting() -> Vec<u8> {
    let mut g = GREETING.to_vec();
    g[11] = 1;
    g
}

fn command(name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    frame(FLAG_COMMAND, &body)
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
    out
}

fn property(name: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = vec![name.len() as u8];
    out.extend_from_slice(name);
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
    out
}

fn ready(socket_type: &[u8]) -> Vec<u8> {
    command(b"READY", &property(b"Socket-Type", socket_type))
}

fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, body) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        out.extend(frame(more, body));
    }
    out
}

fn handshake() -> Vec<u8> {
    let mut bytes = peer_greeting();
    bytes.extend(ready(b"PUB"));
    bytes
}

/// A client past the handshake, with its outgoing bytes drained.
fn open_client(limits: ZmtpLimits) -> ZmtpSub {
    let mut sub = ZmtpSub::new(b"kv_metrics", limits).unwrap();
    sub.feed(&handshake(), |d| panic!("unexpected delivery {d:?}"))
        .unwrap();
    assert!(sub.is_open());
    let mut sent = Vec::new();
    sub.take_outgoing(&mut sent);
    sub
}

fn collect(sub: &mut ZmtpSub, bytes: &[u8]) -> Result<Vec<Delivery>, ZmtpError> {
    let mut out = Vec::new();
    sub.feed(bytes, |d| out.push(d))?;
    Ok(out)
}

fn frames_of(delivery: &Delivery) -> Vec<Vec<u8>> {
    match delivery {
        Delivery::Message(m) => m.frames().map(<[u8]>::to_vec).collect(),
        Delivery::Discarded(d) => panic!("discarded: {d:?}"),
    }
}

#[test]
fn handshake_sends_greeting_ready_then_subscription() {
    let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
    assert_eq!(sub.poll_transmit(), Some(&GREETING[..]));
    assert_eq!(&GREETING[..12], b"\xff\0\0\0\0\0\0\0\0\x7f\x03\x00");
    assert_eq!(&GREETING[12..17], b"NULL\0");
    assert_eq!(GREETING[32], 0, "as-server is 0");
    sub.advance_transmit(10);
    assert_eq!(sub.poll_transmit(), Some(&GREETING[10..]));
    sub.advance_transmit(54);
    assert_eq!(sub.poll_transmit(), None);

    sub.feed(&peer_greeting(), |_| {}).unwrap();
    assert_eq!(sub.peer_minor_version(), 1);
    assert_eq!(sub.poll_transmit(), Some(&READY_SUB[..]));
    assert_eq!(READY_SUB.to_vec(), ready(b"SUB"));
    sub.advance_transmit(READY_SUB.len());
    assert!(!sub.is_open());

    sub.feed(&ready(b"PUB"), |_| {}).unwrap();
    assert!(sub.is_open());
    assert_eq!(sub.poll_transmit(), Some(&b"\x00\x0b\x01kv_metrics"[..]));
}

#[test]
fn xpub_peers_and_extra_ready_properties_are_accepted() {
    let mut sub = ZmtpSub::new(b"kv-events", ZmtpLimits::KV_EVENTS).unwrap();
    let mut props = property(b"Identity", b"");
    props.extend(property(b"socket-type", b"XPUB"));
    let mut bytes = peer_greeting();
    bytes.extend(command(b"READY", &props));
    sub.feed(&bytes, |_| {}).unwrap();
    assert!(sub.is_open());
}

#[test]
fn every_split_point_yields_the_same_messages() {
    let mut wire = handshake();
    let small = message(&[b"kv_metrics", &7u64.to_be_bytes(), &[1, 2, 3]]);
    let long_body = vec![0xAB; 300];
    let long = message(&[b"kv_metrics", &long_body]);
    wire.extend(&small);
    wire.extend(&long);
    for split in 0..wire.len() {
        let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
        let mut got = collect(&mut sub, &wire[..split]).unwrap();
        got.extend(collect(&mut sub, &wire[split..]).unwrap());
        assert_eq!(got.len(), 2, "split at {split}");
        assert_eq!(
            frames_of(&got[0]),
            vec![
                b"kv_metrics".to_vec(),
                7u64.to_be_bytes().to_vec(),
                vec![1, 2, 3]
            ]
        );
        assert_eq!(
            frames_of(&got[1]),
            vec![b"kv_metrics".to_vec(), long_body.clone()]
        );
    }
    // And one byte at a time.
    let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
    let mut got = Vec::new();
    for byte in &wire {
        got.extend(collect(&mut sub, std::slice::from_ref(byte)).unwrap());
    }
    assert_eq!(got.len(), 2);
}

#[test]
fn handle_input_stops_after_each_message_until_polled() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let one = message(&[b"a"]);
    let mut wire = one.clone();
    wire.extend(message(&[b"b", b"c"]));
    let n = sub.handle_input(&wire).unwrap();
    assert_eq!(n, one.len());
    assert_eq!(
        sub.handle_input(&wire[n..]).unwrap(),
        0,
        "held until polled"
    );
    assert_eq!(
        frames_of(&sub.poll_delivery().unwrap()),
        vec![b"a".to_vec()]
    );
    assert_eq!(sub.handle_input(&wire[n..]).unwrap(), wire.len() - n);
    let second = sub.poll_message().unwrap();
    assert_eq!(second.frame_count(), 2);
    assert_eq!(second.frame(1), Some(&b"c"[..]));
    assert_eq!(second.frame(2), None);
    assert_eq!(sub.poll_delivery(), None);
}

#[test]
fn empty_frames_and_long_form_small_sizes_are_accepted() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let mut wire = vec![FLAG_MORE, 0];
    wire.push(FLAG_LONG);
    wire.extend_from_slice(&3u64.to_be_bytes());
    wire.extend_from_slice(b"xyz");
    let got = collect(&mut sub, &wire).unwrap();
    assert_eq!(frames_of(&got[0]), vec![Vec::new(), b"xyz".to_vec()]);
}

#[test]
fn the_frame_buffer_starts_at_512_and_grows_by_powers_of_two() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    assert_eq!(
        sub.buffer_bytes(),
        INITIAL_FRAME_BUFFER + WRITE_BUFFER,
        "idle: 576 bytes"
    );
    let base = sub.buffer_bytes() - INITIAL_FRAME_BUFFER;
    assert_eq!(sub.buf.capacity(), INITIAL_FRAME_BUFFER);
    assert!(sub.out.capacity() <= WRITE_BUFFER);
    let body = vec![7u8; 3000];
    let wire = message(&[&body]);
    // Header plus a part of the body: the buffer is reserved at the next power of two.
    sub.handle_input(&wire[..100]).unwrap();
    assert_eq!(sub.buf.capacity(), 4096);
    sub.handle_input(&wire[100..]).unwrap();
    let received = sub.poll_message().unwrap();
    assert_eq!(received.byte_len(), 3000);
    // Back to the initial size once the message left.
    assert_eq!(sub.buffer_bytes(), base + INITIAL_FRAME_BUFFER);
    // The largest allowed frame reserves up to the message ceiling, never beyond it.
    let body = vec![1u8; ZmtpLimits::KV_METRICS.max_frame_bytes];
    let wire = message(&[&body]);
    sub.handle_input(&wire[..20]).unwrap();
    assert!(sub.buf.capacity() <= ZmtpLimits::KV_METRICS.max_message_bytes);
    sub.handle_input(&wire[20..]).unwrap();
    assert_eq!(sub.poll_message().unwrap().byte_len(), body.len());
}

#[test]
fn a_declared_two_to_the_63_length_is_refused_without_allocating() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let before = sub.buffer_bytes();
    let mut wire = vec![FLAG_LONG];
    wire.extend_from_slice(&(1u64 << 63).to_be_bytes());
    let error = sub.handle_input(&wire).unwrap_err();
    assert_eq!(
        error,
        ZmtpError::FrameTooLarge {
            declared: 1 << 63,
            limit: ZmtpLimits::KV_METRICS.max_skip_bytes
        }
    );
    assert_eq!(error.result_label(), "transport_refused");
    assert!(sub.buffer_bytes() <= before);
    // A failed connection stays failed.
    assert!(matches!(
        sub.handle_input(b"\x00\x01a"),
        Err(ZmtpError::Failed(_))
    ));
    // Also a huge command, and a huge frame during the handshake.
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let mut wire = vec![FLAG_LONG | FLAG_COMMAND];
    wire.extend_from_slice(&u64::MAX.to_be_bytes());
    assert!(matches!(
        sub.handle_input(&wire),
        Err(ZmtpError::CommandTooLarge { .. })
    ));
}

#[test]
fn oversized_frames_are_skipped_without_buffering_and_the_stream_continues() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let big = vec![9u8; ZmtpLimits::KV_METRICS.max_frame_bytes + 1];
    let mut wire = message(&[b"kv_metrics", &[0; 8], &[0; 8], &big]);
    wire.extend(message(&[b"after"]));
    let mut peak = 0;
    let mut got = Vec::new();
    for chunk in wire.chunks(2048) {
        sub.feed(chunk, |d| got.push(d)).unwrap();
        peak = peak.max(sub.buffer_bytes());
    }
    assert!(peak < 2 * INITIAL_FRAME_BUFFER, "peak {peak}");
    assert_eq!(
        got[0],
        Delivery::Discarded(Discard::FrameTooLarge {
            declared: big.len() as u64
        })
    );
    assert_eq!(frames_of(&got[1]), vec![b"after".to_vec()]);
}

#[test]
fn too_many_frames_and_too_many_bytes_discard_the_message() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let got = collect(&mut sub, &message(&[b"1", b"2", b"3", b"4", b"5", b"6"])).unwrap();
    assert_eq!(got, vec![Delivery::Discarded(Discard::TooManyFrames)]);

    let half = vec![0u8; ZmtpLimits::KV_METRICS.max_frame_bytes];
    let got = collect(&mut sub, &message(&[&half, &half[..300]])).unwrap();
    assert_eq!(got, vec![Delivery::Discarded(Discard::MessageTooLarge)]);
    assert_eq!(sub.buf.capacity(), INITIAL_FRAME_BUFFER);

    let got = collect(&mut sub, &message(&[b"ok"])).unwrap();
    assert_eq!(frames_of(&got[0]), vec![b"ok".to_vec()]);
}

#[test]
fn ping_is_answered_with_pong_and_other_commands_are_ignored() {
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    let mut wire = command(b"PING", b"\x00\x64ctx");
    wire.extend(command(b"PONG", b"abc"));
    wire.extend(command(b"FUTURE", b"whatever"));
    wire.extend(message(&[b"m"]));
    let got = collect(&mut sub, &wire).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(sub.poll_transmit(), Some(&command(b"PONG", b"ctx")[..]));
    assert_eq!(sub.pings_answered(), 1);
    assert_eq!(sub.ignored_commands(), 2);
    // With the write buffer full, a PING is skipped rather than growing the buffer.
    for _ in 0..10 {
        collect(&mut sub, &command(b"PING", b"\x00\x01sixteen-bytes-ct")).unwrap();
    }
    assert!(sub.poll_transmit().unwrap().len() <= WRITE_BUFFER);
    assert!(sub.ignored_commands() > 2);
    assert!(collect(&mut sub, &command(b"PING", b"\x00")).is_err());
}

#[test]
fn protocol_violations_are_refused() {
    fn refused(peer: &[u8]) -> ZmtpError {
        let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
        sub.feed(peer, |_| {}).unwrap_err()
    }
    let with = |extra: &[u8]| {
        let mut b = handshake();
        b.extend_from_slice(extra);
        b
    };
    assert_eq!(refused(b"GET / HTTP/1.1\r\n"), ZmtpError::BadSignature);
    let mut zmtp2 = peer_greeting();
    zmtp2[10] = 1;
    zmtp2[11] = 254;
    let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
    assert!(
        sub.feed(&zmtp2[..11], |_| {}).is_ok(),
        "the minor byte is awaited"
    );
    assert_eq!(
        refused(&zmtp2[..12]),
        ZmtpError::UnsupportedVersion {
            major: 1,
            minor: 254
        }
    );
    let mut curve = peer_greeting();
    curve[12..17].copy_from_slice(b"CURVE");
    assert_eq!(
        refused(&curve),
        ZmtpError::UnsupportedMechanism {
            mechanism: "CURVE".into()
        }
    );
    let mut sub_peer = peer_greeting();
    sub_peer.extend(ready(b"SUB"));
    assert_eq!(
        refused(&sub_peer),
        ZmtpError::WrongSocketType {
            socket_type: "SUB".into()
        }
    );
    let mut bare = peer_greeting();
    bare.extend(command(b"READY", b""));
    assert_eq!(refused(&bare), ZmtpError::MissingSocketType);
    let mut truncated = peer_greeting();
    truncated.extend(command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x09PUB"));
    assert!(matches!(
        refused(&truncated),
        ZmtpError::MalformedCommand { command: "READY" }
    ));
    let mut early = peer_greeting();
    early.extend(message(&[b"data"]));
    assert_eq!(refused(&early), ZmtpError::MessageBeforeReady);
    let mut ping_first = peer_greeting();
    ping_first.extend(command(b"PING", b"\x00\x00"));
    assert!(matches!(
        refused(&ping_first),
        ZmtpError::UnexpectedCommand { .. }
    ));
    let mut error = peer_greeting();
    error.extend(command(b"ERROR", b"\x06denied"));
    assert_eq!(
        refused(&error),
        ZmtpError::PeerError {
            reason: "denied".into()
        }
    );
    assert!(matches!(
        refused(&with(&ready(b"PUB"))),
        ZmtpError::UnexpectedCommand { .. }
    ));
    assert_eq!(
        refused(&with(&[0x08, 0])),
        ZmtpError::ReservedFlags { flags: 0x08 }
    );
    assert_eq!(
        refused(&with(&[FLAG_COMMAND | FLAG_MORE, 0])),
        ZmtpError::CommandWithMore
    );
    let mut inside = message(&[b"first", b"second"]);
    inside.truncate(7); // the first frame, MORE set
    inside.extend(command(b"PING", b"\x00\x00"));
    assert_eq!(refused(&with(&inside)), ZmtpError::CommandInsideMessage);
    // An unnamed command after the handshake is just an unknown command.
    let mut sub = open_client(ZmtpLimits::KV_METRICS);
    assert_eq!(collect(&mut sub, &command(b"", b"")), Ok(Vec::new()));
    assert_eq!(sub.ignored_commands(), 1);
    assert!(matches!(
        refused(&with(&[FLAG_COMMAND, 0])),
        ZmtpError::MalformedCommand { .. }
    ));
    assert!(ZmtpSub::new(&[b'x'; 255], ZmtpLimits::KV_METRICS).is_err());
}

/// An upper bound on what a client may hold, whatever it is fed.
fn memory_bound(limits: ZmtpLimits) -> usize {
    limits
        .max_message_bytes
        .next_power_of_two()
        .max(INITIAL_FRAME_BUFFER)
        + 2 * WRITE_BUFFER
        + 64
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic_and_memory_stays_bounded(
        bytes in proptest::collection::vec(any::<u8>(), 0..4096),
        after_handshake in any::<bool>(),
        chunk in 1usize..300,
    ) {
        let limits = ZmtpLimits::KV_METRICS;
        let mut sub = ZmtpSub::new(b"kv_metrics", limits).unwrap();
        if after_handshake {
            sub.feed(&handshake(), |_| {}).unwrap();
        }
        for piece in bytes.chunks(chunk) {
            let result = sub.feed(piece, |_| {});
            prop_assert!(sub.buffer_bytes() <= memory_bound(limits));
            if result.is_err() {
                break;
            }
        }
    }

    #[test]
    fn framed_garbage_after_the_handshake_never_panics(
        frames in proptest::collection::vec(
            (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..600)), 0..20),
        declared in proptest::option::of(any::<u64>()),
    ) {
        let limits = ZmtpLimits::KV_METRICS;
        let mut sub = ZmtpSub::new(b"kv_metrics", limits).unwrap();
        sub.feed(&handshake(), |_| {}).unwrap();
        let mut wire = Vec::new();
        for (flags, body) in &frames {
            wire.extend(frame(flags & 0x05, body));
        }
        if let Some(size) = declared {
            wire.push(FLAG_LONG);
            wire.extend_from_slice(&size.to_be_bytes());
        }
        let mut delivered = 0usize;
        let _ = sub.feed(&wire, |d| {
            if let Delivery::Message(m) = d {
                delivered += m.byte_len();
            }
        });
        prop_assert!(sub.buffer_bytes() <= memory_bound(limits));
        prop_assert!(delivered <= wire.len());
    }
}

/// Fuzzing finding (`zmtp` target): a ZMTP 0.254 greeting fed byte by byte was refused as `0.0`
/// (judged before the minor byte arrived), whole as `0.254`.
#[test]
fn an_old_version_is_named_the_same_whole_and_byte_by_byte() {
    let mut greeting = peer_greeting();
    greeting[10] = 0;
    greeting[11] = 254;
    let whole = {
        let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
        sub.feed(&greeting, |_| {}).unwrap_err()
    };
    let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
    let piecewise = greeting
        .iter()
        .find_map(|b| sub.feed(std::slice::from_ref(b), |_| {}).err())
        .unwrap();
    assert_eq!(whole, piecewise);
    assert_eq!(
        whole,
        ZmtpError::UnsupportedVersion {
            major: 0,
            minor: 254
        }
    );
}
