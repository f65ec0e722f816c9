//! Tables in the seeds' columns, returned as `String`s for examples, tests
//! and issue comments.

use std::fmt::Write;

use super::hackbench::HackbenchResult;
use super::latency::LatencyResult;
use super::wakeaffine::WakeResult;

/// One hackbench row in the seed's columns. Counts are averaged per CPU as
/// in the seed ("the delta in /proc/schedstat ... averaged per CPU"):
/// `sched` = switches to a task + switches to idle, `idle` = switches to
/// idle, `wake` = wakeups, `steal` = tasks stolen; `slice` = busy time per
/// switch to a task (ms); `%find` = search visits x cost / CPU time.
fn hackbench_row(r: &HackbenchResult) -> String {
    let cpus = r.nr_leaves.max(1) as f64;
    let s = &r.run;
    format!(
        "{:>4} {:>8.4} {:>6.2} {:>5.3} {:>8.0} {:>7.0} {:>8.0} {:>5.2} {:>6.0}",
        r.groups,
        s.elapsed_s(),
        s.pct_busy(),
        s.slice_ms(),
        s.sched_count() as f64 / cpus,
        s.goidle as f64 / cpus,
        s.wakeups as f64 / cpus,
        s.pct_find(),
        s.stats.steal as f64 / cpus,
    )
}

const HACKBENCH_HEADER: &str = "grps     time  %busy slice    sched    idle     wake %find  steal";

/// The seed's two tables: `baseline` (steal off) and `new` (steal on) with
/// `%speedup = time_base / time_new - 1`. Rows are matched by position.
pub fn hackbench_tables(baseline: &[HackbenchResult], new: &[HackbenchResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "baseline");
    let _ = writeln!(out, "{HACKBENCH_HEADER}");
    for r in baseline {
        let _ = writeln!(out, "{}", hackbench_row(r));
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "new");
    let _ = writeln!(out, "{HACKBENCH_HEADER} %speedup");
    for (i, r) in new.iter().enumerate() {
        let speedup = baseline
            .get(i)
            .map(|b| 100.0 * (b.run.elapsed_ns as f64 / r.run.elapsed_ns.max(1) as f64 - 1.0));
        match speedup {
            Some(x) => {
                let _ = writeln!(out, "{} {:>8.1}", hackbench_row(r), x);
            }
            None => {
                let _ = writeln!(out, "{}", hackbench_row(r));
            }
        }
    }
    out
}

/// The gate counters of each run: how often `try_steal` ran into the
/// `avg_idle < steal_cost` gate, failed, or stole (totals, not per CPU).
pub fn steal_gate_table(results: &[HackbenchResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "grps steal    steals  smt_steals  steal_fail  skip_avg_idle  goidle"
    );
    for r in results {
        let st = &r.run.stats;
        let _ = writeln!(
            out,
            "{:>4} {:>5} {:>9} {:>11} {:>11} {:>14} {:>7}",
            r.groups,
            if r.steal { "on" } else { "off" },
            st.steal,
            st.steal_smt,
            st.steal_fail,
            st.steal_skip_avg_idle,
            r.run.goidle,
        );
    }
    out
}

/// A seed 001 style table (`clients | base | wake_wide`): throughput in
/// work items per simulated second and mean wakeup-to-run latency in
/// microseconds for each configuration, the number of wakeups `wake_wide`
/// sent wide, and the throughput change. Rows are matched by position.
pub fn wake_table(title: &str, clients: &str, base: &[WakeResult], wide: &[WakeResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{title}");
    let _ = writeln!(out, "{:>9}         base                     wake_wide", "");
    let _ = writeln!(
        out,
        "| {clients:>7} | {:>9} | {:>7} |   | {:>9} | {:>7} | {:>9} | {:>7} |",
        "items/s", "lat us", "items/s", "lat us", "wide", "%change"
    );
    let _ = writeln!(
        out,
        "+---------+-----------+---------+   +-----------+---------+-----------+---------+"
    );
    for (b, w) in base.iter().zip(wide) {
        let change = 100.0 * (w.throughput() / b.throughput().max(f64::MIN_POSITIVE) - 1.0);
        let _ = writeln!(
            out,
            "| {:>7} | {:>9.0} | {:>7.1} |   | {:>9.0} | {:>7.1} | {:>9} | {:>+6.1}% |",
            b.clients,
            b.throughput(),
            b.mean_wake_latency_us(),
            w.throughput(),
            w.mean_wake_latency_us(),
            w.run.stats.wake_wide,
            change,
        );
    }
    out
}

/// Seed 004's comparison: one row per configuration, wake-to-run latency
/// percentiles of the latency class and of the batch class (us), the
/// ratio batch p99 / latency p99 ("inf" when the latency class's p99 is
/// 0: at least 99% of its wakeups ran at once), and batch throughput
/// (hackbench messages per simulated ms) with its ratio to the first row
/// (latency-nice off).
pub fn latency_table(results: &[LatencyResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "latency-nice batch-ln  lat-p50  lat-p99 lat-p99.9  batch-p50  batch-p99  p99 batch/lat  batch msg/ms  vs off"
    );
    let base = results.first().map_or(0.0, LatencyResult::batch_throughput);
    for r in results {
        let us = |ns: u64| ns as f64 / 1000.0;
        let ratio = if r.lat_p99_ns == 0 {
            "inf".to_string()
        } else {
            format!("{:.2}", r.batch_p99_ns as f64 / r.lat_p99_ns as f64)
        };
        let tp = r.batch_throughput();
        let vs = if base == 0.0 { 0.0 } else { tp / base };
        let _ = writeln!(
            out,
            "{:>12} {:>8}  {:>7.1}  {:>7.1} {:>9.1}  {:>9.1}  {:>9.1}  {:>13}  {:>12.1}  {:>6.3}",
            if r.latency_on { "on" } else { "off" },
            r.batch_latency_nice,
            us(r.lat_p50_ns),
            us(r.lat_p99_ns),
            us(r.lat_p999_ns),
            us(r.batch_p50_ns),
            us(r.batch_p99_ns),
            ratio,
            tp / 1000.0,
            vs,
        );
    }
    out
}
