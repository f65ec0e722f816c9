//! The node agent runs real processes, checked from /proc: a real
//! dispatcher and `agent run` on synthetic topologies whose CPUs map onto
//! this machine's real CPUs (synthetic CPU `i` -> the `i mod n`-th CPU the
//! agent may use, `Agent::real` in `agent/src/runtime.rs`).
//!
//! * every process of a job (and a child it starts) runs only on the CPUs
//!   the job was given (`Cpus_allowed_list`);
//! * a cancelled job's whole process group is gone;
//! * a time-sliced job is seen stopped (state `T`) and resumes;
//! * an idle CPU steals a waiting job and re-pins the same process;
//! * hackbench (Debian's rt-tests) runs as jobs.
//!
//! Jobs run as `nobody`; the ones the test must hold wait for a release
//! file in a world-readable directory. No timing is asserted: every wait
//! is a generous deadline on a state the test can observe.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::{Agent, Dispatcher, all_jobs, eventually, is_terminal, wait_nodes};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{
    CancelJobRequest, GetJobRequest, GetNodeRequest, Job, JobSpec, JobState, LogStream,
    StreamLogsRequest, SubmitJobRequest,
};
use tonic::transport::Channel;

const HACKBENCH: &str = "/usr/bin/hackbench";

// ----- /proc -----

/// What the test reads of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stat {
    state: char,
    pgrp: i32,
    starttime: u64,
}

/// `/proc/<pid>/stat`: state, process group, start time (fields 3, 5, 22).
fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: split after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: f.first()?.chars().next()?,
        pgrp: f.get(2)?.parse().ok()?,
        starttime: f.get(19)?.parse().ok()?,
    })
}

fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Live (not zombie) processes with `marker` as one of their arguments.
fn pids_with_arg(marker: &str) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|&p| cmdline(p).iter().any(|a| a == marker))
        .filter(|&p| stat(p).is_some_and(|s| s.state != 'Z'))
        .collect()
}

/// Every process (zombies included) whose process group is `pgid`.
fn group_members(pgid: i32) -> BTreeMap<i32, Stat> {
    all_pids()
        .into_iter()
        .filter_map(|p| stat(p).map(|s| (p, s)))
        .filter(|(_, s)| s.pgrp == pgid)
        .collect()
}

/// `Cpus_allowed_list` of a process, parsed.
fn cpus_allowed(pid: i32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpulist(line.trim())
}

/// `0-2,5` -> [0, 1, 2, 5].
fn parse_cpulist(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => out.push(part.parse().ok()?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// The real CPUs a job given synthetic `cpus` runs on: the agent maps
/// synthetic CPU `i` (the synthetic ids used here are 0..n) onto the
/// `i mod n`-th CPU it may use, which it inherits from this test.
fn real_of(cpus: &[u32]) -> Vec<u32> {
    let mine = std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|l| parse_cpulist(l.trim()))
        })
        .unwrap_or_default();
    let n = mine.len().max(1);
    let mut out: Vec<u32> = cpus
        .iter()
        .map(|&c| mine.get(c as usize % n).copied().unwrap_or(0))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

// ----- one dispatcher and one agent -----

struct Node {
    jobs: JobServiceClient<Channel>,
    nodes: NodeServiceClient<Channel>,
    /// Release files (world-readable, so `nobody` jobs see them).
    release: PathBuf,
    /// A prefix unique to this test run, for markers in command lines.
    tag: String,
    _agent: Agent,
    _dispatcher: Dispatcher,
    // Last: the processes above are killed before their directory goes.
    dir: tempfile::TempDir,
}

