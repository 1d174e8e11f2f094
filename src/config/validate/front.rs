//! The front door's rules: admin token, API keys, server timeouts and limits, `backends[]`,
//! telemetry.

use std::collections::BTreeSet;
use std::time::Duration;

use super::values::{check_http_url, is_backend_name};

use super::*;

impl Validator {
    pub(super) fn server_and_auth(&mut self, config: &Config) {
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
            ("send_timeout", server.send_timeout),
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

    pub(super) fn backends(&mut self, config: &Config) {
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
            self.responses_only_models(&path, backend);
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

    /// `backends[].responses_only_models`: each a model the backend serves (`models`, when it
    /// lists any), once, on a backend whose `/v1/responses` is passed through natively: a
    /// Messages request for one is sent to the backend's own `/v1/responses`.
    fn responses_only_models(&mut self, path: &str, backend: &BackendConfig) {
        if !backend.responses_only_models.is_empty()
            && backend.responses_api != ResponsesApi::Native
        {
            self.err(
                format!("{path}.responses_only_models"),
                "responses_only_models needs responses_api: native (the models are served \
                 through the backend's own /v1/responses)",
            );
        }
        let mut seen = BTreeSet::new();
        for (j, model) in backend.responses_only_models.iter().enumerate() {
            let at = format!("{path}.responses_only_models[{j}]");
            if model.trim().is_empty() {
                self.err(at, "model id must not be empty");
            } else if !seen.insert(model.as_str()) {
                self.err(at, "model id is listed twice");
            } else if !backend.models.is_empty() && !backend.models.contains(model) {
                self.err(
                    at,
                    format!("model {model:?} is not in this backend's models (list it there too)"),
                );
            }
        }
    }

    pub(super) fn telemetry(&mut self, telemetry: &TelemetryConfig) {
        if !telemetry.log_level.is_ascii() {
            // tracing_subscriber's directive parser can panic on non-ASCII text (fuzz finding).
            self.err(
                "telemetry.log_level",
                "not a valid log filter directive: only ASCII characters are allowed",
            );
        } else if let Err(error) =
            tracing_subscriber::EnvFilter::builder().parse(&telemetry.log_level)
        {
            self.err(
                "telemetry.log_level",
                format!("not a valid log filter directive: {error}"),
            );
        }
        if telemetry.service_name.trim().is_empty() {
            self.err("telemetry.service_name", "service name must not be empty");
        }
        let Some(otlp) = &telemetry.otlp else {
            return;
        };
        if let Err(message) = check_http_url(&otlp.endpoint, true) {
            self.err("telemetry.otlp.endpoint", message);
        }
        if let Some(interval) = otlp.metrics_interval
            && (interval.get() < Duration::from_secs(1)
                || interval.get() > Duration::from_secs(3600))
        {
            self.err(
                "telemetry.otlp.metrics_interval",
                format!("metrics_interval must be between 1s and 1h (got {interval})"),
            );
        }
    }
}
