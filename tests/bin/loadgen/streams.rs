//! The clients' side of the load: an open-loop submission stream
//! (SubmitJob, or SubmitJobs batches) at a target rate, and a read stream
//! (GetJob of recently submitted jobs, ListNodes) beside it.
//!
//! Open loop: calls leave on a fixed schedule whatever the latency of the
//! previous ones (each call is its own task), and every latency is
//! measured from the call's *scheduled* time, so a slow dispatcher or a
//! starved load generator shows up in the figures instead of silently
//! lowering the rate (no coordinated omission). Calls that would exceed
//! `max_in_flight` are not sent and are counted as skipped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{GetJobRequest, JobSpec, ListNodesRequest, SubmitJobRequest, SubmitJobsRequest};
use tokio::task::JoinSet;
use tonic::Status;
use tonic::transport::Channel;

use crate::agents::SUBMIT_ENV;
use crate::latency::{Kind, Latencies};

/// The group of every job the load generator submits in the load phase.
pub const GROUP: &str = "loadgen";
/// The group of the unplaceable jobs of the pending-memory phase.
pub const PENDING_GROUP: &str = "loadgen-pending";
/// A label no node carries: the selector of unplaceable jobs.
pub const UNPLACEABLE_LABEL: &str = "loadgen.dispatch.io/unplaceable";

/// What to send.
#[derive(Clone, Debug)]
pub struct LoadPlan {
    /// Jobs per second.
    pub rate: f64,
    /// Jobs per call: 1 = SubmitJob, more = SubmitJobs.
    pub batch: usize,
    /// How long to submit.
    pub duration: Duration,
    /// Mean job duration (uniform in [0.5, 1.5] x this).
    pub job_ms: u64,
    /// CPUs per job, cycled through.
    pub job_cpus: Vec<u32>,
    /// GetJob calls per second.
    pub get_rate: f64,
    /// ListNodes calls per second.
    pub list_nodes_rate: f64,
    /// Nodes per ListNodes page (0: every node in one answer).
    pub list_nodes_page: u32,
    /// Most calls outstanding per stream.
    pub max_in_flight: usize,
    /// Seed of the job durations and of the GetJob targets.
    pub seed: u64,
}

/// The clients the streams use.
#[derive(Clone)]
pub struct Clients {
    /// Job clients, used round-robin (one HTTP/2 connection each).
    pub jobs: Vec<JobServiceClient<Channel>>,
    /// The node client.
    pub nodes: NodeServiceClient<Channel>,
}

/// What the submission stream achieved.
#[derive(Debug, Default)]
pub struct LoadOutcome {
    /// Jobs the dispatcher accepted.
    pub submitted: u64,
    /// Jobs in calls that failed.
    pub failed: u64,
    /// Jobs not sent: too many calls in flight.
    pub skipped: u64,
    /// From the first scheduled call to the last answer.
    pub elapsed: Duration,
}

#[derive(Default)]
struct Shared {
    ids: Mutex<Vec<String>>,
    submitted: AtomicU64,
    failed: AtomicU64,
    skipped: AtomicU64,
}

/// splitmix64: a seeded, reproducible draw per index.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn unit(seed: u64, i: u64) -> f64 {
    (splitmix64(seed ^ splitmix64(i)) >> 11) as f64 / (1u64 << 53) as f64
}

/// The spec of load job number `seq`, scheduled at `submit_us` after the
/// run's base instant.
pub fn job_spec(plan: &LoadPlan, seq: u64, submit_us: u64) -> JobSpec {
    let secs = plan.job_ms as f64 / 1000.0 * (0.5 + unit(plan.seed, seq));
    let cpus = if plan.job_cpus.is_empty() {
        1
    } else {
        plan.job_cpus[(seq % plan.job_cpus.len() as u64) as usize]
    };
    JobSpec {
        name: format!("lg-{seq}"),
        command: vec!["sleep".into(), format!("{secs:.3}")],
        cpus,
        group: GROUP.into(),
        env: HashMap::from([(SUBMIT_ENV.to_string(), submit_us.to_string())]),
        ..Default::default()
    }
}

