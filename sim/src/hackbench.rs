//! Seed 000's message groups at CPU level: `hackbench <groups> process`
//! on one node's topology, run by the engine harness's own hackbench
//! workload ([`sched::harness::hackbench`]) under "ours" with its
//! mechanisms toggled (the baselines are cluster policies and do not apply
//! to CPUs). The engine configuration is the seed's
//! ([`sched::harness::hackbench::seed_config`]) with the toggles applied.

use sched::harness::HarnessConfig;
use sched::harness::hackbench::{self, HackbenchParams, HackbenchResult, seed_config};
use sched::{NodeLimitScope, Policy, SchedConfig};
use serde::Serialize;

use crate::error::{Result, bad_spec};
use crate::policy::{PolicyKind, PolicySpec};

/// One row: a policy at a group count.
#[derive(Clone, Debug, Serialize)]
pub struct HackbenchRow {
    /// Policy name.
    pub policy: String,
    /// Groups.
    pub groups: usize,
    /// Simulated elapsed time, seconds.
    pub time_s: f64,
    /// CPU busy percent.
    pub busy_pct: f64,
    /// Search cost, percent of CPU time.
    pub find_pct: f64,
    /// Tasks stolen.
    pub steals: u64,
    /// Wakeups placed in another LLC than the waker.
    pub remote_wakeups: u64,
    /// Problems found by the conservation check.
    pub problems: Vec<String>,
}

/// The engine configuration of an "ours" policy at CPU level.
pub fn cpu_config(spec: &PolicySpec) -> Result<SchedConfig> {
    let PolicyKind::Ours(f) = spec.kind else {
        return Err(bad_spec(
            "policy",
            &spec.name,
            "hackbench runs the engine at CPU level: only ours[...] policies apply",
        ));
    };
    let mut c = seed_config(f.steal);
    c.steal_cross_llc = f.cross_rack;
    c.wake_wide = f.wake_wide;
    c.latency = f.latency;
    c.busy_skip = f.busy_skip;
    if f.pack {
        c.default_policy = Policy::Pack;
    }
    if let Some(l) = f.node_limit {
        c.node_limit_scope = NodeLimitScope::Global;
        c.steal_node_limit = l;
    }
    Ok(c)
}

/// Run hackbench on `topology` for each policy and group count.
pub fn run(
    topology: &str,
    groups: &[usize],
    loops: u64,
    policies: &[PolicySpec],
    seed: u64,
) -> Result<Vec<HackbenchRow>> {
    let mut rows = Vec::new();
    for p in policies {
        let cfg = cpu_config(p)?;
        for &g in groups {
            let params = HackbenchParams {
                topology: topology.to_string(),
                groups: g,
                loops,
                harness: HarnessConfig {
                    seed,
                    ..HarnessConfig::default()
                },
                ..HackbenchParams::default()
            };
            let r: HackbenchResult = hackbench::run(&params, &cfg)?;
            rows.push(HackbenchRow {
                policy: p.name.clone(),
                groups: g,
                time_s: r.run.elapsed_s(),
                busy_pct: r.run.pct_busy(),
                find_pct: r.run.pct_find(),
                steals: r.run.stats.steal,
                remote_wakeups: r.run.remote_wakeups,
                problems: r.problems,
            });
        }
    }
    Ok(rows)
}

/// The rows as a Markdown table, with the speedup of each row over the
/// first policy's row at the same group count.
pub fn table(rows: &[HackbenchRow]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| policy | groups | time s | %busy | %find | steals | remote wakeups | speedup vs first % |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let base = rows.iter().find(|b| b.groups == r.groups);
        let speedup = base.map_or(0.0, |b| 100.0 * (b.time_s / r.time_s.max(1e-12) - 1.0));
        let _ = writeln!(
            out,
            "| {} | {} | {:.4} | {:.2} | {:.3} | {} | {} | {:.1} |",
            r.policy,
            r.groups,
            r.time_s,
            r.busy_pct,
            r.find_pct,
            r.steals,
            r.remote_wakeups,
            speedup
        );
    }
    out
}
