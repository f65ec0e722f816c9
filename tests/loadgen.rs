//! The load generator at toy scale, so it cannot rot: the real `loadgen`
//! binary starts a (debug) dispatcher on a random loopback port, attaches
//! 20 fake agents, submits 50 jobs and reads, and must see every job reach
//! SUCCEEDED through the fake agents, with samples in every histogram and
//! memory figures read from /proc.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Run `loadgen ARGS --format json --check`; its report.
fn loadgen(args: &[&str]) -> Result<Value> {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(args)
        .args(["--format", "json", "--check"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting loadgen")?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() > deadline {
            // SIGTERM first: loadgen then drops the dispatcher it started
            // (killed on drop); SIGKILL would leave it behind.
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let grace = Instant::now() + Duration::from_secs(10);
            while Instant::now() < grace && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            bail!("loadgen did not finish within 240 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    if !status.success() {
        bail!("loadgen failed ({status}):\n{stdout}\n{stderr}");
    }
    serde_json::from_str(&stdout).with_context(|| format!("loadgen's JSON:\n{stdout}"))
}

fn latency<'a>(pass: &'a Value, kind: &str) -> &'a Value {
    pass["latencies"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["kind"] == kind))
        .unwrap_or_else(|| panic!("no {kind} row in {pass:#}"))
}

fn assert_pass(pass: &Value, jobs: u64, nodes: u64) {
    let j = &pass["jobs"];
    assert_eq!(pass["nodes"], nodes, "{pass:#}");
    assert_eq!(j["submitted"], jobs, "{pass:#}");
    assert_eq!(j["dispatcher_states"]["SUCCEEDED"], jobs, "{pass:#}");
    assert_eq!(
        j["dispatcher_states"].as_object().map(|m| m.len()),
        Some(1),
        "only SUCCEEDED: {pass:#}"
    );
    assert!(j["assigns"].as_u64() >= Some(jobs), "{pass:#}");
    assert_eq!(j["finished_at_agents"], jobs, "{pass:#}");
    for kind in [
        "Attach->Registered",
        "submit->Assign",
        "GetJob",
        "ListNodes",
    ] {
        let row = latency(pass, kind);
        assert!(row["count"].as_u64() > Some(0), "{kind}: {row}");
        assert_eq!(row["errors"], 0, "{kind}: {row}");
        assert!(row["p99_ms"].as_f64() >= row["p50_ms"].as_f64(), "{row}");
        assert!(row["max_ms"].as_f64() > Some(0.0), "{row}");
    }
    assert_eq!(latency(pass, "Attach->Registered")["count"], nodes);
    assert_eq!(latency(pass, "submit->Assign")["count"], jobs);
    let m = &pass["memory"];
    assert!(m["rss_start"].as_u64() > Some(0), "{m}");
    assert!(m["rss_nodes"].as_u64() > Some(0), "{m}");
    assert_eq!(m["pending_jobs"], 200, "{m}");
    assert!(pass["cpu_load_pct"].as_f64().is_some(), "{pass:#}");
}

#[test]
fn twenty_agents_run_fifty_jobs_with_and_without_heartbeats() -> Result<()> {
    let report = loadgen(&[
        "--agents",
        "20",
        "--shapes",
        "1s:4c:2t,1s:2c:2t",
        "--nodes-per-rack",
        "5",
        "--zones",
        "2",
        "--rate",
        "25",
        "--duration-s",
        "2",
        "--job-ms",
        "300",
        "--job-cpus",
        "1,2",
        "--get-rate",
        "10",
        "--list-nodes-rate",
        "2",
        "--steady-s",
        "1",
        "--pending",
        "200",
        "--timeout-s",
        "60",
        "--baseline",
    ])?;
    let passes = report["passes"].as_array().context("passes")?;
    assert_eq!(passes.len(), 2);
    assert_eq!(passes[0]["heartbeats"], true);
    assert_eq!(passes[1]["heartbeats"], false);
    for p in passes {
        assert_pass(p, 50, 20);
        assert_eq!(latency(p, "SubmitJob")["count"], 50);
    }
    // Heartbeats flowed in the first pass only (about 20 per second).
    assert!(
        passes[0]["reports_per_s"].as_f64() > Some(5.0),
        "{report:#}"
    );
    assert_eq!(passes[1]["reports_per_s"].as_f64(), Some(0.0));
    Ok(())
}

#[test]
fn agents_sharing_connections_and_batched_submissions_also_finish_every_job() -> Result<()> {
    let report = loadgen(&[
        "--agents",
        "20",
        "--agents-per-connection",
        "10",
        "--oversubscribe",
        "2",
        "--shapes",
        "1s:2c:1t",
        "--job-cpus",
        "1,2",
        "--rate",
        "25",
        "--batch",
        "5",
        "--duration-s",
        "2",
        "--job-ms",
        "300",
        "--get-rate",
        "10",
        "--list-nodes-rate",
        "2",
        "--steady-s",
        "1",
        "--pending",
        "200",
        "--timeout-s",
        "60",
    ])?;
    let passes = report["passes"].as_array().context("passes")?;
    assert_eq!(passes.len(), 1);
    assert_eq!(passes[0]["agent_connections"], 2);
    assert_pass(&passes[0], 50, 20);
    assert_eq!(latency(&passes[0], "SubmitJobs")["count"], 10);
    Ok(())
}

#[test]
fn agents_attached_through_relays_finish_every_job() -> Result<()> {
    let report = loadgen(&[
        "--agents",
        "20",
        "--nodes-per-stream",
        "8",
        "--shapes",
        "1s:2c:1t",
        "--job-cpus",
        "1,2",
        "--rate",
        "25",
        "--duration-s",
        "2",
        "--job-ms",
        "300",
        "--get-rate",
        "10",
        "--list-nodes-rate",
        "2",
        "--steady-s",
        "1",
        "--pending",
        "200",
        "--timeout-s",
        "60",
    ])?;
    let passes = report["passes"].as_array().context("passes")?;
    assert_eq!(passes.len(), 1);
    // Three AttachMany streams (8 + 8 + 4 nodes), one connection each.
    assert_eq!(passes[0]["agent_connections"], 3);
    assert_pass(&passes[0], 50, 20);
    Ok(())
}
