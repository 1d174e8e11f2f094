//! Credentials: `token_hash` verification, the token-vs-certificate rule, and the ring of
//! revoked credentials.
//!
//! The router stores only `sha256:<64 lowercase hex>` of each bearer token. A presented token
//! is hashed and compared with every configured hash in constant time (no early exit on the
//! first differing byte, and every entry is compared), so timing reveals neither which entry
//! nor how much of a digest matched. Certificates are verified by rustls against
//! `tls.client_ca`; this module only decides which entry the verified DNS SANs name.

use std::collections::VecDeque;

use sha2::{Digest, Sha256};

use super::message::{ClientId, ErrorCode};

/// Revoked credentials remembered for `credential_revoked` answers.
pub const REVOKED_RING: usize = 256;

/// A parsed `token_hash`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenHash([u8; 32]);

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenHash(<redacted>)")
    }
}

impl TokenHash {
    /// Strict parse of `sha256:<64 lowercase hex>`.
    pub fn parse(text: &str) -> Option<Self> {
        let hex = text.strip_prefix("sha256:")?.as_bytes();
        if hex.len() != 64 {
            return None;
        }
        let mut digest = [0u8; 32];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            digest[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Self(digest))
    }

    /// The hash of `token`, as `printf %s "$TOKEN" | sha256sum` computes it.
    pub fn of_token(token: &[u8]) -> Self {
        Self(Sha256::digest(token).into())
    }

    /// Constant-time comparison.
    pub fn ct_eq(&self, other: &TokenHash) -> bool {
        let diff = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        diff == 0
    }
}

fn nibble(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// The token from an `Authorization` header value: `Bearer <token>` (scheme case-insensitive,
/// token non-empty visible ASCII). `None` when absent or malformed.
pub fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    if header.len() < 8 || !header[..7].eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = &header[7..];
    (!token.is_empty() && token.iter().all(|b| b.is_ascii_graphic())).then_some(token)
}

/// One configured credential: the entry id, its token hash if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    pub id: ClientId,
    pub token_hash: Option<TokenHash>,
}

/// What a request presented.
#[derive(Clone, Copy, Debug, Default)]
pub struct Presented<'a> {
    /// The bearer token, if an `Authorization: Bearer` header was sent.
    pub token: Option<&'a [u8]>,
    /// DNS SANs of a client certificate that chained to the `client_ca` of the current CA
    /// generation (empty when no certificate, or the CA generation changed since).
    pub cert_dns_sans: &'a [String],
}

/// Authenticates a request against `credentials`:
/// - a token decides: it must hash to an entry's `token_hash` (else 401 `unauthenticated`, or
///   `credential_revoked` when it matches a revoked hash); a certificate sent with it must not
///   name a different entry (403 `forbidden`);
/// - without a token, a certificate authenticates as the entry whose id equals one of its DNS
///   SANs (lowercase, no wildcards); a certificate naming no entry is `unauthenticated`, or
///   `credential_revoked` when it names a revoked entry;
/// - nothing presented is `unauthenticated`.
pub fn authenticate<'c>(
    credentials: &'c [Credential],
    revoked: &RevokedCredentials,
    presented: Presented<'_>,
) -> Result<&'c ClientId, ErrorCode> {
    let cert_entries = || {
        credentials.iter().filter(|c| {
            presented
                .cert_dns_sans
                .iter()
                .any(|san| is_exact_san(san, &c.id))
        })
    };
    if let Some(token) = presented.token {
        let hash = TokenHash::of_token(token);
        // Compare with every entry, without an early exit.
        let mut found: Option<&ClientId> = None;
        for credential in credentials {
            if let Some(stored) = &credential.token_hash
                && stored.ct_eq(&hash)
                && found.is_none()
            {
                found = Some(&credential.id);
            }
        }
        let Some(id) = found else {
            return Err(if revoked.contains_token(&hash) {
                ErrorCode::CredentialRevoked
            } else {
                ErrorCode::Unauthenticated
            });
        };
        if cert_entries().any(|c| c.id != *id) {
            return Err(ErrorCode::Forbidden);
        }
        return Ok(id);
    }
    if presented.cert_dns_sans.is_empty() {
        return Err(ErrorCode::Unauthenticated);
    }
    let mut named = cert_entries();
    match (named.next(), named.next()) {
        (Some(credential), None) => Ok(&credential.id),
        // A certificate naming two entries is ambiguous: refuse rather than pick one.
        (Some(_), Some(_)) => Err(ErrorCode::Forbidden),
        (None, _) => {
            let revoked_name = presented
                .cert_dns_sans
                .iter()
                .any(|san| revoked.contains_id(san));
            Err(if revoked_name {
                ErrorCode::CredentialRevoked
            } else {
                ErrorCode::Unauthenticated
            })
        }
    }
}

/// SANs match ids exactly: lowercase DNS names, no wildcard.
fn is_exact_san(san: &str, id: &ClientId) -> bool {
    !san.contains('*') && san == id.as_str()
}

/// The last [`REVOKED_RING`] credentials removed by reloads (entry ids and token hashes).
#[derive(Clone, Debug, Default)]
pub struct RevokedCredentials {
    ring: VecDeque<Credential>,
}

impl RevokedCredentials {
    /// Remembers `credential` as revoked, forgetting the oldest beyond the ring size.
    pub fn revoke(&mut self, credential: Credential) {
        self.ring.retain(|c| c.id != credential.id);
        if self.ring.len() == REVOKED_RING {
            self.ring.pop_front();
        }
        self.ring.push_back(credential);
    }

    /// An entry configured again is no longer revoked.
    pub fn restore(&mut self, id: &ClientId) {
        self.ring.retain(|c| c.id != *id);
    }

    /// Applies a reload: every credential in `old` and absent from `new` (by id, or whose token
    /// hash changed) is revoked; every credential in `new` is restored.
    pub fn apply_reload(&mut self, old: &[Credential], new: &[Credential]) {
        for credential in new {
            self.restore(&credential.id);
        }
        for credential in old {
            let kept = new.contains(credential);
            if !kept {
                let replaced_same_id = new.iter().any(|n| n.id == credential.id);
                if replaced_same_id {
                    // Same id, new token: the old token alone is revoked.
                    if credential.token_hash.is_some() {
                        self.ring.push_back(Credential {
                            id: ClientId::new(""),
                            token_hash: credential.token_hash,
                        });
                        if self.ring.len() > REVOKED_RING {
                            self.ring.pop_front();
                        }
                    }
                } else {
                    self.revoke(credential.clone());
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    fn contains_token(&self, hash: &TokenHash) -> bool {
        self.ring
            .iter()
            .filter_map(|c| c.token_hash.as_ref())
            .fold(false, |hit, stored| hit | stored.ct_eq(hash))
    }

    fn contains_id(&self, id: &str) -> bool {
        self.ring
            .iter()
            .any(|c| !c.id.as_str().is_empty() && c.id.as_str() == id)
    }
}
