//! etcd leader failover under a running dispatcher: a three-member etcd
//! cluster on loopback (started by the test; 500 ms election timeout),
//! two dispatcher replicas on it (`--store etcd`, all three endpoints,
//! the shortest leader lease, 2 s, told etcd's election timeout),
//! two agents following the leader. While jobs run, the test finds the
//! etcd leader through the members' `/metrics` (`etcd_server_is_leader`)
//! and SIGKILLs it. Dispatcher leadership must resume within 5 s of the
//! kill, measured as the first write acknowledged after it (a probe job
//! submitted through the replicas' leader redirect), and every job must
//! end exactly once (one marker each, outside the dispatcher).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::faults::{ETCD_ELECTION_TIMEOUT_MS, EtcdCluster, Markers, Rng, exactly_once};
use e2e::{Agent, Dispatcher, is_terminal};
use proto::endpoints::{Endpoints, LeaderChannel};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{Job, JobSpec, JobState, ListNodesRequest, NodeState};
use proto::v1::{SubmitJobRequest, SubmitJobsRequest};

/// The bound the brief sets on leadership coming back.
const RESUME_BOUND: Duration = Duration::from_secs(5);

fn client(urls: &[String], patience: Duration) -> Result<LeaderChannel> {
    Ok(LeaderChannel::new(Endpoints::new(urls.to_vec())?, patience))
}

async fn submit(urls: &[String], specs: Vec<JobSpec>) -> Result<()> {
    let req = SubmitJobsRequest { specs };
    client(urls, Duration::from_secs(60))?
        .call(|ch| {
            let req = req.clone();
            async move { JobServiceClient::new(ch).submit_jobs(req).await }
        })
        .await
        .context("SubmitJobs")?;
    Ok(())
}

async fn jobs(urls: &[String]) -> Result<Vec<Job>> {
    e2e::leader_jobs(&mut client(urls, Duration::from_secs(30))?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leader_kill_dispatcher_resumes_within_5s() -> Result<()> {
    let mut rng = Rng::from_env("faults_etcd");
    let dir = tempfile::tempdir()?;
    let markers = Markers::new(dir.path())?;
    let mut etcd = EtcdCluster::start(dir.path(), 3)?;
    let endpoints = etcd.endpoints();
    let replicas = (0..2)
        .map(|_| {
            Dispatcher::start_replica(
                dir.path(),
                &endpoints,
                &[
                    "--lease-ttl-secs",
                    "2",
                    "--etcd-election-timeout-ms",
                    &ETCD_ELECTION_TIMEOUT_MS.to_string(),
                ],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = replicas.iter().map(|d| d.url.clone()).collect();
    let all = urls.join(",");
    let agents = ["a1", "a2"]
        .iter()
        .map(|n| Agent::start(dir.path(), &all, n, "1s:4c:1t", &[], &[]))
        .collect::<Result<Vec<_>>>()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = client(&urls, Duration::from_secs(5))?
            .call(|ch| async move {
                NodeServiceClient::new(ch)
                    .list_nodes(ListNodesRequest::default())
                    .await
            })
            .await
            .map(|r| {
                r.into_inner()
                    .nodes
                    .iter()
                    .filter(|n| n.state == NodeState::Ready as i32)
                    .count()
            })
            .unwrap_or(0);
        if ready == agents.len() {
            break;
        }
        ensure!(Instant::now() < deadline, "the agents did not attach");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut acked = Vec::new();
    let mut spec = |token: String, rng: &mut Rng| {
        let ms = rng.range(200, 800);
        let s = markers.spec(&token, &format!("0.{ms:03}"), 3);
        acked.push(token);
        s
    };
    let before: Vec<JobSpec> = (0..150).map(|i| spec(format!("t{i}"), &mut rng)).collect();
    submit(&urls, before).await?;
    // Kill while jobs run.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let running = jobs(&urls)
            .await?
            .iter()
            .filter(|j| j.state == JobState::Running as i32)
            .count();
        if running >= 4 {
            break;
        }
        ensure!(Instant::now() < deadline, "no jobs ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some(leader) = etcd.leader() else {
        bail!("no etcd member reports itself leader");
    };
    etcd.kill9(leader);
    let killed = Instant::now();

    // Probe writes, each a job of its own, one more every 100 ms, until
    // one is acknowledged: a probe waiting behind a held commit is
    // acknowledged when the dispatcher writes again, so the first
    // acknowledgement times the resumption to within a few ms.
    let mut probes = 0usize;
    let mut in_flight = tokio::task::JoinSet::new();
    let mut probe_acked = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let resumed = loop {
        tokio::select! {
            _ = tick.tick() => {
                if killed.elapsed() > Duration::from_secs(60) {
                    bail!("no dispatcher leader wrote within 60 s of the etcd leader's kill");
                }
                let token = format!("probe{probes}");
                probes += 1;
                let req = SubmitJobRequest {
                    spec: Some(markers.spec(&token, "0", 3)),
                };
                let urls = urls.clone();
                in_flight.spawn(async move {
                    let mut leader = client(&urls, Duration::from_millis(500))?;
                    let call = leader.call(|ch| {
                        let req = req.clone();
                        async move { JobServiceClient::new(ch).submit_job(req).await }
                    });
                    tokio::time::timeout(Duration::from_secs(10), call).await??;
                    anyhow::Ok(token)
                });
            }
            Some(done) = in_flight.join_next() => {
                if let Ok(Ok(token)) = done {
                    probe_acked.push(token);
                    break killed.elapsed();
                }
            }
        }
    };
    // Probes still in flight may be written or not: not acknowledged.
    in_flight.abort_all();
    let new_leader = (0..etcd.members.len()).find_map(|_| etcd.leader());
    println!(
        "faults_etcd: killed etcd leader m{leader}; a dispatcher write was acknowledged {:.2} s later \
         ({} probes); etcd leader now {:?}",
        resumed.as_secs_f64(),
        probes,
        new_leader.map(|i| format!("m{i}"))
    );

    let after: Vec<JobSpec> = (0..50).map(|i| spec(format!("u{i}"), &mut rng)).collect();
    submit(&urls, after).await?;
    let deadline = Instant::now() + Duration::from_secs(180);
    let all = loop {
        if let Ok(all) = jobs(&urls).await
            && all.iter().all(|j| is_terminal(j.state))
        {
            break all;
        }
        ensure!(Instant::now() < deadline, "jobs did not end");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    acked.extend(probe_acked);
    // Probes not acknowledged may exist; exactly_once also catches any
    // token with two markers.
    let problems = exactly_once(&acked, &all, &markers);
    if !problems.is_empty() {
        let kept = dir.keep();
        bail!("{problems:?}\nlogs kept in {}", kept.display());
    }
    if resumed >= RESUME_BOUND {
        let mut logs = String::new();
        for r in &replicas {
            let text = r.proc.log_text();
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("dispatcher::ha") || l.contains("ERROR"))
                .collect();
            logs += &format!(
                "---- {} ----\n{}\n",
                r.url,
                lines[lines.len().saturating_sub(25)..].join("\n")
            );
        }
        bail!(
            "dispatcher leadership took {resumed:?} to resume after the etcd leader's kill\n{logs}"
        );
    }
    drop(agents);
    drop(replicas);
    Ok(())
}
