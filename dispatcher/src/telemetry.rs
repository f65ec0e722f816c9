//! OTLP export of traces and metrics (OpenTelemetry over gRPC).
//!
//! Off by default. On with `dispatcher --otlp-endpoint URL` or the standard
//! environment (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the per-signal
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `..._METRICS_ENDPOINT`; headers,
//! timeout and compression from the other `OTEL_EXPORTER_OTLP_*`
//! variables; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_METRIC_EXPORT_INTERVAL`; `OTEL_SDK_DISABLED=true` turns it off).
//!
//! Placement never waits on a collector: spans go to the SDK's batch
//! processor (a bounded queue drained by its own thread; spans are dropped
//! when it is full) and metrics are read by a periodic reader on its own
//! thread. Shutdown flushes on a blocking thread with a deadline.
//!
//! **Traces.** Each job gets a root span `job` (attributes `job.id`,
//! `job.class`, `job.cpus`; ends when the job ends, with `job.state`) and
//! children following its life, built from the job events the core
//! publishes: `submit`, `queued` (from submission until it is sent to a
//! node, waiting in a node's queue or for any node; `dispatch.reason`),
//! `placed` (`dispatch.node`, `dispatch.reason`),
//! `run` (from assignment to the end; `dispatch.node`), `started`
//! (`dispatch.node`, `job.cpus_used`) and `finished` (`job.state`,
//! `job.exit_code`).
//!
//! **Metrics.** Every Prometheus metric of [`crate::metrics`] is bridged
//! (counters lose their `_total` suffix: OTLP sums are named without it),
//! and placements are timed into an OTel histogram
//! `dispatch_placement_seconds`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::metrics::{Histogram, Meter, MeterProvider as _};
use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{MetricExporter, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use prometheus::proto::MetricType;
use proto::v1::{Job, JobEvent, JobState};

use crate::metrics::{Metrics, state_name};

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

/// The exporters; dropped or [`Telemetry::shutdown`] at exit.
pub struct Telemetry {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    tracer: SdkTracer,
    placement_seconds: Histogram<f64>,
    jobs: Mutex<HashMap<String, JobTrace>>,
}

/// The open spans of a live job.
struct JobTrace {
    root: Context,
    queued: Option<Context>,
    run: Option<Context>,
}

fn class_of(job: &Job) -> &'static str {
    match &job.spec {
        Some(spec) if spec.latency_nice < 0 => "latency",
        _ => "normal",
    }
}

fn is_terminal(state: i32) -> bool {
    [
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Lost,
    ]
    .iter()
    .any(|s| *s as i32 == state)
}

