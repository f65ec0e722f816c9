//! Prints the seeds' tables from the discrete-event harness
//! (`sched::harness`): seed 000's hackbench table (steal off vs on) and
//! seed 001's pgbench-style tables (wake_wide off vs on).
//!
//! ```text
//! cargo run --release -p sched --example seeds -- \
//!     [--groups 1,2,3,4,8] [--loops 1000] [--items 40000] [--rounds 2000] [--seed 1]
//! ```

use std::process::ExitCode;

use sched::SchedConfig;
use sched::harness::{hackbench, report, wakeaffine};

struct Args {
    groups: Vec<usize>,
    loops: u64,
    items: u64,
    rounds: u64,
    seed: u64,
}

fn parse_list(s: &str) -> Option<Vec<usize>> {
    s.split(',').map(|x| x.trim().parse().ok()).collect()
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        groups: vec![1, 2, 3, 4, 8],
        loops: 1000,
        items: 40_000,
        rounds: 2_000,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--groups" => {
                a.groups =
                    parse_list(&value).ok_or_else(|| format!("--groups {value}: bad list"))?
            }
            "--loops" => a.loops = num()?,
            "--items" => a.items = num()?,
            "--rounds" => a.rounds = num()?,
            "--seed" => a.seed = num()?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(a)
}

fn run(a: &Args) -> Result<(), sched::harness::HarnessError> {
    let mut hb = hackbench::HackbenchParams {
        loops: a.loops,
        ..Default::default()
    };
    hb.harness.seed = a.seed;
    println!(
        "== seed 000: hackbench <grps> process {} on {} ({} tasks per group, pipes of {} messages),",
        hb.loops,
        hb.topology,
        2 * hb.fds,
        hb.pipe_capacity
    );
    println!(
        "   sched_wakeup_granularity_ns={}; counts per CPU; steal off (baseline) vs on (new)",
        hackbench::SEED_WAKEUP_GRANULARITY
    );
    let (base, new) = hackbench::run_comparison(&hb, &a.groups)?;
    print!("{}", report::hackbench_tables(&base, &new));
    println!();
    println!("steal gates (totals; steal_cost = 10 us):");
    let all: Vec<_> = base.iter().chain(&new).cloned().collect();
    print!("{}", report::steal_gate_table(&all));
    for r in &all {
        for p in &r.problems {
            println!("PROBLEM (grps {}, steal {}): {p}", r.groups, r.steal);
        }
    }

    let mut fan = wakeaffine::FanoutParams {
        items: a.items,
        ..Default::default()
    };
    fan.harness.seed = a.seed;
    let workers = [4, 8, 16, 24, 32, 48, 64];
    println!();
    let title = format!(
        "== seed 001: fan-out, 1 server -> W workers ({} us) -> {} collectors, {} items, {}\n   (wake_wide factor = sd_llc_size = 20; cross-LLC stealing on in both arms)",
        fan.work_ns / 1000,
        fan.collectors,
        fan.items,
        fan.topology
    );
    let cfg = wakeaffine::wake_wide_config(false);
    let (b, w) = wakeaffine::fanout_comparison(&fan, &workers, &cfg)?;
    print!("{}", report::wake_table(&title, "workers", &b, &w));
    let mut problems: Vec<_> = b
        .iter()
        .chain(&w)
        .flat_map(|r| r.problems.clone())
        .collect();

    let mut pp = wakeaffine::PingpongParams {
        rounds: a.rounds,
        ..Default::default()
    };
    pp.harness.seed = a.seed;
    println!();
    let title = format!(
        "== seed 001: 1:1 ping-pong pairs ({} us + {} us per round trip), {} rounds, {}",
        pp.work_ns / 1000,
        pp.think_ns / 1000,
        pp.rounds,
        pp.topology
    );
    let (b, w) = wakeaffine::pingpong_comparison(&pp, &[4, 8, 16, 24, 32, 48], &cfg)?;
    print!("{}", report::wake_table(&title, "pairs", &b, &w));
    problems.extend(b.iter().chain(&w).flat_map(|r| r.problems.clone()));

    println!();
    let title = "== for contrast: fan-out with SchedConfig::default() (no cross-LLC balancing):\n   a pile-up in one LLC is permanent, so results follow the start transient";
    let (b, w) = wakeaffine::fanout_comparison(&fan, &workers, &SchedConfig::default())?;
    print!("{}", report::wake_table(title, "workers", &b, &w));
    problems.extend(b.iter().chain(&w).flat_map(|r| r.problems.clone()));
    for p in problems {
        println!("PROBLEM: {p}");
    }

    println!();
    cross_llc_and_node_limit(a)
}

/// Beyond the seed: stealing one level up (the other LLCs of the parent
/// domain, Steve Sistare's per-domain list of LLC masks), measured against
/// LLC-only stealing on a 2-socket machine; and node-limit gating on a
/// 4-socket one (4 NUMA nodes > the limit of 2: no stealing at all).
fn cross_llc_and_node_limit(a: &Args) -> Result<(), sched::harness::HarnessError> {
    println!(
        "== beyond the seed: cross-LLC stealing and node-limit gating (hackbench, {} loops)",
        a.loops
    );
    println!(
        "{:>10} {:>5} {:>22} {:>9} {:>7} {:>8} {:>9} {:>9}",
        "topology", "grps", "config", "time", "%busy", "steal", "crossllc", "%speedup"
    );
    for (topology, groups) in [("2s:10c:2t", [1usize, 2, 4]), ("4s:10c:2t", [1, 2, 4])] {
        for g in groups {
            let mut hb = hackbench::HackbenchParams {
                topology: topology.to_string(),
                groups: g,
                loops: a.loops,
                ..Default::default()
            };
            hb.harness.seed = a.seed;
            let off = hackbench::seed_config(false);
            let llc = hackbench::seed_config(true);
            let cross = SchedConfig {
                steal_cross_llc: true,
                ..hackbench::seed_config(true)
            };
            let base = hackbench::run(&hb, &off)?;
            for (name, cfg) in [
                ("no steal", &off),
                ("steal LLC", &llc),
                ("steal LLC+cross", &cross),
            ] {
                let r = if std::ptr::eq(cfg, &off) {
                    base.clone()
                } else {
                    hackbench::run(&hb, cfg)?
                };
                let speedup = 100.0 * (base.run.elapsed_s() / r.run.elapsed_s() - 1.0);
                println!(
                    "{:>10} {:>5} {:>22} {:>9.4} {:>7.2} {:>8} {:>9} {:>9.1}",
                    topology,
                    g,
                    name,
                    r.run.elapsed_s(),
                    r.run.pct_busy(),
                    r.run.stats.steal,
                    r.run.stats.steal_cross_llc,
                    speedup
                );
                for p in &r.problems {
                    println!("PROBLEM: {p}");
                }
            }
        }
    }
    println!(
        "(4s:10c:2t has 4 NUMA nodes > steal_node_limit 2: gating turns stealing off, as seed 000 patch 9 does)"
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("seeds: {e}");
            eprintln!(
                "usage: seeds [--groups 1,2,3,4,8] [--loops N] [--items N] [--rounds N] [--seed N]"
            );
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("seeds: {e}");
            ExitCode::FAILURE
        }
    }
}
