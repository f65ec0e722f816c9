//! 100 `kill -9` of the dispatcher during a 10,000-job run on the embedded
//! store, restarted on the same data directory each time, with real
//! agents: every acknowledged job ends exactly once.
//!
//! Jobs are submitted in large batches (a few hundred to 1,500 specs per
//! `SubmitJobs`, one store commit each), and about half the kills land
//! 0-40 ms after a batch was sent, in the middle of its commit; the rest
//! at random moments while jobs run and finish. Each job appends its
//! token to a file outside the dispatcher as its last act. A batch whose
//! call returned is acknowledged: each of its jobs must end SUCCEEDED and
//! leave exactly one marker. A batch whose call died with the dispatcher
//! is not: it must be all there or not there at all (a batch is one
//! commit), and what is there must also run exactly once. The moments
//! come from a seeded generator whose seed is printed
//! (`FAULTS_SEED=...` replays a schedule); `FAULTS_JOBS` and
//! `FAULTS_KILLS` shrink the run by hand.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use e2e::faults::{Markers, Rng, exactly_once, token_of};
use e2e::{Agent, Dispatcher, all_jobs, is_terminal, wait_nodes};
use proto::v1::SubmitJobsRequest;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_dispatcher_100_times_during_10000_jobs() -> Result<()> {
    let total = env_or("FAULTS_JOBS", 10_000);
    let kills = env_or("FAULTS_KILLS", 100);
    let mut rng = Rng::from_env("faults_kill9");
    // On tmpfs when there is one: a kill -9 loses no page cache, so this
    // proves the same as a disk, without the fsync of every job's files.
    let dir = match std::path::Path::new("/dev/shm").is_dir() {
        true => tempfile::tempdir_in("/dev/shm")?,
        false => tempfile::tempdir()?,
    };
    let markers = Markers::new(dir.path())?;
    let mut d = Dispatcher::start(dir.path(), &["--submit-rate", "1000000"])?;
    let agents = (0..4)
        .map(|i| Agent::start(dir.path(), &d.url, &format!("n{i}"), "1s:4c:1t", &[], &[]))
        .collect::<Result<Vec<_>>>()?;
    wait_nodes(&d, agents.len(), Duration::from_secs(30)).await?;

    let started = Instant::now();
    // batch number -> (tokens, acknowledged)
    let mut batches: BTreeMap<usize, (Vec<String>, bool)> = BTreeMap::new();
    let (mut acked, mut submitted, mut kill, mut mid_commit) = (0, 0, 0, 0);
    // How long an uncut batch takes to be acknowledged, per job (EWMA):
    // aims the kills meant to land inside a commit.
    // A first batch, never cut, measures it.
    let first: Vec<String> = (0..500).map(|i| format!("b0-{i}")).collect();
    let specs = first.iter().map(|t| markers.spec(t, "0", 3)).collect();
    let sent = Instant::now();
    d.jobs()
        .await?
        .submit_jobs(SubmitJobsRequest { specs })
        .await?;
    let mut ms_per_job = sent.elapsed().as_secs_f64() * 1e3 / first.len() as f64;
    batches.insert(0, (first, true));
    acked += 500;
    submitted += 500;
    while kill < kills || acked < total {
        let mut call = None;
        if acked < total {
            let n = (rng.range(300, 1501) as usize).min(total - acked);
            let b = batches.len();
            let tokens: Vec<String> = (0..n).map(|i| format!("b{b}-{i}")).collect();
            let specs = tokens.iter().map(|t| markers.spec(t, "0", 3)).collect();
            submitted += n;
            let mut client = d.jobs().await?;
            call = Some((
                b,
                n,
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let ok = client
                        .submit_jobs(SubmitJobsRequest { specs })
                        .await
                        .is_ok();
                    (ok, sent.elapsed())
                }),
            ));
            batches.insert(b, (tokens, false));
        }
        if kill < kills {
            // Half the kills aim inside a batch's commit (from its arrival
            // to its reply), the rest land anywhere while jobs run.
            let wait_ms = match &call {
                Some((_, n, _)) if rng.range(0, 2) == 0 => {
                    mid_commit += 1;
                    rng.range(0, (ms_per_job * *n as f64 * 1.5) as u64 + 2)
                }
                _ => rng.range(50, 600),
            };
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            d.kill9_and_restart(dir.path())?;
            kill += 1;
        }
        if let Some((b, n, task)) = call {
            let (ok, took) = task.await.unwrap_or((false, Duration::ZERO));
            if ok {
                acked += n;
                ms_per_job = 0.7 * ms_per_job + 0.3 * (took.as_secs_f64() * 1e3 / n as f64);
                if let Some(entry) = batches.get_mut(&b) {
                    entry.1 = true;
                }
            }
        }
    }
    let killing = started.elapsed();

    // Every job the dispatcher holds ends.
    let deadline = Instant::now() + Duration::from_secs(600);
    let jobs = loop {
        let jobs = match d.jobs().await {
            Ok(mut c) => all_jobs(&mut c).await.ok(),
            Err(_) => None,
        };
        if let Some(jobs) = jobs {
            let open = jobs.iter().filter(|j| !is_terminal(j.state)).count();
            if open == 0 {
                break jobs;
            }
            ensure!(
                Instant::now() < deadline,
                "{open} jobs still open 600 s after the last kill\n{}",
                d.proc.log_text()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let acknowledged: Vec<String> = batches
        .values()
        .filter(|(_, acked)| *acked)
        .flat_map(|(t, _)| t.iter().cloned())
        .collect();
    let mut problems = exactly_once(&acknowledged, &jobs, &markers);
    // A batch the client never heard back about is all there or absent.
    let present: HashSet<&str> = jobs.iter().filter_map(token_of).collect();
    let mut unacked = 0;
    let mut unacked_present = 0;
    for (b, (tokens, acked)) in &batches {
        if *acked {
            continue;
        }
        unacked += 1;
        let there = tokens
            .iter()
            .filter(|t| present.contains(t.as_str()))
            .count();
        if there == tokens.len() {
            unacked_present += 1;
            problems.extend(exactly_once(tokens, &jobs, &markers));
        } else if there != 0 {
            problems.push(format!(
                "batch {b}: {there} of {} jobs exist: a batch was split",
                tokens.len()
            ));
        }
    }
    let attempts: u32 = jobs.iter().map(|j| j.attempt.saturating_sub(1)).sum();
    println!(
        "faults_kill9: {kills} kill -9 ({mid_commit} aimed inside a batch's commit), {submitted} jobs in {} batches \
         ({} acknowledged; {unacked} cut short, {unacked_present} of them committed), {} jobs held, \
         {attempts} retries, a batch acknowledged in ~{ms_per_job:.2} ms per job, killing phase {:.1} s, drained after {:.1} s, {} problems",
        batches.len(),
        acknowledged.len(),
        jobs.len(),
        killing.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        problems.len()
    );
    ensure!(
        problems.is_empty(),
        "{} problems, first: {:?}",
        problems.len(),
        &problems[..problems.len().min(20)]
    );
    ensure!(
        acknowledged.len() == total,
        "{} acknowledged",
        acknowledged.len()
    );
    drop(agents);
    Ok(())
}
