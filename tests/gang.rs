//! Issue 16's gangs end to end: a real dispatcher and four real agent
//! processes on loopback ports (synthetic 2-CPU topologies; rack r1 holds
//! a1, a2, a3, rack r2 holds b1, all in zone z1), and `dispatchctl`.
//!
//! [`gangs_start_together_wait_holding_nothing_and_restart_on_member_loss`]:
//! 1. `dispatchctl submit --nodes 2 --within rack` prints the gang's id
//!    then its members'; both members run on two distinct nodes of r1,
//!    and their ASSIGNED events carry one time (one operation of the
//!    dispatcher); each member's environment names its index and its
//!    peers' nodes; no read of the job table ever shows one member placed
//!    and the other waiting; `dispatchctl get` and `ls --gang` show the
//!    gang.
//! 2. A gang of 3 within one rack cannot start (r1 has one free node, r2
//!    one node): its members stay PENDING with a gang pending reason, and
//!    hold nothing: a 2-CPU single job submitted next starts at once.
//! 3. The agent of a member's node is SIGKILLed: once its heartbeats run
//!    out, the gang restarts (restart-all, the default): both members run
//!    again as attempt 2 on two live nodes of r1, with the retry in their
//!    reason.
//! 4. A gang of 3 preferring one rack waits for it (`gang_resources`),
//!    then, after its `--relax-after`, runs across both racks.
//!
//! Waits are generous; nothing asserts wall-clock performance. A failure
//! prints the jobs and the tails of the process logs.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use e2e::{Agent, Dispatcher, all_jobs, dispatchctl, dispatchctl_timeout, eventually, wait_nodes};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{
    CancelJobRequest, Job, JobSpec, JobState, PendingReasonKind, SubmitJobRequest,
    WatchJobsRequest, Within,
};
use tonic::transport::Channel;

const ZONE: &str = "topology.kubernetes.io/zone";
const RACK: &str = "dispatch.io/rack";
const LONG: Duration = Duration::from_secs(120);

