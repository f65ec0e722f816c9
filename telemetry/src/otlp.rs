//! OTLP export of traces and metrics (OpenTelemetry over gRPC) for both
//! binaries.
//!
//! Off by default. On with `--otlp-endpoint URL` (agent and dispatcher) or
//! the standard environment (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the
//! per-signal `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `..._METRICS_ENDPOINT`;
//! headers, timeout and compression from the other `OTEL_EXPORTER_OTLP_*`
//! variables; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_BSP_*`; `OTEL_SDK_DISABLED=true`
//! turns it off).
//!
//! Nothing waits on a collector: spans go to the SDK's batch processor (a
//! bounded queue drained by its own thread; spans are dropped when it is
//! full) and metrics are read by a periodic reader on its own thread.
//! Shutdown flushes on a blocking thread with a deadline.

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{MetricExporter, SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use prometheus::Registry;
use prometheus::proto::MetricType;

use crate::prom::Family;

/// Why the exporters could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter rejected its configuration (endpoint, headers...).
    #[error("building the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Is OTLP export asked for (flag or environment)?
pub fn wanted(flag: Option<&str>) -> bool {
    let env = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return false;
    }
    flag.is_some()
        || env("OTEL_EXPORTER_OTLP_ENDPOINT")
        || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        || env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
}

/// The OTLP trace and metric pipelines of a process.
#[derive(Clone)]
pub struct Exporters {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
}

impl Exporters {
    /// Build both exporters (inside a tokio runtime: the gRPC channels are
    /// created on it and connect lazily). `default_service` is the
    /// `service.name` unless `OTEL_SERVICE_NAME` says otherwise; `endpoint`
    /// (the flag) overrides the environment's endpoint.
    pub fn init(default_service: &str, endpoint: Option<&str>) -> Result<Self, TelemetryError> {
        let mut resource = Resource::builder();
        if std::env::var("OTEL_SERVICE_NAME").is_err() {
            resource = resource.with_service_name(default_service.to_string());
        }
        let resource = resource.build();
        let timeout = Duration::from_secs(3);
        let mut spans = SpanExporter::builder().with_tonic();
        if let Some(ep) = endpoint {
            spans = spans.with_endpoint(ep).with_timeout(timeout);
        }
        let tracer_provider = SdkTracerProvider::builder()
            .with_batch_exporter(spans.build()?)
            .with_resource(resource.clone())
            .build();
        let mut metrics = MetricExporter::builder().with_tonic();
        if let Some(ep) = endpoint {
            metrics = metrics.with_endpoint(ep).with_timeout(timeout);
        }
        let reader = PeriodicReader::builder(metrics.build()?).build();
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        Ok(Self {
            tracer_provider,
            meter_provider,
        })
    }

    /// A tracer of this pipeline for instrumentation scope `scope`.
    pub fn tracer(&self, scope: &'static str) -> SdkTracer {
        self.tracer_provider.tracer(scope)
    }

    /// A meter of this pipeline for instrumentation scope `scope`.
    pub fn meter(&self, scope: &'static str) -> Meter {
        self.meter_provider.meter(scope)
    }

    /// Flush and stop the exporters on a blocking thread, giving up after
    /// a few seconds (a dead collector errors in about a second).
    pub async fn shutdown(&self) {
        let tracer_provider = self.tracer_provider.clone();
        let meter_provider = self.meter_provider.clone();
        let done = tokio::task::spawn_blocking(move || {
            let _ = tracer_provider.shutdown_with_timeout(Duration::from_secs(3));
            let _ = meter_provider.shutdown_with_timeout(Duration::from_secs(3));
        });
        let _ = tokio::time::timeout(Duration::from_secs(8), done).await;
    }
}

/// Observe every counter and gauge family of `registry` listed in
/// `families` as an OTel instrument of `meter`, read at each export.
/// Counters lose their `_total` suffix (OTLP sums are named without it);
/// histograms are left to the caller (OTel has no observable histogram).
pub fn bridge_prometheus(meter: &Meter, registry: &Registry, families: &[Family]) {
    for (name, help, ty) in families {
        let (name, help, ty) = (name.clone(), help.clone(), *ty);
        let registry = registry.clone();
        let observe = move |name: &str| -> Vec<(f64, Vec<KeyValue>)> {
            registry
                .gather()
                .into_iter()
                .filter(|f| f.name() == name)
                .flat_map(|f| {
                    let ty = f.get_field_type();
                    f.get_metric()
                        .iter()
                        .map(|s| {
                            let v = match ty {
                                MetricType::COUNTER => s.get_counter().get_value(),
                                _ => s.get_gauge().get_value(),
                            };
                            let attrs = s
                                .get_label()
                                .iter()
                                .map(|l| KeyValue::new(l.name().to_string(), l.value().to_string()))
                                .collect();
                            (v, attrs)
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        match ty {
            MetricType::COUNTER => {
                let otel = name.trim_end_matches("_total").to_string();
                let _ = meter
                    .f64_observable_counter(otel)
                    .with_description(help)
                    .with_callback(move |o| {
                        for (v, attrs) in observe(&name) {
                            o.observe(v, &attrs);
                        }
                    })
                    .build();
            }
            MetricType::GAUGE => {
                let otel = name.clone();
                let _ = meter
                    .f64_observable_gauge(otel)
                    .with_description(help)
                    .with_callback(move |o| {
                        for (v, attrs) in observe(&name) {
                            o.observe(v, &attrs);
                        }
                    })
                    .build();
            }
            _ => {}
        }
    }
}