impl Node {
    async fn start(topology: &str, extra: &[&str]) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let release = dir.path().join("release");
        std::fs::create_dir(&release)?;
        std::fs::set_permissions(&release, std::fs::Permissions::from_mode(0o755))?;
        // A 1 s heartbeat, 10 missed before the node is lost: a loaded
        // machine (hackbench jobs, parallel tests) may starve the dispatcher
        // or agent for a while, which is not what these tests are about.
        let d = Dispatcher::start(
            dir.path(),
            &["--heartbeat-ms", "1000", "--missed-heartbeats", "10"],
        )?;
        let a = Agent::start(dir.path(), &d.url, "n1", topology, &[], extra)?;
        wait_nodes(&d, 1, Duration::from_secs(30))
            .await
            .with_context(|| a.proc.log_text())?;
        let tag = dir
            .path()
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("t")
            .trim_start_matches('.')
            .to_string();
        Ok(Self {
            jobs: d.jobs().await?,
            nodes: d.nodes().await?,
            release,
            tag,
            _agent: a,
            _dispatcher: d,
            dir,
        })
    }

    /// A marker unique to this run, passed as `$0` of a job's `sh -c`.
    fn marker(&self, name: &str) -> String {
        format!("procs-{}-{name}", self.tag)
    }

    /// A script fragment that waits until `release(name)` is called.
    fn hold(&self, name: &str) -> String {
        format!(
            "while [ ! -e {} ]; do sleep 0.05; done",
            self.release.join(name).display()
        )
    }

    fn release(&self, name: &str) -> Result<()> {
        std::fs::write(self.release.join(name), b"")?;
        Ok(())
    }

    async fn submit(&mut self, spec: JobSpec) -> Result<String> {
        let r = self
            .jobs
            .submit_job(SubmitJobRequest { spec: Some(spec) })
            .await?
            .into_inner();
        Ok(r.jobs.first().context("no job returned")?.id.clone())
    }

    /// JobService.GetJob.
    async fn job(&mut self, id: &str) -> Result<Job> {
        Ok(self
            .jobs
            .get_job(GetJobRequest { id: id.into() })
            .await?
            .into_inner())
    }

    /// Wait until every job in `ids` is terminal; returns them.
    async fn wait_done(&mut self, ids: &[String], timeout: Duration) -> Result<Vec<Job>> {
        let jobs = self.jobs.clone();
        let want: BTreeSet<String> = ids.iter().cloned().collect();
        let res = eventually(timeout, "the jobs to finish", || {
            let mut c = jobs.clone();
            let want = want.clone();
            async move {
                let all = all_jobs(&mut c).await.ok()?;
                let mine: Vec<Job> = all.into_iter().filter(|j| want.contains(&j.id)).collect();
                (mine.len() == want.len() && mine.iter().all(|j| is_terminal(j.state)))
                    .then_some(mine)
            }
        })
        .await;
        res.with_context(|| self.agent_log())
    }

    /// The agent's engine schedstats from its last load report.
    async fn schedstat(&mut self, name: &str) -> Result<u64> {
        let node = self
            .nodes
            .get_node(GetNodeRequest { name: "n1".into() })
            .await?
            .into_inner();
        Ok(node
            .load
            .and_then(|l| l.schedstats.get(name).copied())
            .unwrap_or(0))
    }

    /// Wait until the agent reports schedstat `name` >= `at_least`.
    async fn wait_schedstat(&self, name: &str, at_least: u64) -> Result<u64> {
        let nodes = self.nodes.clone();
        let what = format!("schedstats[{name}] >= {at_least} reported");
        eventually(Duration::from_secs(15), &what, || {
            let mut c = nodes.clone();
            async move {
                let node = c
                    .get_node(GetNodeRequest { name: "n1".into() })
                    .await
                    .ok()?
                    .into_inner();
                let v = node.load?.schedstats.get(name).copied()?;
                (v >= at_least).then_some(v)
            }
        })
        .await
    }

    async fn stdout(&mut self, id: &str) -> Result<String> {
        let mut stream = self
            .jobs
            .stream_logs(StreamLogsRequest {
                id: id.into(),
                stream: LogStream::Stdout as i32,
                offset: 0,
                follow: false,
            })
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.message().await? {
            out.extend(chunk.data);
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    fn agent_log(&self) -> String {
        let log = self._agent.proc.log_text();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "agent log ({}):\n{}",
            self.dir.path().display(),
            tail.join("\n")
        )
    }
}

fn sh(script: &str, marker: &str, cpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["sh".into(), "-c".into(), script.into(), marker.into()],
        cpus,
        ..Default::default()
    }
}

fn state_name(state: i32) -> String {
    JobState::try_from(state).map_or_else(|_| state.to_string(), |s| s.as_str_name().into())
}

fn assert_succeeded(jobs: &[Job]) {
    for j in jobs {
        assert_eq!(
            j.state,
            JobState::Succeeded as i32,
            "job {} ended {} ({}): {j:?}",
            j.id,
            state_name(j.state),
            j.reason
        );
    }
}

// ----- 1. pinning -----

