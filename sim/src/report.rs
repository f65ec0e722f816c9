//! Output of a run: a Markdown table (readable in a terminal and pasted
//! as is into docs/BENCHMARKS.md), CSV (one row per policy) and JSON (the
//! whole [`RunReport`]).

use std::fmt::Write;

use serde::Serialize;

use crate::metrics::PolicyReport;

/// A whole run: the setting and one report per policy.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Workload name.
    pub workload: String,
    /// Cluster description.
    pub cluster: String,
    /// Nodes.
    pub nodes: u64,
    /// CPUs.
    pub cpus: u64,
    /// Workload jobs.
    pub jobs: u64,
    /// Offered load: total work / (capacity x arrival span).
    pub offered_load: f64,
    /// Seed.
    pub seed: u64,
    /// CPU-level mode.
    pub cpu_level: bool,
    /// Per policy, in the order run.
    pub policies: Vec<PolicyReport>,
}

fn table_of(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<String>, out: &mut String| {
        let _ = write!(out, "|");
        for (i, c) in cells.iter().enumerate() {
            if i == 0 {
                let _ = write!(out, " {c:<width$} |", width = w[i]);
            } else {
                let _ = write!(out, " {c:>width$} |", width = w[i]);
            }
        }
        let _ = writeln!(out);
    };
    line(header.iter().map(|s| s.to_string()).collect(), &mut out);
    let _ = write!(out, "|");
    for (i, width) in w.iter().enumerate() {
        let dashes = "-".repeat(*width);
        if i == 0 {
            let _ = write!(out, " {dashes} |");
        } else {
            let _ = write!(out, " {}: |", &dashes[1..]);
        }
    }
    let _ = writeln!(out);
    for r in rows {
        line(r.clone(), &mut out);
    }
    out
}

