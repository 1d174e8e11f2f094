//! The process's metric exposition, and nothing else: one Prometheus registry, the OpenTelemetry
//! meter provider that exports into it, the text `/metrics` renders, and the one handle
//! ([`Metrics`]) that carries them to the subsystems.
//!
//! Every family is defined and owned by the subsystem that counts it, in that subsystem's
//! `metrics` module (vector's `internal_events` model): `discovery`, `registry`, `load`,
//! `kv_index`, `kv_artifacts`, `supervisor`, `event_bus` and `replica_sync` here, the daemon's,
//! the route's, the proxy's and the front door's in the router crate. A subsystem's family type
//! implements [`Family`]; [`Metrics::register`] registers it once per registry (its closed-set
//! series at 0, so `rate()` and absent-series alerts work from the first scrape) and hands out
//! the one shared instance, so several actors of one subsystem count into the same series. This
//! module names no subsystem: the import arrows point from the subsystems to it.
//!
//! Every label that is not bounded by fleet size is a Rust enum with `as_label()` (see
//! [`label_enum!`](crate::label_enum)), and every recording method takes the enum, so a string
//! from the network can never become a label value.
//!
//! Instruments created through [`Metrics::meter`] (or through `opentelemetry::global::meter`
//! after [`Metrics::install_global_meter_provider`]) are collected into the same `/metrics` text
//! on every scrape, next to a `target_info{service_name}` series.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::proto::MetricType;
use prometheus::{Encoder as _, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::lock::Mutex;

/// Errors building the registry or registering a family. Every arm means a programming error (a
/// family registered twice under another type, an invalid name), never bad input: label values
/// are typed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("registering a metric family failed: {0}")]
    Register(#[from] prometheus::Error),
    #[error("building the OpenTelemetry Prometheus exporter failed: {0}")]
    OtelExporter(String),
}

/// A subsystem's metric families: registered once per [`Metrics`], shared by every user.
pub trait Family: Send + Sync + 'static {
    /// Creates the families, registers them in `registry` and pre-initialises their closed-set
    /// series at 0.
    fn register(registry: &Registry) -> Result<Self, prometheus::Error>
    where
        Self: Sized;
}

/// Defines a closed label set: an enum, its `ALL` list (for pre-initialisation and tests) and its
/// `as_label()` text.
#[macro_export]
macro_rules! label_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The Prometheus label value.
            pub const fn as_label(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_label())
            }
        }
    };
}

/// The process-wide exposition. Cheap to clone; build once in `main` and hand clones down.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

type Registered = Arc<dyn Any + Send + Sync>;

struct Inner {
    registry: Registry,
    meter_provider: SdkMeterProvider,
    /// The families registered so far, one instance per type.
    families: Mutex<HashMap<TypeId, Registered>>,
}

/// A counter family in `registry`.
pub fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, prometheus::Error> {
    let vec = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(vec.clone()))?;
    Ok(vec)
}

/// A gauge family in `registry`.
pub fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, prometheus::Error> {
    let vec = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(vec.clone()))?;
    Ok(vec)
}

