//! The agent's spans of the jobs it runs ([`JobTraces`]). The pipelines
//! they go out on and W3C propagation are [`dispatch_telemetry`]'s.
//!
//! `job.start` (from the local scheduler's Start to the shim running;
//! `job.id`, `job.attempt`, `dispatch.node`, `job.cpus_used` (the
//! scheduler's CPUs), `job.pinned_cpus` (the real ones)) and `job.run`
//! (from then to the exit; events `stopped`, `continued`, `migrated` with
//! the CPUs and, for a move, `steal.level` = smt / llc / cross_llc; ends
//! with `job.state`, `job.exit_code`, `job.signal`). Both are children of
//! the trace context the dispatcher sends in `Assign.trace_context`, so one
//! trace covers the job from submission to exit across both processes.

use std::collections::HashMap;
use std::sync::OnceLock;

use dispatch_telemetry::extract;
use opentelemetry::trace::{Span as _, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

static JOB_TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Trace the jobs this process's agent runs with `tracer` (once). The
/// agent binary installs its own; the dispatcher's `--dev` agent shares
/// the dispatcher's.
pub fn install_job_tracer(tracer: SdkTracer) {
    let _ = JOB_TRACER.set(tracer);
}

/// The level a task moved across, from CPU `from` to CPU `to` (scheduler
/// CPU numbers): `smt` (same core), `llc` (same last-level cache) or
/// `cross_llc`; `None` for a CPU the topology does not have or no move.
pub fn move_level(topo: &sched::Topology, from: u32, to: u32) -> Option<&'static str> {
    let a = topo.leaf_of_os_id(u64::from(from))?;
    let b = topo.leaf_of_os_id(u64::from(to))?;
    if a == b {
        None
    } else if topo.core_of(a) == topo.core_of(b) {
        Some("smt")
    } else if topo.share_llc(a, b) {
        Some("llc")
    } else {
        Some("cross_llc")
    }
}

/// The open spans of one job attempt on this node.
struct JobTrace {
    /// The dispatcher's span (remote), or a fresh root.
    parent: Context,
    starting: Option<Context>,
    run: Option<Context>,
    cpus: Vec<u32>,
    /// `job.id`, `job.attempt`, `dispatch.node`: on every span.
    ids: Vec<KeyValue>,
}

