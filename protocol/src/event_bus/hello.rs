//! Version negotiation and `Hello::validate`: what a credential's `brokers[]` entry lets a
//! client declare.

use std::collections::BTreeSet;

use super::message::{ClientId, ErrorCode, Hello, Role, StreamTarget, truncate_text};
use crate::ids::Namespace;

/// Protocol versions this build speaks, ascending.
pub const SUPPORTED_VERSIONS: &[u32] = &[1];

/// What one `dynamo.event_bus.brokers[]` entry grants the client that authenticates as it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub id: ClientId,
    pub role: Role,
    /// Role broker: namespaces it may declare; empty permits any (config validation warns).
    pub namespaces: BTreeSet<Namespace>,
    /// Role kv_listener: backends it may announce.
    pub backends: BTreeSet<String>,
}

/// A refusal: the code (which fixes the HTTP status) and a diagnostic free of secrets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        truncate_text(&mut message);
        Self { code, message }
    }
}

/// What a welcomed session covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Role broker: the declared Dynamo namespaces.
    Namespaces(BTreeSet<Namespace>),
    /// Role kv_listener: the announced backends.
    Backends(BTreeSet<String>),
}

impl Coverage {
    pub fn covers_namespace(&self, namespace: &Namespace) -> bool {
        matches!(self, Coverage::Namespaces(set) if set.contains(namespace))
    }

    pub fn covers_backend(&self, backend: &str) -> bool {
        matches!(self, Coverage::Backends(set) if set.contains(backend))
    }

    /// Whether a `subscribe` for `target` fits this session.
    pub fn covers(&self, target: &StreamTarget) -> bool {
        match target {
            StreamTarget::ZmqTcp { target, .. } => self.covers_namespace(&target.namespace),
            StreamTarget::AnnouncedSource(source) => self.covers_backend(&source.backend),
        }
    }
}

/// A hello that passed [`Hello::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcceptedHello {
    pub client_id: ClientId,
    pub role: Role,
    pub version: u32,
    pub coverage: Coverage,
}

/// Parses the `continuum-bus-version` header: a decimal integer of at most 10 digits, at
/// least 1. Missing, malformed or 0 is `unsupported_protocol_version` (400).
pub fn parse_version_header(value: Option<&[u8]>) -> Result<u32, Refusal> {
    let refuse = || {
        Refusal::new(
            ErrorCode::UnsupportedProtocolVersion,
            "continuum-bus-version must be an integer >= 1",
        )
    };
    let value = value.ok_or_else(refuse)?;
    if value.is_empty() || value.len() > 10 || !value.iter().all(u8::is_ascii_digit) {
        return Err(refuse());
    }
    let text = std::str::from_utf8(value).map_err(|_| refuse())?;
    match text.parse::<u32>() {
        Ok(version) if version >= 1 => Ok(version),
        _ => Err(refuse()),
    }
}

/// The highest version both sides speak.
pub fn negotiate(offered: &[u32]) -> Option<u32> {
    SUPPORTED_VERSIONS
        .iter()
        .rev()
        .copied()
        .find(|v| offered.contains(v))
}

impl Hello {
    /// Checks the hello against the authenticated entry's grant and the session request's
    /// `continuum-bus-version` header (which must be one of the offered versions).
    ///
    /// - shape (counts, names, duplicates; a broker declares at least one namespace and no
    ///   sources): `invalid_hello`;
    /// - role or client id differing from the entry, a namespace outside a non-empty
    ///   allowlist, a kv_listener declaring namespaces, announcing nothing, or announcing a
    ///   backend outside its grant: `forbidden`;
    /// - no shared version: `unsupported_protocol_version`.
    pub fn validate(&self, grant: &Grant, header_version: u32) -> Result<AcceptedHello, Refusal> {
        if let Err(error) = self.check() {
            return Err(Refusal::new(ErrorCode::InvalidHello, error.to_string()));
        }
        if !self.versions.contains(&header_version) {
            return Err(Refusal::new(
                ErrorCode::InvalidHello,
                "hello versions must include the continuum-bus-version header",
            ));
        }
        if self.role != grant.role {
            return Err(Refusal::new(
                ErrorCode::Forbidden,
                format!(
                    "hello role {} does not match the credential's role {}",
                    self.role.as_str(),
                    grant.role.as_str()
                ),
            ));
        }
        if self.client_id != grant.id {
            return Err(Refusal::new(
                ErrorCode::Forbidden,
                "hello client_id does not match the credential's entry",
            ));
        }
        let coverage = match self.role {
            Role::Broker => self.broker_coverage(grant)?,
            Role::KvListener => self.listener_coverage(grant)?,
        };
        let version = negotiate(&self.versions).ok_or_else(|| {
            Refusal::new(
                ErrorCode::UnsupportedProtocolVersion,
                format!("no shared protocol version; this router speaks {SUPPORTED_VERSIONS:?}"),
            )
        })?;
        Ok(AcceptedHello {
            client_id: self.client_id.clone(),
            role: self.role,
            version,
            coverage,
        })
    }

    fn broker_coverage(&self, grant: &Grant) -> Result<Coverage, Refusal> {
        if !self.sources.is_empty() {
            return Err(Refusal::new(
                ErrorCode::InvalidHello,
                "a broker hello announces no sources",
            ));
        }
        if self.dynamo_namespaces.is_empty() {
            return Err(Refusal::new(
                ErrorCode::InvalidHello,
                "a broker hello declares at least one Dynamo namespace",
            ));
        }
        let mut set = BTreeSet::new();
        for namespace in &self.dynamo_namespaces {
            if !grant.namespaces.is_empty() && !grant.namespaces.contains(namespace) {
                return Err(Refusal::new(
                    ErrorCode::Forbidden,
                    format!("namespace {namespace:?} is not in the entry's namespaces allowlist"),
                ));
            }
            if !set.insert(namespace.clone()) {
                return Err(Refusal::new(
                    ErrorCode::InvalidHello,
                    format!("namespace {namespace:?} is declared twice"),
                ));
            }
        }
        Ok(Coverage::Namespaces(set))
    }

    fn listener_coverage(&self, grant: &Grant) -> Result<Coverage, Refusal> {
        if !self.dynamo_namespaces.is_empty() {
            return Err(Refusal::new(
                ErrorCode::Forbidden,
                "a kv_listener hello declares no dynamo_namespaces",
            ));
        }
        if self.sources.is_empty() {
            return Err(Refusal::new(
                ErrorCode::Forbidden,
                "a kv_listener hello announces at least one source",
            ));
        }
        let mut set = BTreeSet::new();
        for source in &self.sources {
            if !grant.backends.contains(&source.backend) {
                return Err(Refusal::new(
                    ErrorCode::Forbidden,
                    format!(
                        "backend {:?} is not in the entry's backends grant",
                        source.backend
                    ),
                ));
            }
            if !set.insert(source.backend.clone()) {
                return Err(Refusal::new(
                    ErrorCode::InvalidHello,
                    format!("backend {:?} is announced twice", source.backend),
                ));
            }
        }
        Ok(Coverage::Backends(set))
    }
}
