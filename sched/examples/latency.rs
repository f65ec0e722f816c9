//! Seed 004's measurement from the discrete-event harness
//! (`sched::harness::latency`): a latency class (latency-nice -20,
//! periodic wakers) beside hackbench (the batch class), with latency-nice
//! off, on, and on with the batch class at +19, in the same run: p50/p99
//! wake-to-run latency of each class and batch throughput relative to
//! latency-nice off.
//!
//! ```text
//! cargo run --release -p sched --example latency -- \
//!     [--topology 1s:4c:2t] [--loops 400] [--latency-tasks 8] [--seed 1]
//! ```

use std::process::ExitCode;

use sched::harness::latency::{LatencyParams, run_comparison};
use sched::harness::report;

fn parse_args() -> Result<LatencyParams, String> {
    let mut p = LatencyParams::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--topology" => p.topology = value.clone(),
            "--loops" => p.loops = num()?,
            "--latency-tasks" => p.nr_latency = num()? as usize,
            "--seed" => p.harness.seed = num()?,
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(p)
}

fn main() -> ExitCode {
    let p = match parse_args() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "== seed 004: {} latency tasks (latency-nice {}, sleep {} us, burst {} us, +-{:.0}%) beside hackbench {} group(s) x {} loops on {}",
        p.nr_latency,
        p.latency_nice,
        p.period_ns / 1000,
        p.burst_ns / 1000,
        p.jitter * 100.0,
        p.groups,
        p.loops,
        p.topology
    );
    match run_comparison(&p) {
        Ok(rs) => {
            print!("{}", report::latency_table(&rs));
            if rs.iter().any(|r| !r.problems.is_empty()) {
                for r in &rs {
                    for problem in &r.problems {
                        eprintln!("problem: {problem}");
                    }
                }
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
