//! The event-bus wire contract (continuum-event-bus), sans-IO: what the router's listener and
//! the in-cluster agents (continuum-event-broker, continuum-kv-listener) say to each other.
//!
//! docs/event-bus.md is the prose version of this module; keep them in step.
//!
//! | module | what it holds |
//! |---|---|
//! | [`message`] | control messages (NDJSON lines), ids, targets, error codes and stream close reasons |
//! | [`ndjson`] | line framing bounded before allocation |
//! | [`hello`] | `continuum-bus-version` parsing, version negotiation, `Hello::validate` against a [`Grant`] |
//! | [`credential`] | `token_hash` verification in constant time, the token-vs-certificate rule, the revocation ring |
//! | [`rendezvous`] | 64-bit rendezvous weights and ranking of broker sessions |
//! | [`advertised`] | the publishers a broker may dial (DynamoWorkerMetadata event channels) |
//! | [`admission`] | one pre-hello handshake per credential, one session per entry (superseding), `max_sessions` |
//! | [`bounds`] | per-session and per-stream byte bounds, connection cap |
//! | [`server`] | the router's session state machine |
//! | [`client`] | the agent's session state machine |
//! | [`sse`] | the kv_listener push stream: SSE encoding of KV-event batches and resets, the router's bounded parser |
//! | [`transport`] | first-byte check, plaintext refusal, connection deadlines (`auth_timeout`, linger) |

pub mod admission;
pub mod advertised;
pub mod bounds;
pub mod client;
pub mod credential;
pub mod hello;
pub mod message;
pub mod ndjson;
pub mod rendezvous;
pub mod server;
pub mod sse;
pub mod transport;

#[cfg(test)]
mod tests;

pub use admission::Admission;
pub use bounds::{BoundsError, SessionBounds};
pub use client::{ClientEvent, ClientSession};
pub use hello::{AcceptedHello, Coverage, Grant, Refusal};
pub use message::{
    AnnouncedSource, AnnouncedSourceTarget, ClientId, DecodeError, ErrorBody, ErrorCode, Hello,
    Message, Role, SessionId, StreamCloseReason, StreamId, StreamTarget, Welcome, ZmqTcpTarget,
};
pub use server::{ServerConfig, ServerEvent, ServerSession, SubscribeError};

/// The control channel: a long-lived bidirectional NDJSON stream.
pub const SESSION_PATH: &str = "/bus/v1/session";
/// Data streams: `POST /bus/v1/streams/{stream_id}`.
pub const STREAMS_PATH_PREFIX: &str = "/bus/v1/streams/";
/// Request header carrying the client's protocol version (session) or the negotiated one (data
/// streams).
pub const VERSION_HEADER: &str = "continuum-bus-version";
/// Data-stream request header naming the session (`sess-<32 hex>`) that commanded the stream.
pub const SESSION_HEADER: &str = "continuum-bus-session";
/// Content type of the control channel in both directions.
pub const NDJSON_CONTENT_TYPE: &str = "application/x-ndjson";
/// Longest control line, newline included, in either direction.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// ALPN protocol the listener accepts (and the only one).
pub const ALPN_H2: &[u8] = b"h2";

/// A listener request path, parsed strictly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BusPath {
    Session,
    Stream(StreamId),
}

impl BusPath {
    /// `None` for every other path (404 `not_found`, or 404 `unknown_stream` for a malformed
    /// stream id under the streams prefix — see [`BusPath::is_stream_prefix`]).
    pub fn parse(path: &str) -> Option<BusPath> {
        if path == SESSION_PATH {
            return Some(BusPath::Session);
        }
        let segment = path.strip_prefix(STREAMS_PATH_PREFIX)?;
        StreamId::parse_path_segment(segment).map(BusPath::Stream)
    }

    /// Whether `path` is under the streams prefix (so a bad id is `unknown_stream`).
    pub fn is_stream_prefix(path: &str) -> bool {
        path.starts_with(STREAMS_PATH_PREFIX)
    }

    /// The request path of a data stream.
    pub fn stream(stream_id: StreamId) -> String {
        format!("{STREAMS_PATH_PREFIX}{stream_id}")
    }
}
