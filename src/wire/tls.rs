//! Backend CA files (`backends[].tls.ca_file`): read and checked once, by config validation and by
//! the proxy's upstream client alike.

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Largest CA file read (`backends[].tls.ca_file`).
pub const MAX_CA_FILE_BYTES: u64 = 1024 * 1024;

/// Reads the PEM certificates of a CA file: an unreadable file, one larger than
/// [`MAX_CA_FILE_BYTES`], or one holding no parsable `CERTIFICATE` block is an error.
pub fn read_ca_file(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, String> {
    use std::io::Read;
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut pem = Vec::new();
    file.take(MAX_CA_FILE_BYTES + 1)
        .read_to_end(&mut pem)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    if pem.len() as u64 > MAX_CA_FILE_BYTES {
        return Err(format!("{shown} is larger than {MAX_CA_FILE_BYTES} bytes"));
    }
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{shown} is not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{shown} holds no PEM CERTIFICATE block"));
    }
    // Each certificate must also be usable as a trust anchor.
    let mut roots = rustls::RootCertStore::empty();
    for cert in &certs {
        roots
            .add(cert.clone())
            .map_err(|e| format!("{shown} holds a certificate that is not a usable CA: {e}"))?;
    }
    Ok(certs)
}
