//! Issue 4's evidence, end to end: a real dispatcher and several real agent
//! processes (synthetic topologies, zone and rack labels) on loopback
//! ports.
//!
//! - [`a_thousand_jobs_finish_aligned_and_selected`]: >= 1,000 mixed jobs
//!   all succeed, each on CPUs inside one domain of its alignment level and
//!   on a node carrying its selector's labels; a selector matching nothing
//!   leaves its job PENDING with a reason naming the selector.
//! - [`idle_rack_peer_steals_but_not_across_zones_beyond_the_limit`] and
//!   [`other_zone_steals_within_the_default_zone_limit`]: queued jobs of an
//!   overloaded node are stolen by an idle node of its rack; with
//!   `--steal-zone-limit 1` an idle node of the other zone never steals,
//!   with the default limit (2 zones) it does.
//! - [`killed_agents_jobs_are_retried_elsewhere_or_lost`]: after SIGKILL of
//!   an agent and its heartbeats running out, jobs with a retry budget run
//!   again elsewhere (attempt 2), the others end LOST.
//! - [`dispatcher_kill9_and_restart_loses_nothing`]: every acknowledged job
//!   survives a SIGKILL of the dispatcher, runs exactly once and succeeds;
//!   ids continue after the restart.
//! - [`ended_jobs_stay_readable_for_their_retention_across_restarts`]: a job
//!   that ended is readable for `--job-retention-s` (also after a restart
//!   that reloads it), then NOT_FOUND, and stays so after another restart.
//!
//! Each test has its own temporary directory and ports; waits are generous
//! and nothing asserts wall-clock performance. A failure prints the jobs
//! involved (state, node, reason) and the tails of the process logs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::{Agent, Dispatcher, all_jobs, eventually, is_terminal, wait_nodes};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{
    Alignment, GetNodeRequest, Job, JobSpec, JobState, ListJobsRequest, NodeActionRequest,
    NodeState, PlacementPolicy, SubmitJobRequest, SubmitJobsRequest, Topology,
};
use tonic::transport::Channel;

const ZONE: &str = "topology.kubernetes.io/zone";
const RACK: &str = "dispatch.io/rack";
/// The generous bound for anything that should take seconds.
const LONG: Duration = Duration::from_secs(120);

// ----------------------------------------------------------------------
// Helpers

/// Start one agent per (node, topology, zone, rack).
fn start_agents(
    dir: &Path,
    d: &Dispatcher,
    specs: &[(&str, &str, &str, &str)],
) -> Result<Vec<Agent>> {
    specs
        .iter()
        .map(|(node, topo, zone, rack)| {
            let z = format!("{ZONE}={zone}");
            let r = format!("{RACK}={rack}");
            Agent::start(dir, &d.url, node, topo, &[&z, &r], &[])
        })
        .collect()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The tails of the dispatcher's and the agents' logs, for failure messages.
fn logs(d: &Dispatcher, agents: &[Agent]) -> String {
    let mut out = format!(
        "---- dispatcher log (tail) ----\n{}\n",
        tail(&d.proc.log_text(), 80)
    );
    for a in agents {
        out += &format!(
            "---- agent {} log (tail) ----\n{}\n",
            a.node,
            tail(&a.proc.log_text(), 25)
        );
    }
    out
}

fn state_name(state: i32) -> &'static str {
    JobState::try_from(state).map_or("?", |s| s.as_str_name())
}

