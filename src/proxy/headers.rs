//! Outbound and response header hygiene, and the `Dispatch` a worker picker fills with pins.

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use continuum_protocol::ids::{DpRank, InstanceId};
use tracing::debug;

use crate::wire::pins::{is_pin_header, strip_pin_headers};

/// The routing path of every response (`unified`, `aggregated` or `disaggregated`). Each name
/// here is built at compile time: `HeaderName::from_static` at run time, or a `&str` key, is
/// validated again on every use (≈ 670 instructions per answer for this one, callgrind).
pub const ROUTING_PATH: HeaderName = HeaderName::from_static("x-continuum-routing-path");
/// The request header asking for identity disclosure (its value is ignored, even blank).
pub const DISCLOSE_REQUEST: HeaderName = HeaderName::from_static("x-backend");
/// The admission class a request asks for (`admission.priority.selectable`): read by the route,
/// never forwarded.
pub const PRIORITY_REQUEST: HeaderName = HeaderName::from_static("x-continuum-priority");
/// The response header naming the backend replica, sent only on request.
pub const BACKEND_RESPONSE: HeaderName = HeaderName::from_static("x-continuum-backend");

pub const WORKER_INSTANCE_ID: &str = "x-dynamo-worker-instance-id";
pub const PREFILL_INSTANCE_ID: &str = "x-dynamo-prefill-instance-id";
pub const DP_RANK: &str = "x-dynamo-dp-rank";
pub const PREFILL_DP_RANK: &str = "x-dynamo-prefill-dp-rank";

/// The pinned worker identities as a client that sent `x-backend` sees them: each pin's decimal
/// value under the router's own name (no `x-dynamo-*` header is ever echoed).
pub static DISCLOSED_PINS: [(&str, HeaderName); 4] = [
    (
        WORKER_INSTANCE_ID,
        HeaderName::from_static("x-continuum-worker-instance-id"),
    ),
    (DP_RANK, HeaderName::from_static("x-continuum-dp-rank")),
    (
        PREFILL_INSTANCE_ID,
        HeaderName::from_static("x-continuum-prefill-instance-id"),
    ),
    (
        PREFILL_DP_RANK,
        HeaderName::from_static("x-continuum-prefill-dp-rank"),
    ),
];

/// Rank aliases the 1.6.1 frontend honours (dynamo-wire §14.1) that do not start with
/// `x-dynamo-`; beside a pinned worker they would let a client choose the rank.
const RANK_ALIASES: [&str; 3] = ["x-dp-rank", "x-data-parallel-rank", "x-prefill-dp-rank"];

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus those the proxy recomputes.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("proxy-connection"),
];

/// Extra outbound headers chosen by routing (worker pins). Connection retries reuse the same
/// `Dispatch` on another replica: the workers are never re-selected for one request.
#[derive(Clone, Debug, Default)]
pub struct Dispatch {
    /// Written on the outbound request after the client's pins were stripped.
    pub headers: HeaderMap,
}

impl Dispatch {
    /// No pins: standard (unified) routing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Pin headers for a direct-mode shim: decimal instance ids (the frontend treats hex as
    /// absent); a rank header whenever the worker declares `data_parallel_size` (`Some`, even 0).
    pub fn pins(
        decode: InstanceId,
        decode_rank: Option<DpRank>,
        prefill: Option<(InstanceId, Option<DpRank>)>,
    ) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(WORKER_INSTANCE_ID, decimal(decode.0));
        if let Some(rank) = decode_rank {
            headers.insert(DP_RANK, decimal(u64::from(rank.0)));
        }
        if let Some((prefill, rank)) = prefill {
            headers.insert(PREFILL_INSTANCE_ID, decimal(prefill.0));
            if let Some(rank) = rank {
                headers.insert(PREFILL_DP_RANK, decimal(u64::from(rank.0)));
            }
        }
        Self { headers }
    }

    /// The identities added to the response only when the client sent `x-backend`: the pinned
    /// workers (and ranks) under [`DISCLOSED_PINS`]' names, read from the pins (nothing is built
    /// for a request that does not ask).
    pub fn disclosed(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        DISCLOSED_PINS
            .iter()
            .filter_map(|(pin, name)| Some((name, self.headers.get(*pin)?)))
    }
}

fn decimal(n: u64) -> HeaderValue {
    HeaderValue::from(n)
}

/// Removes hop-by-hop headers, including any the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names first: most answers carry none of them.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = connection_named(headers).collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// The header names a `Connection` header lists (hop-by-hop by declaration).
fn connection_named(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
}

/// A field name with `_` is never forwarded (nginx's `underscores_in_headers off`): a backend
/// (or a CGI-style gateway) that maps `_` to `-` would read `Transfer_Encoding` or
/// `Content_Length` as framing beside the router's own (the CVE-2024-1135 class).
fn has_underscore(name: &HeaderName) -> bool {
    let underscore = name.as_str().as_bytes().contains(&b'_');
    if underscore {
        debug!(
            header = name.as_str(),
            "Dropped a request header whose name has '_'."
        );
    }
    underscore
}

/// True for a rank alias (`x-dp-rank`, …) a client could pick a rank with.
fn is_rank_alias(name: &HeaderName) -> bool {
    RANK_ALIASES.contains(&name.as_str())
}

