//! Value rules shared by the sections and by the config's other modules: etcd endpoints, HTTP
//! URLs, Dynamo namespaces, names, ids and addresses.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// A parsed etcd endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdEndpoint {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// Set when the host is an IP literal.
    pub ip: Option<IpAddr>,
}

/// Bare `host:port` becomes `http://host:port`; anything with a scheme is kept.
pub fn normalize_endpoint(raw: &str) -> String {
    let trimmed = raw.trim();
    if trimmed.contains("://") {
        trimmed.to_owned()
    } else {
        format!("http://{trimmed}")
    }
}

/// Checks one etcd endpoint against the reference rules.
pub fn check_endpoint(raw: &str) -> Result<EtcdEndpoint, String> {
    if raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("endpoint must not contain whitespace or control characters".to_owned());
    }
    let normalized = normalize_endpoint(raw);
    let (https, rest) = if let Some(rest) = normalized.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = normalized.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err("endpoint scheme must be http:// or https://".to_owned());
    };
    if rest.contains('@') {
        return Err(
            "endpoint must not embed credentials (user:pass@ or user@); use auth".to_owned(),
        );
    }
    if rest.contains('?') {
        return Err("endpoint must not contain a query string (not even an empty '?')".to_owned());
    }
    if rest.contains('#') {
        return Err("endpoint must not contain a fragment (not even an empty '#')".to_owned());
    }
    if rest.contains('/') {
        return Err("endpoint must not contain a path (not even a trailing '/')".to_owned());
    }
    let (host, port) = split_host_port(rest)?;
    let ip = host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .map(|inner| inner.parse::<Ipv6Addr>().map(IpAddr::V6))
        .transpose()
        .map_err(|_| format!("{host} is not an IPv6 address"))?
        .or_else(|| host.parse::<IpAddr>().ok());
    Ok(EtcdEndpoint {
        https,
        host: host.to_owned(),
        port,
        ip,
    })
}

/// Splits `host:port` (IPv6 as `[::1]:2379`); the port is required.
pub(super) fn split_host_port(authority: &str) -> Result<(&str, u16), String> {
    let (host, port) = if authority.starts_with('[') {
        let end = authority
            .find(']')
            .ok_or_else(|| "unterminated '[' in IPv6 address".to_owned())?;
        let host = &authority[..=end];
        let port = authority[end + 1..]
            .strip_prefix(':')
            .ok_or_else(|| "endpoint needs a port (host:port, IPv6 as [::1]:2379)".to_owned())?;
        (host, port)
    } else {
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| "endpoint needs a port (host:port, IPv6 as [::1]:2379)".to_owned())?;
        if host.contains(':') {
            return Err("IPv6 addresses must be bracketed, as [::1]:2379".to_owned());
        }
        (host, port)
    };
    if host.is_empty() || host == "[]" {
        return Err("endpoint host must not be empty".to_owned());
    }
    if !host.starts_with('[')
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(format!("{host:?} is not a valid host name"));
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| format!("{port:?} is not a valid port (1-65535)"))?;
    Ok((host, port))
}

/// `http(s)://host[:port][/path]` without credentials, query or fragment. `require_port` is for
/// collector addresses where a path makes no sense.
pub(super) fn check_http_url(url: &str, require_port: bool) -> Result<(), String> {
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("URL must not contain whitespace or control characters".to_owned());
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| format!("{url:?} must start with http:// or https://"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if authority.contains('@') {
        return Err("URL must not embed credentials".to_owned());
    }
    if rest.contains('?') || rest.contains('#') {
        return Err("URL must not contain a query string or fragment".to_owned());
    }
    if require_port {
        if !path.is_empty() && path != "/" {
            return Err("endpoint must not contain a path".to_owned());
        }
        split_host_port(authority)?;
    } else if authority.contains(':') && !authority.ends_with(']') {
        split_host_port(authority)?;
    } else if authority.is_empty() || authority == "[]" {
        return Err("URL host must not be empty".to_owned());
    }
    Ok(())
}

/// Dynamo namespace rule: non-empty, no '/', whitespace or control characters.
pub fn check_namespace(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("namespace must not be empty".to_owned());
    }
    if name.contains('/') {
        return Err(format!("namespace {name:?} must not contain '/'"));
    }
    if name.chars().any(char::is_whitespace) {
        return Err(format!("namespace {name:?} must not contain whitespace"));
    }
    if name.chars().any(char::is_control) {
        return Err(format!(
            "namespace {name:?} must not contain control characters"
        ));
    }
    Ok(())
}

/// Kubernetes name rules live once, in `continuum_protocol::kube::labels`.
pub use continuum_protocol::kube::labels::{is_dns1123_label, is_label_value};

pub(super) fn is_model_name(model: &str) -> bool {
    !model.is_empty() && !model.chars().any(|c| c.is_whitespace() || c.is_control())
}

pub(super) fn is_backend_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Lowercase DNS name (labels of `[a-z0-9-]`, dot-separated), no wildcard.
pub(super) fn is_broker_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 253 && id.split('.').all(is_dns1123_label)
}

/// `<prefix><64 lowercase hex>`.
pub fn is_prefixed_hex(text: &str, prefix: &str) -> bool {
    text.strip_prefix(prefix).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Whether two TCP listeners would fight over a port (same port, and same IP or a wildcard).
pub(super) fn listeners_collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

pub(super) fn is_public_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                // 100.64.0.0/10, carrier-grade NAT, often used for Pod networks.
                || (v4.octets()[0] == 100 && (v4.octets()[1] & 0xC0) == 64))
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_unspecified()
                || (v6.segments()[0] & 0xfe00) == 0xfc00
                || (v6.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}