fn start_agents(dir: &Path, d: &Dispatcher, specs: &[(&str, &str)]) -> Result<Vec<Agent>> {
    specs
        .iter()
        .map(|(node, rack)| {
            let z = format!("{ZONE}=z1");
            let r = format!("{RACK}={rack}");
            Agent::start(dir, &d.url, node, "1s:2c:1t", &[&z, &r], &[])
        })
        .collect()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn logs(d: &Dispatcher, agents: &[Agent]) -> String {
    let mut out = format!("---- dispatcher ----\n{}\n", tail(&d.proc.log_text(), 60));
    for a in agents {
        out += &format!(
            "---- agent {} ----\n{}\n",
            a.node,
            tail(&a.proc.log_text(), 15)
        );
    }
    out
}

fn describe(jobs: &[Job]) -> String {
    jobs.iter()
        .map(|j| {
            format!(
                "  {} state={} node={:?} attempt={} reason={:?} pending={:?}",
                j.id,
                j.state,
                j.node,
                j.attempt,
                j.reason,
                j.pending_reason.as_ref().map(|r| &r.message)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn rack_of(node: &str) -> &'static str {
    if node.starts_with('a') { "r1" } else { "r2" }
}

fn holds(j: &Job) -> bool {
    j.state == JobState::Assigned as i32 || j.state == JobState::Running as i32
}

/// The members of gang `id`, by index.
async fn members(c: &mut JobServiceClient<Channel>, id: &str) -> Result<Vec<Job>> {
    let mut m: Vec<Job> = all_jobs(c)
        .await?
        .into_iter()
        .filter(|j| j.gang_id == id)
        .collect();
    m.sort_by_key(|j| j.gang_index);
    Ok(m)
}

/// A read that shows a gang with some live members on nodes and others
/// waiting: the invariant all-or-nothing forbids.
fn partial(gang: &[Job]) -> bool {
    let live: Vec<&Job> = gang
        .iter()
        .filter(|j| j.state <= JobState::Running as i32)
        .collect();
    let on = live.iter().filter(|j| holds(j)).count();
    on > 0 && on < live.len()
}

async fn wait_gang(
    c: &JobServiceClient<Channel>,
    id: &str,
    what: &str,
    pred: impl Fn(&[Job]) -> bool,
    ctx: impl Fn() -> String,
) -> Result<Vec<Job>> {
    let got = eventually(LONG, what, || {
        let mut c = c.clone();
        let pred = &pred;
        async move {
            let m = members(&mut c, id).await.ok()?;
            pred(&m).then_some(m)
        }
    })
    .await;
    match got {
        Ok(m) => Ok(m),
        Err(e) => {
            let mut c = c.clone();
            let all = all_jobs(&mut c).await.unwrap_or_default();
            bail!("{e:#}\njobs now:\n{}\n{}", describe(&all), ctx())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gangs_start_together_wait_holding_nothing_and_restart_on_member_loss() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // A silent node is DOWN after 5 missed 200 ms heartbeats.
    let d = Dispatcher::start(
        dir.path(),
        &[
            "--heartbeat-ms",
            "200",
            "--missed-heartbeats",
            "5",
            "--http-listen",
            "127.0.0.1:0",
        ],
    )?;
    let web = d.web_port(LONG)?;
    let mut agents = start_agents(
        dir.path(),
        &d,
        &[("a1", "r1"), ("a2", "r1"), ("a3", "r1"), ("b1", "r2")],
    )?;
    wait_nodes(&d, 4, Duration::from_secs(60))
        .await
        .with_context(|| logs(&d, &agents))?;
    let mut jobs = d.jobs().await?;

    // 1. A gang of 2 within one rack, from dispatchctl, watched from the
    // start.
    let mut watch = jobs
        .clone()
        .watch_jobs(WatchJobsRequest {
            ids: vec![],
            include_current: false,
        })
        .await?
        .into_inner();
    let (code, out, err) = dispatchctl(
        &d.url,
        &[
            "submit",
            "--nodes",
            "2",
            "--within",
            "rack",
            "--cpus",
            "2",
            "--retries",
            "1",
            "--",
            "sh",
            "-c",
            "echo \"member $DISPATCH_GANG_INDEX of $DISPATCH_GANG_ID on $DISPATCH_GANG_NODES\"; \
             exec sleep 120",
        ],
    )?;
    ensure!(code == 0, "dispatchctl submit: {code} {out} {err}");
    let printed: Vec<&str> = out.lines().collect();
    ensure!(
        printed == ["j-1", "j-1.0", "j-1.1"],
        "submit printed {printed:?}"
    );
    let ctx = || logs(&d, &agents);
    // Every read while it starts sees all of it or none of it placed.
    let started = eventually(LONG, "gang j-1 running on two r1 nodes", || {
        let mut c = jobs.clone();
        async move {
            let m = members(&mut c, "j-1").await.ok()?;
            if partial(&m) {
                return Some(Err(describe(&m)));
            }
            let running = m.iter().all(|j| j.state == JobState::Running as i32);
            running.then_some(Ok(m))
        }
    })
    .await
    .with_context(ctx)?;
    let gang = match started {
        Ok(m) => m,
        Err(seen) => bail!("a read showed a partial gang:\n{seen}"),
    };
    let nodes: HashSet<&str> = gang.iter().map(|j| j.node.as_str()).collect();
    ensure!(
        nodes.len() == 2 && nodes.iter().all(|n| rack_of(n) == "r1"),
        "members not on two r1 nodes:\n{}",
        describe(&gang)
    );
    // Both ASSIGNED transitions happened in one operation (one time).
    let mut assigned_at = Vec::new();
    while assigned_at.len() < 2 {
        let ev = tokio::time::timeout(LONG, watch.message())
            .await
            .context("watch")??
            .context("watch ended")?;
        let job = ev.job.unwrap_or_default();
        if job.gang_id == "j-1" && job.state == JobState::Assigned as i32 {
            assigned_at.push(ev.time_ms);
        }
    }
    ensure!(
        assigned_at[0] == assigned_at[1],
        "members assigned at different times: {assigned_at:?}"
    );
    // Each member knows its index and its peers' nodes.
    let peers = format!("member 1 of j-1 on {},{}", gang[0].node, gang[1].node);
    eventually(LONG, "member 1's output", || {
        let peers = peers.clone();
        let url = d.url.clone();
        async move {
            let (_, out, _) = dispatchctl(&url, &["logs", "j-1.1"]).ok()?;
            out.contains(&peers).then_some(())
        }
    })
    .await
    .with_context(ctx)?;
    let (code, out, _) = dispatchctl(&d.url, &["get", "j-1.1"])?;
    ensure!(
        code == 0 && out.contains("j-1 (member 1 of 2, within rack"),
        "get j-1.1:\n{out}"
    );
    let (code, out, _) = dispatchctl(&d.url, &["ls", "--gang", "j-1"])?;
    ensure!(
        code == 0 && out.contains("j-1.0") && out.contains("j-1.1"),
        "ls --gang j-1:\n{out}"
    );
    // The gang per node and per rack: `nodes` names it on its members'
    // nodes only; `top --once` counts it once, in rack r1; so does the
    // web page's JSON.
    let (code, out, _) = dispatchctl(&d.url, &["nodes"])?;
    ensure!(code == 0, "nodes: {out}");
    for line in out.lines().skip(1) {
        let node = line.split_whitespace().next().unwrap_or_default();
        ensure!(
            line.contains(" j-1 ") == nodes.contains(node),
            "nodes shows gang j-1 wrongly on {node}:\n{out}"
        );
    }
    let (code, out, _) = dispatchctl(&d.url, &["top", "--once"])?;
    ensure!(
        code == 0 && out.contains("gangs: 1 on 2 nodes"),
        "top --once:\n{out}"
    );
    let rack_line = |rack: &str| {
        out.lines()
            .find(|l| l.split_whitespace().take(2).eq(["z1", rack]))
            .map(|l| l.split_whitespace().last().unwrap_or_default().to_string())
    };
    ensure!(
        rack_line("r1").as_deref() == Some("1") && rack_line("r2").as_deref() == Some("0"),
        "top --once's racks:\n{out}"
    );
    eventually(LONG, "the web page's rack r1 holding gang j-1", || async {
        let (_, body) = e2e::http_get(web, "/api/v1/racks/z1/r1").ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        let on: HashSet<String> = v["nodes"]
            .as_array()?
            .iter()
            .filter(|n| {
                n["gangs"]
                    .as_array()
                    .is_some_and(|g| g.iter().any(|x| x == "j-1"))
            })
            .filter_map(|n| n["name"].as_str().map(String::from))
            .collect();
        let (_, body) = e2e::http_get(web, "/api/v1/cluster").ok()?;
        let c: serde_json::Value = serde_json::from_str(&body).ok()?;
        let r1 = c["zones"][0]["racks"]
            .as_array()?
            .iter()
            .find(|r| r["name"] == "r1")?
            .clone();
        (on.len() == 2
            && nodes.iter().all(|n| on.contains(*n))
            && r1["gangs"] == 1
            && r1["totals"]["gang_members"] == 2)
            .then_some(())
    })
    .await
    .with_context(ctx)?;

    // 2. A gang of 3 within one rack does not fit (r1 has one free node,
    // r2 one node): it waits and holds nothing.
    let big = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(JobSpec {
                command: vec!["sleep".into(), "120".into()],
                cpus: 2,
                nodes: 3,
                within: Within::Rack as i32,
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .jobs;
    ensure!(big.len() == 3 && big[0].gang_id == "j-2");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiting = members(&mut jobs, "j-2").await?;
    for j in &waiting {
        let kind = j.pending_reason.as_ref().map_or(0, |r| r.kind);
        ensure!(
            j.state == JobState::Pending as i32 && kind == PendingReasonKind::GangResources as i32,
            "gang j-2 should wait (gang_resources):\n{}",
            describe(&waiting)
        );
    }
    let single = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(JobSpec {
                command: vec!["true".into()],
                cpus: 2,
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .jobs;
    let single_id = single[0].id.clone();
    eventually(LONG, "the single job to run on a free node", || {
        let mut c = jobs.clone();
        let id = single_id.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            let j = all.into_iter().find(|j| j.id == id)?;
            (j.state == JobState::Succeeded as i32).then_some(())
        }
    })
    .await
    .with_context(ctx)?;
    jobs.cancel_job(CancelJobRequest { id: "j-2".into() })
        .await?;

    // 3. Kill the agent of member 0's node: the gang restarts together.
    let lost = gang[0].node.clone();
    agents
        .iter_mut()
        .find(|a| a.node == lost)
        .context("the lost node's agent")?
        .proc
        .kill9();
    let ctx = || logs(&d, &agents);
    let again = wait_gang(
        &jobs,
        "j-1",
        "gang j-1 running again as attempt 2",
        |m| {
            m.len() == 2
                && m.iter().all(|j| {
                    j.attempt == 2 && j.state == JobState::Running as i32 && j.node != lost
                })
        },
        ctx,
    )
    .await?;
    let nodes: HashSet<&str> = again.iter().map(|j| j.node.as_str()).collect();
    ensure!(
        nodes.len() == 2 && nodes.iter().all(|n| rack_of(n) == "r1"),
        "restarted members not on two live r1 nodes:\n{}",
        describe(&again)
    );
    ensure!(
        again
            .iter()
            .all(|j| j.reason.contains("retry 1 of 1") && j.reason.contains(&lost)),
        "reasons do not name the retry:\n{}",
        describe(&again)
    );
    jobs.cancel_job(CancelJobRequest { id: "j-1".into() })
        .await?;
    wait_gang(
        &jobs,
        "j-1",
        "gang j-1 cancelled",
        |m| m.iter().all(|j| j.state == JobState::Cancelled as i32),
        ctx,
    )
    .await?;

    // 4. Three members preferring one rack: r1 has two live nodes, r2
    // one. The gang waits for its rack, then relaxes after 3 s and runs
    // across both racks.
    let (code, out, err) = dispatchctl(
        &d.url,
        &[
            "submit",
            "--nodes",
            "3",
            "--within",
            "rack",
            "--preferred",
            "--relax-after",
            "3s",
            "--cpus",
            "2",
            "--",
            "true",
        ],
    )?;
    ensure!(code == 0, "dispatchctl submit: {code} {out} {err}");
    let id = out.lines().next().unwrap_or_default().to_string();
    let early = members(&mut jobs, &id).await?;
    ensure!(
        early.len() == 3 && early.iter().all(|j| j.state == JobState::Pending as i32),
        "a preferred gang should first wait for one rack:
{}",
        describe(&early)
    );
    let (_, out, _) = dispatchctl(&d.url, &["get", &format!("{id}.0")])?;
    ensure!(
        out.contains("gang_resources"),
        "get {id}.0:
{out}"
    );
    // `dispatchctl watch GANG_ID` follows the members until all ended.
    let (code, out, err) = dispatchctl_timeout(&d.url, &["watch", &id], LONG)?;
    ensure!(
        code == 0 && (0..3).all(|i| out.contains(&format!("{id}.{i}"))),
        "watch {id}: {code}\n{out}\n{err}"
    );
    let done = wait_gang(
        &jobs,
        &id,
        "the relaxed gang to run across racks and succeed",
        |m| m.len() == 3 && m.iter().all(|j| j.state == JobState::Succeeded as i32),
        ctx,
    )
    .await?;
    let racks: HashSet<&str> = done.iter().map(|j| rack_of(&j.node)).collect();
    ensure!(racks.len() == 2, "not across racks:\n{}", describe(&done));
    Ok(())
}
