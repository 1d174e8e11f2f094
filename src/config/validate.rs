//! Every validation rule and warning, collected (never stopping at the first) as
//! path-addressed [`Diagnostic`]s.
//!
//! Rules follow the product reference (docs "Dynamo Worker Discovery"); the ones the reference
//! leaves open (front door, backends, telemetry) are the checks an operator would expect. Each
//! rule has one unit test in `validate/tests.rs` named after it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use super::schema::*;
use super::{Diagnostic, Severity};

/// Most etcd endpoints accepted.
pub const MAX_ETCD_ENDPOINTS: usize = 16;
/// Shortest `dynamo.discovery.file.rescan_interval` accepted.
pub const MIN_FILE_RESCAN: Duration = Duration::from_millis(10);
/// Most Dynamo namespaces one router watches (`MAX_DYNAMO_NAMESPACES`).
pub const MAX_DYNAMO_NAMESPACES: usize = 16;
/// Most shim replicas in `shim.backends` (and in one pool).
pub const MAX_SHIM_BACKENDS: usize = 64;
/// Most `backends[].global_prompts` entries.
pub const MAX_GLOBAL_PROMPTS: usize = 64;
/// Largest `backends[].global_prompts` entry.
pub const MAX_GLOBAL_PROMPT_BYTES: usize = 64 * 1024;
/// Most `shim.model_map` pairs.
pub const MAX_MODEL_MAP_ENTRIES: usize = 1024;
/// Most `load.direct_allow_cidrs` entries.
pub const MAX_DIRECT_ALLOW_CIDRS: usize = 64;
/// Most `kubernetes.models` entries.
pub const MAX_COMPONENT_MODELS: usize = 256;
/// Most `event_bus.brokers` entries (it bounds a metric label set).
pub const MAX_BROKERS: usize = 256;
/// Per-stream floor of the event-bus session buffer (4 reservations of 16 KiB).
pub const MIN_STREAM_BUFFER_BYTES: u64 = 64 * 1024;
/// Most event-bus sessions and streams per session.
pub const MAX_EVENT_BUS_SESSIONS: u32 = 4096;
pub const MAX_STREAMS_PER_SESSION: u32 = 65_536;
/// `load.max_staleness` bounds.
pub const MIN_MAX_STALENESS: Duration = Duration::from_millis(100);
pub const MAX_MAX_STALENESS: Duration = Duration::from_secs(300);

/// Validates a parsed config; returns every error and warning (errors first, then warnings,
/// each group in document order).
pub fn validate(config: &Config) -> Vec<Diagnostic> {
    let mut v = Validator::default();
    v.server_and_auth(config);
    v.backends(config);
    v.telemetry(&config.telemetry);
    v.discovery(config);
    v.load(config);
    v.shim(config);
    v.kv(config);
    v.event_bus(config);
    v.kv_cache_index(config);
    let mut out = v.out;
    out.extend(super::rate_limits::validate(config));
    // Keys of a feature this build lacks are validated like the others, then flagged.
    out.extend(super::features::inactive(
        config,
        crate::build_info::Features::COMPILED,
    ));
    out.sort_by_key(|diagnostic| diagnostic.severity == Severity::Warning);
    out
}

