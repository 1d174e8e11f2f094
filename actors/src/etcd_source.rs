//! The read-only etcd discovery source: range gets then watches, folded into `SourceEvent`s.
//!
//! Role: produce the event stream the discovery reducer consumes for one Dynamo namespace.
//! A *pass* connects a read-only client (optionally over TLS, optionally authenticating),
//! reads `v1/instances/<ns>/`, `v1/mdc/<ns>/` and `v1/event_channels/namespace/<ns>/` (the last
//! with the namespace percent-encoded, as Dynamo writes event-plane keys) at one revision R,
//! streaming them: `Init` once the first page arrived, one `InitApply` per record as its page
//! arrives, `InitDone` after the last page; then watches every prefix from R + 1 and emits
//! `Apply` / `Delete` in order. A pass that fails between `Init` and `InitDone` (a range get
//! failing, R compacted, the seed timeout) ends without `InitDone`, and the next pass's `Init`
//! makes the reducer discard the partial resync. A pass talks to one endpoint: the first of the
//! list, starting after the member the previous pass ended on, that completes the seed. A pass
//! ends on a dropped connection, a closed or cancelled watch, or a compacted start revision;
//! the next pass starts from scratch after a backoff (no jitter) that doubles on
//! repeated failures and returns to its floor only after every watch stayed open for at least
//! `backoff.max` (`Backoff::session_ended`).
//!
//! The read-only contract: this module issues range gets and watches and nothing else. It never
//! takes or renews a lease and never writes or removes a key. `tests/it/tidy_readonly.rs` greps
//! these files for the client calls that would break that promise.
//!
//! Entry points: [`run_etcd_source`] (a future the caller drives) or [`EtcdSource::spawn`]
//! (a task with a `stop`). `connected` is true while the watches of a pass are open.

mod config;
mod pass;

use std::future::Future;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use continuum_protocol::backoff::{Backoff, BackoffPolicy, Jitter};
use continuum_protocol::discovery::SourceEvent;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{info, warn};

pub use config::{
    EtcdAuth, EtcdConfigError, EtcdConfigWarning, EtcdRestartReason, EtcdSourceConfig, EtcdTls,
    MAX_ENDPOINTS,
};
/// The watched key layout lives in `protocol` (the one place that knows Dynamo's keys).
pub use continuum_protocol::discovery::keys::{WatchedPrefix, encode_segment, watched_prefixes};
pub use pass::SEED_TIMEOUT;

use pass::PassOutcome;

/// Why one pass ended. None of these stop the source except `ConsumerGone`.
#[derive(Debug, thiserror::Error)]
pub enum EtcdSourceError {
    #[error("could not read TLS file {path}: {source}")]
    ReadTls {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS file {path} is {len} bytes, above the 1 MiB limit")]
    TlsFileTooLarge { path: PathBuf, len: u64 },
    #[error("could not connect or authenticate to etcd: {0}")]
    Connect(etcd_client::Error),
    #[error("connecting and seeding took longer than {0:?}")]
    SeedTimeout(Duration),
    #[error("opening the watches took longer than {0:?}")]
    WatchOpenTimeout(Duration),
    #[error("range get of the {prefix} prefix failed: {source}")]
    Range {
        prefix: &'static str,
        source: etcd_client::Error,
    },
    #[error("etcd sent a range response without a header")]
    MissingHeader,
    #[error("the {prefix} watch failed: {source}")]
    Watch {
        prefix: &'static str,
        source: etcd_client::Error,
    },
    #[error("etcd closed the {prefix} watch stream")]
    WatchClosed { prefix: &'static str },
    #[error("etcd cancelled the {prefix} watch: {reason}")]
    WatchCanceled {
        prefix: &'static str,
        reason: String,
    },
    #[error("the {prefix} watch start was compacted (compact revision {compact_revision})")]
    Compacted {
        prefix: &'static str,
        compact_revision: i64,
    },
    #[error("the discovery event consumer went away")]
    ConsumerGone,
}

/// Runs passes until `shutdown` resolves or the `events` receiver is dropped.
///
/// Fails only when the configuration is invalid; runtime failures end a pass and are retried.
/// On return `connected` is false.
pub async fn run_etcd_source<S>(
    cfg: EtcdSourceConfig,
    events: mpsc::Sender<SourceEvent>,
    connected: watch::Sender<bool>,
    shutdown: S,
) -> Result<(), EtcdConfigError>
where
    S: Future<Output = ()>,
{
    for warning in cfg.validate()? {
        warn!(%warning, namespace = %cfg.namespace, "etcd discovery configuration needs attention.");
    }
    let endpoints = cfg.normalized_endpoints()?;
    let prefixes = watched_prefixes(&cfg.namespace);
    // Which endpoint the next pass tries first.
    let cursor = AtomicUsize::new(0);
    drive(cfg.backoff, shutdown, &connected, || {
        pass::run_pass(&cfg, &endpoints, &prefixes, &cursor, &events, &connected)
    })
    .await;
    Ok(())
}

/// The pass loop, apart from etcd so the schedule is testable with paused time.
async fn drive<S, P, F>(
    policy: BackoffPolicy,
    shutdown: S,
    connected: &watch::Sender<bool>,
    mut pass: P,
) where
    S: Future<Output = ()>,
    P: FnMut() -> F,
    F: Future<Output = PassOutcome>,
{
    // Discovery reconnects on an exact schedule; the seed specifies no jitter here.
    let policy = BackoffPolicy {
        jitter: Jitter::None,
        ..policy
    };
    let mut backoff = Backoff::new(policy);
    let mut shutdown = pin!(shutdown);
    loop {
        let outcome = tokio::select! {
            biased;
            () = &mut shutdown => break,
            outcome = pass() => outcome,
        };
        connected.send_replace(false);
        if matches!(outcome.end, EtcdSourceError::ConsumerGone) {
            info!("etcd discovery stopped: its event consumer went away.");
            break;
        }
        let delay = backoff.session_ended(outcome.watched_for, policy.max, 0.0);
        warn!(
            error = %outcome.end,
            watched_ms = u64::try_from(outcome.watched_for.as_millis()).unwrap_or(u64::MAX),
            next_attempt_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "etcd discovery pass ended; a full resync follows the backoff."
        );
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            () = tokio::time::sleep(delay) => {}
        }
    }
    connected.send_replace(false);
}

/// A spawned source: the task runs until [`EtcdSource::stop`] or drop.
#[derive(Debug)]
pub struct EtcdSource {
    connected: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl EtcdSource {
    /// Validates `cfg` and spawns the pass loop on the current runtime.
    pub fn spawn(
        cfg: EtcdSourceConfig,
        events: mpsc::Sender<SourceEvent>,
    ) -> Result<Self, EtcdConfigError> {
        cfg.validate()?;
        let (connected_tx, connected) = watch::channel(false);
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let shutdown = async {
                // A dropped sender means the handle is gone: stop as well.
                let _ = stop_rx.await;
            };
            if let Err(error) = run_etcd_source(cfg, events, connected_tx, shutdown).await {
                warn!(%error, "etcd discovery did not start.");
            }
        });
        Ok(Self {
            connected,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// True while every watch of the current pass is open.
    pub fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    /// Stops the loop and waits for it to finish.
    /// Cancel-safe: dropped before the task ended (a caller's grace ran out), the source is
    /// dropped with it and its task aborted.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.as_mut() {
            let _ = task.await;
        }
        self.task = None;
    }

