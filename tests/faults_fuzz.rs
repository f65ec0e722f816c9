//! A hostile agent with a valid certificate: a gRPC-level fuzz of the
//! agent stream (`AgentService.Attach`) against a real dispatcher over
//! mutual TLS.
//!
//! The hostile node (`node-h`, its certificate from the cluster CA) opens
//! stream after stream and sends seeded random and mutated sequences of
//! Register, LoadReport, JobStatus, LogData and StealReply: registers
//! first or not, twice, under another node's name, with broken or huge
//! topologies; reports for jobs that are not its own (real ids of jobs on
//! the genuine node among them), stale and future attempts, states out of
//! range; loads with nonsense figures; answers to requests never made.
//! Meanwhile a genuine agent (`node-g`) runs real jobs pinned to it.
//!
//! After every stream: the dispatcher process lives; if it closed the
//! stream, it said why (a status with a code other than UNKNOWN/INTERNAL
//! and a message); and its state, read through the public API, keeps its
//! invariants: a job on a node is ASSIGNED or RUNNING there with an
//! attempt >= 1, a terminal job never becomes live again, attempts never
//! decrease, `node-g` stays READY, and no job reached `node-h`. At the end
//! every genuine job ends SUCCEEDED with exactly one marker.
//!
//! Earlier runs' findings ([`findings`]) are replayed first, each with the
//! status it must end with.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::faults::{Markers, Rng, exactly_once};
use e2e::{Agent, Dispatcher, gen_certs, is_terminal};
use proto::client_security::ClientTls;
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{
    AgentMessage, CpuGroup, CpuLoad, FreeSummary, JobState, JobStatus, ListJobsRequest,
    ListNodesRequest, LoadReport, LogData, NodeLoad, NodeState, Register, StealReply,
    SubmitJobsRequest, Topology, agent_message,
};
use tonic::Code;

/// Streams the hostile agent opens (each a seeded random sequence).
const STREAMS: usize = 150;

fn text(rng: &mut Rng) -> String {
    match rng.range(0, 8) {
        0 => String::new(),
        1 => "x".repeat(rng.range(1, 70_000) as usize),
        2 => "\u{0}\u{7f}\u{feff}é漢🙂/../".to_string(),
        3 => format!("j-{}", rng.range(0, 40)),
        4 => format!("j-{}.{}", rng.range(0, 40), rng.range(0, 5)),
        5 => "node-g".to_string(),
        6 => format!("{}", rng.next_u64()),
        _ => "node-h".to_string(),
    }
}

fn num(rng: &mut Rng) -> u64 {
    match rng.range(0, 5) {
        0 => 0,
        1 => u64::MAX,
        2 => rng.range(0, 4),
        3 => rng.range(0, 1 << 20),
        _ => rng.next_u64(),
    }
}

fn cpus(rng: &mut Rng, max: u64) -> Vec<u32> {
    (0..rng.range(0, max))
        .map(|_| num(rng) as u32 % 4096)
        .collect()
}

fn topology(rng: &mut Rng) -> Option<Topology> {
    match rng.range(0, 6) {
        0 => None,
        // A sane one: 1 package, 2 cores of 2 threads.
        1 | 2 => Some(Topology {
            cpus: vec![0, 1, 2, 3],
            smt: vec![CpuGroup { cpus: vec![0, 1] }, CpuGroup { cpus: vec![2, 3] }],
            llc: vec![CpuGroup {
                cpus: vec![0, 1, 2, 3],
            }],
            numa: vec![CpuGroup {
                cpus: vec![0, 1, 2, 3],
            }],
            package: vec![CpuGroup {
                cpus: vec![0, 1, 2, 3],
            }],
        }),
        3 => Some(Topology {
            cpus: (0..rng.range(0, 5000) as u32).collect(),
            ..Default::default()
        }),
        _ => {
            let g = |rng: &mut Rng| {
                (0..rng.range(0, 6))
                    .map(|_| CpuGroup { cpus: cpus(rng, 8) })
                    .collect()
            };
            Some(Topology {
                cpus: cpus(rng, 16),
                smt: g(rng),
                llc: g(rng),
                numa: g(rng),
                package: g(rng),
            })
        }
    }
}

