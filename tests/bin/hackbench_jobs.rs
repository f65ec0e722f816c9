//! hackbench (Debian's rt-tests) as real jobs: the agent's idle stealing
//! on vs off, in the spirit of seed 000's table.
//!
//! One dispatcher and one agent (`--oversubscribe 4`, by default on the
//! synthetic `1s:1c:2t`: 2 CPUs that map 1:1 onto a 2-CPU machine). Each
//! run submits K hackbench jobs of 1 CPU each at once and measures the
//! makespan (first submit -> last exit, from the dispatcher's job times),
//! the machine's CPU utilisation over that window (/proc/stat) and the
//! agent's schedstats. Runs alternate steal on / off (`--no-steal`), a
//! fresh dispatcher and agent each time.
//!
//! Workloads:
//! * `mixed`: long and short jobs submitted alternately. The agent places
//!   new jobs on the least loaded CPU, so the long ones queue on one CPU
//!   and the short ones on the other: the imbalance stealing fixes. Without
//!   it the short CPU goes idle while the long CPU still has jobs waiting.
//! * `uniform`: equal jobs, evenly placed: nothing to fix, the control
//!   (stealing must not cost anything here).
//!
//! Usage (release build; `/usr/bin/hackbench` from `apt-get install
//! rt-tests`):
//! `cargo run --release -p e2e --bin hackbench-jobs -- [--reps N]
//! [--oversubscribe N] [--topology SPEC] [--threads] [--quick] [--only
//! WORKLOAD-PREFIX] [--check]`
//!
//! `--check` runs the same path at a tiny size (one rep of each workload,
//! a few hackbench loops per job) and verifies each run instead of timing
//! it (see [`verify`]); `tests/smoke.rs` runs it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use e2e::{Agent, Dispatcher, all_jobs, wait_nodes};
use proto::v1::{GetNodeRequest, Job, JobSpec, JobState, SubmitJobsRequest};

const HACKBENCH: &str = "/usr/bin/hackbench";

struct Opts {
    reps: usize,
    oversubscribe: u32,
    topology: String,
    threads: bool,
    quick: bool,
    only: Option<String>,
    check: bool,
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        reps: 5,
        oversubscribe: 4,
        topology: "1s:1c:2t".into(),
        threads: false,
        quick: false,
        only: None,
        check: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} wants a value"));
        match a.as_str() {
            "--reps" => o.reps = value("--reps")?.parse()?,
            "--oversubscribe" => o.oversubscribe = value("--oversubscribe")?.parse()?,
            "--topology" => o.topology = value("--topology")?,
            "--threads" => o.threads = true,
            "--quick" => o.quick = true,
            "--only" => o.only = Some(value("--only")?),
            "--check" => o.check = true,
            "-h" | "--help" => {
                println!(
                    "hackbench-jobs [--reps N] [--oversubscribe N] [--topology SPEC] [--threads] [--quick] [--only WORKLOAD-PREFIX] [--check]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    o.reps = o.reps.max(1);
    if o.check {
        o.reps = 1;
    }
    Ok(o)
}

/// A workload: hackbench loop counts of its jobs, in submission order.
struct Workload {
    name: String,
    loops: Vec<u32>,
}

fn workloads(quick: bool, check: bool) -> Vec<Workload> {
    let (long, short, even) = if check {
        (20, 2, 8)
    } else if quick {
        (400, 40, 160)
    } else {
        (2000, 200, 800)
    };
    let mixed = |pairs: usize| Workload {
        name: format!("mixed {pairs}x{long}+{pairs}x{short}"),
        loops: (0..2 * pairs)
            .map(|i| if i % 2 == 0 { long } else { short })
            .collect(),
    };
    vec![
        mixed(2),
        mixed(4),
        Workload {
            name: format!("uniform 8x{even}"),
            loops: vec![even; 8],
        },
    ]
}

/// /proc/stat CPU times (all CPUs): (busy, total) in ticks.
fn cpu_times() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest is in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU time of a process itself (`utime + stime`), seconds.
fn own_cpu(pid: u32) -> f64 {
    stat_seconds(pid, 14)
}

/// CPU time of a process's waited-for children (`cutime + cstime` of
/// /proc/PID/stat), seconds. The agent reaps the shims, which reap the
/// jobs, so after the exits this is the CPU the jobs (and shims) used.
fn children_cpu(pid: u32) -> f64 {
    stat_seconds(pid, 16)
}

/// Fields `n` and `n + 1` of /proc/PID/stat (numbered from 1 as in
/// proc(5)), clock ticks summed, in seconds: 14 is utime + stime, 16 is
/// cutime + cstime.
fn stat_seconds(pid: u32, n: usize) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name: field 3 (state) onwards.
    let rest = text.rfind(')').map_or("", |at| &text[at + 1..]);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |k: usize| f.get(k).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    // f[0] is field 3, so field n is f[n - 3].
    let ticks = num(n - 3) + num(n - 2);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100);
    ticks as f64 / hz.max(1) as f64
}

