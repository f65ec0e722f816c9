//! The load generator's report: what one pass measured, and its forms on
//! stdout (Markdown tables, JSON, CSV), with the ratios of a pass with
//! heartbeats to its baseline pass without them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::latency::LatencyRow;

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The configuration, in words.
    pub setup: String,
    /// One pass, or two (heartbeats, then the baseline without).
    pub passes: Vec<PassReport>,
}

/// One pass against one dispatcher.
#[derive(Debug, Serialize)]
pub struct PassReport {
    /// "1 Hz heartbeats" or "no heartbeats".
    pub label: String,
    /// Fake agents sending LoadReports.
    pub heartbeats: bool,
    /// Fake agents registered.
    pub nodes: u64,
    /// Their CPUs.
    pub cpus: u64,
    /// HTTP/2 connections they used.
    pub agent_connections: u64,
    /// Seconds from the first connect to the last Registered.
    pub register_s: f64,
    /// Seconds of the quiet window (nodes attached, no submissions).
    pub steady_s: f64,
    /// Seconds of the load phase (first scheduled call to last answer).
    pub load_s: f64,
    /// Latency per call kind.
    pub latencies: Vec<LatencyRow>,
    /// LoadReports sent per second during the quiet window.
    pub reports_per_s: f64,
    /// Jobs.
    pub jobs: JobsReport,
    /// The dispatcher's CPU use, percent of one core (None: no pid).
    pub cpu_steady_pct: Option<f64>,
    pub cpu_load_pct: Option<f64>,
    /// Time the dispatcher's threads were runnable but got no CPU during
    /// the load phase, percent of the phase (summed over threads).
    pub cpu_wait_load_pct: Option<f64>,
    /// The load generator's own CPU use in the load phase, % of a core.
    pub loadgen_cpu_load_pct: Option<f64>,
    /// The machine's 1-minute load average at the start and end of the
    /// pass (other work on the machine shows here).
    pub loadavg_start: Option<f64>,
    pub loadavg_end: Option<f64>,
    /// The dispatcher's memory (None: no pid).
    pub memory: Option<MemoryReport>,
}

/// What happened to the jobs.
#[derive(Debug, Default, Serialize)]
pub struct JobsReport {
    /// Target rate, jobs/s.
    pub target_rate: f64,
    /// Accepted by the dispatcher.
    pub submitted: u64,
    /// In failed calls.
    pub failed: u64,
    /// Not sent (too many calls in flight).
    pub skipped: u64,
    /// Accepted per second of the load phase.
    pub achieved_rate: f64,
    /// Assigns the fake agents received.
    pub assigns: u64,
    /// Terminal statuses the fake agents sent (load jobs).
    pub finished_at_agents: u64,
    /// All load jobs finished before the drain timeout.
    pub drained: bool,
    /// Seconds from the end of the load phase until all had finished.
    pub drain_s: f64,
    /// The load jobs' states as the dispatcher lists them at the end.
    pub dispatcher_states: BTreeMap<String, u64>,
    /// Steal requests the agents received / answered `released`.
    pub steals: u64,
    pub steals_released: u64,
    /// Agent streams that broke (and reconnected).
    pub stream_errors: u64,
    /// The last stream error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_stream_error: Option<String>,
}

/// The dispatcher's resident memory at each step, bytes.
#[derive(Debug, Default, Serialize)]
pub struct MemoryReport {
    /// Fresh, nothing submitted, no node.
    pub rss_start: u64,
    /// With `pending_jobs` unplaceable jobs (still no node).
    pub rss_pending: u64,
    /// After cancelling them (their records stay): the base for nodes.
    pub rss_before_nodes: u64,
    /// With the nodes attached, after the quiet window.
    pub rss_nodes: u64,
    /// Highest reading during the load phase.
    pub rss_load_peak: u64,
    /// Unplaceable jobs submitted for the pending step.
    pub pending_jobs: u64,
    /// (rss_pending - rss_start) / pending_jobs.
    pub bytes_per_pending_job: f64,
    /// (rss_nodes - rss_before_nodes) / nodes.
    pub bytes_per_node: f64,
}

/// Difference per item, 0 when there are none (RSS can also shrink).
pub fn per_item(before: u64, after: u64, items: u64) -> f64 {
    if items == 0 {
        0.0
    } else {
        (after as f64 - before as f64) / items as f64
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.digits$}"))
}

impl PassReport {
    fn latency(&self, kind: &str) -> Option<&LatencyRow> {
        self.latencies
            .iter()
            .find(|r| r.kind == kind && r.count > 0)
    }

    /// The dispatcher's CPU time in the quiet window per LoadReport
    /// received, microseconds (None without reports or a pid).
    fn cpu_us_per_report(&self) -> Option<f64> {
        let pct = self.cpu_steady_pct?;
        (self.reports_per_s > 0.0).then(|| pct / 100.0 / self.reports_per_s * 1e6)
    }