/// A number with 3 significant digits, plain notation.
fn g(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let a = x.abs();
    if a >= 1e6 {
        format!("{:.3e}", x)
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// The main table: one row per policy.
pub fn table(r: &RunReport) -> String {
    let header = [
        "policy",
        "util %",
        "makespan s",
        "LB s",
        "util waiting %",
        "resp mean s",
        "resp floor s",
        "p50 s",
        "p99 s",
        "bsld",
        "lat wait p99 s",
        "batch wait p99 s",
        "steals",
        "x-rack",
        "x-zone",
        "near waker (rack) %",
        "locality %",
        "active nodes",
        "decisions/s",
        "sched %",
    ];
    let rows: Vec<Vec<String>> = r
        .policies
        .iter()
        .map(|p| {
            vec![
                p.policy.clone(),
                format!("{:.1}", 100.0 * p.utilization),
                g(p.makespan_s),
                g(p.makespan_lb_s),
                p.busy_while_waiting_pct
                    .map_or_else(|| "-".to_string(), |u| format!("{u:.1}")),
                g(p.resp_mean_s),
                g(p.resp_floor_s),
                g(p.resp_p50_s),
                g(p.resp_p99_s),
                g(p.bsld_mean),
                g(p.latency_wait_p99_s),
                g(p.batch_wait_p99_s),
                p.steals.to_string(),
                p.cross_rack_moves.to_string(),
                p.cross_zone_moves.to_string(),
                format!("{:.1}", p.near_waker_rack_pct),
                if p.locality_jobs == 0 {
                    "-".to_string()
                } else {
                    format!("{:.1}", p.locality_pct)
                },
                format!("{:.1}", p.active_nodes_mean),
                format!("{:.0}", p.decisions_per_s),
                format!("{:.1}", p.sched_share_pct),
            ]
        })
        .collect();
    table_of(&header, &rows)
}

/// The engine's counters and run costs, one row per policy.
pub fn details(r: &RunReport) -> String {
    let header = [
        "policy",
        "jobs",
        "unfinished",
        "fan-out child resp s",
        "near waker (node) %",
        "wake_affine",
        "wake_wide",
        "busy_skip",
        "pack",
        "latency picks",
        "visits/decision",
        "events",
        "wall s",
        "setup s",
    ];
    let rows: Vec<Vec<String>> = r
        .policies
        .iter()
        .map(|p| {
            let c = &p.counters;
            vec![
                p.policy.clone(),
                p.jobs.to_string(),
                p.unfinished.to_string(),
                g(p.fanout_child_resp_mean_s),
                format!("{:.1}", p.near_waker_node_pct),
                c.wake_affine.to_string(),
                c.wake_wide.to_string(),
                c.busy_skip.to_string(),
                c.pack_placed.to_string(),
                c.latency_picks.to_string(),
                g(c.visits as f64 / p.decisions.max(1) as f64),
                p.events.to_string(),
                format!("{:.2}", p.wall_s),
                format!("{:.2}", p.setup_s),
            ]
        })
        .collect();
    table_of(&header, &rows)
}

/// Fragmentation and gangs, one row per policy: the share of racks fully
/// free (mean of the samples) and the gangs' waits.
pub fn gang_table(r: &RunReport) -> String {
    let rows: Vec<Vec<String>> = r
        .policies
        .iter()
        .map(|p| {
            vec![
                p.policy.clone(),
                format!("{:.1}", p.racks_free_pct),
                p.gangs.to_string(),
                g(p.gang_wait_mean_s),
                g(p.gang_wait_p99_s),
                p.large_gangs.to_string(),
                g(p.large_gang_wait_mean_s),
                g(p.large_gang_wait_p99_s),
                format!("{:.1}", p.large_gang_compact_pct),
            ]
        })
        .collect();
    table_of(
        &[
            "policy",
            "racks free %",
            "gangs",
            "gang wait mean s",
            "gang wait p99 s",
            "gangs >= rack",
            "their wait mean s",
            "their wait p99 s",
            "their fewest racks %",
        ],
        &rows,
    )
}

/// CPU-level measurements (empty when the run had none).
pub fn cpu_table(r: &RunReport) -> String {
    let rows: Vec<Vec<String>> = r
        .policies
        .iter()
        .filter_map(|p| {
            let c = p.cpu?;
            let pct = |a: u64, b: u64| {
                if b == 0 {
                    0.0
                } else {
                    100.0 * a as f64 / b as f64
                }
            };
            Some(vec![
                p.policy.clone(),
                c.started.to_string(),
                format!("{:.2}", pct(c.waited, c.started)),
                g(if c.waited == 0 {
                    0.0
                } else {
                    c.wait_us as f64 / c.waited as f64 / 1e6
                }),
                c.multi.to_string(),
                format!("{:.1}", pct(c.multi_one_llc, c.multi)),
                format!("{:.1}", pct(c.multi_one_numa, c.multi)),
                c.refused.to_string(),
            ])
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    table_of(
        &[
            "policy",
            "started",
            "waited on node %",
            "mean node wait s",
            "multi-CPU jobs",
            "one LLC %",
            "one NUMA node %",
            "refused",
        ],
        &rows,
    )
}

/// Everything as text: a heading line, the tables.
pub fn text(r: &RunReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "workload {}: {} jobs, offered load {:.2}; cluster {}; seed {}{}\n",
        r.workload,
        r.jobs,
        r.offered_load,
        r.cluster,
        r.seed,
        if r.cpu_level { "; CPU-level" } else { "" }
    );
    out.push_str(&table(r));
    out.push('\n');
    out.push_str(&details(r));
    out.push('\n');
    out.push_str(&gang_table(r));
    let cpu = cpu_table(r);
    if !cpu.is_empty() {
        out.push('\n');
        out.push_str(&cpu);
    }
    out
}

/// One CSV row per policy, every scalar field.
pub fn csv(r: &RunReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "workload,policy,jobs,tasks,unfinished,utilization,busy_while_waiting_pct,makespan_s,makespan_lb_s,resp_mean_s,resp_p50_s,resp_p99_s,wait_mean_s,wait_p99_s,bsld_mean,latency_jobs,latency_resp_p99_s,latency_wait_p99_s,batch_wait_p99_s,fanout_child_resp_mean_s,steals,cross_rack_moves,cross_zone_moves,woken_jobs,near_waker_node_pct,near_waker_rack_pct,locality_jobs,locality_pct,active_nodes_mean,active_nodes_max,nodes,decisions,decisions_per_s,sched_share_pct,sched_wall_s,wall_s,setup_s,events,visits,wake_affine,wake_wide,busy_skip,pack_placed,latency_picks,racks_free_pct,gangs,gang_wait_mean_s,gang_wait_p99_s,large_gangs,large_gang_wait_mean_s,large_gang_wait_p99_s,large_gang_compact_pct,resp_floor_s"
    );
    for p in &r.policies {
        let c = &p.counters;
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.6},{},{:.3},{:.3},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{},{:.6},{:.6},{:.6},{:.6},{},{},{},{},{:.3},{:.3},{},{:.3},{:.3},{},{},{},{:.1},{:.3},{:.6},{:.6},{:.6},{},{},{},{},{},{},{},{:.3},{},{:.6},{:.6},{},{:.6},{:.6},{:.3},{:.6}",
            r.workload.replace(',', ";"),
            p.policy,
            p.jobs,
            p.tasks,
            p.unfinished,
            p.utilization,
            p.busy_while_waiting_pct
                .map_or_else(String::new, |u| format!("{u:.3}")),
            p.makespan_s,
            p.makespan_lb_s,
            p.resp_mean_s,
            p.resp_p50_s,
            p.resp_p99_s,
            p.wait_mean_s,
            p.wait_p99_s,
            p.bsld_mean,
            p.latency_jobs,
            p.latency_resp_p99_s,
            p.latency_wait_p99_s,
            p.batch_wait_p99_s,
            p.fanout_child_resp_mean_s,
            p.steals,
            p.cross_rack_moves,
            p.cross_zone_moves,
            p.woken_jobs,
            p.near_waker_node_pct,
            p.near_waker_rack_pct,
            p.locality_jobs,
            p.locality_pct,
            p.active_nodes_mean,
            p.active_nodes_max,
            p.nodes,
            p.decisions,
            p.decisions_per_s,
            p.sched_share_pct,
            p.sched_wall_s,
            p.wall_s,
            p.setup_s,
            p.events,
            c.visits,
            c.wake_affine,
            c.wake_wide,
            c.busy_skip,
            c.pack_placed,
            c.latency_picks,
            p.racks_free_pct,
            p.gangs,
            p.gang_wait_mean_s,
            p.gang_wait_p99_s,
            p.large_gangs,
            p.large_gang_wait_mean_s,
            p.large_gang_wait_p99_s,
            p.large_gang_compact_pct,
            p.resp_floor_s,
        );
    }
    out
}
