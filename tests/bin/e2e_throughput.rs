//! End-to-end throughput: trivial jobs per second from SubmitJobs to their
//! terminal state, through gRPC, with one dispatcher and 4 agent processes
//! on loopback (synthetic 1s:4c:2t nodes mapped onto this machine's CPUs).
//!
//! `cargo run --release -p e2e --bin e2e-throughput [-- JOBS]` prints the
//! rate; every job runs `true` for real, so on a 2-CPU machine the figure
//! is bounded by process creation, not by placement. The same run first
//! measures its baseline, the raw rate of this machine at starting `true`
//! and waiting for it one at a time (`posix_spawn` + `waitpid`, what
//! `std::process::Command` does), and prints the end-to-end rate as a
//! ratio of it.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::{Agent, Dispatcher, all_jobs, eventually, is_terminal, wait_nodes};
use proto::v1::{JobSpec, JobState, SubmitJobsRequest};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let raw = raw_spawn_wait_rate(n.min(2000))?;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let mut agents = Vec::new();
    for i in 0..4 {
        let rack = format!("dispatch.io/rack=r{}", i / 2);
        agents.push(Agent::start(
            dir.path(),
            &d.url,
            &format!("n{i}"),
            "1s:4c:2t",
            &[rack.as_str()],
            &[],
        )?);
    }
    wait_nodes(&d, 4, Duration::from_secs(30)).await?;
    let mut jobs = d.jobs().await?;
    let start = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let specs = chunk
            .iter()
            .map(|_| JobSpec {
                command: vec!["true".into()],
                ..Default::default()
            })
            .collect();
        jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
    }
    let submitted = start.elapsed();
    let all = eventually(Duration::from_secs(600), "all jobs finished", || {
        let mut c = jobs.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            all.iter().all(|j| is_terminal(j.state)).then_some(all)
        }
    })
    .await?;
    let total = start.elapsed();
    let ok = all
        .iter()
        .filter(|j| j.state == JobState::Succeeded as i32)
        .count();
    println!(
        "jobs {n}, succeeded {ok}, 4 agents x 8 synthetic CPUs on {} real CPUs",
        num_cpus()
    );
    println!(
        "submit (gRPC, batches of 500): {:.0} jobs/s",
        n as f64 / submitted.as_secs_f64()
    );
    let rate = n as f64 / total.as_secs_f64();
    println!(
        "submit -> finished: {:.2} s, {rate:.0} jobs/s",
        total.as_secs_f64(),
    );
    println!("baseline, raw posix_spawn+wait of `true`, one at a time: {raw:.0} /s");
    println!(
        "end to end / raw spawn+wait: {:.2} (target >= 0.50)",
        rate / raw
    );
    drop(agents);
    Ok(())
}

/// Processes per second this machine starts and reaps one at a time: `n`
/// times `true`, each spawned (`posix_spawn`) and waited for before the next.
fn raw_spawn_wait_rate(n: usize) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..n {
        let status = std::process::Command::new("true")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "`true` failed: {status}");
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