fn register(rng: &mut Rng) -> Register {
    let mut labels = HashMap::new();
    for _ in 0..rng.range(0, 4) {
        labels.insert(text(rng), text(rng));
    }
    Register {
        node: if rng.range(0, 6) == 0 {
            text(rng)
        } else {
            "node-h".into()
        },
        labels,
        topology: topology(rng),
        memory_bytes: num(rng),
        jobs: (0..rng.range(0, 4)).map(|_| status(rng)).collect(),
        version: text(rng),
        oversubscribe: num(rng) as u32,
        devices: (0..rng.range(0, 4))
            .map(|_| proto::v1::Device {
                kind: rng.range(0, 5) as i32,
                index: num(rng) as u32,
                pci_address: text(rng),
                numa_node: (rng.range(0, 2) == 0).then(|| num(rng) as u32),
                ..Default::default()
            })
            .collect(),
    }
}

fn status(rng: &mut Rng) -> JobStatus {
    JobStatus {
        job_id: text(rng),
        attempt: num(rng) as u32,
        state: match rng.range(0, 3) {
            0 => rng.range(0, 9) as i32,
            1 => num(rng) as i32,
            _ => JobState::Succeeded as i32,
        },
        cpus: cpus(rng, 6),
        exit_code: num(rng) as i32,
        signal: num(rng) as i32,
        message: text(rng),
        time_ms: num(rng) as i64,
        gpus: cpus(rng, 3),
    }
}

fn message(rng: &mut Rng) -> agent_message::Msg {
    use agent_message::Msg;
    match rng.range(0, 9) {
        0 => Msg::Register(Box::new(register(rng))),
        1 | 2 => Msg::Load(LoadReport {
            load: (rng.range(0, 4) != 0).then(|| NodeLoad {
                cpus: (0..rng.range(0, 6))
                    .map(|_| CpuLoad {
                        cpu: num(rng) as u32,
                        busy: rng.range(0, 2) == 1,
                        runnable: num(rng) as u32,
                    })
                    .collect(),
                overloaded: cpus(rng, 6),
                avg_idle_ns: num(rng),
                free: (rng.range(0, 3) != 0).then(|| FreeSummary {
                    core: num(rng) as u32,
                    llc: num(rng) as u32,
                    numa: num(rng) as u32,
                    package: num(rng) as u32,
                    any: num(rng) as u32,
                }),
                running_jobs: num(rng) as u32,
                waiting_jobs: num(rng) as u32,
                schedstats: [(text(rng), num(rng))].into_iter().collect(),
            }),
            seq: num(rng),
        }),
        3..=5 => Msg::Status(status(rng)),
        6 => Msg::Log(LogData {
            request_id: num(rng),
            data: vec![0xff; rng.range(0, 3) as usize * 40_000],
            offset: num(rng),
            truncated: rng.range(0, 2) == 1,
            eof: rng.range(0, 2) == 1,
            error: text(rng),
        }),
        _ => Msg::StealReply(StealReply {
            job_id: text(rng),
            attempt: num(rng) as u32,
            released: rng.range(0, 2) == 1,
        }),
    }
}

/// One stream's sequence: random, or a valid opening mutated (messages
/// dropped, repeated, swapped).
fn sequence(rng: &mut Rng) -> Vec<agent_message::Msg> {
    let n = rng.range(1, 30) as usize;
    let mut seq: Vec<agent_message::Msg> = (0..n).map(|_| message(rng)).collect();
    if rng.range(0, 2) == 0 {
        let mut valid = register(rng);
        valid.node = "node-h".into();
        valid.topology = topology(&mut Rng::new(2)); // the sane shape
        valid.jobs.clear();
        // Within the limit, so the stream gets past registration.
        valid.oversubscribe = rng.range(0, 4) as u32;
        seq.insert(0, agent_message::Msg::Register(Box::new(valid)));
        for _ in 0..rng.range(0, 4) {
            let (i, j) = (
                rng.range(0, seq.len() as u64) as usize,
                rng.range(0, seq.len() as u64) as usize,
            );
            match rng.range(0, 3) {
                0 => seq.swap(i, j),
                1 => {
                    let m = seq[i].clone();
                    seq.insert(j, m);
                }
                _ if seq.len() > 1 => {
                    seq.remove(i);
                }
                _ => {}
            }
        }
    }
    seq
}

/// How a hostile stream ended: `Ok(Ok(()))` open after the sequence (we
/// hung up) or closed with OK, `Ok(Err(status))` closed with `status`,
/// `Err(_)` neither answered nor closed in 10 s.
type Outcome = Result<Result<(), tonic::Status>, tokio::time::error::Elapsed>;

