//! The event bus's test PKI from the openssl CLI: a CA, the listener's server certificate and a
//! broker client certificate (tests/it/event_bus.rs, tests/it/dynamo_broker_tunnel.rs).
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

fn leaf(dir: &Path, name: &str, san: &str, usage: &str) -> (PathBuf, PathBuf) {
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

pub fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    openssl(
        dir.path(),
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
            "/CN=continuum-event-bus-test-ca",
        ],
    );
    let server = leaf(
        dir.path(),
        "server",
        "DNS:localhost,IP:127.0.0.1",
        "serverAuth",
    );
    let client_a = leaf(dir.path(), "client-a", "DNS:broker-a.dynamo", "clientAuth");
    Pki {
        ca: dir.path().join("ca.pem"),
        server,
        client_a,
        _dir: dir,
    }
}
