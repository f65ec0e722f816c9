//! GPUs end to end: an agent on the captured 8-GPU, 2-socket machine
//! (`agent/tests/fixtures/x6-2-8gpu`, synthetic devices read through
//! `--sysfs-root`, its 88 CPUs mapped onto the real ones) reports its
//! devices; `dispatchctl nodes` and `top` show them; a job submitted with
//! `dispatchctl submit --gpus 2` gets two GPUs on the NUMA node of the CPUs
//! its agent gave it, which its command sees in `CUDA_VISIBLE_DEVICES`;
//! with all 8 GPUs taken a GPU job waits (`gpus_busy`) although CPUs are
//! free, and starts when a GPU job ends; more GPUs than the node has
//! waits `no_match_gpus`. The web page's JSON API counts the GPUs per
//! node and rack.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use e2e::get_job as get;
use e2e::{Agent, Dispatcher, dispatchctl_ok, eventually, http_get, rendered_dom, wait_nodes};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{Job, JobState, PendingReasonKind};
use tonic::transport::Channel;

/// How long anything may take before the test gives up (2 busy cores).
const T: Duration = Duration::from_secs(60);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../agent/tests/fixtures/x6-2-8gpu")
}

/// The X6-2's socket (= NUMA node) of a CPU: cores 0-21 and their
/// siblings 44-65 are socket 0. The fixture's GPUs 0-3 are on node 0,
/// 4-7 on node 1 (PCI bus order, which is also their CUDA numbering with
/// CUDA_DEVICE_ORDER=PCI_BUS_ID on this all-NVIDIA machine).
fn socket(cpu: u32) -> u32 {
    (cpu % 44) / 22
}

fn gpu_node(gpu: u32) -> u32 {
    gpu / 4
}

async fn ctl(url: &str, args: &[&str]) -> Result<String> {
    dispatchctl_ok(url, args, T).await
}

async fn submit(url: &str, args: &[&str]) -> Result<String> {
    let mut all = vec!["submit", "--timeout", "2m"];
    all.extend_from_slice(args);
    Ok(ctl(url, &all).await?.trim().to_string())
}

async fn in_state(c: &JobServiceClient<Channel>, id: &str, state: JobState) -> Result<Job> {
    e2e::job_in_state(c, id, state, T).await
}

/// The GPU column of the node's row in `dispatchctl nodes`.
async fn gpus_column(url: &str) -> Result<String> {
    let out = ctl(url, &["nodes"]).await?;
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().context("header")?.split_whitespace().collect();
    let at = header.iter().position(|h| *h == "GPUS").context("GPUS")?;
    let row: Vec<&str> = lines.next().context("row")?.split_whitespace().collect();
    Ok(row[at].to_string())
}

/// The numbers of a `CUDA_VISIBLE_DEVICES=...` line the job printed.
async fn visible(url: &str, id: &str) -> Result<Vec<u32>> {
    let out = ctl(url, &["logs", id]).await?;
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .with_context(|| format!("{id} printed no CUDA_VISIBLE_DEVICES: {out:?}"))?;
    line.split(',')
        .map(|v| v.trim().parse().context("a GPU number"))
        .collect()
}

