//! Pending reasons end to end, against a real dispatcher and agent: a job
//! no node can take and jobs waiting behind a running one say why, with
//! the same kind, node, count and time through gRPC (GetJob, ListJobs,
//! WatchJobs) and `dispatchctl` (get, get -o json, ls), and stop saying it
//! once they run.

use std::time::Duration;

use anyhow::{Context, Result};
use e2e::{Agent, Dispatcher, dispatchctl_ok, eventually, wait_nodes};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{
    CancelJobRequest, GetJobRequest, Job, JobSpec, JobState, ListJobsRequest, PendingReasonKind,
    SubmitJobsRequest, WatchJobsRequest,
};
use tonic::transport::Channel;

/// How long anything may take before the test gives up (the suite runs on
/// 2 busy cores).
const T: Duration = Duration::from_secs(60);

fn spec(cpus: u32, command: &[&str], timeout_ms: u64) -> JobSpec {
    JobSpec {
        command: command.iter().map(|s| s.to_string()).collect(),
        cpus,
        timeout_ms,
        ..Default::default()
    }
}

async fn get(c: &mut JobServiceClient<Channel>, id: &str) -> Result<Job> {
    Ok(c.get_job(GetJobRequest { id: id.into() })
        .await?
        .into_inner())
}

async fn ctl(url: &str, args: &[&str]) -> Result<String> {
    dispatchctl_ok(url, args, T).await
}

/// The value of `Field:` in `get`'s detail view.
fn field<'a>(detail: &'a str, name: &str) -> Option<&'a str> {
    detail
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_say_why_through_grpc_and_dispatchctl() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let _a = Agent::start(dir.path(), &d.url, "node-a", "1s:2c:1t", &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let mut c = d.jobs().await?;

    // j-1 holds both CPUs of node-a for at most 60 s; j-2 (2 CPUs) is next
    // in node-a's queue, j-3 behind it; j-4 asks for more CPUs than any
    // node has.
    let jobs = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![
                spec(2, &["sleep", "30"], 60_000),
                spec(2, &["true"], 0),
                spec(1, &["true"], 0),
                spec(16, &["true"], 0),
            ],
        })
        .await?
        .into_inner()
        .jobs;
    let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
    let submitted = jobs[0].submit_time_ms;
    let running = eventually(T, "j-1 running", || {
        let mut c = c.clone();
        let id = ids[0].clone();
        async move {
            let j = get(&mut c, &id).await.ok()?;
            (j.state == JobState::Running as i32).then_some(j)
        }
    })
    .await?;
    assert_eq!(running.pending_reason, None, "a running job does not wait");

    // gRPC: GetJob.
    let head = get(&mut c, &ids[1]).await?;
    let r = head.pending_reason.context("j-2 has no pending reason")?;
    assert_eq!(r.kind(), PendingReasonKind::Resources, "{r:?}");
    assert_eq!((r.node.as_str(), r.jobs_ahead), ("node-a", 0));
    // Its reservation: j-1's timeout from when it started, at the latest.
    assert!(
        r.until_ms > submitted && r.until_ms <= submitted + 60_000 + 5_000,
        "until {} vs submitted {submitted}: {r:?}",
        r.until_ms
    );
    let behind = get(&mut c, &ids[2])
        .await?
        .pending_reason
        .context("j-3 has no pending reason")?;
    assert_eq!(behind.kind(), PendingReasonKind::QueuedBehind, "{behind:?}");
    assert_eq!((behind.node.as_str(), behind.jobs_ahead), ("node-a", 1));
    let none = get(&mut c, &ids[3])
        .await?
        .pending_reason
        .context("j-4 has no pending reason")?;
    assert_eq!(none.kind(), PendingReasonKind::NoMatchCpus, "{none:?}");
    assert!(
        none.message
            .contains("0/1 nodes match: 1 have fewer than 16 CPUs (largest 2)"),
        "{}",
        none.message
    );

    // gRPC: ListJobs and WatchJobs carry the same.
    let listed = c
        .list_jobs(ListJobsRequest {
            states: vec![JobState::Pending as i32],
            ..Default::default()
        })
        .await?
        .into_inner()
        .jobs;
    let kinds: Vec<(String, Option<PendingReasonKind>)> = listed
        .iter()
        .map(|j| (j.id.clone(), j.pending_reason.as_ref().map(|r| r.kind())))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (ids[3].clone(), Some(PendingReasonKind::NoMatchCpus)),
            (ids[2].clone(), Some(PendingReasonKind::QueuedBehind)),
            (ids[1].clone(), Some(PendingReasonKind::Resources)),
        ]
    );
    let mut watch = c
        .watch_jobs(WatchJobsRequest {
            ids: vec![ids[2].clone()],
            include_current: true,
        })
        .await?
        .into_inner();
    let current = tokio::time::timeout(T, watch.message())
        .await??
        .context("watch ended")?;
    let job = current.job.context("event without a job")?;
    assert_eq!(
        job.pending_reason.map(|r| (r.kind(), r.jobs_ahead)),
        Some((PendingReasonKind::QueuedBehind, 1))
    );

    // dispatchctl get: the Waiting rows.
    let detail = ctl(&d.url, &["get", &ids[2]]).await?;
    assert_eq!(
        field(&detail, "Waiting"),
        Some("queued_behind: waiting behind 1 job in node-a's queue (0 of its 2 CPUs free)"),
        "{detail}"
    );
    assert_eq!(field(&detail, "Waiting on"), Some("node-a"), "{detail}");
    assert_eq!(field(&detail, "Jobs ahead"), Some("1"), "{detail}");
    let detail = ctl(&d.url, &["get", &ids[1]]).await?;
    let until = field(&detail, "Until").context("j-2: no Until row")?;
    assert!(until.contains("(in "), "{detail}");
    // -o json carries the structured field.
    let json: serde_json::Value =
        serde_json::from_str(&ctl(&d.url, &["get", &ids[3], "-o", "json"]).await?)?;
    assert_eq!(json["pending_reason"]["kind"], "no_match_cpus", "{json}");
    assert!(json["pending_reason"]["node"].is_null(), "{json}");
    // ls: the kind leads the REASON column of waiting jobs.
    let table = ctl(&d.url, &["ls", "-o", "wide"]).await?;
    for (id, kind) in [
        (&ids[1], "resources:"),
        (&ids[2], "queued_behind:"),
        (&ids[3], "no_match_cpus:"),
    ] {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id.as_str()))
            .with_context(|| format!("{id} not listed:\n{table}"))?;
        assert!(line.contains(kind), "{line}");
    }

    // j-1 ends: j-2 and j-3 run and stop waiting; j-4 still cannot.
    c.cancel_job(CancelJobRequest { id: ids[0].clone() })
        .await?;
    for id in &ids[1..3] {
        eventually(T, &format!("{id} no longer pending"), || {
            let mut c = c.clone();
            let id = id.clone();
            async move {
                let j = get(&mut c, &id).await.ok()?;
                (j.state != JobState::Pending as i32).then_some(j)
            }
        })
        .await?;
    }
    let j4 = get(&mut c, &ids[3]).await?;
    assert_eq!(
        j4.pending_reason.map(|r| r.kind()),
        Some(PendingReasonKind::NoMatchCpus)
    );
    let done = eventually(T, "j-3 done", || {
        let mut c = c.clone();
        let id = ids[2].clone();
        async move {
            let j = get(&mut c, &id).await.ok()?;
            (j.state == JobState::Succeeded as i32).then_some(j)
        }
    })
    .await?;
    assert_eq!(done.pending_reason, None);
    Ok(())
}