    /// The figures compared between passes: (name, value).
    fn key_figures(&self) -> Vec<(String, Option<f64>)> {
        let mut out = vec![
            (
                "dispatcher CPU, nodes attached, no jobs (% of a core)".to_string(),
                self.cpu_steady_pct,
            ),
            (
                "dispatcher CPU under load (% of a core)".to_string(),
                self.cpu_load_pct,
            ),
            (
                "jobs accepted / s".to_string(),
                Some(self.jobs.achieved_rate),
            ),
        ];
        for kind in [
            "SubmitJob",
            "SubmitJobs",
            "submit->Assign",
            "GetJob",
            "ListNodes",
        ] {
            if let Some(r) = self.latency(kind) {
                out.push((format!("{kind} p50 (ms)"), Some(r.p50_ms)));
                out.push((format!("{kind} p99 (ms)"), Some(r.p99_ms)));
            }
        }
        if let Some(m) = &self.memory {
            out.push((
                "dispatcher RSS with the nodes (MiB)".into(),
                Some(m.rss_nodes as f64 / 1048576.0),
            ));
            out.push(("bytes per node".into(), Some(m.bytes_per_node)));
            out.push((
                "bytes per pending job".into(),
                Some(m.bytes_per_pending_job),
            ));
        }
        out
    }

    fn markdown(&self, s: &mut String) {
        let _ = writeln!(s, "#### {}\n", self.label);
        let _ = writeln!(
            s,
            "{} nodes ({} CPUs) registered in {:.1} s over {} connections; quiet window {:.0} s, load phase {:.1} s.\n",
            self.nodes,
            self.cpus,
            self.register_s,
            self.agent_connections,
            self.steady_s,
            self.load_s
        );
        s.push_str("| call | count | errors | rate/s | p50 ms | p99 ms | p99.9 ms | max ms |\n");
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in &self.latencies {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.kind, r.count, r.errors, r.rate_per_s, r.p50_ms, r.p99_ms, r.p999_ms, r.max_ms
            );
        }
        for r in &self.latencies {
            if let Some(e) = &r.last_error {
                let _ = writeln!(s, "\nlast {} error: {e}", r.kind);
            }
        }
        let j = &self.jobs;
        s.push('\n');
        s.push_str("| figure | value |\n|---|---:|\n");
        let mut row = |k: &str, v: String| {
            let _ = writeln!(s, "| {k} | {v} |");
        };
        row("LoadReports sent / s", format!("{:.0}", self.reports_per_s));
        row(
            "jobs: target rate / accepted rate (per s)",
            format!("{:.0} / {:.1}", j.target_rate, j.achieved_rate),
        );
        row(
            "jobs: accepted / failed / not sent (in-flight cap)",
            format!("{} / {} / {}", j.submitted, j.failed, j.skipped),
        );
        row(
            "jobs: Assigns received / finished at the agents",
            format!("{} / {}", j.assigns, j.finished_at_agents),
        );
        row(
            "jobs: states at the end (dispatcher)",
            j.dispatcher_states
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
        row(
            "drained (all jobs finished) after",
            if j.drained {
                format!("{:.1} s", j.drain_s)
            } else {
                format!("NO (timeout {:.0} s)", j.drain_s)
            },
        );
        row(
            "Steal requests / released",
            format!("{} / {}", j.steals, j.steals_released),
        );
        row("agent streams broken", j.stream_errors.to_string());
        row(
            "dispatcher CPU, nodes attached, no jobs (% of a core)",
            opt(self.cpu_steady_pct, 1),
        );
        row(
            "dispatcher CPU per LoadReport in the quiet window (us; all its work / reports)",
            opt(self.cpu_us_per_report(), 1),
        );
        row(
            "dispatcher CPU under load (% of a core)",
            opt(self.cpu_load_pct, 1),
        );
        row(
            "dispatcher threads runnable but without a CPU under load (% of the phase)",
            opt(self.cpu_wait_load_pct, 1),
        );
        row(
            "load generator CPU under load (% of a core)",
            opt(self.loadgen_cpu_load_pct, 1),
        );
        row(
            "machine load average (1 min) at start / end",
            format!(
                "{} / {}",
                opt(self.loadavg_start, 1),
                opt(self.loadavg_end, 1)
            ),
        );
        if let Some(m) = &self.memory {
            row("dispatcher RSS at start (MiB)", mib(m.rss_start));
            row(
                &format!(
                    "dispatcher RSS with {} pending jobs, no node (MiB)",
                    m.pending_jobs
                ),
                mib(m.rss_pending),
            );
            row(
                "dispatcher RSS after cancelling them (MiB)",
                mib(m.rss_before_nodes),
            );
            row(
                &format!("dispatcher RSS with {} nodes (MiB)", self.nodes),
                mib(m.rss_nodes),
            );
            row("dispatcher RSS peak under load (MiB)", mib(m.rss_load_peak));
            row(
                "bytes per pending job",
                format!("{:.0}", m.bytes_per_pending_job),
            );
            row("bytes per node", format!("{:.0}", m.bytes_per_node));
        }
        if let Some(e) = &j.last_stream_error {
            let _ = writeln!(s, "\nlast agent stream error: {e}");
        }
        s.push('\n');
    }
}

