//! The README's promise: a dispatcher and agents on loopback run real jobs
//! submitted with dispatchctl, pinned to the CPUs the agents chose.

use std::time::Duration;

use e2e::{Agent, Dispatcher, all_jobs, dispatchctl, eventually, is_terminal, wait_nodes};
use proto::v1::{JobSpec, JobState, ListNodesRequest, SubmitJobsRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_on_agents_and_report_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &["--heartbeat-ms", "300"])?;
    let _a = Agent::start(
        dir.path(),
        &d.url,
        "n1",
        "1s:2c:2t",
        &["dispatch.io/rack=r1"],
        &[],
    )?;
    let _b = Agent::start(
        dir.path(),
        &d.url,
        "n2",
        "1s:2c:2t",
        &["dispatch.io/rack=r1"],
        &[],
    )?;
    wait_nodes(&d, 2, Duration::from_secs(20)).await?;

    // ListNodes in pages of one: each node once, in name order, and the
    // last page says there is no next one.
    let mut nodes = d.nodes().await?;
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = nodes
            .list_nodes(ListNodesRequest {
                page_size: 1,
                page_token: token,
            })
            .await?
            .into_inner();
        pages.push(
            page.nodes
                .iter()
                .map(|n| n.name.clone())
                .collect::<Vec<_>>(),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(pages, [vec!["n1"], vec!["n2"]]);
    let (code, out, err) = dispatchctl(&d.url, &["nodes"])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("n1") && out.contains("n2"), "{out}");

    // dispatchctl submit --wait returns the job's exit code.
    let (code, out, err) = dispatchctl(&d.url, &["submit", "--wait", "--", "sh", "-c", "exit 7"])?;
    assert_eq!(code, 7, "stdout {out} stderr {err}");

    let mut jobs = d.jobs().await?;
    let specs: Vec<JobSpec> = (0..20)
        .map(|i| JobSpec {
            command: vec![
                "sh".into(),
                "-c".into(),
                format!("grep Cpus_allowed_list /proc/self/status; echo job {i}"),
            ],
            cpus: 1 + (i % 2),
            ..Default::default()
        })
        .collect();
    jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
    let done = eventually(Duration::from_secs(60), "all jobs terminal", || {
        let mut c = jobs.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            all.iter().all(|j| is_terminal(j.state)).then_some(all)
        }
    })
    .await?;
    assert_eq!(done.len(), 21);
    for j in &done {
        if j.spec
            .as_ref()
            .is_some_and(|s| s.command.len() == 3 && s.command[2].contains("echo job"))
        {
            assert_eq!(j.state, JobState::Succeeded as i32, "{j:?}");
            assert_eq!(
                j.cpus.len() as u32,
                j.spec.as_ref().map_or(1, |s| s.cpus),
                "{j:?}"
            );
            assert!(j.node == "n1" || j.node == "n2");
        }
    }
    // Logs come back through the dispatcher.
    let (code, out, _) = dispatchctl(&d.url, &["logs", &done[0].id])?;
    assert_eq!(code, 0);
    assert!(out.contains("Cpus_allowed_list"), "{out}");
    Ok(())
}

/// Run one of this crate's benchmark binaries in its check mode (the same
/// code path at a small size, verifying its own results); fails on a
/// non-zero exit or a missing `check:` line, with its output.
fn run_check_mode(exe: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    anyhow::ensure!(
        out.status.success() && stdout.contains("\ncheck: "),
        "{exe} {args:?}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    Ok(stdout.into_owned())
}

#[test]
fn e2e_throughput_check_mode() -> anyhow::Result<()> {
    let out = run_check_mode(env!("CARGO_BIN_EXE_e2e-throughput"), &["--check"])?;
    assert!(out.contains("jobs 40, succeeded 40"), "{out}");
    Ok(())
}

#[test]
fn hackbench_jobs_check_mode() -> anyhow::Result<()> {
    // .ci/run installs rt-tests; without hackbench the binary fails, and so
    // does this test.
    let out = run_check_mode(env!("CARGO_BIN_EXE_hackbench-jobs"), &["--check"])?;
    for w in ["mixed 2x", "mixed 4x", "uniform 8x"] {
        assert!(out.contains(w), "{w} missing from\n{out}");
    }
    Ok(())
}

/// The dispatcher's anonymous memory in transparent huge pages, KiB
/// (`AnonHugePages` of `/proc/PID/smaps_rollup`).
fn anon_huge_kib(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path)?;
    text.lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no AnonHugePages line in {path}"))
}

/// `DISPATCH_HUGE_PAGES=1` backs the dispatcher's heap with transparent
/// huge pages (`dispatcher::allocator::options`) where the kernel offers
/// them: once it listens, part of its memory is in huge pages. Where the
/// kernel's mode is `madvise` (this machine's), a dispatcher without the
/// variable has none, so the pages are the variable's doing. With THP
/// off (`never`) there is nothing to see and the test says so. A value
/// it does not know stops the dispatcher with an error naming it.
#[test]
fn huge_pages_back_the_heap_when_asked() -> anyhow::Result<()> {
    let bad = tempfile::tempdir()?;
    let refused = Dispatcher::start_env(bad.path(), &[], &[("DISPATCH_HUGE_PAGES", "maybe")]);
    match refused {
        Ok(_) => anyhow::bail!("DISPATCH_HUGE_PAGES=maybe was accepted"),
        Err(e) => {
            let text = format!("{e:#}");
            assert!(
                text.contains("DISPATCH_HUGE_PAGES=\"maybe\": want 1, true, yes or on"),
                "{text}"
            );
        }
    }
    let mode =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if mode.is_empty() || mode.contains("[never]") {
        eprintln!("transparent huge pages are off here ({mode:?}): nothing to check");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    for sub in ["with", "without"] {
        std::fs::create_dir_all(dir.path().join(sub))?;
    }
    let with = Dispatcher::start_env(
        &dir.path().join("with"),
        &[],
        &[("DISPATCH_HUGE_PAGES", "1")],
    )?;
    let huge = anon_huge_kib(with.proc.pid())?;
    assert!(
        huge >= 2048,
        "DISPATCH_HUGE_PAGES=1 and THP {mode:?}, but {huge} KiB in huge pages"
    );
    if mode.contains("[madvise]") {
        let without = Dispatcher::start(&dir.path().join("without"), &[])?;
        let none = anon_huge_kib(without.proc.pid())?;
        assert_eq!(
            none, 0,
            "huge pages without DISPATCH_HUGE_PAGES (THP {mode:?})"
        );
    }
    Ok(())
}
