//! The pass loop of both Kubernetes sources: client, paginated lists, watches with idle
//! deadlines, and the relist-after-backoff rule.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::backoff::Backoff;
use continuum_protocol::kube::metadata::{MetaNote, MetadataState, Step};
use continuum_protocol::kube::objects;
use continuum_protocol::kube::pods::{PodMember, PodNote, PodSet};
use continuum_protocol::kube::{
    ENDPOINT_SLICE_PAGE, MAX_HELD_OBJECTS, METADATA_PAGE, POD_PAGE, labels,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, ListParams, WatchEvent, WatchParams};
use kube::config::{ExecInteractiveMode, KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{
    KubeConnect, KubeSourceConfig, KubeSourceError, KubeUpdate, MetadataUpdate, PodUpdate,
    WorkerMetadataChange, WorkerMetadataUpdate,
};

/// Builds an inferred client on the blocking pool.
type Build = Arc<dyn Fn() -> Result<Client, KubeSourceError> + Send + Sync>;

/// Builds clients, keeping a build abandoned by the setup timeout for the next pass to await.
pub struct ClientSource {
    connect: KubeConnect,
    pending: Option<JoinHandle<Result<Client, KubeSourceError>>>,
    build: Build,
}

impl ClientSource {
    pub fn new(connect: KubeConnect) -> Self {
        Self::with_build(connect, Arc::new(build_inferred_client))
    }

    /// A source whose inferred builds run `build` (tests count and hold them).
    fn with_build(connect: KubeConnect, build: Build) -> Self {
        Self {
            connect,
            pending: None,
            build,
        }
    }

    /// A fresh client. Cancel-safe: if the caller's timeout drops this future, the blocking
    /// build keeps running and the next call awaits it instead of starting another.
    pub async fn client(&mut self) -> Result<Client, KubeSourceError> {
        if let KubeConnect::Url(url) = &self.connect {
            let uri: http::Uri =
                url.parse()
                    .map_err(|e: http::uri::InvalidUri| KubeSourceError::BadUrl {
                        url: url.clone(),
                        reason: e.to_string(),
                    })?;
            return Ok(Client::try_from(Config::new(uri))?);
        }
        let build = self.build.clone();
        let handle = self
            .pending
            .get_or_insert_with(|| tokio::task::spawn_blocking(move || build()));
        let joined = handle.await;
        self.pending = None;
        joined.map_err(|e| KubeSourceError::Join(e.to_string()))?
    }
}

/// Runs on the blocking pool: reading kubeconfig and running exec plugins may block.
fn build_inferred_client() -> Result<Client, KubeSourceError> {
    let runtime = tokio::runtime::Handle::current();
    let config = inferred_config(Config::incluster, || {
        let mut kubeconfig = Kubeconfig::read().map_err(|e| e.to_string())?;
        never_interactive(&mut kubeconfig);
        runtime
            .block_on(Config::from_custom_kubeconfig(
                kubeconfig,
                &KubeConfigOptions::default(),
            ))
            .map_err(|e| e.to_string())
    })?;
    let _entered = runtime.enter();
    Ok(Client::try_from(config)?)
}

/// In-cluster credentials first; only when they are missing, `KUBECONFIG` / `~/.kube/config`.
fn inferred_config<E: std::fmt::Display>(
    in_cluster: impl FnOnce() -> Result<Config, E>,
    kubeconfig: impl FnOnce() -> Result<Config, String>,
) -> Result<Config, KubeSourceError> {
    match in_cluster() {
        Ok(config) => Ok(config),
        Err(in_cluster) => kubeconfig().map_err(|kubeconfig| KubeSourceError::NoConfig {
            in_cluster: in_cluster.to_string(),
            kubeconfig,
        }),
    }
}

/// A hung interactive exec plugin must not be able to wait on a terminal forever.
fn never_interactive(kubeconfig: &mut Kubeconfig) {
    for named in &mut kubeconfig.auth_infos {
        if let Some(exec) = named.auth_info.as_mut().and_then(|a| a.exec.as_mut()) {
            exec.interactive_mode = Some(ExecInteractiveMode::Never);
        }
    }
}

/// The receiver is gone: the source stops.
#[derive(Debug)]
pub(super) struct Closed;

/// How a pass ended.
struct Ended {
    /// How long the watch session lasted (zero if setup failed).
    lasted: Duration,
    /// `None` for a clean end of stream.
    error: Option<KubeSourceError>,
}

impl Ended {
    fn setup(error: KubeSourceError) -> Self {
        Self {
            lasted: Duration::ZERO,
            error: Some(error),
        }
    }
}

type WatchStream<K> = BoxStream<'static, kube::Result<WatchEvent<K>>>;

/// Pages through a list; returns the items (stopping once past the object ceiling, so the
/// state can count the overflow) and the list's resourceVersion.
async fn list_all<K>(
    api: &Api<K>,
    selector: Option<&str>,
    page: u32,
) -> Result<(Vec<K>, String), KubeSourceError>
where
    K: Clone + DeserializeOwned + Debug,
{
    let mut items = Vec::new();
    let mut version = None;
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().limit(page);
        if let Some(selector) = selector {
            params = params.labels(selector);
        }
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let list = api.list(&params).await?;
        // Every page of a paginated list is served from the first page's snapshot.
        if version.is_none() {
            version = list.metadata.resource_version.clone();
        }
        items.extend(list.items);
        token = list.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() || items.len() > MAX_HELD_OBJECTS {
            break;
        }
    }
    Ok((items, version.unwrap_or_else(|| "0".to_owned())))
}

