//! A node stalled with its stream open must not run a job twice.
//!
//! Agent `a` runs a job (sleep, then leave a marker) and is frozen with
//! SIGSTOP: its TCP connection stays open, so the dispatcher sees only
//! silence. The agent's lease (granted in `Registered` and renewed by
//! every answered LoadReport) runs out first and its job's shim stops
//! the job; only after the node's heartbeat deadline, one interval later,
//! does the dispatcher retry the job on agent `b`. The test checks the
//! order (the stale copy is stopped before the retry exists), that the
//! marker is written once while `a` stays frozen, and, after SIGCONT,
//! that `a` cancels its stale copy without ever finishing it.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use e2e::faults::{Markers, attempt_dir, exactly_once, job_proc_state};
use e2e::{Agent, Dispatcher, wait_nodes};
use nix::sys::signal::Signal;
use proto::v1::{GetJobRequest, JobState, SubmitJobRequest};

const HEARTBEAT_MS: u64 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_agent_fences_its_job_before_the_retry() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let markers = Markers::new(dir.path())?;
    let hb = HEARTBEAT_MS.to_string();
    // Deadline 3 x 500 ms; the lease is one interval shorter (1 s).
    let d = Dispatcher::start(dir.path(), &["--heartbeat-ms", &hb])?;
    let a = Agent::start(dir.path(), &d.url, "a", "1s:2c:1t", &[], &[])?;
    wait_nodes(&d, 1, Duration::from_secs(20)).await?;
    let mut jobs = d.jobs().await?;
    let job = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(markers.spec("stalled", "6", 2)),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    let id = job.id.clone();
    let get = |jobs: &mut proto::v1::job_service_client::JobServiceClient<_>| {
        let id = id.clone();
        let mut jobs = jobs.clone();
        async move { anyhow::Ok(jobs.get_job(GetJobRequest { id }).await?.into_inner()) }
    };
    let first = attempt_dir(&dir.path().join("agent-a"), &id, 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while job_proc_state(&first).is_none()
        || get(&mut jobs).await?.state != JobState::Running as i32
    {
        ensure!(Instant::now() < deadline, "the job did not start on a");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = Agent::start(dir.path(), &d.url, "b", "1s:2c:1t", &[], &[])?;
    wait_nodes(&d, 2, Duration::from_secs(20)).await?;

    a.proc.signal(Signal::SIGSTOP);
    let frozen = Instant::now();
    // Until the retry appears, watch the stale copy: it must be stopped
    // (state T) before the dispatcher hands the job to b.
    let mut fenced_after = None;
    let retried_after = loop {
        if fenced_after.is_none() && job_proc_state(&first) == Some('T') {
            fenced_after = Some(frozen.elapsed());
        }
        let j = get(&mut jobs).await?;
        if j.attempt >= 2 {
            break frozen.elapsed();
        }
        if frozen.elapsed() > Duration::from_secs(20) {
            bail!("the job was not retried while a was frozen: {j:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "a frozen: its job stopped after {fenced_after:?}, the dispatcher retried it after {retried_after:?}"
    );
    let Some(fenced_after) = fenced_after else {
        bail!(
            "the dispatcher retried the job after {retried_after:?} while its first copy still ran on the frozen node (state {:?})",
            job_proc_state(&first)
        );
    };
    ensure!(
        fenced_after < retried_after,
        "fenced {fenced_after:?}, retried {retried_after:?}"
    );

    // The retry runs to its end on b while a stays frozen.
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = loop {
        let j = get(&mut jobs).await?;
        if e2e::is_terminal(j.state) {
            break j;
        }
        ensure!(Instant::now() < deadline, "the retry did not end: {j:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(
        done.state == JobState::Succeeded as i32 && done.node == "b",
        "the retry: {done:?}"
    );
    // The first copy would have ended by now had it kept running.
    ensure!(
        frozen.elapsed() > Duration::from_secs(6),
        "the retry ended too early to tell"
    );
    let problems = exactly_once(
        &["stalled".to_string()],
        std::slice::from_ref(&done),
        &markers,
    );
    ensure!(
        problems.is_empty(),
        "while a was frozen: {problems:?}\n{}",
        a.proc.log_text()
    );
    ensure!(
        job_proc_state(&first) == Some('T'),
        "the stale copy is not stopped while a is frozen: {:?}",
        job_proc_state(&first)
    );

    // Thaw a: it reads the Cancel queued for the stale attempt and ends
    // it; the copy must never reach its end.
    a.proc.signal(Signal::SIGCONT);
    // The shim appends the exit to the job's record.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut status = e2e::faults::record_line(&first, "exit");
    while status.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = e2e::faults::record_line(&first, "exit");
    }
    let status = status.unwrap_or_default();
    ensure!(
        status.contains("\"outcome\":\"cancelled\""),
        "the stale copy ended otherwise: {status:?}"
    );
    let problems = exactly_once(&["stalled".to_string()], &[done], &markers);
    ensure!(
        problems.is_empty(),
        "after a resumed: {problems:?}\n{}",
        a.proc.log_text()
    );
    wait_nodes(&d, 2, Duration::from_secs(20)).await?;
    drop(b);
    Ok(())
}