    /// A source around a task the test controls (it may ignore `stop`).
    #[cfg(test)]
    pub(crate) fn from_task(task: JoinHandle<()>, stop: oneshot::Sender<()>) -> Self {
        Self {
            connected: watch::channel(false).1,
            stop: Some(stop),
            task: Some(task),
        }
    }
}

impl Drop for EtcdSource {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::lock::Mutex;

    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Scripted passes: each entry is (time until the pass ends, how long its watches were open).
    /// Records the paused-clock start of every pass.
    async fn schedule(script: Vec<(Duration, Duration)>) -> Vec<Duration> {
        let policy = BackoffPolicy {
            initial: ms(500),
            max: ms(4000),
            jitter: Jitter::Full,
        };
        let origin = tokio::time::Instant::now();
        let starts = Arc::new(Mutex::new(Vec::new()));
        let (connected, _rx) = watch::channel(false);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let mut script = script.into_iter();
        let mut stop_tx = Some(stop_tx);
        let recorded = starts.clone();
        drive(
            policy,
            async {
                let _ = stop_rx.await;
            },
            &connected,
            move || {
                recorded.lock().push(origin.elapsed());
                let step = script.next();
                if step.is_none()
                    && let Some(stop) = stop_tx.take()
                {
                    let _ = stop.send(());
                }
                async move {
                    let Some((runs, watched)) = step else {
                        return std::future::pending().await;
                    };
                    tokio::time::sleep(runs).await;
                    PassOutcome {
                        end: EtcdSourceError::WatchClosed {
                            prefix: "instances",
                        },
                        watched_for: watched,
                    }
                }
            },
        )
        .await;
        starts.lock().clone()
    }

    #[tokio::test(start_paused = true)]
    async fn failures_double_the_delay_without_jitter() {
        let starts = schedule(vec![(ms(0), ms(0)); 5]).await;
        // 500, 1000, 2000, 4000, 4000 between attempts; Full jitter in the policy is ignored.
        assert_eq!(
            starts,
            [ms(0), ms(500), ms(1500), ms(3500), ms(7500), ms(11_500)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn only_watches_open_for_backoff_max_restore_the_floor() {
        let starts = schedule(vec![
            (ms(0), ms(0)),       // fails: wait 500
            (ms(0), ms(0)),       // fails: wait 1000
            (ms(3999), ms(3999)), // watched just under max: still doubles, wait 2000
            (ms(4000), ms(4000)), // watched for max: back to the floor, wait 500
        ])
        .await;
        assert_eq!(starts, [ms(0), ms(500), ms(1500), ms(7499), ms(11_999)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gone_consumer_stops_the_loop_and_clears_connected() {
        let (connected, rx) = watch::channel(true);
        let mut calls = 0;
        drive(
            EtcdSourceConfig::DEFAULT_BACKOFF,
            std::future::pending(),
            &connected,
            || {
                calls += 1;
                async {
                    PassOutcome {
                        end: EtcdSourceError::ConsumerGone,
                        watched_for: Duration::ZERO,
                    }
                }
            },
        )
        .await;
        assert_eq!(calls, 1);
        assert!(!*rx.borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn spawn_refuses_an_invalid_config_and_stop_ends_a_retrying_loop() {
        let (tx, _rx) = mpsc::channel(8);
        let bad = EtcdSourceConfig::new(vec![], continuum_protocol::ids::Namespace::new("d"));
        assert_eq!(
            EtcdSource::spawn(bad, tx.clone()).err(),
            Some(EtcdConfigError::NoEndpoints)
        );
        // Port 1 on loopback refuses connections: the loop keeps retrying until stopped.
        let cfg = EtcdSourceConfig::new(
            vec!["http://127.0.0.1:1".into()],
            continuum_protocol::ids::Namespace::new("d"),
        );
        let source = EtcdSource::spawn(cfg, tx).unwrap();
        assert!(!*source.connected().borrow());
        source.stop().await;
    }
}