/// Send `seq` on a new Attach stream and read what the dispatcher sends
/// until it closes the stream (or stays quiet for 300 ms).
async fn exchange(
    mut client: AgentServiceClient<tonic::transport::Channel>,
    seq: Vec<agent_message::Msg>,
) -> Outcome {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::time::timeout(Duration::from_secs(10), async {
        let call = client.attach(tokio_stream::wrappers::ReceiverStream::new(rx));
        let feed = async {
            for m in seq {
                if tx.send(AgentMessage { msg: Some(m) }).await.is_err() {
                    break;
                }
            }
            drop(tx);
        };
        let (resp, ()) = tokio::join!(call, feed);
        let mut inbound = resp?.into_inner();
        loop {
            match tokio::time::timeout(Duration::from_millis(300), inbound.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(status)) => return Err(status),
                Err(_) => return Ok(()), // still open: we hang up
            }
        }
    })
    .await
}

/// Findings of earlier runs, replayed first on every run: a sequence and
/// the status code and message start the dispatcher must close it with.
fn findings() -> Vec<(&'static str, Vec<agent_message::Msg>, Code, &'static str)> {
    let sane = topology(&mut Rng::new(2));
    let reg = |node: String| Register {
        node,
        topology: sane.clone(),
        ..Default::default()
    };
    vec![
        // Seed 1796152517651511953, stream 117: a status echoing a 41 KB
        // node name outgrew the client's HTTP/2 header limit, which reset
        // the stream (PROTOCOL_ERROR) and lost the status.
        (
            "a 41 KB node name",
            vec![agent_message::Msg::Register(Box::new(reg(
                "x".repeat(41_296)
            )))],
            Code::InvalidArgument,
            "register.node: 41296 bytes",
        ),
        // The longest name a status may echo whole still reaches the
        // client: refused by the certificate check, not the length.
        (
            "a 253-byte node name",
            vec![agent_message::Msg::Register(Box::new(reg(
                "é".repeat(126) + "x"
            )))],
            Code::PermissionDenied,
            "node: the client certificate is for",
        ),
        // A message over the size limit after a good Register: the stream
        // ends with the reader's error, not with OK.
        (
            "log data over the agent message limit",
            vec![
                agent_message::Msg::Register(Box::new(reg("node-h".into()))),
                agent_message::Msg::Log(LogData {
                    data: vec![0; 300_000],
                    ..Default::default()
                }),
            ],
            Code::OutOfRange,
            "agent stream: ",
        ),
    ]
}