/// Removes every header a client could pin a worker or a rank with.
pub fn strip_all_pins(headers: &mut HeaderMap) -> usize {
    let mut removed = strip_pin_headers(headers);
    if headers.keys().any(is_rank_alias) {
        for alias in RANK_ALIASES {
            removed += headers.get_all(alias).iter().count();
            headers.remove(alias);
        }
    }
    removed
}

/// Headers the router never forwards whatever their value: the framing it recomputes, the
/// disclosure and priority requests, and `100-continue` (the body was read whole already).
fn request_only(name: &HeaderName) -> bool {
    name == header::HOST
        || name == header::CONTENT_LENGTH
        || name == header::EXPECT
        || name == header::CONTENT_TYPE
        || name == DISCLOSE_REQUEST
        || name == PRIORITY_REQUEST
}

/// The body is validated JSON; OpenAI-wire servers (the Dynamo frontend among them) refuse a JSON
/// body without this content type.
static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");

/// The outbound header set: the client's headers minus hop-by-hop, pins, the router's own
/// credentials and request-only headers, plus `content-type: application/json` and the
/// dispatch's pins. A view over the client's headers: the connection pool encodes its
/// [`fields`](Self::fields) straight into the request it writes (no map is built); the HTTPS
/// client gets them as a map ([`to_map`](Self::to_map)).
pub struct Outbound<'a> {
    client: &'a HeaderMap,
    dispatch: &'a Dispatch,
    drop_authorization: bool,
    /// The names the client's `Connection` header lists (hop-by-hop by declaration): empty, and
    /// not allocated, for nearly every request.
    named: Vec<HeaderName>,
}

impl<'a> Outbound<'a> {
    pub fn new(client: &'a HeaderMap, dispatch: &'a Dispatch, drop_authorization: bool) -> Self {
        Self {
            client,
            dispatch,
            drop_authorization,
            named: connection_named(client).collect(),
        }
    }

    /// Whether a client header stays behind.
    fn dropped(&self, name: &HeaderName) -> bool {
        HOP_BY_HOP.contains(name)
            || self.named.contains(name)
            // Stripped again right before dispatch, whatever middleware ran before.
            || is_pin_header(name.as_str())
            || is_rank_alias(name)
            || request_only(name)
            // The client's router key is not the backend's credential.
            || (self.drop_authorization && name == header::AUTHORIZATION)
            || has_underscore(name)
    }

    /// The outbound fields in order: the client's that are forwarded, the content type, the
    /// dispatch's pins (none of which a client field can carry: pins are dropped above).
    pub fn fields(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> + '_ {
        self.client
            .iter()
            .filter(|(name, _)| !self.dropped(name))
            .chain(std::iter::once((&header::CONTENT_TYPE, &APPLICATION_JSON)))
            .chain(self.dispatch.headers.iter())
    }

    /// The outbound fields as a header map.
    pub fn to_map(&self) -> HeaderMap {
        let mut headers =
            HeaderMap::with_capacity(self.client.keys_len() + self.dispatch.headers.len() + 1);
        for (name, value) in self.fields() {
            headers.append(name.clone(), value.clone());
        }
        headers
    }
}

/// Cleans an upstream response's headers before they reach the client.
pub fn response(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    strip_all_pins(headers);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_priority_header_is_the_one_admission_documents() {
        assert_eq!(
            PRIORITY_REQUEST.as_str(),
            crate::config::admission::PRIORITY_HEADER
        );
    }

    #[test]
    fn outbound_drops_hop_by_hop_pins_keys_and_underscored_names_and_adds_dispatch_pins() {
        let mut client = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-custom-hop"),
            ("x-custom-hop", "1"),
            ("te", "trailers"),
            ("host", "router"),
            ("x-dynamo-worker-instance-id", "666"),
            ("x-worker-instance-id", "666"),
            ("x-dp-rank", "3"),
            ("x-data-parallel-rank", "3"),
            ("x-prefill-dp-rank", "3"),
            ("authorization", "Bearer client"),
            ("x-backend", ""),
            ("x-continuum-priority", "high"),
            ("content-type", "text/plain"),
            ("expect", "100-continue"),
            ("x-request-id", "r1"),
            ("transfer_encoding", "chunked"),
            ("content_length", "0"),
            ("x_custom", "1"),
        ] {
            client.append(k, HeaderValue::from_static(v));
        }
        let dispatch = Dispatch::pins(
            InstanceId(0x1a2b),
            Some(DpRank(0)),
            Some((InstanceId(7), None)),
        );
        let out = Outbound::new(&client, &dispatch, true).to_map();
        let mut names: Vec<_> = out.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "content-type",
                "x-dynamo-dp-rank",
                "x-dynamo-prefill-instance-id",
                "x-dynamo-worker-instance-id",
                "x-request-id"
            ]
        );
        assert_eq!(out[WORKER_INSTANCE_ID], "6699");
        assert_eq!(out[DP_RANK], "0");
        assert_eq!(out[PREFILL_INSTANCE_ID], "7");
        assert_eq!(out[header::CONTENT_TYPE], "application/json");
        assert!(
            Outbound::new(&client, &Dispatch::none(), false)
                .to_map()
                .contains_key("authorization")
        );
        // The fields the pool encodes are the map's, in order.
        let fields: Vec<_> = Outbound::new(&client, &dispatch, true)
            .fields()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mapped: Vec<_> = out.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(fields.len(), mapped.len());
        assert!(fields.iter().all(|field| mapped.contains(field)));
    }
}
