//! `dynamo.discovery`: etcd endpoints, TLS and auth; Kubernetes and file sources; the shared
//! namespace and backoff rules.

use std::collections::{BTreeMap, BTreeSet};

use super::values::{is_model_name, is_public_ip};

use super::*;

impl Validator {
    /// In this order (diagnostics keep document order): etcd, Kubernetes, file, then what the
    /// chosen source implies.
    pub(super) fn discovery(&mut self, config: &Config) {
        self.etcd(config);
        self.kubernetes(config);
        self.file(config);
        self.source(config);
    }

    /// `dynamo.discovery.etcd`: endpoints, TLS, auth, backoff and namespaces. etcd formats are
    /// checked whatever the source: a typo there is still a typo.
    fn etcd(&mut self, config: &Config) {
        let dynamo = &config.dynamo;
        let etcd = &dynamo.discovery.etcd;
        let source = dynamo.discovery.source;
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
        self.etcd_tls_and_auth(etcd, plaintext);
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
    }

    /// `dynamo.discovery.etcd.tls` and `.auth`; `plaintext`: an endpoint is http://.
    fn etcd_tls_and_auth(&mut self, etcd: &EtcdConfig, plaintext: bool) {
        let base = "dynamo.discovery.etcd";
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
    }

    /// `dynamo.discovery.kubernetes`: backoff, and the namespaces when it is the source.
    fn kubernetes(&mut self, config: &Config) {
        let source = config.dynamo.discovery.source;
        let kube = &config.dynamo.discovery.kubernetes;
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
    }

    /// `dynamo.discovery.file`: root, ttl, rescan interval, and the namespaces when it is the
    /// source.
    fn file(&mut self, config: &Config) {
        let source = config.dynamo.discovery.source;
        let file = &config.dynamo.discovery.file;
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
    }

    /// What the chosen source implies: warnings for `simulated`, ignored model keys for
    /// `kubernetes`, the `kubernetes_pods` rules.
    fn source(&mut self, config: &Config) {
        let kube = &config.dynamo.discovery.kubernetes;
        let kbase = "dynamo.discovery.kubernetes";
        match config.dynamo.discovery.source {
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
}