/// Each job, 1-CPU and 2-CPU, and a child it starts, run only on the CPUs
/// the job was given: checked from outside (every process of the job's
/// group, from /proc, while it is held) and from inside (what the job and
/// its child print).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_only_on_their_cpus() -> Result<()> {
    let mut n = Node::start("1s:1c:2t", &[]).await?;
    let mut ids: BTreeMap<String, String> = BTreeMap::new(); // job id -> name
    for (i, cpus) in [1, 2, 1, 1, 2, 1].into_iter().enumerate() {
        let name = format!("pin{i}");
        let script = format!(
            "grep Cpus_allowed_list /proc/$$/status | sed 's/^/self /'; \
             sleep 5 & child=$!; grep Cpus_allowed_list /proc/$child/status | sed 's/^/child /'; \
             {}; kill $child; wait",
            n.hold(&name)
        );
        let id = n.submit(sh(&script, &n.marker(&name), cpus)).await?;
        ids.insert(id, name);
    }

    // Watch: every held job is checked from /proc, then released.
    let mut checked: BTreeMap<String, usize> = BTreeMap::new(); // id -> processes checked
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let all = all_jobs(&mut n.jobs).await?;
        let mine: Vec<&Job> = all.iter().filter(|j| ids.contains_key(&j.id)).collect();
        if mine.iter().all(|j| is_terminal(j.state)) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "jobs did not finish: {mine:?}\n{}",
            n.agent_log()
        );
        for j in mine {
            let name = &ids[&j.id];
            if j.state != JobState::Running as i32 || checked.contains_key(&j.id) {
                continue;
            }
            let leaders = pids_with_arg(&n.marker(name));
            let [leader] = leaders[..] else { continue };
            let members = group_members(leader);
            // The job's shell leads its own group and has its `sleep` child.
            if members.len() < 2 {
                continue;
            }
            let want = real_of(&j.cpus);
            assert_eq!(j.cpus.len() as u32, j.spec.as_ref().map_or(0, |s| s.cpus));
            for &pid in members.keys() {
                if let Some(got) = cpus_allowed(pid) {
                    assert_eq!(
                        got,
                        want,
                        "process {pid} ({:?}) of job {} given CPUs {:?}",
                        cmdline(pid),
                        j.id,
                        j.cpus
                    );
                }
            }
            checked.insert(j.id.clone(), members.len());
            n.release(name)?;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(checked.len(), ids.len(), "every job was seen running");
    eprintln!("processes checked per job: {checked:?}");

    let ids_v: Vec<String> = ids.keys().cloned().collect();
    let done = n.wait_done(&ids_v, Duration::from_secs(10)).await?;
    assert_succeeded(&done);
    for j in &done {
        // GetJob reports the CPUs the job was given.
        let got = n.job(&j.id).await?;
        assert_eq!(got.cpus, j.cpus);
        let want = real_of(&got.cpus);
        let out = n.stdout(&j.id).await?;
        for who in ["self", "child"] {
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{who} Cpus_allowed_list:")))
                .with_context(|| format!("job {} printed no {who} line: {out:?}", j.id))?;
            assert_eq!(
                parse_cpulist(line.trim()),
                Some(want.clone()),
                "{who} of job {} given CPUs {:?}: {out:?}",
                j.id,
                j.cpus
            );
        }
    }
    Ok(())
}

// ----- 2. cancel -----

/// A cancelled job's whole process group (its shell and both background
/// sleeps) is gone, zombies included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_job_leaves_no_process() -> Result<()> {
    let mut n = Node::start("1s:1c:2t", &[]).await?;
    let marker = n.marker("cancel");
    let id = n
        .submit(sh("sleep 100 & sleep 100 & wait", &marker, 1))
        .await?;
    let (pgid, members) = eventually(Duration::from_secs(20), "the job's 3 processes", || {
        let marker = marker.clone();
        async move {
            let [leader] = pids_with_arg(&marker)[..] else {
                return None;
            };
            let members = group_members(leader);
            let sleeps = members
                .keys()
                .filter(|&&p| cmdline(p).first().is_some_and(|c| c.ends_with("sleep")))
                .count();
            (sleeps == 2).then_some((leader, members))
        }
    })
    .await
    .with_context(|| n.agent_log())?;
    assert_eq!(members.len(), 3, "{members:?}");

    let job = n
        .jobs
        .cancel_job(CancelJobRequest { id: id.clone() })
        .await?
        .into_inner();
    assert_eq!(job.id, id);
    let done = n
        .wait_done(std::slice::from_ref(&id), Duration::from_secs(30))
        .await?;
    assert_eq!(
        done[0].state,
        JobState::Cancelled as i32,
        "{:?} {}",
        done[0],
        n.agent_log()
    );
    // Gone: neither the processes seen (same pid and start time) nor any
    // other member of the group exists, not even as a zombie.
    eventually(
        Duration::from_secs(10),
        "the process group to be gone",
        || {
            let members = members.clone();
            async move {
                let survivors: Vec<i32> = members
                    .iter()
                    .filter(|(p, s)| stat(**p).is_some_and(|now| now.starttime == s.starttime))
                    .map(|(p, _)| *p)
                    .collect();
                (survivors.is_empty() && group_members(pgid).is_empty()).then_some(())
            }
        },
    )
    .await
    .with_context(|| format!("group {pgid}: {:?}", group_members(pgid)))?;
    Ok(())
}