struct Run {
    /// Jobs run, each succeeded.
    jobs: usize,
    makespan: f64,
    /// The jobs' CPU time over (real CPUs x makespan), percent.
    util_pct: f64,
    /// All CPUs of the machine busy over the window (/proc/stat), percent.
    busy_pct: f64,
    /// CPU time of the agent process itself (its scheduler, signals,
    /// re-pinning), seconds.
    agent_cpu: f64,
    stats: BTreeMap<String, u64>,
    /// Jobs whose CPU at exit differs from the CPU they started on.
    moved: usize,
}

async fn one_run(o: &Opts, w: &Workload, steal: bool) -> Result<Run> {
    let dir = tempfile::tempdir()?;
    // A 1 s heartbeat and 10 missed before the node is lost: up to 320
    // hackbench processes on 2 CPUs (plus whatever else the machine runs)
    // can starve the dispatcher and agent for seconds.
    let d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "1000", "--missed-heartbeats", "10"],
    )?;
    let over = o.oversubscribe.to_string();
    // Shims, not the supervisor: the jobs' CPU time is read from the
    // agent's reaped children (each job's shim, which reaped the job),
    // and a supervisor is reaped only when it exits.
    let mut extra = vec!["--oversubscribe", over.as_str(), "--launcher", "shim"];
    if !steal {
        extra.push("--no-steal");
    }
    let agent = Agent::start(dir.path(), &d.url, "n1", &o.topology, &[], &extra)?;
    wait_nodes(&d, 1, Duration::from_secs(30)).await?;
    let mut jobs = d.jobs().await?;
    let mut nodes = d.nodes().await?;

    let specs: Vec<JobSpec> = w
        .loops
        .iter()
        .map(|&l| {
            let mut command = vec![HACKBENCH.to_string(), "-g".into(), "1".into()];
            if o.threads {
                command.push("-T".into());
            }
            command.extend(["-l".to_string(), l.to_string()]);
            JobSpec {
                command,
                cpus: 1,
                ..Default::default()
            }
        })
        .collect();
    let cpu0 = cpu_times();
    let jobs_cpu0 = children_cpu(agent.proc.pid());
    let agent_cpu0 = own_cpu(agent.proc.pid());
    jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
    // Where each job started (its first RUNNING report).
    let mut first_cpus: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    let done: Vec<Job> = loop {
        let all = all_jobs(&mut jobs).await?;
        for j in &all {
            if j.state == JobState::Running as i32 && !j.cpus.is_empty() {
                first_cpus
                    .entry(j.id.clone())
                    .or_insert_with(|| j.cpus.clone());
            }
        }
        if all.len() == w.loops.len() && all.iter().all(|j| e2e::is_terminal(j.state)) {
            break all;
        }
        if Instant::now() > deadline {
            bail!("jobs still running after 600 s:\n{}", agent.proc.log_text());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let cpu1 = cpu_times();
    for j in &done {
        if j.state != JobState::Succeeded as i32 {
            drop(agent);
            drop(d);
            let kept = dir.keep();
            bail!(
                "job {} did not succeed: {} {:?}; logs kept in {}",
                j.id,
                j.reason,
                j,
                kept.display()
            );
        }
    }
    let start = done.iter().map(|j| j.submit_time_ms).min().unwrap_or(0);
    let end = done.iter().map(|j| j.end_time_ms).max().unwrap_or(0);
    let moved = done
        .iter()
        .filter(|j| first_cpus.get(&j.id).is_some_and(|c| *c != j.cpus))
        .count();
    // One more load report, so the schedstats include the last exits (and
    // the agent has reaped every shim).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let jobs_cpu = children_cpu(agent.proc.pid()) - jobs_cpu0;
    let agent_cpu = own_cpu(agent.proc.pid()) - agent_cpu0;
    let node = nodes
        .get_node(GetNodeRequest { name: "n1".into() })
        .await?
        .into_inner();
    let stats = node
        .load
        .clone()
        .map(|l| l.schedstats.into_iter().collect())
        .unwrap_or_default();
    let (busy, total) = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
    drop(agent);
    drop(d);
    let makespan = (end - start) as f64 / 1000.0;
    // The real CPUs the jobs can use: the synthetic ones map onto them.
    let real_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let synthetic = node.topology.as_ref().map_or(1, |t| t.cpus.len());
    let used = real_cpus.min(synthetic).max(1) as f64;
    Ok(Run {
        jobs: done.len(),
        makespan,
        util_pct: 100.0 * jobs_cpu / (used * makespan).max(1e-9),
        busy_pct: 100.0 * busy as f64 / total.max(1) as f64,
        agent_cpu,
        stats,
        moved,
    })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Relative standard deviation, percent (sample stdev).
fn pct_stdev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
    100.0 * var.sqrt() / m
}

#[derive(Default)]
struct Side {
    time: Vec<f64>,
    util: Vec<f64>,
    busy: Vec<f64>,
    agent: Vec<f64>,
    steal: Vec<f64>,
    steal_fail: Vec<f64>,
    moved: Vec<f64>,
    preempt: Vec<f64>,
}

impl Side {
    fn add(&mut self, r: &Run) {
        let stat = |k: &str| r.stats.get(k).copied().unwrap_or(0) as f64;
        self.time.push(r.makespan);
        self.util.push(r.util_pct);
        self.busy.push(r.busy_pct);
        self.agent.push(r.agent_cpu);
        self.steal.push(stat("steal"));
        self.steal_fail.push(stat("steal_fail"));
        self.preempt.push(stat("nr_preemptions"));
        self.moved.push(r.moved as f64);
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let o = parse_args()?;
    if !std::path::Path::new(HACKBENCH).exists() {
        bail!("{HACKBENCH} is missing: apt-get install -y rt-tests");
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "hackbench -g 1 ({} mode: 20 senders + 20 receivers) as 1-CPU jobs; one agent \
         --oversubscribe {} on synthetic {} over {cpus} real CPUs; {} runs per cell, \
         steal on/off alternating; load average at start {}",
        if o.threads { "thread" } else { "process" },
        o.oversubscribe,
        o.topology,
        o.reps,
        loadavg()
    );
    let mut rows = Vec::new();
    let chosen = workloads(o.quick, o.check).into_iter().filter(|w| {
        o.only
            .as_ref()
            .is_none_or(|p| w.name.starts_with(p.as_str()))
    });
    for w in chosen {
        let (mut on, mut off) = (Side::default(), Side::default());
        for rep in 0..o.reps {
            // Alternate which goes first, so drift hits both alike.
            let order = if rep % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for steal in order {
                let r = one_run(&o, &w, steal)
                    .await
                    .with_context(|| format!("{} steal={steal} rep {rep}", w.name))?;
                eprintln!(
                    "  {:<20} steal {:<3} rep {rep}: {:6.3} s  util {:5.1}%  machine busy {:5.1}%  agent {:.2} s  steals {}  moved {}",
                    w.name,
                    if steal { "on" } else { "off" },
                    r.makespan,
                    r.util_pct,
                    r.busy_pct,
                    r.agent_cpu,
                    r.stats.get("steal").copied().unwrap_or(0),
                    r.moved
                );
                if o.check {
                    verify(&w, steal, &r)?;
                }
                if steal { on.add(&r) } else { off.add(&r) }
            }
        }
        rows.push((w.name, off, on));
    }

    println!();
    println!(
        "{:<20} {:>4} | {:^21} | {:^37} | {:>8}",
        "", "", "steal off", "steal on", ""
    );
    println!(
        "{:<20} {:>4} | {:>7} {:>6} {:>6} | {:>7} {:>6} {:>6} {:>7} {:>8} | {:>8}",
        "workload",
        "runs",
        "time s",
        "%stdev",
        "%util",
        "time s",
        "%stdev",
        "%util",
        "steals",
        "moved",
        "%speedup"
    );
    for (name, off, on) in &rows {
        let speedup = 100.0 * (mean(&off.time) / mean(&on.time) - 1.0);
        println!(
            "{:<20} {:>4} | {:>7.3} {:>6.1} {:>6.1} | {:>7.3} {:>6.1} {:>6.1} {:>7.1} {:>8.1} | {:>8.1}",
            name,
            off.time.len(),
            mean(&off.time),
            pct_stdev(&off.time),
            mean(&off.util),
            mean(&on.time),
            pct_stdev(&on.time),
            mean(&on.util),
            mean(&on.steal),
            mean(&on.moved),
            speedup
        );
    }
    println!();
    println!("time: makespan, first submit -> last exit (the dispatcher's job times)");
    println!("%util: the jobs' CPU time / (CPUs x makespan), from the agent's reaped children");
    println!("steals: agent schedstats `steal` per run; moved: jobs that ended on another CPU");
    println!("%speedup = time off / time on - 1 (seed 000's definition)");
    for (name, off, on) in &rows {
        println!(
            "{name}: failed steals/run {:.1}; preemptions/run off {:.0} on {:.0}; \
             agent CPU/run off {:.2} s on {:.2} s; \
             machine busy (/proc/stat, all processes) off {:.1}% on {:.1}%",
            mean(&on.steal_fail),
            mean(&off.preempt),
            mean(&on.preempt),
            mean(&off.agent),
            mean(&on.agent),
            mean(&off.busy),
            mean(&on.busy)
        );
    }
    println!("load average at end {}", loadavg());
    if o.check {
        println!("check: every run verified");
    }
    Ok(())
}

/// Check mode: a run did what the table reports. `one_run` already fails
/// when a job does not succeed; here every job of the workload ran, the
/// measured figures are real (a positive makespan, the jobs' CPU time
/// seen), the agent reported its schedstats, and `--no-steal` stole
/// nothing.
fn verify(w: &Workload, steal: bool, r: &Run) -> Result<()> {
    let name = format!("{} steal={steal}", w.name);
    anyhow::ensure!(
        r.jobs == w.loops.len(),
        "{name}: {} jobs for {}",
        r.jobs,
        w.loops.len()
    );
    anyhow::ensure!(r.makespan > 0.0, "{name}: makespan {}", r.makespan);
    anyhow::ensure!(r.util_pct > 0.0, "{name}: no job CPU time was seen");
    anyhow::ensure!(
        r.stats.contains_key("steal"),
        "{name}: no schedstats in the load report: {:?}",
        r.stats
    );
    if !steal {
        anyhow::ensure!(
            r.stats["steal"] == 0 && r.moved == 0,
            "{name}: stealing is off, yet {} steals and {} jobs moved",
            r.stats["steal"],
            r.moved
        );
    }
    Ok(())
}
