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
//!
//! It also prints where the machine's CPU time went per job in that
//! phase, read from `/proc`: the dispatcher, the agents, their supervisors
//! (or shims), the jobs themselves, and this client. The jobs' share is
//! what the raw baseline pays too; the rest is the system's overhead.
//! The dispatcher's share is split by thread (core, store, gRPC runtime).
//!
//! A second phase then submits open loop at half the end-to-end rate just
//! measured (a batch every 10 ms, for `JOBS / 2` jobs) and prints the
//! submit -> start latency of those jobs (the dispatcher's submit time to
//! the start time the agent reported, both in ms on this machine's clock):
//! its median and p99, against the target p99 <= 10 ms.
//!
//! `--launcher supervisor` (this binary's default, and the agent's) starts
//! the agents with a cgroup v2 root each (under this process's cgroup,
//! removed at the end; the run fails if none can be made rather than
//! measure shims under that name): every job is then one process, a child
//! of its agent's supervisor. `--launcher shim` measures a shim and the
//! job per job.
//!
//! `--check` runs the same path with 40 jobs and verifies the result (every
//! job submitted once, succeeded, on one of the agents, with CPUs of its
//! node); `tests/smoke.rs` runs it.

use std::time::{Duration, Instant};

use anyhow::Result;
use e2e::{Agent, Dispatcher, all_jobs, eventually_every, is_terminal, procstat, wait_nodes};
use proto::v1::{JobSpec, JobState, SubmitJobsRequest};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let check = std::env::args().any(|a| a == "--check");
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|s| s.parse().ok())
        .unwrap_or(if check { 40 } else { 2000 });
    let args: Vec<String> = std::env::args().collect();
    let launcher = args
        .windows(2)
        .find(|w| w[0] == "--launcher")
        .map_or("supervisor", |w| w[1].as_str())
        .to_owned();
    anyhow::ensure!(
        ["shim", "supervisor"].contains(&launcher.as_str()),
        "--launcher shim|supervisor, not {launcher:?}"
    );
    let raw = raw_spawn_wait_rate(n.min(2000))?;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let mut agents = Vec::new();
    let mut cgroup_roots = Vec::new();
    for i in 0..4 {
        let rack = format!("dispatch.io/rack=r{}", i / 2);
        let mut extra = vec!["--launcher".to_owned(), launcher.clone()];
        if launcher == "supervisor" {
            let root = cgroup_root(&format!("n{i}"))?;
            extra.extend(["--cgroup-root".to_owned(), root.display().to_string()]);
            cgroup_roots.push(root);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        agents.push(Agent::start(
            dir.path(),
            &d.url,
            &format!("n{i}"),
            "1s:4c:2t",
            &[rack.as_str()],
            &extra,
        )?);
    }
    wait_nodes(&d, 4, Duration::from_secs(30)).await?;
    let mut jobs = d.jobs().await?;
    let agent_pids: Vec<u32> = agents.iter().map(|a| a.proc.pid()).collect();
    let cpu_before = RoleCpu::read(d.proc.pid(), &agent_pids)?;
    let threads_before = procstat::threads_cpu(d.proc.pid())?;
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
    wait_none_unfinished(&mut jobs).await?;
    let total = start.elapsed();
    let cpu = RoleCpu::read(d.proc.pid(), &agent_pids)?.minus(&cpu_before);
    let threads = procstat::threads_cpu(d.proc.pid())?;
    let all = all_jobs(&mut jobs).await?;
    anyhow::ensure!(
        all.iter().all(|j| is_terminal(j.state)),
        "a job listed unfinished after none was"
    );
    let ok = all
        .iter()
        .filter(|j| j.state == JobState::Succeeded as i32)
        .count();
    println!(
        "jobs {n}, succeeded {ok}, 4 agents x 8 synthetic CPUs on {} real CPUs, launcher {launcher}",
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
    println!(
        "CPU per job, us: dispatcher {:.0}, agents {:.0}, their supervisors or shims {:.0}, \
         the jobs they reaped {:.0}, the agents' reaped children {:.0}, this client {:.0}; \
         all {:.0} = {:.0}% of {} CPUs over the phase",
        cpu.dispatcher / n as f64 * 1e6,
        cpu.agents / n as f64 * 1e6,
        cpu.supervisors / n as f64 * 1e6,
        cpu.jobs / n as f64 * 1e6,
        cpu.agents_reaped / n as f64 * 1e6,
        cpu.client / n as f64 * 1e6,
        cpu.sum() / n as f64 * 1e6,
        100.0 * cpu.sum() / (num_cpus() as f64 * total.as_secs_f64()),
        num_cpus()
    );
    // Which of the dispatcher's threads pays: the core's (the job table,
    // placement), the store's (the commits and their fsyncs) or the
    // runtime's (gRPC).
    let per_thread: Vec<String> = threads
        .iter()
        .map(|(name, &after)| {
            let spent = after - threads_before.get(name).copied().unwrap_or(0.0);
            (name, spent)
        })
        .filter(|&(_, spent)| spent > 0.0)
        .map(|(name, spent)| format!("{name} {:.0}", spent / n as f64 * 1e6))
        .collect();
    println!(
        "the dispatcher's CPU per job by thread, us: {}",
        per_thread.join(", ")
    );
    println!("baseline, raw posix_spawn+wait of `true`, one at a time: {raw:.0} /s");
    println!(
        "end to end / raw spawn+wait: {:.2} (target >= 0.50)",
        rate / raw
    );
    let paced = n / 2;
    // E2E_PACED_RATE=R paces at R jobs/s instead (to see the latency
    // floor at a low rate; the target is at half the measured rate).
    let pace = std::env::var("E2E_PACED_RATE")
        .ok()
        .and_then(|r| r.parse::<f64>().ok())
        .filter(|r| *r > 0.0)
        .unwrap_or(rate / 2.0);
    let latencies = paced_submit_to_start(&mut jobs, paced, pace).await?;
    println!(
        "paced at {pace:.0} jobs/s (half the rate above unless E2E_PACED_RATE), {paced} jobs: submit -> start p50 {} ms, p99 {} ms (target p99 <= 10 ms)",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
    );
    drop(agents);
    if std::env::var_os("E2E_KEEP_DIR").is_some() {
        // The processes' logs, e.g. with E2E_RUST_LOG=info,lat=debug.
        println!("logs kept in {}", dir.keep().display());
    }
    for root in &cgroup_roots {
        // The agents removed their jobs' cgroups; the root this run made
        // goes now, with whatever a late exit or a killed agent left.
        if let Err(e) = agent::exec::cgroup::remove_tree(root, std::time::Duration::from_secs(5)) {
            eprintln!("the cgroups {} stay: {e}", root.display());
        }
    }
    if check {
        verify(&all, n)?;
        anyhow::ensure!(
            latencies.len() == paced,
            "{} start times for {paced} paced jobs",
            latencies.len()
        );
        println!("check: {n} jobs, each submitted once, succeeded on an agent's CPUs");
    }
    Ok(())
}

/// Check mode: the run did what it measured.
fn verify(all: &[proto::v1::Job], n: usize) -> Result<()> {
    let ids: std::collections::BTreeSet<&str> = all.iter().map(|j| j.id.as_str()).collect();
    anyhow::ensure!(
        all.len() == n && ids.len() == n,
        "{} jobs ({} distinct) for {n} submitted",
        all.len(),
        ids.len()
    );
    for j in all {
        anyhow::ensure!(
            j.state == JobState::Succeeded as i32,
            "job {} ended {:?}: {}",
            j.id,
            JobState::try_from(j.state),
            j.reason
        );
        anyhow::ensure!(
            ["n0", "n1", "n2", "n3"].contains(&j.node.as_str()),
            "job {} ran on {:?}",
            j.id,
            j.node
        );
        // 1s:4c:2t: CPUs 0-7, one of them per trivial job.
        anyhow::ensure!(
            j.cpus.len() == 1 && j.cpus[0] < 8,
            "job {} had CPUs {:?}",
            j.id,
            j.cpus
        );
    }
    Ok(())
}

/// Submit `n` trivial jobs open loop at `rate` per second (a batch every
/// 10 ms, sized to keep the schedule), wait for them to end, and return
/// each succeeded job's submit -> start latency in ms, sorted.
async fn paced_submit_to_start(
    jobs: &mut proto::v1::job_service_client::JobServiceClient<tonic::transport::Channel>,
    n: usize,
    rate: f64,
) -> Result<Vec<i64>> {
    let tick = Duration::from_millis(10);
    let start = Instant::now();
    let mut ids = std::collections::HashSet::new();
    let mut sent = 0usize;
    let mut interval = tokio::time::interval(tick);
    while sent < n {
        interval.tick().await;
        let due = ((start.elapsed().as_secs_f64() * rate) as usize + 1).min(n);
        if due <= sent {
            continue;
        }
        let specs = (sent..due)
            .map(|_| JobSpec {
                command: vec!["true".into()],
                ..Default::default()
            })
            .collect();
        let reply = jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
        ids.extend(reply.into_inner().jobs.into_iter().map(|j| j.id));
        sent = due;
    }
    wait_none_unfinished(jobs).await?;
    let done: Vec<_> = all_jobs(jobs)
        .await?
        .into_iter()
        .filter(|j| ids.contains(&j.id))
        .collect();
    anyhow::ensure!(
        done.len() == ids.len() && done.iter().all(|j| is_terminal(j.state)),
        "{} of {} paced jobs listed, or one unfinished",
        done.len(),
        ids.len()
    );
    let mut lat: Vec<i64> = done
        .iter()
        .filter(|j| j.state == JobState::Succeeded as i32 && j.start_time_ms > 0)
        .map(|j| (j.start_time_ms - j.submit_time_ms).max(0))
        .collect();
    lat.sort_unstable();
    Ok(lat)
}

/// Wait until the dispatcher lists no unfinished job: one ListJobs of at
/// most one PENDING, ASSIGNED or RUNNING job every 10 ms, as a user's
/// script would poll (`dispatchctl ls --state ...`). Listing every job at
/// each poll instead made the benchmark's own reads a tenth of the CPU it
/// measured: the whole table encoded, sent and decoded 20 times a second.
async fn wait_none_unfinished(
    jobs: &mut proto::v1::job_service_client::JobServiceClient<tonic::transport::Channel>,
) -> Result<()> {
    let unfinished = vec![
        JobState::Pending as i32,
        JobState::Assigned as i32,
        JobState::Running as i32,
    ];
    eventually_every(
        Duration::from_secs(600),
        Duration::from_millis(10),
        "every job finished",
        || {
            let mut c = jobs.clone();
            let states = unfinished.clone();
            async move {
                let page = c
                    .list_jobs(proto::v1::ListJobsRequest {
                        states,
                        page_size: 1,
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                page.jobs.is_empty().then_some(())
            }
        },
    )
    .await
}

/// CPU seconds of the run's processes by role, from `/proc`: where the
/// machine's time per job goes (the jobs' own share is what the raw
/// baseline pays too).
#[derive(Clone, Copy, Debug, Default)]
struct RoleCpu {
    dispatcher: f64,
    /// The agents' own threads.
    agents: f64,
    /// The agents' live children, their own time: the supervisors (or,
    /// with `--launcher shim`, the shims running then).
    supervisors: f64,
    /// What those children reaped: the jobs under a supervisor.
    jobs: f64,
    /// What the agents reaped: exited shims with their jobs.
    agents_reaped: f64,
    /// This process (submitting and polling).
    client: f64,
}

impl RoleCpu {
    fn read(dispatcher: u32, agents: &[u32]) -> Result<Self> {
        let mut r = Self {
            dispatcher: procstat::proc_cpu(dispatcher)?.own,
            client: procstat::proc_cpu(std::process::id())?.own,
            ..Self::default()
        };
        for &a in agents {
            let cpu = procstat::proc_cpu(a)?;
            r.agents += cpu.own;
            r.agents_reaped += cpu.reaped;
            for child in procstat::children(a) {
                // A shim may exit between the listing and the read.
                if let Ok(cpu) = procstat::proc_cpu(child) {
                    r.supervisors += cpu.own;
                    r.jobs += cpu.reaped;
                }
            }
        }
        Ok(r)
    }

    fn minus(&self, before: &Self) -> Self {
        Self {
            dispatcher: self.dispatcher - before.dispatcher,
            agents: self.agents - before.agents,
            supervisors: self.supervisors - before.supervisors,
            jobs: self.jobs - before.jobs,
            agents_reaped: self.agents_reaped - before.agents_reaped,
            client: self.client - before.client,
        }
    }

    fn sum(&self) -> f64 {
        self.dispatcher
            + self.agents
            + self.supervisors
            + self.jobs
            + self.agents_reaped
            + self.client
    }
}

/// The `q` quantile of sorted values (nearest rank); 0 when empty.
fn percentile(sorted: &[i64], q: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
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

/// A cgroup v2 directory for one agent's jobs, under this process's own
/// cgroup, usable (created, `cgroup.procs` writable) or an error saying why.
fn cgroup_root(node: &str) -> Result<std::path::PathBuf> {
    use agent::exec::cgroup;
    let (Some(mount), Some(own)) = (cgroup::cgroup2_mount(), cgroup::own_cgroup()) else {
        anyhow::bail!("--launcher supervisor needs a cgroup2 hierarchy (none mounted)");
    };
    let root = mount
        .join(own.strip_prefix("/").unwrap_or(&own))
        .join(format!("dispatch-e2e-{}-{node}", std::process::id()));
    cgroup::CgroupSupport::probe(&root)
        .map_err(|reason| anyhow::anyhow!("--launcher supervisor: {reason}"))?;
    Ok(root)
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
