//! Test PKI from the openssl CLI: a CA ([`ca`]) and the leaf certificates it signs ([`leaf`]);
//! [`pki`] is the event bus's set (the listener's server certificate and a broker client
//! certificate: tests/it/event_bus.rs, tests/it/dynamo_broker_tunnel.rs), tests/it/proxy_tls.rs
//! makes its own HTTPS upstreams' set.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test CA, the listener's certificate (DNS:localhost, IP:127.0.0.1) and broker-a's client
/// certificate (DNS SAN broker-a.dynamo), in a temporary directory.
pub struct Pki {
    pub _dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub server: (PathBuf, PathBuf),
    pub client_a: (PathBuf, PathBuf),
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl CLI runs (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A certificate for `san` (`DNS:…,IP:…`) with extended key usage `usage` (`serverAuth`,
/// `clientAuth`), signed by the [`ca`] in `dir`: its (certificate, key) paths.
pub fn leaf(dir: &Path, name: &str, san: &str, usage: &str) -> (PathBuf, PathBuf) {
    let (key, csr, pem, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}.ext"),
    );
    std::fs::write(
        dir.join(&ext),
        format!(
            "subjectAltName={san}\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
        ),
    )
    .expect("write ext");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    (dir.join(pem), dir.join(key))
}

/// A self-signed CA (`ca.pem`, `ca.key`) named `cn` in `dir`: the certificate's path.
pub fn ca(dir: &Path, cn: &str) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    dir.join("ca.pem")
}

pub fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = ca(dir.path(), "continuum-event-bus-test-ca");
    let server = leaf(
        dir.path(),
        "server",
        "DNS:localhost,IP:127.0.0.1",
        "serverAuth",
    );
    let client_a = leaf(dir.path(), "client-a", "DNS:broker-a.dynamo", "clientAuth");
    Pki {
        ca,
        server,
        client_a,
        _dir: dir,
    }
}