async fn open_watch<K>(
    api: &Api<K>,
    selector: Option<&str>,
    version: &str,
    timeout_secs: u32,
) -> Result<WatchStream<K>, KubeSourceError>
where
    K: Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut params = WatchParams::default().timeout(timeout_secs);
    if let Some(selector) = selector {
        params = params.labels(selector);
    }
    Ok(api.watch(&params, version).await?.boxed())
}

/// One decoded watch item.
enum Next<K> {
    Apply(K),
    Delete(K),
    Bookmark,
    End(Option<KubeSourceError>),
}

fn decode<K>(item: Option<kube::Result<WatchEvent<K>>>) -> Next<K> {
    match item {
        None => Next::End(None),
        Some(Err(error)) => Next::End(Some(KubeSourceError::Client(error))),
        Some(Ok(WatchEvent::Added(o) | WatchEvent::Modified(o))) => Next::Apply(o),
        Some(Ok(WatchEvent::Deleted(o))) => Next::Delete(o),
        Some(Ok(WatchEvent::Bookmark(_))) => Next::Bookmark,
        Some(Ok(WatchEvent::Error(status))) if status.code == 410 => {
            Next::End(Some(KubeSourceError::Gone))
        }
        Some(Ok(WatchEvent::Error(status))) => Next::End(Some(KubeSourceError::WatchStatus {
            code: status.code,
            message: status.message,
        })),
    }
}

/// The kube object as `protocol`'s tolerant view.
fn to_proto<T: DeserializeOwned>(object: &impl Serialize) -> Option<T> {
    serde_json::to_value(object)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
}

async fn send<T>(tx: &mpsc::Sender<KubeUpdate<T>>, update: KubeUpdate<T>) -> Result<(), Closed> {
    tx.send(update).await.map_err(|_| Closed)
}

/// Tracks `connected` so transitions are reported once.
struct Connection {
    connected: bool,
}

impl Connection {
    async fn set<T>(&mut self, tx: &mpsc::Sender<KubeUpdate<T>>, up: bool) -> Result<(), Closed> {
        if self.connected != up {
            self.connected = up;
            send(tx, KubeUpdate::Connected(up)).await?;
        }
        Ok(())
    }
}

/// What survives between passes: the backoff schedule and the `connected` flag.
struct PassLoop {
    backoff: Backoff,
    reset_after: Duration,
    conn: Connection,
}

impl PassLoop {
    fn new(config: &KubeSourceConfig) -> Self {
        Self {
            backoff: Backoff::new(config.backoff),
            reset_after: config.reset_after(),
            conn: Connection { connected: false },
        }
    }

    /// The wait before the next relist, and whether the end was a routine close: a clean end
    /// of stream after a full-length session. Sessions of at least `reset_after` restore the
    /// floor; a routine close also leaves the floor in place for the next real failure.
    fn plan(&mut self, lasted: Duration, clean: bool) -> (Duration, bool) {
        let routine = clean && lasted >= self.reset_after;
        let delay = self.backoff.session_ended(lasted, self.reset_after, 0.0);
        if routine {
            self.backoff.reset();
        }
        (delay, routine)
    }

