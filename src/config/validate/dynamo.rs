//! `dynamo.load`, `dynamo.shim` (replica lists and pools, model map) and `dynamo.kv` (with
//! `kv_cache_index.sources`).

use std::collections::{BTreeMap, BTreeSet};

use super::*;

impl Validator {
    pub(super) fn load(&mut self, config: &Config) {
        let load = &config.dynamo.load;
        let staleness = load.max_staleness.get();
        if !(MIN_MAX_STALENESS..=MAX_MAX_STALENESS).contains(&staleness) {
            self.err(
                "dynamo.load.max_staleness",
                format!("{} is outside 100ms..=5m", load.max_staleness),
            );
        }
        let window = load.tie_break_window;
        if !(window.is_finite() && (0.0..=MAX_TIE_BREAK_WINDOW).contains(&window)) {
            self.err(
                "dynamo.load.tie_break_window",
                format!("{window} must be a finite number in 0..={MAX_TIE_BREAK_WINDOW}"),
            );
        }
        if load.peer_slots && window == 0.0 {
            self.warn(
                "dynamo.load.peer_slots",
                "has no effect without dynamo.load.tie_break_window (the slots are taken in its \
                 tie set); set 2.0",
            );
        }
        if load.peer_slots && !config.replica_sync.enabled {
            self.warn(
                "dynamo.load.peer_slots",
                "has no effect without replica_sync: the replica's place among its peers comes \
                 from the peers it hears from; the seeded draw decides instead",
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

    pub(super) fn shim(&mut self, config: &Config) {
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
            self.shim_pools(config, &namespaces);
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

    /// `shim.pools`: one pool per configured namespace, each replica in at most one pool.
    fn shim_pools(&mut self, config: &Config, namespaces: &[String]) {
        let shim = &config.dynamo.shim;
        let base = "dynamo.shim";
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
        for namespace in namespaces {
            if !pool_of.contains_key(namespace.as_str()) {
                self.err(
                    format!("{base}.pools"),
                    format!("namespace {namespace:?} has no shim pool"),
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
                             renders with the first replica's, and nvext.token_data is not sent \
                             to this pool"
                        ),
                    );
                }
            }
        }
    }

    pub(super) fn kv(&mut self, config: &Config) {
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
    pub(super) fn kv_cache_index(&mut self, config: &Config) {
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
}