fn cpu_list(cpus: &[u32]) -> String {
    cpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The agent's spans of the jobs it holds, by local id (job and attempt).
/// Every method is a no-op when no job tracer is installed or the job was
/// not announced with [`JobTraces::assigned`].
#[derive(Default)]
pub struct JobTraces {
    jobs: HashMap<String, JobTrace>,
}

impl JobTraces {
    fn tracer() -> Option<&'static SdkTracer> {
        JOB_TRACER.get()
    }

    /// The dispatcher assigned the job `id` with `trace_context`.
    pub fn assigned(&mut self, id: &str, trace_context: &HashMap<String, String>) {
        if Self::tracer().is_none() {
            return;
        }
        let parent = extract(trace_context).unwrap_or_default();
        self.jobs.insert(
            id.to_string(),
            JobTrace {
                parent,
                starting: None,
                run: None,
                cpus: Vec::new(),
                ids: Vec::new(),
            },
        );
    }

    /// The agent starts the job on `cpus` (scheduler CPUs) pinned to
    /// `pinned` (real CPUs): opens `job.start`.
    pub fn starting(
        &mut self,
        id: &str,
        (job_id, attempt): (&str, u32),
        node: &str,
        cpus: &[u32],
        pinned: &[u32],
    ) {
        let (Some(tracer), Some(t)) = (Self::tracer(), self.jobs.get_mut(id)) else {
            return;
        };
        t.ids = vec![
            KeyValue::new("job.id", job_id.to_string()),
            KeyValue::new("job.attempt", i64::from(attempt)),
            KeyValue::new("dispatch.node", node.to_string()),
        ];
        let mut span = tracer.start_with_context("job.start", &t.parent);
        span.set_attributes(t.ids.iter().cloned().chain([
            KeyValue::new("job.cpus_used", cpu_list(cpus)),
            KeyValue::new("job.pinned_cpus", cpu_list(pinned)),
        ]));
        t.starting = Some(t.parent.with_span(span));
        t.cpus = cpus.to_vec();
    }

    /// The shim runs (`Ok`) or could not start (`Err`): ends `job.start`
    /// and, on success, opens `job.run`.
    pub fn started(&mut self, id: &str, result: Result<(), &str>) {
        let (Some(tracer), Some(t)) = (Self::tracer(), self.jobs.get_mut(id)) else {
            return;
        };
        if let Some(cx) = t.starting.take() {
            let span = cx.span();
            if let Err(err) = result {
                span.set_status(Status::error(err.to_string()));
            }
            span.end();
        }
        match result {
            Ok(()) => {
                let mut span = tracer.start_with_context("job.run", &t.parent);
                span.set_attributes(t.ids.iter().cloned());
                t.run = Some(t.parent.with_span(span));
            }
            Err(_) => {
                self.jobs.remove(id);
            }
        }
    }

    /// The job was time-sliced out (SIGSTOP).
    pub fn stopped(&mut self, id: &str) {
        if let Some(run) = self.jobs.get(id).and_then(|t| t.run.as_ref()) {
            run.span().add_event("stopped", Vec::new());
        }
    }

    /// The job runs again (`continued`, after a stop) or was re-pinned
    /// while running (`migrated`) on `cpus`; a move to other CPUs carries
    /// the level it crossed.
    pub fn moved(&mut self, id: &str, event: &'static str, cpus: &[u32], topo: &sched::Topology) {
        let Some(t) = self.jobs.get_mut(id) else {
            return;
        };
        let Some(run) = &t.run else { return };
        let mut attrs = vec![KeyValue::new("job.cpus_used", cpu_list(cpus))];
        // The widest level any of the job's CPUs moved across.
        let level = t
            .cpus
            .iter()
            .zip(cpus)
            .filter_map(|(&a, &b)| move_level(topo, a, b))
            .max_by_key(|l| match *l {
                "smt" => 0,
                "llc" => 1,
                _ => 2,
            });
        if let Some(level) = level {
            attrs.push(KeyValue::new("steal.level", level));
        }
        run.span().add_event(event, attrs);
        t.cpus = cpus.to_vec();
    }

    /// The job ended: ends `job.run` with its state and exit.
    pub fn ended(&mut self, id: &str, state: &str, exit_code: i32, signal: i32, message: &str) {
        let Some(t) = self.jobs.remove(id) else {
            return;
        };
        if let Some(cx) = t.starting {
            cx.span().end();
        }
        if let Some(run) = t.run {
            let span = run.span();
            span.set_attributes([
                KeyValue::new("job.state", state.to_string()),
                KeyValue::new("job.exit_code", i64::from(exit_code)),
                KeyValue::new("job.signal", i64::from(signal)),
            ]);
            if !message.is_empty() {
                span.set_attribute(KeyValue::new("job.message", message.to_string()));
            }
            if state != "succeeded" {
                span.set_status(Status::error(message.to_string()));
            }
            span.end();
        }
    }

    /// The job left the node without running (cancelled before it
    /// started, stolen back by the dispatcher).
    pub fn forget(&mut self, id: &str) {
        self.jobs.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;

    #[test]
    fn job_spans_are_children_of_the_assigned_context_and_record_the_run() {
        use opentelemetry_sdk::trace::InMemorySpanExporter;
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        install_job_tracer(provider.tracer("test"));
        let m = crate::topology::synthetic("2s:2c:2t:linear").unwrap();
        let topo = m.to_sched().unwrap();
        let core0 = m.smt_groups()[0].clone();
        let llc1 = m.llc_groups()[1].clone();
        let parent: HashMap<String, String> = [(
            "traceparent".to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        )]
        .into();
        let mut traces = JobTraces::default();
        traces.assigned("j-1_a2", &parent);
        traces.starting("j-1_a2", ("j-1", 2), "n1", &[core0[0]], &[7]);
        traces.started("j-1_a2", Ok(()));
        traces.stopped("j-1_a2");
        traces.moved("j-1_a2", "continued", &[core0[1]], &topo);
        traces.moved("j-1_a2", "migrated", &[llc1[0]], &topo);
        traces.ended("j-1_a2", "failed", 3, 0, "exited with status 3");
        // A job that leaves before it starts leaves no span.
        traces.assigned("j-2_a1", &parent);
        traces.forget("j-2_a1");
        traces.ended("j-2_a1", "cancelled", 0, 0, "");

        let spans = exporter.get_finished_spans().unwrap();
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
        assert_eq!(names, ["job.start", "job.run"]);
        let attr = |s: &opentelemetry_sdk::trace::SpanData, k: &str| {
            s.attributes
                .iter()
                .find(|kv| kv.key.as_str() == k)
                .map(|kv| kv.value.to_string())
        };
        for s in &spans {
            assert_eq!(
                s.span_context.trace_id().to_string(),
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
            assert_eq!(s.parent_span_id.to_string(), "00f067aa0ba902b7");
            assert!(s.parent_span_is_remote);
            assert_eq!(attr(s, "job.id").as_deref(), Some("j-1"));
            assert_eq!(attr(s, "job.attempt").as_deref(), Some("2"));
            assert_eq!(attr(s, "dispatch.node").as_deref(), Some("n1"));
        }
        let (start, run) = (&spans[0], &spans[1]);
        assert_eq!(attr(start, "job.cpus_used"), Some(core0[0].to_string()));
        assert_eq!(attr(start, "job.pinned_cpus").as_deref(), Some("7"));
        assert_eq!(attr(run, "job.state").as_deref(), Some("failed"));
        assert_eq!(attr(run, "job.exit_code").as_deref(), Some("3"));
        assert!(matches!(run.status, Status::Error { .. }));
        let events: Vec<(String, Option<String>)> = run
            .events
            .iter()
            .map(|e| {
                let level = e
                    .attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == "steal.level")
                    .map(|kv| kv.value.to_string());
                (e.name.to_string(), level)
            })
            .collect();
        assert_eq!(
            events,
            [
                ("stopped".to_string(), None),
                ("continued".to_string(), Some("smt".to_string())),
                ("migrated".to_string(), Some("cross_llc".to_string())),
            ]
        );
    }

    #[test]
    fn moves_are_classified_by_the_level_they_cross() {
        // 1 socket, 2 LLCs of 2 cores of 2 threads: CPUs 0-7, siblings
        // (0,1), (2,3), ...; LLC 0 = 0-3 under this spec's linear layout.
        let m = crate::topology::synthetic("2s:2c:2t:linear").unwrap();
        let topo = m.to_sched().unwrap();
        let core0: Vec<u32> = m.smt_groups()[0].clone();
        let llc0: Vec<u32> = m.llc_groups()[0].clone();
        let llc1: Vec<u32> = m.llc_groups()[1].clone();
        assert_eq!(move_level(&topo, core0[0], core0[0]), None);
        assert_eq!(move_level(&topo, core0[0], core0[1]), Some("smt"));
        let other_core = *llc0.iter().find(|c| !core0.contains(c)).unwrap();
        assert_eq!(move_level(&topo, core0[0], other_core), Some("llc"));
        assert_eq!(move_level(&topo, llc0[0], llc1[0]), Some("cross_llc"));
        assert_eq!(move_level(&topo, 0, 999), None);
    }
}
