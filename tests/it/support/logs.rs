//! Per-test log capture: the code under test runs on the test's current-thread runtime, so a
//! thread-local default subscriber sees all of its logs (tests/it/etcd_source.rs,
//! tests/it/event_bus.rs, tests/it/features.rs).

use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

/// Keeps the capture installed; prints it when the test fails.
pub struct LogGuard {
    logs: Logs,
    _default: tracing::subscriber::DefaultGuard,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("captured logs:\n{}", self.logs.text());
        }
    }
}

impl Logs {
    /// Installs the capture (DEBUG and above) as this thread's default subscriber.
    pub fn install(&self) -> LogGuard {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(self.clone())
            .finish();
        LogGuard {
            logs: self.clone(),
            _default: tracing::subscriber::set_default(subscriber),
        }
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