// ----- 3. time slicing -----

/// Three CPU spinners on a 1-CPU node with `--oversubscribe 3`: the agent
/// time-slices them with SIGSTOP/SIGCONT, so a job is seen stopped (`T`)
/// and later running again, and all of them complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_jobs_resume() -> Result<()> {
    let mut n = Node::start("1s:1c:1t", &["--oversubscribe", "3"]).await?;
    let mut ids = Vec::new();
    let mut markers = Vec::new();
    for i in 0..3 {
        let marker = n.marker(&format!("spin{i}"));
        let script = "i=0; while [ $i -lt 1500000 ]; do i=$((i+1)); done";
        ids.push(n.submit(sh(script, &marker, 1)).await?);
        markers.push(marker);
    }
    // Poll every job's state from /proc until all are done.
    let mut seen: BTreeMap<i32, Vec<char>> = BTreeMap::new(); // pid -> states, changes only
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        for m in &markers {
            for pid in pids_with_arg(m) {
                if let Some(s) = stat(pid) {
                    let v = seen.entry(pid).or_default();
                    if v.last() != Some(&s.state) {
                        v.push(s.state);
                    }
                }
            }
        }
        let all = all_jobs(&mut n.jobs).await?;
        if ids
            .iter()
            .all(|id| all.iter().any(|j| &j.id == id && is_terminal(j.state)))
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "spinners did not finish: {seen:?}\n{}",
            n.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = n.wait_done(&ids, Duration::from_secs(5)).await?;
    assert_succeeded(&done);
    // A process was stopped and then ran again.
    let resumed = seen.values().any(|states| {
        states
            .iter()
            .position(|&c| c == 'T')
            .is_some_and(|t| states[t..].iter().any(|&c| c == 'R' || c == 'S'))
    });
    assert!(
        resumed,
        "no job was seen stopped (T) and then running: {seen:?}"
    );
    let stops: BTreeMap<i32, usize> = seen
        .iter()
        .map(|(p, v)| (*p, v.iter().filter(|&&c| c == 'T').count()))
        .collect();
    eprintln!("times each spinner was seen stopped (pid: count): {stops:?}");
    n.wait_schedstat("nr_preemptions", 1).await?;
    Ok(())
}

// ----- 4. stealing -----

