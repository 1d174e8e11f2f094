//! The one way out: TCP to the listener, TLS 1.3 only (rustls, ring), ALPN `h2` only, then
//! hyper's HTTP/2 client. The listener refuses anything else (docs/event-bus.md, "Transport").

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

use crate::config::BrokerConfig;

/// Request bodies of the session and the data streams.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// TCP connect, TLS handshake and HTTP/2 handshake together.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 PINGs while connected (the listener pings every 20 s too).
pub const KEEPALIVE: Duration = Duration::from_secs(20);
/// Receive window of each stream the broker reads (router → publisher bytes: ZMTP greetings and
/// subscriptions, a few hundred bytes per stream).
pub const STREAM_WINDOW: u32 = 64 * 1024;
/// Receive window of the whole connection.
pub const CONNECTION_WINDOW: u32 = 4 * 1024 * 1024;

/// The rustls client configuration: the CA file's roots, TLS 1.3, ALPN h2, and the client
/// certificate when configured.
pub fn client_config(config: &BrokerConfig) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(&config.ca_file)
        .with_context(|| format!("cannot read the CA file {}", config.ca_file.display()))?;
    for cert in certs {
        let cert = cert.with_context(|| format!("CA file {}", config.ca_file.display()))?;
        roots
            .add(cert)
            .with_context(|| format!("CA file {}", config.ca_file.display()))?;
    }
    if roots.is_empty() {
        anyhow::bail!(
            "the CA file {} holds no certificate",
            config.ca_file.display()
        );
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3")?
        .with_root_certificates(roots);
    let mut tls = match &config.credential.client_cert {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .with_context(|| format!("client certificate {}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .with_context(|| format!("client key {}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("client certificate and key")?
        }
        None => builder.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![continuum_protocol::event_bus::ALPN_H2.to_vec()];
    // The server name is checked now, so a bad one is a startup error.
    ServerName::try_from(config.server_name.clone())
        .with_context(|| format!("TLS server name {:?}", config.server_name))?;
    Ok(Arc::new(tls))
}

/// Dials the listener; the returned handle sends requests on one HTTP/2 connection, whose
/// driver runs in its own task until the connection ends (`closed` resolves then).
pub async fn connect(
    config: &BrokerConfig,
    tls: Arc<rustls::ClientConfig>,
) -> anyhow::Result<(SendRequest<Body>, tokio::task::JoinHandle<()>)> {
    let tcp = TcpStream::connect(config.bus.authority())
        .await
        .with_context(|| format!("TCP connect to {}", config.bus.authority()))?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(config.server_name.clone()).context("server name")?;
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .context("TLS handshake")?;
    if tls.get_ref().1.alpn_protocol() != Some(continuum_protocol::event_bus::ALPN_H2) {
        anyhow::bail!("the listener did not select ALPN h2");
    }
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .adaptive_window(false)
        .max_header_list_size(16 * 1024)
        .keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE)
        .keep_alive_while_idle(true);
    let (send, conn) = builder
        .handshake(TokioIo::new(tls))
        .await
        .context("HTTP/2 handshake")?;
    let driver = tokio::spawn(async move {
        if let Err(error) = conn.await {
            tracing::debug!(%error, "Event-bus connection ended.");
        }
    });
    Ok((send, driver))
}