/// One line per job: id, state, node, attempt, CPUs, reason.
fn describe(jobs: &[Job]) -> String {
    jobs.iter()
        .map(|j| {
            format!(
                "  {} {} node={:?} attempt={} cpus={:?} reason={:?}",
                j.id,
                state_name(j.state),
                j.node,
                j.attempt,
                j.cpus,
                j.reason
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

fn job_spec(command: Vec<String>) -> JobSpec {
    JobSpec {
        command,
        ..Default::default()
    }
}

/// Submit specs in batches through SubmitJobs; returns the acknowledged
/// jobs in order.
async fn submit_batches(
    c: &mut JobServiceClient<Channel>,
    specs: Vec<JobSpec>,
    batch: usize,
) -> Result<Vec<Job>> {
    let mut out = Vec::new();
    for chunk in specs.chunks(batch) {
        let got = c
            .submit_jobs(SubmitJobsRequest {
                specs: chunk.to_vec(),
            })
            .await
            .context("SubmitJobs")?
            .into_inner()
            .jobs;
        ensure!(
            got.len() == chunk.len(),
            "SubmitJobs acknowledged {} jobs for {} specs",
            got.len(),
            chunk.len()
        );
        out.extend(got);
    }
    Ok(out)
}

/// Jobs not yet in a terminal state.
async fn unfinished(c: &mut JobServiceClient<Channel>) -> Result<Vec<Job>> {
    Ok(c.list_jobs(ListJobsRequest {
        states: vec![
            JobState::Pending as i32,
            JobState::Assigned as i32,
            JobState::Running as i32,
        ],
        page_size: 10_000,
        ..Default::default()
    })
    .await?
    .into_inner()
    .jobs)
}

/// Wait until every job but `except` is terminal (polling every 250 ms,
/// tolerating transient RPC errors); on timeout fail with the unfinished
/// jobs and `context()`.
async fn wait_until_done(
    c: &mut JobServiceClient<Channel>,
    except: &HashSet<String>,
    timeout: Duration,
    context: impl Fn() -> String,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let (open, err) = match unfinished(c).await {
            Ok(jobs) => (
                jobs.into_iter()
                    .filter(|j| !except.contains(&j.id))
                    .collect::<Vec<_>>(),
                None,
            ),
            Err(e) => (Vec::new(), Some(e)),
        };
        if open.is_empty() && err.is_none() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "after {timeout:?}, {} jobs are not finished (last error: {err:?}):\n{}\n{}",
                open.len(),
                describe(&open[..open.len().min(40)]),
                context()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Poll every job until `pred` holds for the whole list; returns it.
async fn wait_jobs(
    c: &JobServiceClient<Channel>,
    what: &str,
    pred: impl Fn(&[Job]) -> bool,
    context: impl Fn() -> String,
) -> Result<Vec<Job>> {
    let got = eventually(LONG, what, || {
        let mut c = c.clone();
        let pred = &pred;
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            pred(&all).then_some(all)
        }
    })
    .await;
    match got {
        Ok(all) => Ok(all),
        Err(e) => {
            let mut c = c.clone();
            let all = all_jobs(&mut c).await.unwrap_or_default();
            bail!("{e:#}\njobs now:\n{}\n{}", describe(&all), context())
        }
    }
}

async fn node_admin(d: &Dispatcher, name: &str, cordon: bool) -> Result<()> {
    let mut n = d.nodes().await?;
    let req = NodeActionRequest { name: name.into() };
    let node = if cordon {
        n.cordon_node(req).await
    } else {
        n.uncordon_node(req).await
    }
    .with_context(|| format!("(un)cordon {name}"))?
    .into_inner();
    let want = if cordon {
        NodeState::Cordoned
    } else {
        NodeState::Ready
    };
    ensure!(node.state == want as i32, "{name} is {:?}", node.state);
    Ok(())
}

/// The CPU groups of one alignment level (ANY: the whole node).
fn domains(topo: &Topology, align: Alignment) -> Vec<Vec<u32>> {
    let groups = |g: &[proto::v1::CpuGroup]| g.iter().map(|x| x.cpus.clone()).collect();
    match align {
        Alignment::Any => vec![topo.cpus.clone()],
        Alignment::Core => groups(&topo.smt),
        Alignment::Llc => groups(&topo.llc),
        Alignment::Numa => groups(&topo.numa),
        Alignment::Package => groups(&topo.package),
    }
}

/// The job used its requested number of distinct CPUs, all inside one
/// domain of its alignment level on its node.
fn check_alignment(job: &Job, topo: &Topology) -> Result<(), String> {
    let spec = job.spec.clone().unwrap_or_default();
    let align = Alignment::try_from(spec.alignment).unwrap_or(Alignment::Any);
    let cpus: HashSet<u32> = job.cpus.iter().copied().collect();
    if cpus.len() != spec.cpus.max(1) as usize || cpus.len() != job.cpus.len() {
        return Err(format!(
            "{} asked {} CPUs and got {:?}",
            job.id, spec.cpus, job.cpus
        ));
    }
    let inside_one = domains(topo, align)
        .iter()
        .any(|g| cpus.iter().all(|c| g.contains(c)));
    if !inside_one {
        return Err(format!(
            "{}: CPUs {:?} on {} are not inside one {} domain of {:?}",
            job.id,
            job.cpus,
            job.node,
            align.as_str_name(),
            domains(topo, align)
        ));
    }
    Ok(())
}

// ----------------------------------------------------------------------
// 1. A thousand jobs

/// The i-th job of the mix: `true` or a short sleep; 1..4 CPUs; alignment
/// any / core / llc / numa (core jobs ask at most the 2 threads a core
/// has); some with node selectors on zone or rack, some packed.
fn mixed_spec(i: u32) -> JobSpec {
    let command = match i % 4 {
        0 => vec!["true".to_string()],
        k => sh(&format!("sleep 0.0{k}")),
    };
    let alignment = [
        Alignment::Any,
        Alignment::Core,
        Alignment::Llc,
        Alignment::Numa,
    ][(i / 4 % 4) as usize];
    let cpus = match alignment {
        Alignment::Core => 1 + (i / 16) % 2,
        _ => 1 + (i / 16) % 4,
    };
    let node_selector: HashMap<String, String> = match i % 10 {
        3 => [(ZONE.to_string(), "z2".to_string())].into(),
        7 => [(RACK.to_string(), "r2".to_string())].into(),
        5 => [
            (ZONE.to_string(), "z1".to_string()),
            (RACK.to_string(), "r1".to_string()),
        ]
        .into(),
        _ => HashMap::new(),
    };
    let policy = if i % 20 == 9 {
        PlacementPolicy::Pack
    } else {
        PlacementPolicy::Spread
    };
    JobSpec {
        name: format!("mix-{i}"),
        group: "mix".into(),
        command,
        cpus,
        alignment: alignment as i32,
        node_selector,
        policy: policy as i32,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_jobs_finish_aligned_and_selected() -> Result<()> {
    const JOBS: u32 = 1_000;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    // Zone z1 has racks r1 (two nodes) and r2; zone z2 has rack r3. The
    // topologies differ in SMT, LLC and NUMA shapes (8 CPUs each).
    let agents = start_agents(
        dir.path(),
        &d,
        &[
            ("a1", "1s:4c:2t", "z1", "r1"),
            ("a2", "2s:4c:1t", "z1", "r1"),
            ("a3", "2s:2c:2t", "z1", "r2"),
            ("b1", "1s:4c:2t:llc=2", "z2", "r3"),
            ("b2", "1s:8c:1t", "z2", "r3"),
        ],
    )?;
    let ctx = || logs(&d, &agents);
    wait_nodes(&d, agents.len(), Duration::from_secs(60))
        .await
        .with_context(ctx)?;
    let mut jobs = d.jobs().await?;

    let submitted = submit_batches(&mut jobs, (0..JOBS).map(mixed_spec).collect(), 100).await?;
    // A job whose selector no node matches waits, saying why.
    let stuck = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(JobSpec {
                node_selector: [(RACK.to_string(), "nowhere".to_string())].into(),
                ..job_spec(vec!["true".into()])
            }),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    let except: HashSet<String> = [stuck.id.clone()].into();
    wait_until_done(&mut jobs, &except, LONG, ctx).await?;

    let all = all_jobs(&mut jobs).await?;
    let ids: HashSet<&str> = all.iter().map(|j| j.id.as_str()).collect();
    ensure!(ids.len() == all.len(), "a job id is listed twice");
    ensure!(
        all.len() == JOBS as usize + 1,
        "{} jobs listed, {} submitted",
        all.len(),
        JOBS + 1
    );
    for j in &submitted {
        ensure!(ids.contains(j.id.as_str()), "{} vanished", j.id);
    }

    // The topology and labels of every node, from NodeService.GetNode.
    let mut nodes_client = d.nodes().await?;
    let mut nodes = BTreeMap::new();
    for a in &agents {
        let n = nodes_client
            .get_node(GetNodeRequest {
                name: a.node.clone(),
            })
            .await?
            .into_inner();
        nodes.insert(a.node.clone(), n);
    }

    let mut bad = Vec::new();
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    // (alignment, CPUs) -> jobs checked, so the mix cannot silently shrink.
    let mut checked: BTreeMap<(i32, u32), usize> = BTreeMap::new();
    for j in all.iter().filter(|j| j.id != stuck.id) {
        if j.state != JobState::Succeeded as i32 {
            bad.push(format!(
                "not SUCCEEDED:\n{}",
                describe(std::slice::from_ref(j))
            ));
            continue;
        }
        let Some(node) = nodes.get(&j.node) else {
            bad.push(format!("{} ran on unknown node {:?}", j.id, j.node));
            continue;
        };
        *per_node.entry(j.node.as_str()).or_default() += 1;
        let topo = node.topology.clone().unwrap_or_default();
        let spec = j.spec.clone().unwrap_or_default();
        match check_alignment(j, &topo) {
            Ok(()) => *checked.entry((spec.alignment, spec.cpus)).or_default() += 1,
            Err(e) => bad.push(e),
        }
        for (k, v) in &spec.node_selector {
            if node.labels.get(k) != Some(v) {
                bad.push(format!(
                    "{} wants {k}={v} but ran on {} labelled {:?}",
                    j.id, j.node, node.labels
                ));
            }
        }
    }
    ensure!(
        bad.is_empty(),
        "{} violations:\n{}\n{}",
        bad.len(),
        bad[..bad.len().min(40)].join("\n"),
        ctx()
    );
    // Every node took part (spread is the default policy), and every
    // alignment was checked with multi-CPU jobs: core with 2 CPUs, the
    // others with 2 to 4.
    ensure!(
        per_node.len() == agents.len(),
        "jobs per node: {per_node:?}"
    );
    for (align, max) in [
        (Alignment::Core, 2),
        (Alignment::Llc, 4),
        (Alignment::Numa, 4),
        (Alignment::Any, 4),
    ] {
        for cpus in 1..=max {
            ensure!(
                checked.get(&(align as i32, cpus)).copied().unwrap_or(0) > 0,
                "no {align:?} job of {cpus} CPUs checked: {checked:?}"
            );
        }
    }
    eprintln!("jobs per node: {per_node:?}");

    // The unmatched job is still PENDING and names its selector.
    let s = jobs
        .get_job(proto::v1::GetJobRequest {
            id: stuck.id.clone(),
        })
        .await?
        .into_inner();
    ensure!(
        s.state == JobState::Pending as i32
            && s.node.is_empty()
            && s.reason.contains("selector")
            && s.reason.contains(RACK)
            && s.reason.contains("nowhere"),
        "the unmatched job:\n{}",
        describe(&[s])
    );
    let c = jobs
        .cancel_job(proto::v1::CancelJobRequest {
            id: stuck.id.clone(),
        })
        .await?
        .into_inner();
    ensure!(
        c.state == JobState::Cancelled as i32,
        "after cancel:\n{}",
        describe(&[c])
    );
    Ok(())
}

// ----------------------------------------------------------------------
// 2. Steals

/// Three 2-CPU nodes: a1 and a2 in rack r1 of zone z1, b1 alone in zone
/// z2. With only a1 schedulable, eight long jobs run two at a time on a1
/// and queue there (PENDING, "queued on a1"). Returns the dispatcher, the
/// agents and the job ids once that is so.
async fn overload_a1(
    dir: &Path,
    flags: &[&str],
    sleep_s: u32,
) -> Result<(Dispatcher, Vec<Agent>, Vec<String>)> {
    let d = Dispatcher::start(dir, flags)?;
    let agents = start_agents(
        dir,
        &d,
        &[
            ("a1", "1s:2c:1t", "z1", "r1"),
            ("a2", "1s:2c:1t", "z1", "r1"),
            ("b1", "1s:2c:1t", "z2", "r3"),
        ],
    )?;
    wait_nodes(&d, 3, Duration::from_secs(60))
        .await
        .with_context(|| logs(&d, &agents))?;
    // The dispatcher queues on a node only when no node has room: leave
    // a1 as the only node taking jobs.
    node_admin(&d, "a2", true).await?;
    node_admin(&d, "b1", true).await?;
    let mut jobs = d.jobs().await?;
    let specs = (0..8)
        .map(|_| job_spec(sh(&format!("sleep {sleep_s}"))))
        .collect();
    let ids: Vec<String> = submit_batches(&mut jobs, specs, 8)
        .await?
        .into_iter()
        .map(|j| j.id)
        .collect();
    wait_jobs(
        &jobs,
        "two jobs on a1 and six queued on a1",
        |all| {
            let on = all
                .iter()
                .filter(|j| {
                    j.node == "a1"
                        && matches!(
                            JobState::try_from(j.state),
                            Ok(JobState::Assigned | JobState::Running)
                        )
                })
                .count();
            let queued = all
                .iter()
                .filter(|j| {
                    j.state == JobState::Pending as i32 && j.reason.contains("queued on a1")
                })
                .count();
            on == 2 && queued == 6
        },
        || logs(&d, &agents),
    )
    .await?;
    Ok((d, agents, ids))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_rack_peer_steals_but_not_across_zones_beyond_the_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (d, agents, ids) = overload_a1(dir.path(), &["--steal-zone-limit", "1"], 6).await?;
    let ctx = || logs(&d, &agents);
    let jobs = d.jobs().await?;

    // b1 (the other zone) becomes idle and schedulable first: with a limit
    // of one zone it must never take a1's queued jobs. No sleep stands in
    // for "long enough": the proof that stealing ran while b1 could have
    // stolen is a2's steal below. b1 was made schedulable before a2, so
    // every tick that let a2 (a1's rack peer) steal offered b1 the same.
    node_admin(&d, "b1", false).await?;
    node_admin(&d, "a2", false).await?;
    let all = wait_jobs(
        &jobs,
        "a2 to steal from a1",
        |all| {
            all.iter().any(|j| {
                j.node == "a2" && j.reason.contains("steal:") && j.reason.contains("same rack")
            })
        },
        ctx,
    )
    .await?;
    // ... and when a2 stole, a1 had more queued than a2 could take: b1 had
    // work in reach the whole time and took none.
    let still_queued = all
        .iter()
        .filter(|j| j.state == JobState::Pending as i32 && j.reason.contains("queued on a1"))
        .count();
    ensure!(
        all.iter()
            .all(|j| j.node != "b1" && !j.reason.contains("another zone"))
            && still_queued > 0,
        "b1 stole across zones beyond the limit, or a1's queue was gone ({still_queued} queued):\n{}\n{}",
        describe(&all),
        ctx()
    );
    let stolen: Vec<&Job> = all.iter().filter(|j| j.reason.contains("steal:")).collect();
    for j in &stolen {
        ensure!(
            j.node == "a2"
                && j.reason.contains("from overloaded a1")
                && j.reason.contains("same rack"),
            "unexpected steal:\n{}",
            describe(&[(*j).clone()])
        );
    }

    let mut c = jobs.clone();
    wait_until_done(&mut c, &HashSet::new(), LONG, ctx).await?;
    let all = all_jobs(&mut c).await?;
    ensure!(all.len() == ids.len());
    let mut bad = Vec::new();
    for j in &all {
        if j.state != JobState::Succeeded as i32
            || j.node == "b1"
            || j.reason.contains("another zone")
        {
            bad.push(j.clone());
        }
    }
    ensure!(
        bad.is_empty(),
        "jobs that failed or crossed zones:\n{}\n{}",
        describe(&bad),
        ctx()
    );
    let on_a2 = all
        .iter()
        .filter(|j| j.node == "a2" && j.reason.contains("steal:") && j.reason.contains("same rack"))
        .count();
    ensure!(on_a2 >= 1, "no steal by a2 recorded:\n{}", describe(&all));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_zone_steals_within_the_default_zone_limit() -> Result<()> {
    // The same overload with the default limit of two zones: the idle node
    // of the other zone does steal, so the previous test's "never" is the
    // limit's doing.
    let dir = tempfile::tempdir()?;
    let (d, agents, _ids) = overload_a1(dir.path(), &[], 5).await?;
    let ctx = || logs(&d, &agents);
    let jobs = d.jobs().await?;
    node_admin(&d, "b1", false).await?;
    wait_jobs(
        &jobs,
        "b1 to steal from a1 across zones",
        |all| {
            all.iter().any(|j| {
                j.node == "b1"
                    && j.reason.contains("steal: b1 took it from overloaded a1")
                    && j.reason.contains("another zone")
            })
        },
        ctx,
    )
    .await?;
    let mut c = jobs.clone();
    wait_until_done(&mut c, &HashSet::new(), LONG, ctx).await?;
    let all = all_jobs(&mut c).await?;
    let failed: Vec<Job> = all
        .into_iter()
        .filter(|j| j.state != JobState::Succeeded as i32)
        .collect();
    ensure!(failed.is_empty(), "{}\n{}", describe(&failed), ctx());
    Ok(())
}

// ----------------------------------------------------------------------
// 3. A killed agent

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agents_jobs_are_retried_elsewhere_or_lost() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Heartbeats every 200 ms: a silent node is DOWN in ~1 s
    // (five rather than three missed, so a busy test machine does not
    // take the surviving node for dead too).
    let d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "200", "--missed-heartbeats", "5"],
    )?;
    let mut agents = start_agents(
        dir.path(),
        &d,
        &[
            ("a1", "1s:2c:2t", "z1", "r1"),
            ("a2", "1s:2c:2t", "z1", "r1"),
        ],
    )?;
    wait_nodes(&d, 2, Duration::from_secs(60))
        .await
        .with_context(|| logs(&d, &agents))?;
    // Everything starts on a1.
    node_admin(&d, "a2", true).await?;
    let mut jobs = d.jobs().await?;
    let specs = (0..4)
        .map(|i| JobSpec {
            name: format!("retries-{}", i % 2),
            retries: i % 2,
            ..job_spec(sh("sleep 3"))
        })
        .collect();
    let submitted = submit_batches(&mut jobs, specs, 4).await?;
    wait_jobs(
        &jobs,
        "all four jobs RUNNING on a1",
        |all| {
            all.iter()
                .all(|j| j.state == JobState::Running as i32 && j.node == "a1")
        },
        || logs(&d, &agents),
    )
    .await?;
    node_admin(&d, "a2", false).await?;

    // SIGKILL the agent only. Its jobs' shims keep running (by design: jobs
    // survive agent restarts and are re-adopted), but no agent reports them
    // any more, so for the dispatcher the node is lost once its heartbeats
    // are overdue.
    agents[0].proc.kill9();
    let ctx = || logs(&d, &agents);

    let mut nodes = d.nodes().await?;
    eventually(LONG, "a1 DOWN", || {
        let mut n = nodes.clone();
        async move {
            let node = n
                .get_node(GetNodeRequest { name: "a1".into() })
                .await
                .ok()?
                .into_inner();
            (node.state == NodeState::Down as i32).then_some(())
        }
    })
    .await
    .with_context(ctx)?;
    wait_until_done(&mut jobs, &HashSet::new(), LONG, ctx).await?;

    let all = all_jobs(&mut jobs).await?;
    ensure!(all.len() == submitted.len());
    let mut bad = Vec::new();
    for j in &all {
        let retries = j.spec.as_ref().map_or(0, |s| s.retries);
        let ok = if retries == 1 {
            j.state == JobState::Succeeded as i32
                && j.node == "a2"
                && j.attempt == 2
                && j.reason.contains("retry 1 of 1")
                && j.reason.contains("a1")
        } else {
            j.state == JobState::Lost as i32
                && j.node == "a1"
                && j.attempt == 1
                && j.reason.contains("node a1 lost")
        };
        if !ok {
            bad.push(j.clone());
        }
    }
    ensure!(
        bad.is_empty(),
        "jobs not retried on a2 (retries 1) or not LOST (retries 0):\n{}\n{}",
        describe(&bad),
        ctx()
    );
    let node = nodes
        .get_node(GetNodeRequest { name: "a1".into() })
        .await?
        .into_inner();
    ensure!(node.state == NodeState::Down as i32);
    Ok(())
}

// ----------------------------------------------------------------------
// 4. The dispatcher killed and restarted

/// Job directories (`<job>_a<attempt>`) under every agent's state
/// directory: which attempts ran where.
fn attempts_run(dir: &Path, agents: &[Agent]) -> Result<HashMap<String, Vec<String>>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for a in agents {
        let jobs_dir = dir.join(format!("agent-{}", a.node)).join("jobs");
        for entry in std::fs::read_dir(&jobs_dir)
            .with_context(|| format!("reading {}", jobs_dir.display()))?
        {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.starts_with("j-") {
                out.entry(name).or_default().push(a.node.clone());
            }
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_kill9_and_restart_loses_nothing() -> Result<()> {
    const JOBS: usize = 300;
    let dir = tempfile::tempdir()?;
    let mut d = Dispatcher::start(dir.path(), &[])?;
    let agents = start_agents(
        dir.path(),
        &d,
        &[
            ("a1", "1s:4c:1t", "z1", "r1"),
            ("a2", "1s:4c:1t", "z1", "r1"),
            ("b1", "1s:2c:2t", "z2", "r3"),
        ],
    )?;
    wait_nodes(&d, 3, Duration::from_secs(60))
        .await
        .with_context(|| logs(&d, &agents))?;
    let mut jobs = d.jobs().await?;
    // Each job prints a line: a job directory with output is kept after
    // the job (one without is recycled for a later job), so the agents'
    // directories below show which attempts ran where.
    let specs = (0..JOBS)
        .map(|i| match i % 3 {
            0 => job_spec(sh("echo ran; sleep 1")),
            1 => job_spec(sh("echo ran; sleep 0.05")),
            _ => JobSpec {
                cpus: 2,
                ..job_spec(sh("echo ran"))
            },
        })
        .collect();
    let acked = submit_batches(&mut jobs, specs, 50).await?;
    let acked_ids: Vec<String> = acked.iter().map(|j| j.id.clone()).collect();
    ensure!(acked_ids.len() == JOBS);

    // Kill it mid-run: some jobs running, many still waiting.
    let before = wait_jobs(
        &jobs,
        "some jobs running and some finished",
        |all| {
            all.iter().any(|j| j.state == JobState::Running as i32)
                && all.iter().any(|j| j.state == JobState::Succeeded as i32)
        },
        || logs(&d, &agents),
    )
    .await?;
    // Running jobs at the last look before the kill, and their nodes.
    let running_before: HashMap<String, String> = before
        .iter()
        .filter(|j| j.state == JobState::Running as i32)
        .map(|j| (j.id.clone(), j.node.clone()))
        .collect();
    let open_before = before.iter().filter(|j| !is_terminal(j.state)).count();
    eprintln!(
        "at the kill: {open_before} of {JOBS} jobs open, {} running",
        running_before.len()
    );
    drop(jobs);
    d.kill9_and_restart(dir.path())?;
    let ctx = || logs(&d, &agents);
    // The agents reconnect by themselves (with backoff).
    wait_nodes(&d, 3, LONG).await.with_context(ctx)?;
    let mut jobs = d.jobs().await?;
    wait_until_done(&mut jobs, &HashSet::new(), LONG, ctx).await?;

    let all = all_jobs(&mut jobs).await?;
    let by_id: HashMap<&str, &Job> = all.iter().map(|j| (j.id.as_str(), j)).collect();
    ensure!(by_id.len() == all.len(), "a job id is listed twice");
    ensure!(
        all.len() == JOBS,
        "{} jobs after the restart, {JOBS} acknowledged before it",
        all.len()
    );
    let mut bad = Vec::new();
    for id in &acked_ids {
        match by_id.get(id.as_str()) {
            None => bad.push(format!("{id}: missing after the restart")),
            Some(j) if j.state != JobState::Succeeded as i32 || j.attempt != 1 => {
                bad.push(describe(&[(*j).clone()]))
            }
            Some(j) => {
                if let Some(node) = running_before.get(id)
                    && &j.node != node
                {
                    bad.push(format!(
                        "{id} was running on {node} before the kill, ended on {}",
                        j.node
                    ));
                }
            }
        }
    }
    // Each job ran exactly once: one job directory (attempt 1) in all the
    // agents' state directories.
    let ran = attempts_run(dir.path(), &agents)?;
    for id in &acked_ids {
        let key = format!("{id}_a1");
        match ran.get(&key) {
            Some(nodes) if nodes.len() == 1 => {
                let j = by_id[id.as_str()];
                if nodes[0] != j.node {
                    bad.push(format!(
                        "{id} ran on {} but is recorded on {}",
                        nodes[0], j.node
                    ));
                }
            }
            other => bad.push(format!("{id} ran on {other:?}")),
        }
    }
    let extra: Vec<&String> = ran.keys().filter(|k| !k.ends_with("_a1")).collect();
    if !extra.is_empty() {
        bad.push(format!("attempts other than the first ran: {extra:?}"));
    }
    ensure!(
        bad.is_empty(),
        "{} jobs were open at the kill, {} running; problems:\n{}\n{}",
        open_before,
        running_before.len(),
        bad[..bad.len().min(40)].join("\n"),
        ctx()
    );

    // New submissions continue the id sequence.
    let last = acked_ids
        .iter()
        .filter_map(|id| id.strip_prefix("j-")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    let next = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(job_spec(vec!["true".into()])),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    ensure!(
        next.id == format!("j-{}", last + 1),
        "after the restart the next id is {}, the last before it j-{last}",
        next.id
    );
    wait_until_done(&mut jobs, &HashSet::new(), LONG, ctx).await?;
    let j = jobs
        .get_job(proto::v1::GetJobRequest { id: next.id })
        .await?
        .into_inner();
    ensure!(j.state == JobState::Succeeded as i32, "{}", describe(&[j]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_jobs_stay_readable_for_their_retention_across_restarts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut d = Dispatcher::start(dir.path(), &["--job-retention-s", "3"])?;
    let agents = start_agents(dir.path(), &d, &[("a1", "1s:2c:1t", "z1", "r1")])?;
    wait_nodes(&d, 1, Duration::from_secs(60))
        .await
        .with_context(|| logs(&d, &agents))?;
    let mut jobs = d.jobs().await?;
    let id = submit_batches(&mut jobs, vec![job_spec(vec!["true".into()])], 1).await?[0]
        .id
        .clone();
    let state = |jobs: &JobServiceClient<Channel>| {
        let (mut c, id) = (jobs.clone(), id.clone());
        async move {
            match c.get_job(proto::v1::GetJobRequest { id }).await {
                Ok(j) => Some(j.into_inner().state),
                Err(s) if s.code() == tonic::Code::NotFound => None,
                Err(s) => Some(-(s.code() as i32)),
            }
        }
    };
    eventually(LONG, "the job succeeded", || {
        let s = state(&jobs);
        async move { (s.await == Some(JobState::Succeeded as i32)).then_some(()) }
    })
    .await
    .with_context(|| logs(&d, &agents))?;
    // Kept across a restart (well within its 3 s).
    drop(jobs);
    d.kill9_and_restart(dir.path())?;
    let jobs = d.jobs().await?;
    ensure!(
        state(&jobs).await == Some(JobState::Succeeded as i32),
        "an ended job was not reloaded within its retention:\n{}",
        logs(&d, &agents)
    );
    // Then forgotten, and still forgotten after another restart.
    eventually(LONG, "the ended job forgotten", || {
        let s = state(&jobs);
        async move { s.await.is_none().then_some(()) }
    })
    .await
    .with_context(|| logs(&d, &agents))?;
    drop(jobs);
    d.kill9_and_restart(dir.path())?;
    let mut jobs = d.jobs().await?;
    ensure!(state(&jobs).await.is_none(), "a deleted job came back");
    ensure!(
        all_jobs(&mut jobs).await?.is_empty(),
        "a deleted job is listed"
    );
    Ok(())
}
