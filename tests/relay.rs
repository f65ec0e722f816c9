//! AttachMany end to end: a real dispatcher process and one AttachMany
//! stream carrying three nodes (this test is their relay and their fake
//! agents: it heartbeats every live node in one frame, and answers
//! Assigns with RUNNING and, for jobs it is told to finish, SUCCEEDED).
//!
//! A job assigned to one of the nodes runs and finishes through the
//! stream; then the node running a second job is detached (its session
//! ends as if its own stream broke) while the others keep heartbeating:
//! after the node's lease and heartbeat deadline its job is retried on
//! another node of the same stream, where it finishes, the detached node
//! is DOWN and the others stayed READY throughout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::{Dispatcher, wait_nodes};
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::{
    AgentMessage, Assign, Detach, DispatcherMessage, GetJobRequest, JobSpec, JobState, JobStatus,
    ListNodesRequest, LoadReport, NodeLoad, NodeMessage, NodeState, Register, RelayMessage,
    SubmitJobRequest, agent_message, dispatcher_message, node_message, node_reply,
};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

const HEARTBEAT_MS: u64 = 300;
const NODES: [&str; 3] = ["relay-a", "relay-b", "relay-c"];

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn agent_msg(slot: u32, msg: agent_message::Msg) -> NodeMessage {
    NodeMessage {
        slot,
        msg: Some(node_message::Msg::Message(AgentMessage { msg: Some(msg) })),
    }
}

fn status(a: &Assign, state: JobState) -> agent_message::Msg {
    agent_message::Msg::Status(JobStatus {
        job_id: a.job_id.clone(),
        attempt: a.attempt,
        state: state as i32,
        cpus: vec![0],
        time_ms: now_ms(),
        ..Default::default()
    })
}

/// The test's relay: one AttachMany stream, the live slots heartbeating.
struct Relay {
    tx: mpsc::UnboundedSender<RelayMessage>,
    /// Slots that heartbeat (a detached one stops).
    live: Arc<Mutex<Vec<u32>>>,
    /// Assigns and session ends read from the stream, by slot (leases
    /// and Registered are only counted).
    replies: mpsc::UnboundedReceiver<(u32, node_reply::Msg)>,
}

impl Relay {
    async fn attach(url: &str) -> Result<Self> {
        let mut client = AgentServiceClient::connect(url.to_string()).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let topology = agent::runtime::topology_proto(&agent::topology::synthetic("1s:2c:1t")?);
        // Every node's Register in one frame.
        let nodes = NODES
            .iter()
            .enumerate()
            .map(|(slot, node)| {
                agent_msg(
                    slot as u32,
                    agent_message::Msg::Register(Box::new(Register {
                        node: node.to_string(),
                        topology: Some(topology.clone()),
                        memory_bytes: 8 << 30,
                        version: "relay-test".into(),
                        ..Default::default()
                    })),
                )
            })
            .collect();
        tx.send(RelayMessage { nodes })?;
        let mut inbound = client
            .attach_many(UnboundedReceiverStream::new(rx))
            .await
            .context("AttachMany")?
            .into_inner();
        let (out, replies) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(Ok(frame)) = inbound.next().await {
                for r in frame.nodes {
                    let Some(msg) = r.msg else { continue };
                    let keep = !matches!(
                        &msg,
                        node_reply::Msg::Message(DispatcherMessage {
                            msg: Some(
                                dispatcher_message::Msg::Lease(_)
                                    | dispatcher_message::Msg::Registered(_)
                            )
                        })
                    );
                    if keep && out.send((r.slot, msg)).is_err() {
                        return;
                    }
                }
            }
        });
        let live = Arc::new(Mutex::new((0..NODES.len() as u32).collect::<Vec<_>>()));
        // Heartbeats: every live slot's LoadReport (with a lease seq) in
        // one frame, every 100 ms.
        let (beat_tx, beat_live) = (tx.clone(), live.clone());
        tokio::spawn(async move {
            let mut seq = 0;
            loop {
                seq += 1;
                let slots = beat_live.lock().map(|l| l.clone()).unwrap_or_default();
                let nodes = slots
                    .into_iter()
                    .map(|slot| {
                        agent_msg(
                            slot,
                            agent_message::Msg::Load(LoadReport {
                                load: Some(NodeLoad::default()),
                                seq,
                            }),
                        )
                    })
                    .collect();
                if beat_tx.send(RelayMessage { nodes }).is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Ok(Self { tx, live, replies })
    }

    fn send(&self, nodes: Vec<NodeMessage>) -> Result<()> {
        self.tx.send(RelayMessage { nodes })?;
        Ok(())
    }

    /// The next Assign (its slot), failing on a session's end.
    async fn assign(&mut self) -> Result<(u32, Assign)> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (slot, msg) = tokio::time::timeout(left, self.replies.recv())
                .await
                .context("no Assign within 20 s")?
                .context("the stream ended")?;
            match msg {
                node_reply::Msg::Message(DispatcherMessage {
                    msg: Some(dispatcher_message::Msg::Assign(a)),
                }) => return Ok((slot, a)),
                node_reply::Msg::Ended(e) => bail!("slot {slot} ended: {e:?}"),
                _ => {}
            }
        }
    }

    /// Detach `slot`: it stops heartbeating; the answer is its `ended`
    /// CANCELLED.
    async fn detach(&mut self, slot: u32) -> Result<()> {
        self.live
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .retain(|&s| s != slot);
        self.send(vec![NodeMessage {
            slot,
            msg: Some(node_message::Msg::Detach(Detach {})),
        }])?;
        let (s, msg) = tokio::time::timeout(Duration::from_secs(10), self.replies.recv())
            .await
            .context("no answer to Detach")?
            .context("the stream ended")?;
        match msg {
            node_reply::Msg::Ended(e) if s == slot && e.code == tonic::Code::Cancelled as i32 => {
                Ok(())
            }
            other => bail!("Detach of slot {slot} answered on slot {s} with {other:?}"),
        }
    }
}