/// Gauges hold `i64`; figures are `u64` from the wire and saturate rather than wrap.
pub fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Metrics {
    /// Builds the registry and the meter provider; no family yet (each subsystem registers its
    /// own). `service_name` becomes the `service_name` label of `target_info`.
    pub fn new(service_name: &str) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .map_err(|error| MetricsError::OtelExporter(error.to_string()))?;
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name(service_name.to_owned())
                    .build(),
            )
            .build();
        Ok(Self {
            inner: Arc::new(Inner {
                registry,
                meter_provider,
                families: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The one instance of `F` in this registry, registering it on the first call.
    pub fn register<F: Family>(&self) -> Result<Arc<F>, MetricsError> {
        let mut families = self.inner.families.lock();
        if let Some(family) = families.get(&TypeId::of::<F>()) {
            // The map is keyed by the type, so the downcast cannot fail.
            if let Ok(family) = Arc::clone(family).downcast::<F>() {
                return Ok(family);
            }
        }
        let family = Arc::new(F::register(&self.inner.registry)?);
        families.insert(TypeId::of::<F>(), family.clone());
        Ok(family)
    }

    /// [`Metrics::register`] for a subsystem that counts into `F`: `None` (logged) when the
    /// family cannot be registered, which only a programming error causes (the daemon registers
    /// every family at startup and refuses to start on an error).
    pub fn family<F: Family>(&self) -> Option<Arc<F>> {
        match self.register::<F>() {
            Ok(family) => Some(family),
            Err(error) => {
                tracing::error!(%error, family = std::any::type_name::<F>(), "Metric family not registered.");
                None
            }
        }
    }

    /// The registry, for a custom scrape handler or extra families.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The OpenTelemetry meter provider that exports into [`Self::registry`].
    pub fn meter_provider(&self) -> &SdkMeterProvider {
        &self.inner.meter_provider
    }

    /// An OpenTelemetry meter whose instruments appear in [`Self::render`]. Counters get a
    /// `_total` suffix and every series an `otel_scope_name` label. Give instruments names
    /// that differ from the native families: a clash makes the scrape drop one family.
    pub fn meter(&self, scope: &'static str) -> Meter {
        self.inner.meter_provider.meter(scope)
    }

    /// Makes `opentelemetry::global::meter(..)` export into this registry.
    pub fn install_global_meter_provider(&self) {
        opentelemetry::global::set_meter_provider(self.inner.meter_provider.clone());
    }

    /// The `Content-Type` of [`Self::render`]'s output, for the `/metrics` handler.
    pub const CONTENT_TYPE: &'static str = prometheus::TEXT_FORMAT;

    /// The Prometheus text exposition of every family, native and OpenTelemetry.
    pub fn render(&self) -> String {
        let families = self.inner.registry.gather();
        let mut buffer = Vec::new();
        // The text encoder fails only on a write error, and a Vec never fails to write.
        if let Err(error) = TextEncoder::new().encode(&families, &mut buffer) {
            tracing::warn!(%error, "Failed to encode the metrics text.");
        }
        String::from_utf8(buffer).unwrap_or_else(|error| {
            // Label values are typed and ASCII; this is unreachable in practice, and a lossy
            // scrape is better than an empty one.
            String::from_utf8_lossy(error.as_bytes()).into_owned()
        })
    }

    /// The current value of one series, for tests and the admin API: `None` when the series
    /// does not exist. Labels are matched exactly and must name every label of the family.
    pub fn value(&self, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let family = self
            .inner
            .registry
            .gather()
            .into_iter()
            .find(|mf| mf.name() == family)?;
        let metric = family.get_metric().iter().find(|metric| {
            let pairs = metric.get_label();
            pairs.len() == labels.len()
                && labels.iter().all(|(name, value)| {
                    pairs
                        .iter()
                        .any(|pair| pair.name() == *name && pair.value() == *value)
                })
        })?;
        match family.get_field_type() {
            MetricType::COUNTER => Some(metric.get_counter().get_value()),
            MetricType::GAUGE => Some(metric.get_gauge().get_value()),
            _ => None,
        }
    }
}

/// Test helpers shared by the subsystems' metric tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::collections::BTreeSet;
    use std::fmt;

    use super::Metrics;

    pub(crate) fn metrics() -> Metrics {
        Metrics::new("continuum-router-test").expect("the exposition builds")
    }

    /// Every closed label value is a valid, unique, snake-case Prometheus label value.
    pub(crate) fn check_closed<T: Copy + fmt::Debug>(all: &[T], label: impl Fn(T) -> &'static str) {
        let mut seen = BTreeSet::new();
        for value in all {
            let text = label(*value);
            assert!(
                !text.is_empty()
                    && text
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{value:?} -> {text:?}"
            );
            assert!(seen.insert(text), "duplicate label {text:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::KeyValue;
    use prometheus::IntCounterVec;

    use super::testing::metrics;
    use super::*;

    struct Probe(IntCounterVec);

    impl Family for Probe {
        fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
            let vec = counter_vec(registry, "continuum_probe_total", "A probe.", &["kind"])?;
            vec.with_label_values(&["a"]);
            Ok(Self(vec))
        }
    }

    #[test]
    fn a_family_registers_once_and_is_shared() {
        let metrics = metrics();
        let first = metrics.register::<Probe>().expect("registers");
        let again = metrics.family::<Probe>().expect("the same family");
        assert!(Arc::ptr_eq(&first, &again));
        again.0.with_label_values(&["a"]).inc();
        assert_eq!(
            metrics.value("continuum_probe_total", &[("kind", "a")]),
            Some(1.0)
        );
        assert!(
            metrics
                .render()
                .contains("# TYPE continuum_probe_total counter")
        );
        // A clone shares the registry and the registered families.
        let clone = metrics.clone();
        assert!(Arc::ptr_eq(
            &first,
            &clone.family::<Probe>().expect("shared")
        ));
        // Another exposition has its own.
        assert_eq!(
            super::testing::metrics().value("continuum_probe_total", &[("kind", "a")]),
            None
        );
    }

    #[test]
    fn gauges_saturate() {
        assert_eq!(gauge_value(7), 7);
        assert_eq!(gauge_value(u64::MAX), i64::MAX);
    }

    #[test]
    fn opentelemetry_instruments_export_into_the_same_registry() {
        let metrics = metrics();
        metrics.register::<Probe>().expect("registers");
        let counter = metrics
            .meter("continuum.test")
            .u64_counter("continuum_otel_probe")
            .with_description("A probe counter.")
            .build();
        counter.add(3, &[KeyValue::new("probe", "yes")]);
        let text = metrics.render();
        assert!(text.contains("continuum_otel_probe_total{"), "{text}");
        assert!(
            text.contains(r#"otel_scope_name="continuum.test""#),
            "{text}"
        );
        assert!(text.contains("} 3"), "{text}");
        assert!(
            text.contains(r#"service_name="continuum-router-test""#),
            "target_info carries the service name: {text}"
        );
        // The native families are still there beside the OpenTelemetry ones.
        assert!(text.contains(r#"continuum_probe_total{kind="a"} 0"#));
    }
}