impl Report {
    /// Markdown: the setup, each pass, then the comparison.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}\n", self.setup);
        for p in &self.passes {
            p.markdown(&mut s);
        }
        if let [on, off] = self.passes.as_slice() {
            let _ = writeln!(s, "#### {} against {}\n", on.label, off.label);
            if let (Some(a), Some(b)) = (on.cpu_steady_pct, off.cpu_steady_pct)
                && on.reports_per_s > 0.0
            {
                let _ = writeln!(
                    s,
                    "Heartbeats alone: {:.1}% of a core for {:.0} LoadReports/s, {:.1} us of dispatcher CPU each.\n",
                    a - b,
                    on.reports_per_s,
                    (a - b) / 100.0 / on.reports_per_s * 1e6
                );
            }
            let _ = writeln!(s, "| figure | {} | {} | ratio |", on.label, off.label);
            s.push_str("|---|---:|---:|---:|\n");
            let base: BTreeMap<String, Option<f64>> = off.key_figures().into_iter().collect();
            for (name, v) in on.key_figures() {
                let b = base.get(&name).copied().flatten();
                let ratio = match (v, b) {
                    (Some(v), Some(b)) if b != 0.0 => format!("{:.2}", v / b),
                    _ => "n/a".into(),
                };
                let _ = writeln!(s, "| {name} | {} | {} | {ratio} |", opt(v, 2), opt(b, 2));
            }
            s.push('\n');
        }
        s
    }

    /// CSV: one line per pass and figure.
    pub fn csv(&self) -> String {
        let mut s = String::from("pass,figure,value\n");
        for p in &self.passes {
            for r in &p.latencies {
                for (q, v) in [
                    ("count", r.count as f64),
                    ("errors", r.errors as f64),
                    ("rate_per_s", r.rate_per_s),
                    ("p50_ms", r.p50_ms),
                    ("p99_ms", r.p99_ms),
                    ("p999_ms", r.p999_ms),
                    ("max_ms", r.max_ms),
                ] {
                    let _ = writeln!(s, "{},{} {q},{v}", p.label, r.kind);
                }
            }
            for (name, v) in p.key_figures() {
                if let Some(v) = v {
                    let _ = writeln!(s, "{},\"{name}\",{v}", p.label);
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(label: &str, cpu: f64, p99: f64) -> PassReport {
        PassReport {
            label: label.into(),
            heartbeats: true,
            nodes: 10,
            cpus: 160,
            agent_connections: 10,
            register_s: 0.5,
            steady_s: 5.0,
            load_s: 30.0,
            latencies: vec![LatencyRow {
                kind: "SubmitJob".into(),
                count: 100,
                errors: 0,
                rate_per_s: 3.3,
                p50_ms: 1.0,
                p99_ms: p99,
                p999_ms: p99,
                max_ms: p99,
                last_error: None,
            }],
            reports_per_s: 10.0,
            jobs: JobsReport::default(),
            cpu_steady_pct: Some(cpu),
            cpu_load_pct: None,
            cpu_wait_load_pct: None,
            loadgen_cpu_load_pct: None,
            loadavg_start: None,
            loadavg_end: None,
            memory: Some(MemoryReport {
                rss_before_nodes: 10 << 20,
                rss_nodes: 20 << 20,
                bytes_per_node: per_item(10 << 20, 20 << 20, 10),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn the_comparison_divides_heartbeats_by_the_baseline() {
        let r = Report {
            setup: "setup".into(),
            passes: vec![pass("on", 20.0, 4.0), pass("off", 10.0, 2.0)],
        };
        let md = r.markdown();
        assert!(
            md.contains(
                "| dispatcher CPU, nodes attached, no jobs (% of a core) | 20.00 | 10.00 | 2.00 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| SubmitJob p99 (ms) | 4.00 | 2.00 | 2.00 |"),
            "{md}"
        );
        // Figures without a value on either side have no ratio.
        assert!(md.contains("| dispatcher CPU under load (% of a core) | n/a | n/a | n/a |"));
        assert!(md.contains("| bytes per node | 1048576"));
        // 10% of a core for 10 reports/s: 10 ms each.
        assert!(md.contains("Heartbeats alone: 10.0% of a core for 10 LoadReports/s, 10000.0 us of dispatcher CPU each."), "{md}");
        let csv = r.csv();
        assert!(csv.starts_with("pass,figure,value\n"));
        assert!(csv.contains("on,SubmitJob p99_ms,4\n"), "{csv}");
    }

    #[test]
    fn per_item_handles_none_and_shrinking() {
        assert_eq!(per_item(100, 300, 0), 0.0);
        assert_eq!(per_item(100, 300, 2), 100.0);
        assert_eq!(per_item(300, 100, 2), -100.0);
    }
}