async fn node_states(d: &Dispatcher) -> Result<HashMap<String, i32>> {
    let nodes = d
        .nodes()
        .await?
        .list_nodes(ListNodesRequest::default())
        .await?
        .into_inner()
        .nodes;
    Ok(nodes.into_iter().map(|n| (n.name, n.state)).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_one_attach_many_stream_run_jobs_and_one_detaches() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let hb = HEARTBEAT_MS.to_string();
    let d = Dispatcher::start(dir.path(), &["--heartbeat-ms", &hb])?;
    let mut relay = Relay::attach(&d.url).await?;
    wait_nodes(&d, NODES.len(), Duration::from_secs(20)).await?;
    let mut jobs = d.jobs().await?;
    let spec = |name: &str| JobSpec {
        name: name.into(),
        command: vec!["true".into()],
        cpus: 1,
        retries: 2,
        ..Default::default()
    };

    // A job on one of the nodes: RUNNING, then SUCCEEDED, through its slot.
    let first = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(spec("first")),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    let (slot, a) = relay.assign().await?;
    ensure!(
        a.job_id == first.id,
        "assigned {} for {}",
        a.job_id,
        first.id
    );
    relay.send(vec![
        agent_msg(slot, status(&a, JobState::Running)),
        agent_msg(slot, status(&a, JobState::Succeeded)),
    ])?;
    let job = e2e::eventually(Duration::from_secs(20), "the first job done", || {
        let mut c = jobs.clone();
        let id = first.id.clone();
        async move {
            let j = c.get_job(GetJobRequest { id }).await.ok()?.into_inner();
            (j.state == JobState::Succeeded as i32).then_some(j)
        }
    })
    .await?;
    ensure!(
        job.node == NODES[slot as usize],
        "the job ran on {} but its Assign came on slot {slot} ({})",
        job.node,
        NODES[slot as usize]
    );

    // A second job, kept RUNNING; its node is detached.
    let second = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(spec("second")),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    let (lost_slot, a) = relay.assign().await?;
    ensure!(a.job_id == second.id && a.attempt == 1, "{a:?}");
    relay.send(vec![agent_msg(lost_slot, status(&a, JobState::Running))])?;
    e2e::eventually(Duration::from_secs(20), "the second job running", || {
        let mut c = jobs.clone();
        let id = second.id.clone();
        async move {
            let j = c.get_job(GetJobRequest { id }).await.ok()?.into_inner();
            (j.state == JobState::Running as i32).then_some(())
        }
    })
    .await?;
    let detached_at = Instant::now();
    relay.detach(lost_slot).await?;
    let lost = NODES[lost_slot as usize];

    // Retried, after the node's deadline, on another node of the stream.
    let (slot, a) = relay.assign().await?;
    let waited = detached_at.elapsed();
    ensure!(
        a.job_id == second.id && a.attempt == 2 && slot != lost_slot,
        "{a:?} on slot {slot}"
    );
    // Not before the lease: the deadline is 3 heartbeats, the lease one
    // shorter.
    ensure!(
        waited >= Duration::from_millis(2 * HEARTBEAT_MS),
        "retried {waited:?} after the detach, before the lease ran out"
    );
    relay.send(vec![
        agent_msg(slot, status(&a, JobState::Running)),
        agent_msg(slot, status(&a, JobState::Succeeded)),
    ])?;
    let job = e2e::eventually(Duration::from_secs(20), "the retried job done", || {
        let mut c = jobs.clone();
        let id = second.id.clone();
        async move {
            let j = c.get_job(GetJobRequest { id }).await.ok()?.into_inner();
            (j.state == JobState::Succeeded as i32).then_some(j)
        }
    })
    .await?;
    ensure!(
        job.node == NODES[slot as usize] && job.node != lost,
        "{job:?}"
    );

    // The detached node is DOWN; the others kept their sessions.
    let states = node_states(&d).await?;
    ensure!(states[lost] == NodeState::Down as i32, "{states:?}");
    for node in NODES.iter().filter(|n| **n != lost) {
        ensure!(states[*node] == NodeState::Ready as i32, "{states:?}");
    }
    // A job now goes to a live node of the stream, never the lost one.
    let third = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(spec("third")),
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    let (slot, a) = relay.assign().await?;
    ensure!(
        a.job_id == third.id && slot != lost_slot,
        "{a:?} on slot {slot}"
    );
    Ok(())
}