/// Replay a run with `FAULTS_SEED=N cargo test -p e2e --test faults_fuzz
/// -- --nocapture` (the seed is printed first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_agent_stream_cannot_crash_or_corrupt_the_dispatcher() -> Result<()> {
    let mut rng = Rng::from_env("faults_fuzz");
    let dir = tempfile::tempdir()?;
    let p = |s: &str| dir.path().join(s).display().to_string();
    gen_certs(&[
        "--ca-dir",
        &p("ca"),
        "--server-name",
        "localhost",
        "--agent",
        "node-g",
        "--agent",
        "node-h",
    ])?;
    let markers = Markers::new(dir.path())?;
    let mut d = Dispatcher::start(
        dir.path(),
        &[
            "--tls-cert",
            &p("ca/server.pem"),
            "--tls-key",
            &p("ca/server.key"),
            "--tls-client-ca",
            &p("ca/ca.pem"),
            "--heartbeat-ms",
            "300",
            // Agent messages up to 4 x 64 KiB: the hostile texts and logs
            // cross it.
            "--max-message-bytes",
            "65536",
        ],
    )?;
    d.url = format!("https://localhost:{}", d.port);
    let ca = ClientTls {
        ca: Some(dir.path().join("ca/ca.pem")),
        ..ClientTls::default()
    };
    let genuine = Agent::start(
        dir.path(),
        &d.url,
        "node-g",
        "1s:4c:1t",
        &["side=genuine"],
        &[
            "--tls-ca",
            &p("ca/ca.pem"),
            "--tls-cert",
            &p("ca/agent-node-g.pem"),
            "--tls-key",
            &p("ca/agent-node-g.key"),
        ],
    )?;
    let hostile_tls = ClientTls {
        ca: Some(dir.path().join("ca/ca.pem")),
        cert: Some(dir.path().join("ca/agent-node-h.pem")),
        key: Some(dir.path().join("ca/agent-node-h.key")),
        domain: None,
    };
    let channel = |tls: &ClientTls| {
        let url = d.url.clone();
        let tls = tls.clone();
        async move {
            anyhow::Ok(
                proto::endpoints::endpoint(&url, &tls)?
                    .connect()
                    .await
                    .context("connecting")?,
            )
        }
    };
    let mut jobs = JobServiceClient::new(channel(&ca).await?).max_decoding_message_size(64 << 20);
    let mut nodes = NodeServiceClient::new(channel(&ca).await?);

    // Genuine jobs, pinned to node-g, in three waves during the fuzzing.
    let mut tokens = Vec::new();
    let wave = |n: usize, tokens: &mut Vec<String>| {
        let specs: Vec<_> = (0..n)
            .map(|i| {
                let token = format!("g{}-{i}", tokens.len());
                tokens.push(token.clone());
                let mut spec = markers.spec(&token, "0.2", 0);
                spec.node_selector.insert("side".into(), "genuine".into());
                spec
            })
            .collect();
        SubmitJobsRequest { specs }
    };

    for (what, seq, code, start) in findings() {
        let client = AgentServiceClient::new(channel(&hostile_tls).await?);
        match exchange(client, seq).await {
            Ok(Err(status)) if status.code() == code && status.message().starts_with(start) => {}
            other => bail!("{what}: want {code:?} \"{start}...\", got {other:?}"),
        }
    }

    let mut seen: HashMap<String, (u32, bool)> = HashMap::new();
    let mut closed: HashMap<String, usize> = HashMap::new();
    let mut sent = 0usize;
    let started = Instant::now();
    for stream in 0..STREAMS {
        if stream % 50 == 0 {
            jobs.submit_jobs(wave(20, &mut tokens)).await?;
        }
        let seq = sequence(&mut rng);
        sent += seq.len();
        let client = AgentServiceClient::new(channel(&hostile_tls).await?)
            .max_decoding_message_size(64 << 20);
        let outcome = exchange(client, seq).await;
        let key = match &outcome {
            Err(_) => bail!("stream {stream}: the dispatcher neither answered nor closed in 10 s"),
            Ok(Ok(())) => "open or closed cleanly".to_string(),
            Ok(Err(status)) => {
                ensure!(
                    !matches!(status.code(), Code::Unknown | Code::Internal)
                        && !status.message().is_empty(),
                    "stream {stream}: closed without a clear status: {status:?}"
                );
                format!("{:?}", status.code())
            }
        };
        *closed.entry(key).or_default() += 1;

        // Invariants through the public API.
        ensure!(
            d.proc.alive(),
            "stream {stream}: the dispatcher died:\n{}",
            d.proc.log_text()
        );
        let all = jobs
            .list_jobs(ListJobsRequest {
                page_size: 10_000,
                ..Default::default()
            })
            .await
            .with_context(|| format!("after stream {stream}:\n{}", d.proc.log_text()))?
            .into_inner()
            .jobs;
        for j in &all {
            let live = matches!(
                JobState::try_from(j.state),
                Ok(JobState::Assigned | JobState::Running)
            );
            ensure!(
                !live || (!j.node.is_empty() && j.attempt >= 1),
                "stream {stream}: {} is live without a node: {j:?}",
                j.id
            );
            ensure!(
                j.node != "node-h",
                "stream {stream}: a genuine job reached the hostile node: {j:?}"
            );
            if let Some((attempt, terminal)) = seen.get(&j.id) {
                ensure!(
                    j.attempt >= *attempt,
                    "stream {stream}: {} went back to attempt {}",
                    j.id,
                    j.attempt
                );
                ensure!(
                    !terminal || is_terminal(j.state),
                    "stream {stream}: {} came back from a terminal state: {j:?}",
                    j.id
                );
            }
            seen.insert(j.id.clone(), (j.attempt, is_terminal(j.state)));
        }
        let list = nodes
            .list_nodes(ListNodesRequest::default())
            .await?
            .into_inner()
            .nodes;
        let g = list.iter().find(|n| n.name == "node-g");
        ensure!(
            g.is_some_and(|n| n.state == NodeState::Ready as i32),
            "stream {stream}: node-g is not ready: {g:?}"
        );
    }
    let fuzzing = started.elapsed();

    let deadline = Instant::now() + Duration::from_secs(120);
    let all = loop {
        let all = jobs
            .list_jobs(ListJobsRequest {
                page_size: 10_000,
                ..Default::default()
            })
            .await?
            .into_inner()
            .jobs;
        if all.iter().all(|j| is_terminal(j.state)) {
            break all;
        }
        ensure!(Instant::now() < deadline, "genuine jobs did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let problems = exactly_once(&tokens, &all, &markers);
    println!(
        "faults_fuzz: {STREAMS} hostile streams, {sent} messages in {:.1} s; outcomes {closed:?}; \
         {} genuine jobs, {} problems",
        fuzzing.as_secs_f64(),
        tokens.len(),
        problems.len()
    );
    ensure!(
        problems.is_empty(),
        "{problems:?}\n{}",
        genuine.proc.log_text()
    );
    Ok(())
}