impl Telemetry {
    /// Build the OTLP exporters (inside a tokio runtime: the gRPC channel
    /// is created on it, connecting lazily) and bridge `metrics`.
    pub fn init(endpoint: Option<&str>, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let mut resource = Resource::builder();
        if std::env::var("OTEL_SERVICE_NAME").is_err() {
            resource = resource.with_service_name("dispatcher");
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
        let mut mexp = MetricExporter::builder().with_tonic();
        if let Some(ep) = endpoint {
            mexp = mexp.with_endpoint(ep).with_timeout(timeout);
        }
        let reader = PeriodicReader::builder(mexp.build()?).build();
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        let meter = meter_provider.meter("dispatcher");
        bridge(&meter, &metrics);
        let placement_seconds = meter
            .f64_histogram("dispatch_placement_seconds")
            .with_unit("s")
            .with_description("Time the core spent validating and placing a submitted job.")
            .build();
        Ok(Self {
            tracer: tracer_provider.tracer("dispatcher"),
            tracer_provider,
            meter_provider,
            placement_seconds,
            jobs: Mutex::new(HashMap::new()),
        })
    }

    /// The core placed `n` submitted jobs in `seconds`.
    pub fn observe_submit(&self, n: usize, seconds: f64) {
        let each = seconds / n.max(1) as f64;
        for _ in 0..n {
            self.placement_seconds.record(each, &[]);
        }
    }

    fn instant(&self, name: &'static str, parent: &Context, attrs: Vec<KeyValue>) {
        let mut span = self.tracer.start_with_context(name, parent);
        span.set_attributes(attrs);
        span.end();
    }

    fn open(&self, name: &'static str, parent: &Context, attrs: Vec<KeyValue>) -> Context {
        let mut span = self.tracer.start_with_context(name, parent);
        span.set_attributes(attrs);
        parent.with_span(span)
    }

    /// Follow the job events of a committed batch with spans.
    pub fn observe_events(&self, events: &[JobEvent]) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        for ev in events {
            let Some(job) = &ev.job else { continue };
            let id = KeyValue::new("job.id", job.id.clone());
            if ev.previous_state == JobState::Unspecified as i32 && !jobs.contains_key(&job.id) {
                let mut root = self.tracer.start_with_context("job", &Context::new());
                root.set_attributes([
                    id.clone(),
                    KeyValue::new("job.class", class_of(job)),
                    KeyValue::new(
                        "job.cpus",
                        job.spec.as_ref().map_or(1, |s| s.cpus.max(1)) as i64,
                    ),
                ]);
                let root = Context::new().with_span(root);
                self.instant("submit", &root, vec![id.clone()]);
                let queued = self.open("queued", &root, vec![id.clone()]);
                jobs.insert(
                    job.id.clone(),
                    JobTrace {
                        root,
                        queued: Some(queued),
                        run: None,
                    },
                );
            }
            let Some(t) = jobs.get_mut(&job.id) else {
                continue;
            };
            let node = KeyValue::new("dispatch.node", job.node.clone());
            let reason = KeyValue::new("dispatch.reason", job.reason.clone());
            match JobState::try_from(job.state).unwrap_or(JobState::Unspecified) {
                // Back to PENDING (a retry, a steal back): queued again.
                JobState::Pending if t.queued.is_none() => {
                    t.queued = Some(self.open("queued", &t.root, vec![id.clone()]));
                }
                JobState::Assigned => {
                    if let Some(q) = t.queued.take() {
                        q.span().set_attribute(reason.clone());
                        q.span().end();
                    }
                    if t.run.is_none() {
                        self.instant("placed", &t.root, vec![id.clone(), node.clone(), reason]);
                        t.run = Some(self.open("run", &t.root, vec![id.clone(), node]));
                    }
                }
                JobState::Running => {
                    let parent = t.run.clone().unwrap_or_else(|| t.root.clone());
                    let cpus: Vec<String> = job.cpus.iter().map(|c| c.to_string()).collect();
                    self.instant(
                        "started",
                        &parent,
                        vec![
                            id.clone(),
                            node,
                            KeyValue::new("job.cpus_used", cpus.join(",")),
                        ],
                    );
                }
                _ if is_terminal(job.state) => {
                    let state = KeyValue::new(
                        "job.state",
                        state_name(JobState::try_from(job.state).unwrap_or_default()),
                    );
                    let parent = t.run.clone().unwrap_or_else(|| t.root.clone());
                    self.instant(
                        "finished",
                        &parent,
                        vec![
                            id.clone(),
                            state.clone(),
                            KeyValue::new("job.exit_code", job.exit_code as i64),
                        ],
                    );
                    if let Some(q) = t.queued.take() {
                        q.span().end();
                    }
                    if let Some(r) = t.run.take() {
                        r.span().end();
                    }
                    t.root.span().set_attribute(state);
                    t.root.span().end();
                    jobs.remove(&job.id);
                }
                _ => {}
            }
        }
    }

    /// Flush and stop the exporters, on a blocking thread, giving up after
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

/// Observe every Prometheus family of `metrics` as an OTel instrument.
fn bridge(meter: &Meter, metrics: &Arc<Metrics>) {
    for (name, help, ty) in metrics.families() {
        let (name, help, ty) = (name.clone(), help.clone(), *ty);
        let m = metrics.clone();
        let observe = move |name: &str| -> Vec<(f64, Vec<KeyValue>)> {
            m.registry
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
                let n = name.clone();
                let _ = meter
                    .f64_observable_gauge(n)
                    .with_description(help)
                    .with_callback(move |o| {
                        for (v, attrs) in observe(&name) {
                            o.observe(v, &attrs);
                        }
                    })
                    .build();
            }
            // Histograms are recorded directly (observe_submit).
            _ => {}
        }
    }
}

static TELEMETRY: OnceLock<Arc<Telemetry>> = OnceLock::new();

/// Install the process's telemetry (once).
pub fn install(t: Arc<Telemetry>) {
    let _ = TELEMETRY.set(t);
}

/// The installed telemetry, if any.
pub fn installed() -> Option<&'static Arc<Telemetry>> {
    TELEMETRY.get()
}