const PRINT_AND_SLEEP: &str = "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; sleep 60";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_jobs_get_gpus_near_their_cpus_and_wait_for_free_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &["--http-listen", "127.0.0.1:0"])?;
    let web = d.web_port(T)?;
    let _a = Agent::start_sysfs(dir.path(), &d.url, "gpu-node", &fixture(), &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let c = d.jobs().await?;
    assert_eq!(gpus_column(&d.url).await?, "8/8");

    // A job holding one NUMA node's 44 CPUs (no GPUs): the GPU job's CPUs
    // are then on the other node, and its GPUs must be too (GPUs 0-1, the
    // closest pair of the machine, would be wrong when that is node 1).
    let numa = submit(
        &d.url,
        &["--cpus", "44", "--align", "numa", "--", "sleep", "60"],
    )
    .await?;
    let numa_job = in_state(&c, &numa, JobState::Running).await?;
    let full = socket(numa_job.cpus[0]);
    assert!(numa_job.cpus.iter().all(|&x| socket(x) == full));

    let two = submit(
        &d.url,
        &[
            "--gpus",
            "2",
            "--cpus",
            "2",
            "--",
            "sh",
            "-c",
            PRINT_AND_SLEEP,
        ],
    )
    .await?;
    let job = in_state(&c, &two, JobState::Running).await?;
    let node = socket(job.cpus[0]);
    assert_ne!(node, full, "its CPUs are on the free node: {:?}", job.cpus);
    assert!(
        job.cpus.iter().all(|&x| socket(x) == node),
        "{:?}",
        job.cpus
    );
    assert_eq!(job.gpus.len(), 2, "{job:?}");
    assert!(
        job.gpus.iter().all(|&g| gpu_node(g) == node),
        "GPUs {:?} for CPUs {:?} on NUMA node {node}",
        job.gpus,
        job.cpus
    );
    // What the job's command saw is what the dispatcher shows.
    let seen = eventually(T, "the job's output", || async {
        visible(&d.url, &two).await.ok()
    })
    .await?;
    assert_eq!(seen, job.gpus);
    let detail = ctl(&d.url, &["get", &two]).await?;
    let line = detail
        .lines()
        .find(|l| l.starts_with("GPUs:"))
        .context("get shows GPUs")?;
    assert!(line.ends_with("(2)"), "{line}");

    // The other six, then one more GPU job: it waits for a GPU although
    // 42 CPUs are idle, and says so.
    let six = submit(&d.url, &["--gpus", "6", "--", "sleep", "60"]).await?;
    let six_job = in_state(&c, &six, JobState::Running).await?;
    let mut all: Vec<u32> = six_job.gpus.iter().chain(&job.gpus).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..8).collect::<Vec<u32>>(), "no GPU given twice");
    assert_eq!(gpus_column(&d.url).await?, "0/8");
    let top = ctl(&d.url, &["top", "--once"]).await?;
    let row = top
        .lines()
        .find(|l| l.starts_with("gpu-node"))
        .context("top's row")?;
    assert!(row.contains(" 0/8 "), "top --once: {row}");
    // The web page's rack (the default zone and rack) and its node.
    let rack = eventually(T, "the web snapshot with 0 of 8 GPUs free", || async {
        let (status, body) = http_get(web, "/api/v1/racks/default/default").ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (status == 200 && v["totals"]["free_gpus"] == 0 && v["totals"]["gpus"] == 8).then_some(v)
    })
    .await?;
    assert_eq!(rack["nodes"][0]["gpus"], 8, "{rack}");
    assert_eq!(rack["nodes"][0]["gpus_free"], 0, "{rack}");
    // The page itself (headless Chromium): the rack's cell and the node's
    // row in its drill-down.
    let url = format!("http://127.0.0.1:{web}/#rack=default/default");
    let dom = tokio::task::spawn_blocking(move || rendered_dom(&url)).await??;
    assert!(
        dom.contains(r#"data-gpus="8" data-free-gpus="0"><b>0</b>/8 GPUs free"#),
        "the rack's GPUs:\n{dom}"
    );
    assert!(
        dom.contains(r#"<td class="num gpus" data-gpus="8" data-free-gpus="0">0/8</td>"#),
        "the node's GPUs:\n{dom}"
    );
    let one = submit(
        &d.url,
        &[
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES",
        ],
    )
    .await?;
    let mut cc = c.clone();
    let waiting = eventually(T, "a GPU pending reason", || {
        let mut cc = cc.clone();
        let one = one.clone();
        async move {
            let j = get(&mut cc, &one).await.ok()?;
            j.pending_reason
                .filter(|r| r.kind() == PendingReasonKind::GpusBusy)
        }
    })
    .await?;
    assert!(
        waiting.message.contains("gpu-node 0 of 8 free"),
        "{waiting:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get(&mut cc, &one).await?.state, JobState::Pending as i32);

    // More GPUs than the node has: no node matches.
    let nine = submit(&d.url, &["--gpus", "9", "--", "true"]).await?;
    let r = eventually(T, "no_match_gpus", || {
        let mut cc = cc.clone();
        let nine = nine.clone();
        async move { get(&mut cc, &nine).await.ok()?.pending_reason }
    })
    .await?;
    assert_eq!(r.kind(), PendingReasonKind::NoMatchGpus, "{r:?}");
    assert!(
        r.message.contains("have fewer than 9 GPUs (largest 8)"),
        "{r:?}"
    );

    // The 2-GPU job ends: the waiting job starts on one of its GPUs.
    ctl(&d.url, &["cancel", &two]).await?;
    let done = in_state(&c, &one, JobState::Succeeded).await?;
    assert_eq!(done.gpus.len(), 1, "{done:?}");
    assert!(job.gpus.contains(&done.gpus[0]), "{done:?} after {job:?}");
    assert_eq!(visible(&d.url, &one).await?, done.gpus);
    for id in [&numa, &six, &nine] {
        ctl(&d.url, &["cancel", id]).await?;
    }
    Ok(())
}

/// An agent killed (SIGKILL: its shims and jobs live on) and started again
/// on the same state directory re-adopts a GPU job with the GPUs it held
/// (its ledger): a later job gets the other GPUs, never one still in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_keeps_readopted_jobs_gpus() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let mut first = Agent::start_sysfs(dir.path(), &d.url, "gpu-node", &fixture(), &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let c = d.jobs().await?;
    let two = submit(&d.url, &["--gpus", "2", "--", "sleep", "60"]).await?;
    let held = in_state(&c, &two, JobState::Running).await?.gpus;
    assert_eq!(held.len(), 2);

    first.proc.kill9();
    let _second = Agent::start_sysfs(dir.path(), &d.url, "gpu-node", &fixture(), &[], &[])?;
    let log = _second.proc.log.clone();
    eventually(T, "the job re-adopted", || async {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("re-adopted jobs").then_some(())
    })
    .await?;
    wait_nodes(&d, 1, T).await?;

    let six = submit(&d.url, &["--gpus", "6", "--", "sleep", "60"]).await?;
    let got = in_state(&c, &six, JobState::Running).await?.gpus;
    assert!(
        got.iter().all(|g| !held.contains(g)),
        "GPUs {got:?} given while the re-adopted job holds {held:?}"
    );
    assert_eq!(got.len(), 6);
    assert_eq!(
        in_state(&c, &two, JobState::Running).await?.gpus,
        held,
        "still reported"
    );
    for id in [&two, &six] {
        ctl(&d.url, &["cancel", id]).await?;
    }
    Ok(())
}

/// The fixture's `/dev/nvidiaN` minors in PCI order (GPU index -> minor):
/// `proc/driver/nvidia/gpus/*/information` of x6-2-8gpu.
const NVIDIA_MINORS: [u32; 8] = [2, 3, 0, 1, 6, 7, 4, 5];

/// A job's cgroup denies it the GPUs it does not hold. The fixture's GPUs
/// do not exist here, so the test makes their device nodes itself
/// (`mknod c 195 N`, no driver behind them): opening one the job holds
/// fails with ENXIO (no such device), one it does not hold with EPERM
/// from the job cgroup's BPF device program, before any driver is asked.
/// The agent runs its jobs under the supervisor launcher, whose cgroup
/// root it creates itself; CI has cgroup2 and BPF, elsewhere the test
/// says what is missing and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_job_cannot_open_the_gpus_it_does_not_hold() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let nodes = dir.path().join("dev");
    std::fs::create_dir(&nodes)?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    for minor in 0..8u32 {
        let path = nodes.join(format!("nvidia{minor}"));
        let made = nix::sys::stat::mknod(
            &path,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(195, u64::from(minor)),
        );
        if let Err(e) = made {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root but mknod failed: {e}"
            );
            eprintln!("not exercised: mknod {}: {e}", path.display());
            return Ok(());
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    }
    let d = Dispatcher::start(dir.path(), &[])?;
    let agent = Agent::start_sysfs(
        dir.path(),
        &d.url,
        "gpu-node",
        &fixture(),
        &[],
        &["--launcher", "supervisor"],
    )?;
    wait_nodes(&d, 1, T).await?;
    let c = d.jobs().await?;
    let script = format!(
        "for n in 0 1 2 3 4 5 6 7; do err=$( (exec 3<{}/nvidia$n) 2>&1 ); \
         case \"$err\" in *'not permitted'*) echo \"nvidia$n denied\";; \
         *) echo \"nvidia$n open-attempted: $err\";; esac; done",
        nodes.display()
    );
    let id = submit(&d.url, &["--gpus", "1", "--", "sh", "-c", &script]).await?;
    let job = in_state(&c, &id, JobState::Succeeded).await?;
    let log = std::fs::read_to_string(&agent.proc.log).unwrap_or_default();
    if log.contains("GPUs not held by the job are not denied") || log.contains("no cgroup for jobs")
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI provides cgroup2 and BPF, but the agent could not confine GPUs: see {}",
            agent.proc.log.display()
        );
        eprintln!("not exercised: the agent could not confine GPUs here");
        return Ok(());
    }
    assert_eq!(job.gpus.len(), 1, "{job:?}");
    let held = NVIDIA_MINORS[job.gpus[0] as usize];
    let out = ctl(&d.url, &["logs", &id]).await?;
    for minor in 0..8u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("nvidia{minor} ")))
            .with_context(|| format!("no line for nvidia{minor}: {out:?}"))?;
        if minor == held {
            assert!(
                line.contains("open-attempted") && !line.contains("not permitted"),
                "the job holds /dev/nvidia{minor}: {line}"
            );
        } else {
            assert_eq!(
                line,
                format!("nvidia{minor} denied"),
                "the job holds only /dev/nvidia{held}"
            );
        }
    }
    Ok(())
}
