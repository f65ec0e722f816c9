//! The dispatcher's OTLP traces and metrics (OpenTelemetry over gRPC).
//!
//! Off by default; on and configured exactly like the agent's (flag
//! `--otlp-endpoint` or the standard `OTEL_*` environment): the pipelines,
//! the Prometheus bridge and W3C propagation live in [`dispatch_telemetry`]
//! and are shared. Placement never waits on a collector (batch exporters
//! on their own threads).
//!
//! **Traces.** Each job gets a root span `job` (attributes `job.id`,
//! `job.class`, `job.cpus`; ends when the job ends, with `job.state`) and
//! children following its life, built from the job events the core
//! publishes: `submit`, `queued` (from submission until it is sent to a
//! node, waiting in a node's queue or for any node; `dispatch.reason`),
//! `placed` (`dispatch.node`, `dispatch.reason`),
//! `run` (from assignment to the end of the attempt; `dispatch.node`; a
//! retried job has one per attempt), `started`
//! (`dispatch.node`, `job.cpus_used`) and `finished` (`job.state`,
//! `job.exit_code`). When the SubmitJob(s) request carried a W3C
//! `traceparent` in its metadata, `job` is a child of the client's span
//! ([`Telemetry::adopt_parent`]). The core puts the `run` span's context
//! in every `Assign` it sends ([`Telemetry::trace_context`]), so the
//! agent's `job.start` / `job.run` spans join the same trace.
//!
//! **Metrics.** Every Prometheus metric of [`crate::metrics`] is bridged
//! (counters lose their `_total` suffix: OTLP sums are named without it),
//! and placements are timed into an OTel histogram
//! `dispatch_placement_seconds`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dispatch_telemetry::{Exporters, TelemetryError};
use opentelemetry::metrics::{Histogram, Meter};
use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;
use proto::v1::{JobEvent, JobState};

use crate::cluster::JobRecord;
use crate::metrics::{Metrics, class_of, state_name};
use crate::observe::Observer;

/// The exporters; dropped or [`Telemetry::shutdown`] at exit.
pub struct Telemetry {
    /// The OTLP pipelines (`None` in unit tests, which give a tracer).
    exporters: Option<Exporters>,
    tracer: SdkTracer,
    placement_seconds: Histogram<f64>,
    jobs: Mutex<HashMap<String, JobTrace>>,
    /// Remote parents of jobs just submitted, taken when their root span
    /// opens (the same core batch).
    parents: Mutex<HashMap<String, Context>>,
}

/// The open spans of a live job.
struct JobTrace {
    root: Context,
    queued: Option<Context>,
    run: Option<Context>,
}

impl Telemetry {
    /// Build the OTLP exporters (inside a tokio runtime: the gRPC channel
    /// is created on it, connecting lazily) and bridge `metrics`.
    pub fn init(endpoint: Option<&str>, metrics: Arc<Metrics>) -> Result<Self, TelemetryError> {
        let exporters = Exporters::init("dispatcher", endpoint)?;
        let meter = exporters.meter("dispatcher");
        dispatch_telemetry::bridge_prometheus(&meter, &metrics.registry, metrics.families());
        let tracer = exporters.tracer("dispatcher");
        Ok(Self::new(Some(exporters), tracer, &meter))
    }

    fn new(exporters: Option<Exporters>, tracer: SdkTracer, meter: &Meter) -> Self {
        let placement_seconds = meter
            .f64_histogram("dispatch_placement_seconds")
            .with_unit("s")
            .with_description("Time the core spent validating and placing a submitted job.")
            .build();
        Self {
            exporters,
            tracer,
            placement_seconds,
            jobs: Mutex::new(HashMap::new()),
            parents: Mutex::new(HashMap::new()),
        }
    }

    /// A tracer of the same pipeline for another instrumentation scope
    /// (the `--dev` agent traces its jobs through it).
    pub fn tracer(&self, scope: &'static str) -> Option<SdkTracer> {
        self.exporters.as_ref().map(|e| e.tracer(scope))
    }