#[derive(Default)]
struct Validator {
    out: Vec<Diagnostic>,
}

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(Diagnostic::error(path, message));
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(Diagnostic::warning(path, message));
    }

    fn server_and_auth(&mut self, config: &Config) {
        if config.admin.enabled {
            match config.admin.token.as_deref() {
                None | Some("") => self.err(
                    "admin.token",
                    "admin.enabled is true but no admin token is set; /admin/* would be open",
                ),
                Some(token) if token.len() < 16 => self.warn(
                    "admin.token",
                    "admin token is shorter than 16 characters; use a long random token",
                ),
                Some(_) => {}
            }
        }

        let mut keys = BTreeSet::new();
        let mut names = BTreeSet::new();
        for (i, api_key) in config.api_keys.iter().enumerate() {
            let path = format!("api_keys[{i}]");
            if api_key.key.trim().is_empty() {
                self.err(format!("{path}.key"), "API key must not be empty");
            } else if !keys.insert(api_key.key.as_str()) {
                self.err(format!("{path}.key"), "API key is listed twice");
            }
            if api_key.name.trim().is_empty() {
                self.err(format!("{path}.name"), "API key name must not be empty");
            } else if !names.insert(api_key.name.as_str()) {
                self.err(format!("{path}.name"), "API key name is used twice");
            }
            for (j, backend) in api_key.allowed_backends.iter().flatten().enumerate() {
                if config.backend(backend).is_none() {
                    self.err(
                        format!("{path}.allowed_backends[{j}]"),
                        format!("backend {backend:?} is not defined in backends[]"),
                    );
                }
            }
        }
        let server = &config.server;
        for (key, value) in [
            ("header_read_timeout", server.header_read_timeout),
            ("body_read_timeout", server.body_read_timeout),
            ("idle_timeout", server.idle_timeout),
        ] {
            if value.get() < Duration::from_millis(100) || value.get() > Duration::from_secs(3600) {
                self.err(
                    format!("server.{key}"),
                    format!("{key} must be between 100ms and 1h (got {value})"),
                );
            }
        }
        if !(1..=1_000_000).contains(&server.max_connections) {
            self.err(
                "server.max_connections",
                "max_connections must be between 1 and 1000000",
            );
        }
        if config.api_keys.is_empty() && !config.server.bind_address.ip().is_loopback() {
            self.warn(
                "server.bind_address",
                format!(
                    "the front door binds {} beyond loopback and no api_keys are configured; \
                     any client that reaches it can use every backend",
                    config.server.bind_address
                ),
            );
        }
    }

    fn backends(&mut self, config: &Config) {
        let mut seen = BTreeSet::new();
        for (i, backend) in config.backends.iter().enumerate() {
            let path = format!("backends[{i}]");
            if !is_backend_name(&backend.name) {
                self.err(
                    format!("{path}.name"),
                    "backend name must be 1-128 characters of [A-Za-z0-9._-]",
                );
            } else if !seen.insert(backend.name.as_str()) {
                self.err(
                    format!("{path}.name"),
                    format!("backend name {:?} is used twice", backend.name),
                );
            }
            if let Err(message) = check_http_url(&backend.url, false) {
                self.err(format!("{path}.url"), message);
            }
            if backend.role != BackendRole::Unified {
                self.err(
                    format!("{path}.role"),
                    "only role unified is routed: standard routing sends requests to unified \
                     backends, and prefill/decode phases run behind a unified Dynamo shim \
                     replica (dynamo.shim); set role: unified",
                );
            }
            if let Some(ca) = &backend.tls.ca_cert {
                if !backend.url.starts_with("https://") {
                    self.err(
                        format!("{path}.tls.ca_cert"),
                        "tls.ca_cert applies to https:// backends only",
                    );
                }
                if let Err(message) = crate::wire::tls::read_ca_file(ca) {
                    self.err(format!("{path}.tls.ca_cert"), message);
                }
            }
            for (j, prompt) in backend.global_prompts.iter().enumerate() {
                if prompt.trim().is_empty() {
                    self.err(
                        format!("{path}.global_prompts[{j}]"),
                        "a global prompt must not be empty",
                    );
                } else if prompt.len() > MAX_GLOBAL_PROMPT_BYTES {
                    self.err(
                        format!("{path}.global_prompts[{j}]"),
                        format!("a global prompt is at most {MAX_GLOBAL_PROMPT_BYTES} bytes"),
                    );
                }
            }
            if backend.global_prompts.len() > MAX_GLOBAL_PROMPTS {
                self.err(
                    format!("{path}.global_prompts"),
                    format!("at most {MAX_GLOBAL_PROMPTS} global prompts per backend"),
                );
            }
            let mut models = BTreeSet::new();
            for (j, model) in backend.models.iter().enumerate() {
                if model.trim().is_empty() {
                    self.err(format!("{path}.models[{j}]"), "model id must not be empty");
                } else if !models.insert(model.as_str()) {
                    self.err(format!("{path}.models[{j}]"), "model id is listed twice");
                }
            }
            let hc = &backend.health_check;
            let hc_path = format!("{path}.health_check");
            if hc.interval.get().is_zero() {
                self.err(
                    format!("{hc_path}.interval"),
                    "interval must be greater than 0",
                );
            }
            if hc.timeout.get().is_zero() {
                self.err(
                    format!("{hc_path}.timeout"),
                    "timeout must be greater than 0",
                );
            } else if hc.timeout > hc.interval && !hc.interval.get().is_zero() {
                self.err(
                    format!("{hc_path}.timeout"),
                    "timeout must not exceed interval (probes would overlap)",
                );
            }
            if hc.unhealthy_threshold == 0 {
                self.err(
                    format!("{hc_path}.unhealthy_threshold"),
                    "must be at least 1",
                );
            }
            if hc.healthy_threshold == 0 {
                self.err(format!("{hc_path}.healthy_threshold"), "must be at least 1");
            }
            if !hc.path.starts_with('/')
                || hc.path.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                self.err(
                    format!("{hc_path}.path"),
                    "health check path must start with '/' and contain no whitespace",
                );
            }
        }
    }

    fn telemetry(&mut self, telemetry: &TelemetryConfig) {
        if let Err(error) = tracing_subscriber::EnvFilter::builder().parse(&telemetry.log_level) {
            self.err(
                "telemetry.log_level",
                format!("not a valid log filter directive: {error}"),
            );
        }
        if telemetry.service_name.trim().is_empty() {
            self.err("telemetry.service_name", "service name must not be empty");
        }
        if let Some(otlp) = &telemetry.otlp
            && let Err(message) = check_http_url(&otlp.endpoint, true)
        {
            self.err("telemetry.otlp.endpoint", message);
        }
    }

    fn discovery(&mut self, config: &Config) {
        let dynamo = &config.dynamo;
        let discovery = &dynamo.discovery;
        let etcd = &discovery.etcd;
        let source = discovery.source;

        // etcd formats are checked whatever the source: a typo there is still a typo.
        let base = "dynamo.discovery.etcd";
        if etcd.endpoints.is_empty() && dynamo.enabled && source == DiscoverySource::Etcd {
            self.err(
                format!("{base}.endpoints"),
                "at least one etcd endpoint is required when dynamo.enabled is true",
            );
        }
        if etcd.endpoints.len() > MAX_ETCD_ENDPOINTS {
            self.err(
                format!("{base}.endpoints"),
                format!(
                    "{} endpoints given; at most {MAX_ETCD_ENDPOINTS} are accepted",
                    etcd.endpoints.len()
                ),
            );
        }
        let mut schemes = BTreeMap::new();
        let mut seen = BTreeSet::new();
        let mut external = Vec::new();
        for (i, raw) in etcd.endpoints.iter().enumerate() {
            let path = format!("{base}.endpoints[{i}]");
            match check_endpoint(raw) {
                Ok(endpoint) => {
                    schemes.entry(endpoint.https).or_insert(i);
                    if !seen.insert(normalize_endpoint(raw)) {
                        self.warn(path.clone(), "endpoint is listed twice");
                    }
                    if let Some(ip) = endpoint.ip
                        && is_public_ip(ip)
                    {
                        external.push(path);
                    }
                }
                Err(message) => self.err(path, message),
            }
        }
        if schemes.len() > 1 {
            self.err(
                format!("{base}.endpoints"),
                "endpoints mix http:// and https://; use one scheme for every endpoint",
            );
        }
        let plaintext = schemes.contains_key(&false);
        if let Some(tls) = &etcd.tls {
            if plaintext {
                self.err(
                    format!("{base}.tls"),
                    "a tls block cannot be combined with http:// endpoints \
                     (bare host:port means http://); write https:// endpoints",
                );
            }
            for (name, value) in [
                ("ca_cert", &tls.ca_cert),
                ("client_cert", &tls.client_cert),
                ("client_key", &tls.client_key),
            ] {
                if value.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                    self.err(format!("{base}.tls.{name}"), "path must not be empty");
                }
            }
            if tls
                .server_name
                .as_deref()
                .is_some_and(|name| name.trim().is_empty())
            {
                self.err(
                    format!("{base}.tls.server_name"),
                    "server_name must not be empty",
                );
            }
            match (&tls.client_cert, &tls.client_key) {
                (Some(_), None) => self.err(
                    format!("{base}.tls.client_key"),
                    "client_cert is set without client_key; set both or neither",
                ),
                (None, Some(_)) => self.err(
                    format!("{base}.tls.client_cert"),
                    "client_key is set without client_cert; set both or neither",
                ),
                _ => {}
            }
        }
        if let Some(auth) = &etcd.auth {
            if auth.username.trim().is_empty() {
                self.err(
                    format!("{base}.auth.username"),
                    "username must not be empty",
                );
            }
            if auth.password.is_empty() {
                self.err(
                    format!("{base}.auth.password"),
                    "password must not be empty",
                );
            }
            if etcd.tls.is_none() || plaintext {
                self.warn(
                    format!("{base}.auth"),
                    "etcd auth over plaintext: the Authenticate RPC and session token travel \
                     in cleartext; use https:// endpoints with a tls block",
                );
            }
        }
        if dynamo.enabled
            && source == DiscoverySource::Etcd
            && dynamo.load.transport == LoadTransport::Direct
        {
            for path in external {
                self.warn(
                    path,
                    "etcd endpoint is a public address but load.transport is direct, which \
                     assumes the router runs inside the cluster; use transport: broker from outside",
                );
            }
        }
        self.backoff(
            &format!("{base}.watch_reconnect_backoff"),
            &etcd.watch_reconnect_backoff,
        );

        self.namespaces(
            base,
            "namespace",
            &etcd.namespace,
            "namespaces",
            &etcd.namespaces,
            false,
        );

        let kube = &discovery.kubernetes;
        let kbase = "dynamo.discovery.kubernetes";
        self.backoff(
            &format!("{kbase}.watch_reconnect_backoff"),
            &kube.watch_reconnect_backoff,
        );
        if source.is_kubernetes() {
            if !is_dns1123_label(&kube.namespace) {
                self.err(
                    format!("{kbase}.namespace"),
                    "Kubernetes namespace must be a DNS-1123 label \
                     (1-63 of [a-z0-9-], starting and ending alphanumeric)",
                );
            }
            self.namespaces(
                kbase,
                "dynamo_namespace",
                &kube.dynamo_namespace,
                "dynamo_namespaces",
                &kube.dynamo_namespaces,
                true,
            );
        }
        let file = &discovery.file;
        let fbase = "dynamo.discovery.file";
        if file
            .root
            .as_ref()
            .is_some_and(|root| root.as_os_str().is_empty())
        {
            self.err(format!("{fbase}.root"), "path must not be empty");
        }
        if file.ttl.get().is_zero() {
            self.err(format!("{fbase}.ttl"), "ttl must be greater than 0");
        }
        if file.rescan_interval.get() < MIN_FILE_RESCAN {
            self.err(
                format!("{fbase}.rescan_interval"),
                format!(
                    "rescan_interval must be at least {}",
                    humantime::format_duration(MIN_FILE_RESCAN)
                ),
            );
        } else if source == DiscoverySource::File && file.rescan_interval > file.ttl {
            self.warn(
                format!("{fbase}.rescan_interval"),
                "rescan_interval is longer than ttl; inotify still reports new and removed \
                 files at once, and expiry is scheduled from mtimes",
            );
        }
        if source == DiscoverySource::File {
            self.namespaces(
                fbase,
                "namespace",
                &file.namespace,
                "namespaces",
                &file.namespaces,
                false,
            );
        }
        match source {
            DiscoverySource::Etcd | DiscoverySource::File => {}
            DiscoverySource::Simulated => self.warn(
                "dynamo.discovery.source",
                "source simulated discovers only the fleet `continuum-router demo` simulates; \
                 a daemon run from a file discovers no workers with it",
            ),
            DiscoverySource::Kubernetes => {
                if kube.model.is_some() || !kube.models.is_empty() {
                    self.warn(
                        format!("{kbase}.model"),
                        "source kubernetes reads the model from each worker's card; \
                         kubernetes.model and kubernetes.models are ignored",
                    );
                }
            }
            DiscoverySource::KubernetesPods => self.kubernetes_pods(config),
        }
    }

    fn kubernetes_pods(&mut self, config: &Config) {
        let kube = &config.dynamo.discovery.kubernetes;
        let kbase = "dynamo.discovery.kubernetes";
        self.warn(
            "dynamo.discovery.source",
            "kubernetes_pods provides no load or capacity signals (no model cards or event \
             channels): workers rotate round-robin; prefer source kubernetes when RBAC allows \
             reading dynamoworkermetadatas and endpointslices",
        );
        match (&kube.model, kube.models.is_empty()) {
            (Some(_), false) => self.err(
                format!("{kbase}.models"),
                "set exactly one of kubernetes.model or kubernetes.models, not both",
            ),
            (None, true) => self.err(
                format!("{kbase}.model"),
                "source kubernetes_pods needs kubernetes.model or kubernetes.models",
            ),
            _ => {}
        }
        if let Some(model) = &kube.model
            && !is_model_name(model)
        {
            self.err(
                format!("{kbase}.model"),
                "model must be non-empty and contain no whitespace",
            );
        }
        if kube.models.len() > MAX_COMPONENT_MODELS {
            self.err(
                format!("{kbase}.models"),
                format!(
                    "{} entries given; at most {MAX_COMPONENT_MODELS} are accepted",
                    kube.models.len()
                ),
            );
        }
        let namespaces = config.dynamo.discovery.namespace_names();
        let several = namespaces.len() > 1;
        let mut components = BTreeSet::new();
        for (i, entry) in kube.models.iter().enumerate() {
            let path = format!("{kbase}.models[{i}]");
            if !is_label_value(&entry.component) {
                self.err(
                    format!("{path}.component"),
                    "component must be a non-empty Kubernetes label value",
                );
            } else if !components
                .insert((entry.dynamo_namespace.as_deref(), entry.component.as_str()))
            {
                self.err(
                    format!("{path}.component"),
                    format!("component {:?} is listed twice", entry.component),
                );
            }
            if !is_model_name(&entry.model) {
                self.err(
                    format!("{path}.model"),
                    "model must be non-empty and contain no whitespace",
                );
            }
            match &entry.dynamo_namespace {
                None if several => self.err(
                    format!("{path}.dynamo_namespace"),
                    "several Dynamo namespaces are configured; every models entry must name \
                     its dynamo_namespace",
                ),
                Some(ns) if !namespaces.contains(ns) => self.err(
                    format!("{path}.dynamo_namespace"),
                    format!("{ns:?} is not one of the configured Dynamo namespaces"),
                ),
                _ => {}
            }
        }
    }

    /// The shared namespace / namespaces rules (etcd and Kubernetes sources).
    fn namespaces(
        &mut self,
        base: &str,
        scalar_key: &str,
        scalar: &str,
        list_key: &str,
        list: &[String],
        label: bool,
    ) {
        let check = |name: &str| -> Result<(), String> {
            check_namespace(name)?;
            if label && !is_label_value(name) {
                return Err(
                    "Dynamo namespace must be a Kubernetes label value (at most 63 of \
                     [A-Za-z0-9._-], starting and ending alphanumeric)"
                        .to_owned(),
                );
            }
            Ok(())
        };
        if let Err(message) = check(scalar) {
            self.err(format!("{base}.{scalar_key}"), message);
        }
        if list.is_empty() {
            return;
        }
        if scalar != DEFAULT_DYNAMO_NAMESPACE {
            self.err(
                format!("{base}.{list_key}"),
                format!(
                    "{list_key} is mutually exclusive with a non-default {scalar_key}; set one"
                ),
            );
        }
        if list.len() > MAX_DYNAMO_NAMESPACES {
            self.err(
                format!("{base}.{list_key}"),
                format!(
                    "{} namespaces given; at most {MAX_DYNAMO_NAMESPACES} are accepted",
                    list.len()
                ),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, name) in list.iter().enumerate() {
            let path = format!("{base}.{list_key}[{i}]");
            if let Err(message) = check(name) {
                self.err(path, message);
            } else if !seen.insert(name.as_str()) {
                self.err(path, format!("namespace {name:?} is listed twice"));
            }
        }
    }

    fn backoff(&mut self, path: &str, backoff: &BackoffConfig) {
        if backoff.initial.get().is_zero() {
            self.err(
                format!("{path}.initial"),
                "initial backoff must be greater than 0",
            );
        }
        if backoff.max < backoff.initial {
            self.err(
                format!("{path}.max"),
                format!(
                    "max ({}) must be >= initial ({})",
                    backoff.max, backoff.initial
                ),
            );
        }
    }

    fn load(&mut self, config: &Config) {
        let load = &config.dynamo.load;
        let staleness = load.max_staleness.get();
        if !(MIN_MAX_STALENESS..=MAX_MAX_STALENESS).contains(&staleness) {
            self.err(
                "dynamo.load.max_staleness",
                format!("{} is outside 100ms..=5m", load.max_staleness),
            );
        }
        match &load.direct_allow_cidrs {
            None => {
                if config.dynamo.enabled && load.transport == LoadTransport::Direct {
                    self.warn(
                        "dynamo.load.direct_allow_cidrs",
                        "unset: direct mode may dial any address a worker record names; add \
                         the worker Pod CIDRs (for example 10.0.0.0/8)",
                    );
                }
            }
            Some(cidrs) => {
                if cidrs.is_empty()
                    && config.dynamo.enabled
                    && load.transport == LoadTransport::Direct
                {
                    self.warn(
                        "dynamo.load.direct_allow_cidrs",
                        "empty list: direct mode will dial no publisher; list the worker Pod \
                         CIDRs or remove the key",
                    );
                }
                if cidrs.len() > MAX_DIRECT_ALLOW_CIDRS {
                    self.err(
                        "dynamo.load.direct_allow_cidrs",
                        format!(
                            "{} CIDRs given; at most {MAX_DIRECT_ALLOW_CIDRS} are accepted",
                            cidrs.len()
                        ),
                    );
                }
                for (i, cidr) in cidrs.iter().enumerate() {
                    if cidr.trim().parse::<ipnet::IpNet>().is_err() {
                        self.err(
                            format!("dynamo.load.direct_allow_cidrs[{i}]"),
                            format!("{cidr:?} is not an IPv4 or IPv6 CIDR (like 10.0.0.0/8)"),
                        );
                    }
                }
            }
        }
    }

    fn shim(&mut self, config: &Config) {
        let dynamo = &config.dynamo;
        let shim = &dynamo.shim;
        let namespaces = dynamo.discovery.namespace_names();
        let base = "dynamo.shim";

        if !shim.backends.is_empty() && !shim.pools.is_empty() {
            self.err(
                format!("{base}.pools"),
                "set shim.backends or shim.pools, not both",
            );
        }
        self.shim_backend_list(config, &format!("{base}.backends"), &shim.backends);

        if namespaces.len() > 1 && shim.pools.is_empty() {
            self.err(
                format!("{base}.pools"),
                "several Dynamo namespaces are configured; shim.pools (one pool per namespace) \
                 is required instead of shim.backends",
            );
        }
        if !shim.pools.is_empty() {
            let mut pool_of: BTreeMap<&str, usize> = BTreeMap::new();
            let mut owner: BTreeMap<&str, usize> = BTreeMap::new();
            for (i, pool) in shim.pools.iter().enumerate() {
                let path = format!("{base}.pools[{i}]");
                if !namespaces.contains(&pool.namespace) {
                    self.err(
                        format!("{path}.namespace"),
                        format!(
                            "{:?} is not a configured Dynamo namespace ({})",
                            pool.namespace,
                            namespaces.join(", ")
                        ),
                    );
                } else if let Some(first) = pool_of.insert(pool.namespace.as_str(), i) {
                    self.err(
                        format!("{path}.namespace"),
                        format!(
                            "namespace {:?} already has a pool (pools[{first}]); each \
                             namespace needs exactly one",
                            pool.namespace
                        ),
                    );
                }
                if pool.backends.is_empty() {
                    self.err(
                        format!("{path}.backends"),
                        "a pool needs at least one backend",
                    );
                }
                self.shim_backend_list(config, &format!("{path}.backends"), &pool.backends);
                for (j, backend) in pool.backends.iter().enumerate() {
                    if let Some(&first) = owner.get(backend.as_str()) {
                        if first != i {
                            self.err(
                                format!("{path}.backends[{j}]"),
                                format!(
                                    "backend {backend:?} already belongs to pools[{first}]; a \
                                     replica may belong to at most one pool"
                                ),
                            );
                        }
                    } else {
                        owner.insert(backend.as_str(), i);
                    }
                }
            }
            for namespace in &namespaces {
                if !pool_of.contains_key(namespace.as_str()) {
                    self.err(
                        format!("{base}.pools"),
                        format!("namespace {namespace:?} has no shim pool"),
                    );
                }
            }
        }

        let listed = !shim.backends.is_empty() || !shim.pools.is_empty();
        if listed && (!dynamo.enabled || !config.disaggregated_serving.enabled) {
            let path = if shim.pools.is_empty() {
                format!("{base}.backends")
            } else {
                format!("{base}.pools")
            };
            self.warn(
                path,
                "a shim pool is listed but dynamo.enabled or disaggregated_serving.enabled is \
                 false, so no request is pinned through it",
            );
        }
        if dynamo.enabled && !listed {
            self.warn(
                format!("{base}.backends"),
                "dynamo.enabled is true but no shim replica is listed; discovered workers \
                 cannot be dispatched to",
            );
        }

        if shim.model_map.len() > MAX_MODEL_MAP_ENTRIES {
            self.err(
                format!("{base}.model_map"),
                format!(
                    "{} pairs given; at most {MAX_MODEL_MAP_ENTRIES} are accepted",
                    shim.model_map.len()
                ),
            );
        }
        for (client, display) in &shim.model_map {
            if client.trim().is_empty() {
                self.err(
                    format!("{base}.model_map"),
                    "model_map keys must not be empty",
                );
            } else if display.trim().is_empty() {
                self.err(
                    format!("{base}.model_map.{client}"),
                    "model_map values must not be empty",
                );
            }
        }
    }

    /// Rules shared by `shim.backends` and each `shim.pools[].backends`.
    fn shim_backend_list(&mut self, config: &Config, path: &str, names: &[String]) {
        if names.len() > MAX_SHIM_BACKENDS {
            self.err(
                path,
                format!(
                    "{} backends given; at most {MAX_SHIM_BACKENDS} are accepted",
                    names.len()
                ),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, name) in names.iter().enumerate() {
            let item = format!("{path}[{i}]");
            if !seen.insert(name.as_str()) {
                self.err(item, format!("backend {name:?} is listed twice"));
                continue;
            }
            match config.backend(name) {
                None => self.err(
                    item,
                    format!("backend {name:?} is not defined in backends[]"),
                ),
                Some(backend) => {
                    if backend.internal || !backend.enabled {
                        self.warn(
                            item.clone(),
                            format!(
                                "shim replica {name:?} is {}; it will not receive pinned requests",
                                if backend.internal {
                                    "internal: true"
                                } else {
                                    "enabled: false"
                                }
                            ),
                        );
                    }
                }
            }
        }
        // KV rendering applies the first replica's rewrites; a replica that rewrites differently
        // receives prompts whose prefix hashes the picker did not see.
        let rewrites: Vec<_> = names
            .iter()
            .filter_map(|name| config.backend(name))
            .map(|b| (b.name.as_str(), b.prompt_rewrite()))
            .collect();
        if let Some((first, rewrite)) = rewrites.first() {
            for (name, other) in &rewrites[1..] {
                if other != rewrite {
                    self.warn(
                        path.to_owned(),
                        format!(
                            "shim replica {name:?} has other global_prompts or \
                             requires_single_leading_system than {first:?}; KV-aware selection \
                             renders with the first replica's"
                        ),
                    );
                }
            }
        }
    }

    fn kv(&mut self, config: &Config) {
        let kv = &config.dynamo.kv;
        let base = "dynamo.kv";
        if kv.conditional_disaggregation.enabled {
            self.warn(
                format!("{base}.conditional_disaggregation.enabled"),
                "Dynamo 1.5.x direct-mode frontends refuse requests without a prefill id while \
                 prefill workers are registered (503 disaggregated_prefill_decode_unavailable)",
            );
        }
        if let Some(threshold) = kv.conditional_disaggregation.decode_busy_threshold
            && !(threshold.is_finite() && (0.0..=1.0).contains(&threshold))
        {
            self.err(
                format!("{base}.conditional_disaggregation.decode_busy_threshold"),
                "decode_busy_threshold is a fraction of total_kv_blocks in 0.0..=1.0",
            );
        }
        let mut pins = BTreeSet::new();
        for (i, pin) in kv.pinned_artifacts.iter().enumerate() {
            let path = format!("{base}.pinned_artifacts[{i}]");
            if !is_prefixed_hex(pin, "blake3:") {
                self.err(
                    path,
                    "a pin is \"blake3:<64 lowercase hex>\" (the b3sum of the reviewed file)",
                );
            } else if !pins.insert(pin.as_str()) {
                self.warn(path, "pin is listed twice");
            }
        }
        for (key, value) in [
            ("router_temperature", kv.router_temperature),
            ("overlap_score_credit", kv.overlap_score_credit),
            ("prefill_load_scale", kv.prefill_load_scale),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                self.err(
                    format!("{base}.{key}"),
                    format!("{key} must be a finite number >= 0"),
                );
            }
        }
        if kv.artifact_cache_dir.as_os_str().is_empty() {
            self.err(
                format!("{base}.artifact_cache_dir"),
                "artifact_cache_dir must not be empty",
            );
        }
        if kv.enabled {
            if !config.dynamo.enabled {
                self.warn(
                    format!("{base}.enabled"),
                    "kv.enabled has no effect while dynamo.enabled is false",
                );
            }
            if kv.pinned_artifacts.is_empty() {
                self.warn(
                    format!("{base}.pinned_artifacts"),
                    "no artifact is pinned, so no tokenizer loads and every selection runs \
                     without a KV term; pin the reviewed tokenizer checksums",
                );
            }
        } else if kv.send_token_data {
            self.warn(
                format!("{base}.send_token_data"),
                "send_token_data has no effect while kv.enabled is false",
            );
        }
    }

    /// `dynamo.kv.kv_cache_index.sources`: names, duplicates, and the three advisories that tie
    /// `transport: event_bus` sources to the listener and to kv_listener grants.
    fn kv_cache_index(&mut self, config: &Config) {
        let index = &config.dynamo.kv.kv_cache_index;
        let bus = &config.dynamo.event_bus;
        let base = "dynamo.kv.kv_cache_index.sources";
        let mut seen = BTreeSet::new();
        let granted: BTreeSet<&str> = bus
            .brokers
            .iter()
            .filter(|b| b.role == BrokerRole::KvListener)
            .flat_map(|b| b.backends.iter().map(String::as_str))
            .collect();
        for (i, source) in index.sources.iter().enumerate() {
            let path = format!("{base}[{i}]");
            let target = continuum_protocol::event_bus::message::StreamTarget::AnnouncedSource(
                continuum_protocol::event_bus::message::AnnouncedSourceTarget {
                    backend: source.backend.clone(),
                    last_event_id: None,
                },
            );
            if let Err(error) = target.check() {
                self.err(format!("{path}.backend"), error.to_string());
                continue;
            }
            if !seen.insert(source.backend.as_str()) {
                self.err(
                    format!("{path}.backend"),
                    format!("backend {:?} is listed twice", source.backend),
                );
                continue;
            }
            if source.transport == KvSourceTransport::EventBus {
                if !bus.enabled {
                    self.warn(
                        format!("{path}.transport"),
                        "transport is event_bus but dynamo.event_bus.enabled is false: no \
                         continuum-kv-listener can push this source's KV events",
                    );
                } else if !granted.contains(source.backend.as_str()) {
                    self.warn(
                        format!("{path}.backend"),
                        format!(
                            "no dynamo.event_bus.brokers[] entry with role kv_listener grants \
                             backend {:?}: no session may announce it",
                            source.backend
                        ),
                    );
                }
            }
        }
        let sources: BTreeSet<&str> = index
            .sources
            .iter()
            .filter(|s| s.transport == KvSourceTransport::EventBus)
            .map(|s| s.backend.as_str())
            .collect();
        for (i, broker) in bus.brokers.iter().enumerate() {
            if broker.role != BrokerRole::KvListener {
                continue;
            }
            for (j, backend) in broker.backends.iter().enumerate() {
                if !sources.contains(backend.as_str()) {
                    self.warn(
                        format!("dynamo.event_bus.brokers[{i}].backends[{j}]"),
                        format!(
                            "backend {backend:?} is granted to a kv_listener but no \
                             dynamo.kv.kv_cache_index.sources[] entry with transport event_bus \
                             reads it"
                        ),
                    );
                }
            }
        }
    }

    fn event_bus(&mut self, config: &Config) {
        let bus = &config.dynamo.event_bus;
        let base = "dynamo.event_bus";
        let namespaces = config.dynamo.discovery.namespace_names();

        if config.dynamo.load.transport == LoadTransport::Broker && !bus.enabled {
            self.err(
                "dynamo.load.transport",
                "transport is broker but dynamo.event_bus.enabled is false: no broker could ever \
                 carry a load or KV subscription (the router never falls back to dialling \
                 publishers directly); enable dynamo.event_bus or use transport: direct",
            );
        }
        if bus.enabled {
            if !config.dynamo.enabled {
                self.warn(
                    format!("{base}.enabled"),
                    "the event bus listens but dynamo.enabled is false, so nothing subscribes",
                );
            }
            if listeners_collide(bus.listen, config.server.bind_address) {
                self.err(
                    format!("{base}.listen"),
                    format!(
                        "{} collides with server.bind_address {}",
                        bus.listen, config.server.bind_address
                    ),
                );
            }
            match &bus.tls {
                None => self.err(
                    format!("{base}.tls"),
                    "the event bus is TLS-only: tls.cert and tls.key are required when enabled",
                ),
                Some(tls) => {
                    if tls.cert.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                        self.err(
                            format!("{base}.tls.cert"),
                            "tls.cert is required when enabled",
                        );
                    }
                    if tls.key.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                        self.err(
                            format!("{base}.tls.key"),
                            "tls.key is required when enabled",
                        );
                    }
                }
            }
            if bus.brokers.is_empty() {
                self.warn(
                    format!("{base}.brokers"),
                    "no brokers are configured, so no client can authenticate",
                );
            }
        }
        if bus.max_sessions == 0 || bus.max_sessions > MAX_EVENT_BUS_SESSIONS {
            self.err(
                format!("{base}.max_sessions"),
                format!("max_sessions must be in 1..={MAX_EVENT_BUS_SESSIONS}"),
            );
        }
        if bus.max_streams_per_session == 0 || bus.max_streams_per_session > MAX_STREAMS_PER_SESSION
        {
            self.err(
                format!("{base}.max_streams_per_session"),
                format!("max_streams_per_session must be in 1..={MAX_STREAMS_PER_SESSION}"),
            );
        }
        let floor = u64::from(bus.max_streams_per_session) * MIN_STREAM_BUFFER_BYTES;
        if bus.max_session_buffer_bytes < floor {
            self.err(
                format!("{base}.max_session_buffer_bytes"),
                format!(
                    "must be at least max_streams_per_session * 64 KiB = {floor} bytes \
                     (16 KiB per direction-reservation per stream)"
                ),
            );
        }
        if bus.max_session_buffer_bytes > continuum_protocol::event_bus::bounds::MAX_HTTP2_WINDOW {
            self.err(
                format!("{base}.max_session_buffer_bytes"),
                format!(
                    "must be at most {} bytes: it is the HTTP/2 connection window",
                    continuum_protocol::event_bus::bounds::MAX_HTTP2_WINDOW
                ),
            );
        }
        if bus.heartbeat_interval.get().is_zero() {
            self.err(
                format!("{base}.heartbeat_interval"),
                "must be greater than 0",
            );
        }
        if bus.idle_timeout <= bus.heartbeat_interval {
            self.err(
                format!("{base}.idle_timeout"),
                format!(
                    "idle_timeout ({}) must exceed heartbeat_interval ({}) or healthy \
                     sessions would be closed",
                    bus.idle_timeout, bus.heartbeat_interval
                ),
            );
        }
        if bus.brokers.len() > MAX_BROKERS {
            self.err(
                format!("{base}.brokers"),
                format!(
                    "{} entries given; at most {MAX_BROKERS} are accepted",
                    bus.brokers.len()
                ),
            );
        }
        let has_client_ca = bus.tls.as_ref().is_some_and(|tls| tls.client_ca.is_some());
        let mut ids = BTreeSet::new();
        for (i, broker) in bus.brokers.iter().enumerate() {
            let path = format!("{base}.brokers[{i}]");
            if !is_broker_id(&broker.id) {
                self.err(
                    format!("{path}.id"),
                    "id must be a lowercase DNS name (it is matched against client certificate \
                     DNS SANs; no wildcards)",
                );
            } else if !ids.insert(broker.id.as_str()) {
                self.err(
                    format!("{path}.id"),
                    format!("id {:?} is used twice", broker.id),
                );
            }
            match &broker.token_hash {
                Some(hash) if !is_prefixed_hex(hash, "sha256:") => self.err(
                    format!("{path}.token_hash"),
                    "token_hash is \"sha256:<64 lowercase hex>\" of the token \
                     (printf %s \"$TOKEN\" | sha256sum), never the token itself",
                ),
                None if !has_client_ca => self.err(
                    format!("{path}.token_hash"),
                    "entry has no credential: set token_hash or dynamo.event_bus.tls.client_ca",
                ),
                _ => {}
            }
            match broker.role {
                BrokerRole::Broker => {
                    if !broker.backends.is_empty() {
                        self.err(
                            format!("{path}.backends"),
                            "backends grants apply to role kv_listener; a broker is granted \
                             namespaces",
                        );
                    }
                    if broker.namespaces.is_empty() {
                        self.warn(
                            format!("{path}.namespaces"),
                            "empty namespaces allowlist: this broker may serve any Dynamo \
                             namespace",
                        );
                    }
                    for (j, namespace) in broker.namespaces.iter().enumerate() {
                        if let Err(message) = check_namespace(namespace) {
                            self.err(format!("{path}.namespaces[{j}]"), message);
                        } else if !namespaces.contains(namespace) {
                            self.warn(
                                format!("{path}.namespaces[{j}]"),
                                format!("{namespace:?} is not a configured Dynamo namespace"),
                            );
                        }
                    }
                }
                BrokerRole::KvListener => {
                    if !broker.namespaces.is_empty() {
                        self.err(
                            format!("{path}.namespaces"),
                            "role kv_listener is granted backends, not namespaces",
                        );
                    }
                    if broker.backends.is_empty() {
                        self.err(
                            format!("{path}.backends"),
                            "role kv_listener needs at least one granted backend",
                        );
                    }
                    for (j, backend) in broker.backends.iter().enumerate() {
                        if config.backend(backend).is_none() {
                            self.warn(
                                format!("{path}.backends[{j}]"),
                                format!("backend {backend:?} is not defined in backends[]"),
                            );
                        }
                    }
                }
            }
        }
    }
}

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
fn split_host_port(authority: &str) -> Result<(&str, u16), String> {
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
fn check_http_url(url: &str, require_port: bool) -> Result<(), String> {
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

fn is_model_name(model: &str) -> bool {
    !model.is_empty() && !model.chars().any(|c| c.is_whitespace() || c.is_control())
}

fn is_backend_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Lowercase DNS name (labels of `[a-z0-9-]`, dot-separated), no wildcard.
fn is_broker_id(id: &str) -> bool {
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
fn listeners_collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn is_public_ip(ip: IpAddr) -> bool {
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

#[cfg(test)]
mod tests;