/// Run the submission and read streams for `plan.duration`, then wait for
/// the calls still in flight.
pub async fn run(
    clients: Clients,
    plan: LoadPlan,
    base: Instant,
    lat: Arc<Latencies>,
) -> LoadOutcome {
    let plan = Arc::new(plan);
    let shared = Arc::new(Shared::default());
    let start = tokio::time::Instant::now();
    let submit = tokio::spawn(submit_stream(
        clients.jobs.clone(),
        plan.clone(),
        base,
        start,
        lat.clone(),
        shared.clone(),
    ));
    let gets = tokio::spawn(read_stream(
        Reader::GetJob(clients.jobs[0].clone()),
        plan.clone(),
        start,
        lat.clone(),
        shared.clone(),
    ));
    let lists = tokio::spawn(read_stream(
        Reader::ListNodes(clients.nodes.clone()),
        plan.clone(),
        start,
        lat.clone(),
        shared.clone(),
    ));
    let _ = tokio::join!(submit, gets, lists);
    LoadOutcome {
        submitted: shared.submitted.load(Ordering::Relaxed),
        failed: shared.failed.load(Ordering::Relaxed),
        skipped: shared.skipped.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    }
}

async fn submit_stream(
    clients: Vec<JobServiceClient<Channel>>,
    plan: Arc<LoadPlan>,
    base: Instant,
    start: tokio::time::Instant,
    lat: Arc<Latencies>,
    shared: Arc<Shared>,
) {
    let batch = plan.batch.max(1);
    let calls_per_s = plan.rate / batch as f64;
    if calls_per_s <= 0.0 || clients.is_empty() {
        return;
    }
    let calls = (plan.duration.as_secs_f64() * calls_per_s).floor() as u64;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut set = JoinSet::new();
    for call in 0..calls {
        let due = start + Duration::from_secs_f64(call as f64 / calls_per_s);
        tokio::time::sleep_until(due).await;
        while set.try_join_next().is_some() {}
        if in_flight.load(Ordering::Relaxed) >= plan.max_in_flight {
            shared.skipped.fetch_add(batch as u64, Ordering::Relaxed);
            continue;
        }
        let due = due.into_std();
        let submit_us = due.saturating_duration_since(base).as_micros() as u64;
        let mut specs: Vec<JobSpec> = (0..batch as u64)
            .map(|k| job_spec(&plan, call * batch as u64 + k, submit_us))
            .collect();
        let mut client = clients[(call % clients.len() as u64) as usize].clone();
        let (lat, shared, in_flight) = (lat.clone(), shared.clone(), in_flight.clone());
        in_flight.fetch_add(1, Ordering::Relaxed);
        set.spawn(async move {
            let (kind, result) = if batch == 1 {
                let spec = specs.pop();
                let r = client.submit_job(SubmitJobRequest { spec }).await;
                (Kind::SubmitJob, r.map(|r| r.into_inner().jobs))
            } else {
                let r = client.submit_jobs(SubmitJobsRequest { specs }).await;
                (Kind::SubmitJobs, r.map(|r| r.into_inner().jobs))
            };
            let took = due.elapsed();
            match result {
                Ok(jobs) => {
                    lat.record(kind, took);
                    shared
                        .submitted
                        .fetch_add(jobs.len() as u64, Ordering::Relaxed);
                    let mut ids = shared.ids.lock().unwrap_or_else(|e| e.into_inner());
                    ids.extend(jobs.into_iter().map(|j| j.id));
                }
                Err(status) => {
                    lat.error(kind, status);
                    shared.failed.fetch_add(batch as u64, Ordering::Relaxed);
                }
            }
            in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }
    while set.join_next().await.is_some() {}
}

enum Reader {
    GetJob(JobServiceClient<Channel>),
    ListNodes(NodeServiceClient<Channel>),
}

async fn read_stream(
    reader: Reader,
    plan: Arc<LoadPlan>,
    start: tokio::time::Instant,
    lat: Arc<Latencies>,
    shared: Arc<Shared>,
) {
    let rate = match reader {
        Reader::GetJob(_) => plan.get_rate,
        Reader::ListNodes(_) => plan.list_nodes_rate,
    };
    if rate <= 0.0 {
        return;
    }
    let calls = (plan.duration.as_secs_f64() * rate).floor() as u64;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut set = JoinSet::new();
    for call in 0..calls {
        let due = start + Duration::from_secs_f64(call as f64 / rate);
        tokio::time::sleep_until(due).await;
        while set.try_join_next().is_some() {}
        if in_flight.load(Ordering::Relaxed) >= plan.max_in_flight {
            continue;
        }
        let due = due.into_std();
        let (lat, in_flight2) = (lat.clone(), in_flight.clone());
        match &reader {
            Reader::GetJob(client) => {
                let id = {
                    let ids = shared.ids.lock().unwrap_or_else(|e| e.into_inner());
                    if ids.is_empty() {
                        continue; // nothing submitted yet
                    }
                    // Mostly recent jobs (the last 1000), as a UI polls.
                    let window = ids.len().min(1000) as u64;
                    let back = splitmix64(plan.seed ^ call) % window;
                    ids[ids.len() - 1 - back as usize].clone()
                };
                let mut client = client.clone();
                in_flight.fetch_add(1, Ordering::Relaxed);
                set.spawn(async move {
                    match client.get_job(GetJobRequest { id }).await {
                        Ok(_) => lat.record(Kind::GetJob, due.elapsed()),
                        Err(status) => lat.error(Kind::GetJob, status),
                    }
                    in_flight2.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Reader::ListNodes(client) => {
                let mut client = client.clone();
                in_flight.fetch_add(1, Ordering::Relaxed);
                let page_size = plan.list_nodes_page;
                set.spawn(async move {
                    match list_every_node(&mut client, page_size).await {
                        Ok(()) => lat.record(Kind::ListNodes, due.elapsed()),
                        Err(status) => lat.error(Kind::ListNodes, status),
                    }
                    in_flight2.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
    }
    while set.join_next().await.is_some() {}
}

/// Read every node, in pages of `page_size` (0: one answer), following
/// the page tokens as `dispatchctl nodes` does.
async fn list_every_node(
    client: &mut NodeServiceClient<Channel>,
    page_size: u32,
) -> Result<(), Status> {
    let mut token = String::new();
    loop {
        let page = client
            .list_nodes(ListNodesRequest {
                page_size,
                page_token: std::mem::take(&mut token),
            })
            .await?
            .into_inner();
        if page.next_page_token.is_empty() {
            return Ok(());
        }
        token = page.next_page_token;
    }
}

/// Submit `count` jobs no node can run (a selector on a label no node
/// carries) as arrays of `batch` elements (SubmitJob with `array_count`;
/// each element is a job of its own); returns the jobs accepted and the
/// arrays' ids.
pub async fn submit_unplaceable(
    client: &mut JobServiceClient<Channel>,
    count: u64,
    batch: u64,
    lat: &Latencies,
) -> (u64, Vec<String>) {
    let mut accepted = 0;
    let mut arrays = Vec::new();
    let mut next = 0;
    while next < count {
        let n = batch.min(count - next).max(1);
        let spec = JobSpec {
            name: format!("lg-pending-{next}"),
            command: vec!["sleep".into(), "1".into()],
            group: PENDING_GROUP.into(),
            node_selector: HashMap::from([(UNPLACEABLE_LABEL.to_string(), "true".into())]),
            array_count: n as u32,
            ..Default::default()
        };
        next += n;
        let sent = Instant::now();
        match client
            .submit_job(SubmitJobRequest { spec: Some(spec) })
            .await
        {
            Ok(r) => {
                lat.record(Kind::SubmitPending, sent.elapsed());
                let jobs = r.into_inner().jobs;
                accepted += jobs.len() as u64;
                if let Some(j) = jobs.first() {
                    arrays.push(if j.array_id.is_empty() {
                        j.id.clone()
                    } else {
                        j.array_id.clone()
                    });
                }
            }
            Err(status) => lat.error(Kind::SubmitPending, status),
        }
    }
    (accepted, arrays)
}

/// Cancel jobs or arrays by id; returns the calls that failed.
pub async fn cancel(client: &mut JobServiceClient<Channel>, ids: &[String]) -> u64 {
    let mut failed = 0;
    for id in ids {
        if client
            .cancel_job(proto::v1::CancelJobRequest { id: id.clone() })
            .await
            .is_err()
        {
            failed += 1;
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> LoadPlan {
        LoadPlan {
            rate: 10.0,
            batch: 1,
            duration: Duration::from_secs(1),
            job_ms: 2000,
            job_cpus: vec![1, 2],
            get_rate: 0.0,
            list_nodes_rate: 0.0,
            list_nodes_page: 0,
            max_in_flight: 10,
            seed: 7,
        }
    }

    #[test]
    fn job_specs_carry_their_submit_time_and_a_seeded_duration() {
        let p = plan();
        let a = job_spec(&p, 3, 1234);
        assert_eq!(a.env.get(SUBMIT_ENV).map(String::as_str), Some("1234"));
        assert_eq!((a.cpus, a.group.as_str()), (2, GROUP));
        assert_eq!(a.command[0], "sleep");
        let secs: f64 = a.command[1].parse().unwrap();
        assert!((1.0..=3.0).contains(&secs), "{secs}");
        // Reproducible from the seed.
        assert_eq!(job_spec(&p, 3, 1234).command, a.command);
        // Durations spread over the range.
        let distinct: std::collections::BTreeSet<String> = (0..50)
            .map(|i| job_spec(&p, i, 0).command[1].clone())
            .collect();
        assert!(distinct.len() > 25);
    }

    #[test]
    fn the_unit_draw_stays_in_zero_one() {
        for i in 0..10_000 {
            let u = unit(42, i);
            assert!((0.0..1.0).contains(&u));
        }
    }
}