    /// The jobs `ids` were submitted by a request carrying the W3C trace
    /// context `carrier`: their root spans become children of it. Call
    /// before the batch's events are observed.
    pub fn adopt_parent<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
        carrier: &HashMap<String, String>,
    ) {
        let Some(parent) = dispatch_telemetry::extract(carrier) else {
            return;
        };
        let mut parents = self.parents.lock().unwrap_or_else(|e| e.into_inner());
        for id in ids {
            parents.insert(id.to_string(), parent.clone());
        }
    }

    /// The W3C trace context to send with the job's `Assign`: its `run`
    /// span (or its root); empty for a job without a live trace (one that
    /// predates this process).
    pub fn trace_context(&self, job_id: &str) -> HashMap<String, String> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.get(job_id) {
            Some(t) => dispatch_telemetry::inject(t.run.as_ref().unwrap_or(&t.root)),
            None => HashMap::new(),
        }
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
                let parent = self
                    .parents
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&job.id)
                    .unwrap_or_default();
                let mut root = self.tracer.start_with_context("job", &parent);
                root.set_attributes([
                    id.clone(),
                    KeyValue::new("job.class", class_of(job)),
                    KeyValue::new(
                        "job.cpus",
                        job.spec.as_ref().map_or(1, |s| s.cpus.max(1)) as i64,
                    ),
                ]);
                let root = parent.with_span(root);
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
                // Back to PENDING (a retry, a steal back): the attempt's
                // run ends (the next Assign gets a run span of its own) and
                // the job is queued again.
                JobState::Pending => {
                    if let Some(r) = t.run.take() {
                        r.span().set_attribute(reason.clone());
                        r.span().end();
                    }
                    if t.queued.is_none() {
                        t.queued = Some(self.open("queued", &t.root, vec![id.clone()]));
                    }
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
                _ if crate::record::is_terminal_state(job.state) => {
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

    /// Flush and stop the exporters (bounded; see [`Exporters::shutdown`]).
    pub async fn shutdown(&self) {
        if let Some(e) = &self.exporters {
            e.shutdown().await;
        }
    }
}

impl Observer for Telemetry {
    fn submitted(&self, jobs: usize, seconds: f64) {
        self.observe_submit(jobs, seconds);
    }

    fn submitted_in_trace(&self, jobs: &[Arc<JobRecord>], carrier: &HashMap<String, String>) {
        let ids: Vec<String> = jobs.iter().map(|j| j.id()).collect();
        self.adopt_parent(ids.iter().map(String::as_str), carrier);
    }

    fn committed(&self, events: &[JobEvent]) {
        self.observe_events(events);
    }

    fn trace_context(&self, job_id: &str) -> HashMap<String, String> {
        Telemetry::trace_context(self, job_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::metrics::SdkMeterProvider;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use proto::v1::{Job, JobSpec};

    fn event(id: &str, prev: JobState, state: JobState, node: &str, reason: &str) -> JobEvent {
        JobEvent {
            job: Some(Job {
                id: id.into(),
                state: state as i32,
                node: node.into(),
                reason: reason.into(),
                spec: Some(JobSpec {
                    cpus: 1,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            previous_state: prev as i32,
            time_ms: 0,
        }
    }

    fn telemetry() -> (Telemetry, InMemorySpanExporter) {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let meter = SdkMeterProvider::default().meter("test");
        (
            Telemetry::new(None, provider.tracer("test"), &meter),
            exporter,
        )
    }

    fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
        spans.iter().filter(|s| s.name == name).collect()
    }

    #[test]
    fn a_job_continues_its_clients_trace_and_each_attempt_gets_a_run_span() {
        use JobState::*;
        let (t, exporter) = telemetry();
        let client: HashMap<String, String> = [(
            "traceparent".to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        )]
        .into();
        t.adopt_parent(["j-1"], &client);
        assert!(t.trace_context("j-1").is_empty(), "no trace before events");
        t.observe_events(&[
            event("j-1", Unspecified, Pending, "", "waiting"),
            event("j-1", Pending, Assigned, "n1", "idlest"),
        ]);
        let first = t.trace_context("j-1");
        // The node is lost: the attempt ends, the job is placed again.
        t.observe_events(&[event("j-1", Assigned, Pending, "", "node n1 down")]);
        t.observe_events(&[event("j-1", Pending, Assigned, "n2", "idlest")]);
        let second = t.trace_context("j-1");
        t.observe_events(&[
            event("j-1", Assigned, Running, "n2", ""),
            event("j-1", Running, Succeeded, "n2", ""),
        ]);
        assert!(
            t.trace_context("j-1").is_empty(),
            "the trace ends with the job"
        );

        let spans = exporter.get_finished_spans().unwrap();
        let root = named(&spans, "job");
        assert_eq!(root.len(), 1);
        let root = root[0];
        assert_eq!(
            root.span_context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(root.parent_span_id.to_string(), "00f067aa0ba902b7");
        let runs = named(&spans, "run");
        assert_eq!(runs.len(), 2, "one run span per attempt");
        assert_eq!(named(&spans, "placed").len(), 2);
        assert_eq!(named(&spans, "queued").len(), 2);
        // Each Assign named its own attempt's run span.
        let tp = |sd: &SpanData| {
            format!(
                "00-{}-{}-01",
                sd.span_context.trace_id(),
                sd.span_context.span_id()
            )
        };
        let mut sent = [first["traceparent"].clone(), second["traceparent"].clone()];
        let mut ran = [tp(runs[0]), tp(runs[1])];
        sent.sort();
        ran.sort();
        assert_eq!(sent, ran);
        for s in &spans {
            assert_eq!(s.span_context.trace_id(), root.span_context.trace_id());
        }
    }

    #[test]
    fn a_job_without_a_client_trace_is_a_root() {
        use JobState::*;
        let (t, exporter) = telemetry();
        let bad: HashMap<String, String> =
            [("traceparent".to_string(), "garbage".to_string())].into();
        t.adopt_parent(["j-2"], &bad);
        t.observe_events(&[
            event("j-2", Unspecified, Pending, "", "waiting"),
            event("j-2", Pending, Cancelled, "", "cancelled"),
        ]);
        let spans = exporter.get_finished_spans().unwrap();
        let root = named(&spans, "job");
        assert_eq!(root.len(), 1);
        assert_eq!(
            root[0].parent_span_id,
            opentelemetry::trace::SpanId::INVALID
        );
    }
}