/// Two CPUs, `--oversubscribe 3`, three held jobs: two time-slice on one
/// CPU, one runs on the other. Once both jobs of the shared CPU have run
/// there, the lone job is released: its CPU goes idle and steals the
/// waiting one, and the agent re-pins that same process onto it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_cpu_steals_and_repins() -> Result<()> {
    ensure!(
        real_of(&[0]) != real_of(&[1]),
        "this test needs 2 real CPUs to tell a re-pin from /proc"
    );
    let mut n = Node::start("1s:1c:2t", &["--oversubscribe", "3"]).await?;
    let names = ["st0", "st1", "st2"];
    let mut ids: BTreeMap<String, &str> = BTreeMap::new();
    for name in names {
        let id = n.submit(sh(&n.hold(name), &n.marker(name), 1)).await?;
        ids.insert(id, name);
    }
    // All three started (the shared CPU's two alternate), each seen from
    // /proc pinned to its CPU. A job's `cpus` in the dispatcher is where
    // it started; nothing moves before a CPU goes idle.
    let jobs = n.jobs.clone();
    let started: Vec<(Job, i32)> =
        eventually(Duration::from_secs(30), "all three jobs started", || {
            let mut c = jobs.clone();
            let ids = ids.clone();
            let tag = n.tag.clone();
            async move {
                let all = all_jobs(&mut c).await.ok()?;
                let mut out = Vec::new();
                for j in all.into_iter().filter(|j| ids.contains_key(&j.id)) {
                    if j.state != JobState::Running as i32 || j.cpus.len() != 1 {
                        return None;
                    }
                    let marker = format!("procs-{tag}-{}", ids[&j.id]);
                    let [pid] = pids_with_arg(&marker)[..] else {
                        return None;
                    };
                    out.push((j, pid));
                }
                (out.len() == 3).then_some(out)
            }
        })
        .await
        .with_context(|| n.agent_log())?;
    let mut by_cpu: BTreeMap<u32, Vec<&(Job, i32)>> = BTreeMap::new();
    for s in &started {
        assert_eq!(cpus_allowed(s.1), Some(real_of(&s.0.cpus)), "{:?}", s.0);
        by_cpu.entry(s.0.cpus[0]).or_default().push(s);
    }
    assert_eq!(by_cpu.len(), 2, "one job per CPU, plus one: {started:?}");
    let (&shared_cpu, pair) = by_cpu
        .iter()
        .find(|(_, v)| v.len() == 2)
        .context("a CPU with two jobs")?;
    let (&lone_cpu, lone) = by_cpu
        .iter()
        .find(|(_, v)| v.len() == 1)
        .context("a CPU with one job")?;
    let (lone_job, _) = lone[0];
    let pair: Vec<(Job, i32)> = pair.iter().map(|&x| x.clone()).collect();
    let steals_before = n.schedstat("steal").await?;
    assert_eq!(steals_before, 0, "nothing to steal yet");

    // The lone CPU goes idle: it steals whichever of the pair waits now.
    n.release(ids[&lone_job.id])?;
    let want_real = real_of(&[lone_cpu]);
    let (stolen, stayed) = eventually(
        Duration::from_secs(20),
        "a job of the shared CPU re-pinned onto the idle one",
        || {
            let pair = pair.clone();
            let want_real = want_real.clone();
            async move {
                let moved: Vec<&(Job, i32)> = pair
                    .iter()
                    .filter(|(_, pid)| cpus_allowed(*pid).as_ref() == Some(&want_real))
                    .collect();
                let [moved] = moved[..] else { return None };
                // It runs there: continued, not left stopped.
                (stat(moved.1)?.state != 'T').then_some(())?;
                let other = pair.iter().find(|(j, _)| j.id != moved.0.id)?;
                Some((moved.clone(), other.clone()))
            }
        },
    )
    .await
    .with_context(|| n.agent_log())?;
    // The same process, first pinned to the shared CPU, now on the idle one.
    assert_ne!(lone_cpu, shared_cpu);
    assert_eq!(cpus_allowed(stayed.1), Some(real_of(&[shared_cpu])));
    let steals = n.wait_schedstat("steal", 1).await?;

    for (j, _) in [&stolen, &stayed] {
        n.release(ids[&j.id])?;
    }
    let all_ids: Vec<String> = ids.keys().cloned().collect();
    let done = n.wait_done(&all_ids, Duration::from_secs(20)).await?;
    assert_succeeded(&done);
    // The final report says where each ended.
    let cpus_of = |id: &str| done.iter().find(|j| j.id == id).map(|j| j.cpus.clone());
    assert_eq!(cpus_of(&stolen.0.id), Some(vec![lone_cpu]), "{done:?}");
    assert_eq!(cpus_of(&stayed.0.id), Some(vec![shared_cpu]), "{done:?}");
    assert_eq!(
        stolen.0.cpus,
        vec![shared_cpu],
        "it queued on the shared CPU"
    );
    eprintln!(
        "job {} (pid {}) queued on CPU {shared_cpu}, stolen by CPU {lone_cpu}; steals {steals}",
        stolen.0.id, stolen.1
    );
    Ok(())
}

// ----- 5. hackbench -----

/// Two short hackbench runs (rt-tests) as 1-CPU jobs on an oversubscribed
/// agent: 40 processes each, time-sliced as a group; both succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hackbench_jobs_succeed() -> Result<()> {
    if !Path::new(HACKBENCH).exists() {
        bail!("{HACKBENCH} is missing: install rt-tests (apt-get install -y rt-tests)");
    }
    let mut n = Node::start("1s:1c:2t", &["--oversubscribe", "3"]).await?;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let spec = JobSpec {
            command: ["-g", "1", "-l", "100"].iter().fold(
                vec![HACKBENCH.to_string()],
                |mut v, a| {
                    v.push(a.to_string());
                    v
                },
            ),
            cpus: 1,
            ..Default::default()
        };
        ids.push(n.submit(spec).await?);
    }
    let done = n.wait_done(&ids, Duration::from_secs(40)).await?;
    assert_succeeded(&done);
    for id in &ids {
        let out = n.stdout(id).await?;
        assert!(out.contains("Time:"), "hackbench output: {out:?}");
    }
    Ok(())
}