    /// After any termination: report, then wait the backoff before the next full relist.
    async fn after<T>(
        &mut self,
        ended: Ended,
        tx: &mpsc::Sender<KubeUpdate<T>>,
    ) -> Result<(), Closed> {
        let (delay, routine) = self.plan(ended.lasted, ended.error.is_none());
        if routine {
            debug!(lasted = ?ended.lasted, "Kubernetes watch closed routinely; relisting.");
        } else {
            let error = ended.error.unwrap_or(KubeSourceError::EarlyEof("watch"));
            warn!(%error, lasted = ?ended.lasted, "Kubernetes watch ended; relisting after backoff.");
            self.conn.set(tx, false).await?;
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => Ok(()),
            () = tx.closed() => Err(Closed),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// kubernetes_pods

pub(super) async fn run_pods(
    config: KubeSourceConfig,
    mut set: PodSet,
    tx: mpsc::Sender<PodUpdate>,
) {
    let mut clients = ClientSource::new(config.connect.clone());
    let mut last: Option<Vec<PodMember>> = None;
    let mut passes = PassLoop::new(&config);
    loop {
        let Ok(ended) = pod_pass(
            &config,
            &mut clients,
            &mut set,
            &tx,
            &mut passes.conn,
            &mut last,
        )
        .await
        else {
            return;
        };
        if passes.after(ended, &tx).await.is_err() {
            return;
        }
    }
}

async fn report_pod_notes(tx: &mpsc::Sender<PodUpdate>, notes: Vec<PodNote>) -> Result<(), Closed> {
    for note in notes {
        let (kind, object) = match note {
            PodNote::Refused { pod, reason } => {
                warn!(pod, ?reason, "Refused Kubernetes worker Pod.");
                ("refused", pod)
            }
            PodNote::Duplicate { pod, key } => {
                warn!(pod, instance_id = %key.instance_id, namespace = %key.namespace,
                    "Refused Pod whose name hashes to another ready Pod's instance id.");
                ("duplicate", pod)
            }
            PodNote::Overflow { pod } => {
                warn!(
                    pod,
                    limit = MAX_HELD_OBJECTS,
                    "Refused Pod past the held-Pod ceiling."
                );
                ("malformed", pod)
            }
            PodNote::Held { pod, component } => {
                debug!(
                    pod,
                    ?component,
                    "Holding ready Pod whose component has no model mapping."
                );
                continue;
            }
        };
        send(tx, KubeUpdate::Counted { kind, object }).await?;
    }
    Ok(())
}

async fn publish_members(
    tx: &mpsc::Sender<PodUpdate>,
    set: &PodSet,
    last: &mut Option<Vec<PodMember>>,
) -> Result<(), Closed> {
    let members = set.members();
    if last.as_ref() != Some(&members) {
        *last = Some(members.clone());
        send(tx, KubeUpdate::Data(members)).await?;
    }
    Ok(())
}

async fn pod_pass(
    config: &KubeSourceConfig,
    clients: &mut ClientSource,
    set: &mut PodSet,
    tx: &mpsc::Sender<PodUpdate>,
    conn: &mut Connection,
    last: &mut Option<Vec<PodMember>>,
) -> Result<Ended, Closed> {
    let selector = labels::pod_selector(&set.config().namespaces);
    let timing = config.timing;
    let setup = tokio::time::timeout(timing.setup_timeout, async {
        let client = clients.client().await?;
        let api: Api<Pod> = Api::namespaced(client, &config.namespace);
        let (items, version) = list_all(&api, Some(&selector), POD_PAGE).await?;
        let stream = open_watch(&api, Some(&selector), &version, timing.watch_timeout_secs).await?;
        Ok::<_, KubeSourceError>((items, stream))
    })
    .await;
    let (items, mut stream) = match setup {
        Err(_) => {
            return Ok(Ended::setup(KubeSourceError::SetupTimeout(
                timing.setup_timeout,
            )));
        }
        Ok(Err(error)) => return Ok(Ended::setup(error)),
        Ok(Ok(listed)) => listed,
    };
    let pods: Vec<objects::Pod> = items.iter().filter_map(to_proto).collect();
    info!(
        pods = pods.len(),
        namespace = config.namespace,
        "Listed Dynamo worker Pods."
    );
    report_pod_notes(tx, set.replace_all(pods.iter())).await?;
    // A relist always republishes, so the owner sees the resynced view even when unchanged.
    *last = None;
    publish_members(tx, set, last).await?;
    conn.set(tx, true).await?;

    let started = Instant::now();
    loop {
        let item = match tokio::time::timeout(timing.idle_timeout, stream.next()).await {
            Err(_) => Next::End(Some(KubeSourceError::Stalled("pods"))),
            Ok(item) => decode(item),
        };
        match item {
            Next::Apply(pod) => {
                if let Some(pod) = to_proto::<objects::Pod>(&pod) {
                    report_pod_notes(tx, set.apply(&pod)).await?;
                }
            }
            Next::Delete(pod) => {
                if let Some(name) = pod.metadata.name.as_deref() {
                    report_pod_notes(tx, set.delete(name)).await?;
                }
            }
            Next::Bookmark => continue,
            Next::End(error) => {
                return Ok(Ended {
                    lasted: started.elapsed(),
                    error,
                });
            }
        }
        publish_members(tx, set, last).await?;
    }
}

// ---------------------------------------------------------------------------------------------
// kubernetes (metadata)

/// nvidia.com/v1alpha1 DynamoWorkerMetadata (wire §13.1).
pub(super) fn dynamo_worker_metadata() -> ApiResource {
    ApiResource {
        group: "nvidia.com".into(),
        version: "v1alpha1".into(),
        api_version: "nvidia.com/v1alpha1".into(),
        kind: "DynamoWorkerMetadata".into(),
        plural: "dynamoworkermetadatas".into(),
    }
}

pub(super) async fn run_metadata(
    config: KubeSourceConfig,
    mut state: MetadataState,
    tx: mpsc::Sender<MetadataUpdate>,
) {
    let mut clients = ClientSource::new(config.connect.clone());
    let mut passes = PassLoop::new(&config);
    loop {
        let Ok(ended) =
            metadata_pass(&config, &mut clients, &mut state, &tx, &mut passes.conn).await
        else {
            return;
        };
        if passes.after(ended, &tx).await.is_err() {
            return;
        }
    }
}

async fn publish_step(tx: &mpsc::Sender<MetadataUpdate>, step: Step) -> Result<(), Closed> {
    for MetaNote {
        resource,
        kind,
        detail,
    } in step.notes
    {
        warn!(
            resource,
            kind = kind.as_str(),
            detail,
            "Refused DynamoWorkerMetadata resource."
        );
        send(
            tx,
            KubeUpdate::Counted {
                kind: kind.as_str(),
                object: resource,
            },
        )
        .await?;
    }
    if !step.events.is_empty() {
        send(tx, KubeUpdate::Data(step.events)).await?;
    }
    Ok(())
}

async fn metadata_pass(
    config: &KubeSourceConfig,
    clients: &mut ClientSource,
    state: &mut MetadataState,
    tx: &mpsc::Sender<MetadataUpdate>,
    conn: &mut Connection,
) -> Result<Ended, Closed> {
    let timing = config.timing;
    let selector = labels::endpoint_slice_selector();
    let setup = tokio::time::timeout(timing.setup_timeout, async {
        let client = clients.client().await?;
        let resources: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &config.namespace, &dynamo_worker_metadata());
        let slices: Api<EndpointSlice> = Api::namespaced(client, &config.namespace);
        let (dwms, dwm_version) = list_all(&resources, None, METADATA_PAGE).await?;
        let (eps, eps_version) = list_all(&slices, Some(selector), ENDPOINT_SLICE_PAGE).await?;
        let dwm_stream =
            open_watch(&resources, None, &dwm_version, timing.watch_timeout_secs).await?;
        let eps_stream = open_watch(
            &slices,
            Some(selector),
            &eps_version,
            timing.watch_timeout_secs,
        )
        .await?;
        Ok::<_, KubeSourceError>((dwms, eps, dwm_stream, eps_stream))
    })
    .await;
    let (dwms, eps, mut dwm_stream, mut eps_stream) = match setup {
        Err(_) => {
            return Ok(Ended::setup(KubeSourceError::SetupTimeout(
                timing.setup_timeout,
            )));
        }
        Ok(Err(error)) => return Ok(Ended::setup(error)),
        Ok(Ok(listed)) => listed,
    };
    let dwms: Vec<objects::DynamoWorkerMetadata> = dwms.iter().filter_map(to_proto).collect();
    let eps: Vec<objects::EndpointSlice> = eps.iter().filter_map(to_proto).collect();
    info!(
        resources = dwms.len(),
        slices = eps.len(),
        namespace = config.namespace,
        "Listed DynamoWorkerMetadata and EndpointSlices."
    );
    publish_step(tx, state.relist(&dwms, &eps)).await?;
    conn.set(tx, true).await?;

    let started = Instant::now();
    let idle = timing.idle_timeout;
    // Independent deadlines: a stalled slice watch is caught even while resources keep flowing.
    let dwm_deadline = tokio::time::sleep(idle);
    let eps_deadline = tokio::time::sleep(idle);
    tokio::pin!(dwm_deadline, eps_deadline);
    let end = |error| Ended {
        lasted: started.elapsed(),
        error,
    };
    loop {
        tokio::select! {
            item = dwm_stream.next() => {
                dwm_deadline.as_mut().reset(Instant::now() + idle);
                let step = match decode(item) {
                    Next::Apply(o) => match to_proto::<objects::DynamoWorkerMetadata>(&o) {
                        Some(r) => state.apply_resource(&r),
                        None => continue,
                    },
                    Next::Delete(o) => match o.metadata.name.as_deref() {
                        Some(name) => state.delete_resource(name),
                        None => continue,
                    },
                    Next::Bookmark => continue,
                    Next::End(error) => return Ok(end(error)),
                };
                publish_step(tx, step).await?;
            }
            item = eps_stream.next() => {
                eps_deadline.as_mut().reset(Instant::now() + idle);
                let step = match decode(item) {
                    Next::Apply(o) => match to_proto::<objects::EndpointSlice>(&o) {
                        Some(s) => state.apply_slice(&s),
                        None => continue,
                    },
                    Next::Delete(o) => match o.metadata.name.as_deref() {
                        Some(name) => state.delete_slice(name),
                        None => continue,
                    },
                    Next::Bookmark => continue,
                    Next::End(error) => return Ok(end(error)),
                };
                publish_step(tx, step).await?;
            }
            () = &mut dwm_deadline => {
                return Ok(end(Some(KubeSourceError::Stalled("dynamoworkermetadatas"))));
            }
            () = &mut eps_deadline => {
                return Ok(end(Some(KubeSourceError::Stalled("endpointslices"))));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// DynamoWorkerMetadata alone (continuum-event-broker's advertised publishers)

pub(super) async fn run_worker_metadata(
    config: KubeSourceConfig,
    tx: mpsc::Sender<WorkerMetadataUpdate>,
) {
    let mut clients = ClientSource::new(config.connect.clone());
    let mut passes = PassLoop::new(&config);
    loop {
        let Ok(ended) = worker_metadata_pass(&config, &mut clients, &tx, &mut passes.conn).await
        else {
            return;
        };
        if passes.after(ended, &tx).await.is_err() {
            return;
        }
    }
}

async fn worker_metadata_pass(
    config: &KubeSourceConfig,
    clients: &mut ClientSource,
    tx: &mpsc::Sender<WorkerMetadataUpdate>,
    conn: &mut Connection,
) -> Result<Ended, Closed> {
    let timing = config.timing;
    let setup = tokio::time::timeout(timing.setup_timeout, async {
        let client = clients.client().await?;
        let resources: Api<DynamicObject> =
            Api::namespaced_with(client, &config.namespace, &dynamo_worker_metadata());
        let (items, version) = list_all(&resources, None, METADATA_PAGE).await?;
        let stream = open_watch(&resources, None, &version, timing.watch_timeout_secs).await?;
        Ok::<_, KubeSourceError>((items, stream))
    })
    .await;
    let (items, mut stream) = match setup {
        Err(_) => {
            return Ok(Ended::setup(KubeSourceError::SetupTimeout(
                timing.setup_timeout,
            )));
        }
        Ok(Err(error)) => return Ok(Ended::setup(error)),
        Ok(Ok(listed)) => listed,
    };
    let mut items: Vec<objects::DynamoWorkerMetadata> = items.iter().filter_map(to_proto).collect();
    items.truncate(MAX_HELD_OBJECTS);
    info!(
        resources = items.len(),
        namespace = config.namespace,
        "Listed DynamoWorkerMetadata."
    );
    send(tx, KubeUpdate::Data(WorkerMetadataChange::Relisted(items))).await?;
    conn.set(tx, true).await?;
    let started = Instant::now();
    loop {
        let item = match tokio::time::timeout(timing.idle_timeout, stream.next()).await {
            Err(_) => Next::End(Some(KubeSourceError::Stalled("dynamoworkermetadatas"))),
            Ok(item) => decode(item),
        };
        let change = match item {
            Next::Apply(o) => match to_proto::<objects::DynamoWorkerMetadata>(&o) {
                Some(r) => WorkerMetadataChange::Applied(Box::new(r)),
                None => continue,
            },
            Next::Delete(o) => match o.metadata.name {
                Some(name) => WorkerMetadataChange::Deleted(name),
                None => continue,
            },
            Next::Bookmark => continue,
            Next::End(error) => {
                return Ok(Ended {
                    lasted: started.elapsed(),
                    error,
                });
            }
        };
        send(tx, KubeUpdate::Data(change)).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crd_resource_matches_the_wire_contract() {
        let ar = dynamo_worker_metadata();
        assert_eq!(
            <DynamicObject as kube::Resource>::url_path(&ar, Some("llm-prod")),
            "/apis/nvidia.com/v1alpha1/namespaces/llm-prod/dynamoworkermetadatas"
        );
        assert_eq!(ar.plural, "dynamoworkermetadatas");
        assert_eq!(ar.api_version, "nvidia.com/v1alpha1");
    }

    fn pass_loop(initial_ms: u64, max_ms: u64) -> PassLoop {
        PassLoop::new(&KubeSourceConfig {
            connect: KubeConnect::Url("http://127.0.0.1:1".into()),
            namespace: "dynamo".into(),
            backoff: continuum_protocol::backoff::BackoffPolicy {
                initial: Duration::from_millis(initial_ms),
                max: Duration::from_millis(max_ms),
                jitter: continuum_protocol::backoff::Jitter::None,
            },
            timing: super::super::WatchTiming::default(),
        })
    }

    #[test]
    fn failures_double_the_wait_and_a_long_session_restores_the_floor() {
        let ms = Duration::from_millis;
        let mut passes = pass_loop(500, 30_000);
        assert_eq!(passes.plan(Duration::ZERO, false), (ms(500), false));
        assert_eq!(passes.plan(Duration::ZERO, false), (ms(1000), false));
        assert_eq!(
            passes.plan(ms(100), true),
            (ms(2000), false),
            "an early EOF is a failure"
        );
        // A transport error after a session of at least min(max, 290 s) waits the floor.
        assert_eq!(passes.plan(ms(30_000), false), (ms(500), false));
        assert_eq!(passes.plan(Duration::ZERO, false), (ms(1000), false));
    }

    #[test]
    fn routine_closes_wait_the_floor_and_do_not_raise_the_backoff() {
        let ms = Duration::from_millis;
        let mut passes = pass_loop(500, 600_000);
        // reset_after = min(600 s, 290 s).
        for _ in 0..3 {
            assert_eq!(passes.plan(Duration::from_secs(290), true), (ms(500), true));
        }
        assert_eq!(passes.plan(Duration::ZERO, false), (ms(500), false));
    }

    #[test]
    fn kubeconfig_exec_plugins_are_forced_non_interactive() {
        let mut kubeconfig = Kubeconfig::from_yaml(
            r#"
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users:
  - name: exec-user
    user:
      exec:
        apiVersion: client.authentication.k8s.io/v1
        command: get-token
        interactiveMode: IfAvailable
  - name: token-user
    user: {token: abc}
contexts: [{name: x, context: {cluster: c, user: exec-user}}]
current-context: x
"#,
        )
        .expect("kubeconfig parses");
        never_interactive(&mut kubeconfig);
        let exec = kubeconfig.auth_infos[0]
            .auth_info
            .as_ref()
            .and_then(|a| a.exec.as_ref())
            .expect("exec config");
        assert_eq!(exec.interactive_mode, Some(ExecInteractiveMode::Never));
        assert!(
            kubeconfig.auth_infos[1]
                .auth_info
                .as_ref()
                .is_some_and(|a| a.exec.is_none())
        );
    }

    /// Spec "List, watch, and relist": in-cluster credentials are tried before the kubeconfig,
    /// which is read only when they are missing; when both fail the error names both.
    #[test]
    fn in_cluster_credentials_are_tried_before_the_kubeconfig() {
        let cluster = || Config::new("https://10.0.0.1:443".parse().expect("uri"));
        let from_cluster = inferred_config(
            || Ok::<_, String>(cluster()),
            || panic!("the kubeconfig is not read when in-cluster credentials exist"),
        )
        .expect("in-cluster");
        assert_eq!(from_cluster.cluster_url, cluster().cluster_url);
        let from_file = inferred_config(
            || Err("KUBERNETES_SERVICE_HOST unset"),
            || Ok(Config::new("https://127.0.0.1:6443".parse().expect("uri"))),
        )
        .expect("kubeconfig");
        assert_eq!(from_file.cluster_url.port_u16(), Some(6443));
        match inferred_config(
            || Err("KUBERNETES_SERVICE_HOST unset"),
            || Err("no ~/.kube/config".to_string()),
        ) {
            Err(KubeSourceError::NoConfig {
                in_cluster,
                kubeconfig,
            }) => {
                assert_eq!(in_cluster, "KUBERNETES_SERVICE_HOST unset");
                assert_eq!(kubeconfig, "no ~/.kube/config");
            }
            other => panic!("expected NoConfig, got {other:?}"),
        }
    }

    /// Spec: "an abandoned client build is awaited by the next pass rather than spawned twice".
    /// A build held on the blocking pool outlives the pass whose 30 s setup budget gave up on it
    /// (tokio's paused clock); the next call awaits that same build, and only the call after it
    /// starts a new one.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_client_build_is_awaited_by_the_next_pass_not_spawned_again() {
        let builds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(crate::lock::Mutex::new(held));
        let runtime = tokio::runtime::Handle::current();
        let build: Build = {
            let builds = builds.clone();
            Arc::new(move || {
                builds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // The first build hangs (a stuck exec plugin) until released.
                let _ = held.lock().recv();
                let _entered = runtime.enter();
                Ok(Client::try_from(Config::new(
                    "http://127.0.0.1:1".parse().expect("uri"),
                ))?)
            })
        };
        let mut clients = ClientSource::with_build(KubeConnect::Infer, build);
        let abandoned = {
            let attempt = tokio::time::timeout(Duration::from_secs(30), clients.client());
            tokio::pin!(attempt);
            assert!(futures::poll!(&mut attempt).is_pending());
            // The build runs on a blocking thread (which holds tokio's paused clock still):
            // once it started, move the clock past the pass's budget by hand.
            let mut spins = 0u32;
            while builds.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                assert!(spins < 10_000_000, "the build starts");
                spins += 1;
                tokio::task::yield_now().await;
            }
            tokio::time::advance(Duration::from_secs(30)).await;
            attempt.await
        };
        assert!(
            abandoned.is_err(),
            "the first pass gives up at its setup budget"
        );
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(clients.pending.is_some(), "the abandoned build is kept");

        release.send(()).expect("release the build");
        drop(release);
        clients
            .client()
            .await
            .expect("the next pass gets the held build's client");
        assert_eq!(
            builds.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "awaited, not spawned twice"
        );
        assert!(clients.pending.is_none());
        clients.client().await.expect("a fresh build");
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn reset_after_is_the_smaller_of_backoff_max_and_the_watch_timeout() {
        let mut cfg = KubeSourceConfig {
            connect: KubeConnect::Url("http://127.0.0.1:1".into()),
            namespace: "dynamo".into(),
            backoff: KubeSourceConfig::DEFAULT_BACKOFF,
            timing: super::super::WatchTiming::default(),
        };
        assert_eq!(cfg.reset_after(), Duration::from_secs(30));
        cfg.backoff.max = Duration::from_secs(600);
        assert_eq!(cfg.reset_after(), Duration::from_secs(290));
    }
}
