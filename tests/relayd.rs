//! `dispatch-relay` end to end: a real dispatcher, a real relay process
//! and real `agent` processes that know only the relay's address, running
//! real jobs submitted with dispatchctl.
//!
//! * the agents' sessions go through the relay (one AttachMany stream to
//!   the dispatcher): their nodes are READY, jobs pinned to each node by
//!   a label run there on the CPUs it chose and succeed; bad input to the
//!   relay is answered with a status naming the field;
//! * the relay is SIGKILLed while jobs run and started again on its
//!   port: the agents see their streams break, reattach through the new
//!   relay, re-register listing the jobs they run, and every job ends
//!   visibly (SUCCEEDED, on its first attempt: nothing was lost or
//!   retried), and a job submitted afterwards runs too;
//! * the relay's `/metrics` counts what it carries (agents, frames,
//!   messages and bytes each way, its stream, one reconnect after the
//!   dispatcher's restart) and its plain-text health port answers
//!   grpc.health.v1 as the Helm chart's readiness probe reads it.
//!
//! No timing is asserted: every wait is a generous deadline on a state
//! the test can observe.

use std::path::Path;
use std::process::Command;
use std::sync::Once;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::get_job as get;
use e2e::{
    Agent, Dispatcher, Etcd, Proc, bin_dir, dispatchctl_ok, eventually, gen_certs, is_terminal,
    wait_nodes,
};
use proto::client_security::ClientTls;
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{
    AgentMessage, Job, JobSpec, JobState, ListNodesRequest, LoadReport, NodeState,
    SubmitJobRequest, agent_message,
};
use tonic::transport::Channel;

const T: Duration = Duration::from_secs(60);

/// One test at a time: each starts several processes (the HA one an etcd
/// and two replicas with 3 s leases), which starve each other on a
/// 2-CPU machine (tokio's mutex: not poisoned by a failed test).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

static BUILD: Once = Once::new();

/// The relay's binary, built if missing (it is another package's).
fn relay_binary() -> std::path::PathBuf {
    let path = bin_dir().join("dispatch-relay");
    BUILD.call_once(|| {
        if !path.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args(["build", "-p", "dispatch-relay", "--bins"])
                .args(bin_dir().ends_with("release").then_some("--release"))
                .status();
            assert!(
                status.is_ok_and(|s| s.success()),
                "building dispatch-relay failed"
            );
        }
    });
    path
}

/// A `dispatch-relay` process.
struct Relay {
    proc: Proc,
    url: String,
    port: u16,
}

impl Relay {
    /// A relay to `dispatcher` on `port` (0: the kernel chooses).
    fn start(dir: &Path, dispatcher: &str, port: u16) -> Result<Self> {
        Self::start_with(dir, dispatcher, port, &[])
    }

    /// [`Relay::start`] with `extra` flags.
    fn start_with(dir: &Path, dispatcher: &str, port: u16, extra: &[String]) -> Result<Self> {
        let mut cmd = Command::new(relay_binary());
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--dispatcher")
            .arg(dispatcher)
            .args(extra)
            .env("RUST_LOG", "info");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let log = dir.join(format!("relay-{port}-{nanos}.log"));
        let mut proc = Proc::spawn_logged("dispatch-relay", cmd, log)?;
        let deadline = Instant::now() + T;
        loop {
            if !proc.alive() {
                bail!("the relay exited:\n{}", proc.log_text());
            }
            let bound = proc.log_text().lines().find_map(|l| {
                let url = l.split("dispatch-relay listening on ").nth(1)?.trim();
                let port: u16 = url.rsplit(':').next()?.parse().ok()?;
                Some((url.to_string(), port))
            });
            if let Some((url, port)) = bound
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                return Ok(Self { proc, url, port });
            }
            if Instant::now() > deadline {
                bail!("the relay did not listen:\n{}", proc.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

async fn in_state(c: &JobServiceClient<Channel>, id: &str, state: JobState) -> Result<Job> {
    e2e::job_in_state(c, id, state, T).await
}

/// Submit `cmd` pinned (by label) to `node`; its id.
async fn submit_on(url: &str, node: &str, cmd: &str) -> Result<String> {
    let selector = format!("node={node}");
    let out = dispatchctl_ok(
        url,
        &[
            "submit",
            "--selector",
            &selector,
            "--",
            "/bin/sh",
            "-c",
            cmd,
        ],
        T,
    )
    .await?;
    Ok(out.trim().to_string())
}

/// A dispatcher, a relay to it and two agents that know only the relay.
struct Setup {
    dir: tempfile::TempDir,
    d: Dispatcher,
    relay: Relay,
    agents: Vec<Agent>,
}

const NODES: [&str; 2] = ["ra", "rb"];

/// One agent per node of `NODES` (2 CPUs, labelled `node=NAME`),
/// attached to the relay at `url`.
fn agents_through(dir: &std::path::Path, url: &str) -> Result<Vec<Agent>> {
    NODES
        .iter()
        .map(|node| {
            let label = format!("node={node}");
            Agent::start(dir, url, node, "1s:2c:1t", &[&label], &[])
        })
        .collect()
}

async fn setup() -> Result<Setup> {
    let dir = tempfile::tempdir()?;
    // A 1 s heartbeat, 10 missed before a node is lost: a loaded machine
    // must not lose nodes while the relay restarts.
    let d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "1000", "--missed-heartbeats", "10"],
    )?;
    let relay = Relay::start(dir.path(), &d.url, 0)?;
    let agents = agents_through(dir.path(), &relay.url)?;
    let logs = || {
        agents
            .iter()
            .map(|a| a.proc.log_text())
            .collect::<Vec<_>>()
            .join("\n")
    };
    wait_nodes(&d, NODES.len(), T)
        .await
        .with_context(|| format!("{}\n{}", relay.proc.log_text(), logs()))?;
    Ok(Setup {
        dir,
        d,
        relay,
        agents,
    })
}

impl Setup {
    /// Both agents attached through the relay (its log names them).
    fn attached_through_relay(&self, log: &str) -> bool {
        self.agents.iter().all(|a| {
            log.lines()
                .any(|l| l.contains("agent attached through the relay") && l.contains(&a.node))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_run_pinned_jobs_through_the_relay() -> Result<()> {
    let _serial = serial().await;
    let s = setup().await?;
    ensure!(
        s.attached_through_relay(&s.relay.proc.log_text()),
        "the relay's log names no attached agents:\n{}",
        s.relay.proc.log_text()
    );
    let jobs = s.d.jobs().await?;
    let mut ids = Vec::new();
    for node in NODES {
        for i in 0..2 {
            let id = submit_on(&s.d.url, node, &format!("echo {node}-{i}")).await?;
            ids.push((node, id));
        }
    }
    for (node, id) in &ids {
        let j = in_state(&jobs, id, JobState::Succeeded)
            .await
            .with_context(|| s.relay.proc.log_text())?;
        ensure!(j.node == *node, "job {id} ran on {:?}, not {node}", j.node);
        ensure!(!j.cpus.is_empty(), "job {id} was given no CPUs");
        let out = dispatchctl_ok(&s.d.url, &["logs", id], T).await?;
        ensure!(
            out.contains(&format!("{node}-")),
            "job {id}'s output: {out:?}"
        );
    }

    // Bad input: a status naming the field.
    let mut client = AgentServiceClient::connect(s.relay.url.clone()).await?;
    let load = AgentMessage {
        msg: Some(agent_message::Msg::Load(LoadReport::default())),
    };
    let err = client
        .attach(tokio_stream::iter(vec![load]))
        .await
        .err()
        .context("an Attach starting with a LoadReport was accepted")?;
    ensure!(
        err.code() == tonic::Code::InvalidArgument && err.message().starts_with("register"),
        "{err:?}"
    );
    let register = AgentMessage {
        msg: Some(agent_message::Msg::Register(Default::default())),
    };
    let err = client
        .attach(tokio_stream::iter(vec![register]))
        .await
        .err()
        .context("a Register without a node name was accepted")?;
    ensure!(
        err.code() == tonic::Code::InvalidArgument && err.message().starts_with("register.node"),
        "{err:?}"
    );
    let err = client
        .attach_many(tokio_stream::iter(vec![]))
        .await
        .err()
        .context("the relay took an AttachMany")?;
    ensure!(err.code() == tonic::Code::Unimplemented, "{err:?}");
    drop(s.dir);
    Ok(())
}

/// The relay's grpc.health.v1 status of the whole server ("") and of the
/// agent service, if it answers.
async fn relay_health(url: &str) -> Option<[i32; 2]> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let mut health = HealthClient::new(
        Channel::from_shared(url.to_string())
            .ok()?
            .connect()
            .await
            .ok()?,
    );
    let mut out = [0; 2];
    for (i, service) in ["", "dispatch.v1.AgentService"].into_iter().enumerate() {
        out[i] = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .ok()?
            .into_inner()
            .status;
    }
    Some(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_is_healthy_only_while_it_reaches_a_dispatcher() -> Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let _serial = serial().await;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let relay = Relay::start(dir.path(), &d.url, 0)?;
    let serving = ServingStatus::Serving as i32;
    let not_serving = ServingStatus::NotServing as i32;
    eventually(T, "the relay SERVING", || async {
        (relay_health(&relay.url).await == Some([serving; 2])).then_some(())
    })
    .await
    .with_context(|| relay.proc.log_text())?;
    // The dispatcher gone: the relay has no stream to carry agents on.
    drop(d);
    eventually(T, "the relay NOT_SERVING", || async {
        (relay_health(&relay.url).await == Some([not_serving; 2])).then_some(())
    })
    .await
    .with_context(|| relay.proc.log_text())?;
    drop(dir);
    Ok(())
}

/// The port the relay printed after `what` ("metrics on http://ADDR/metrics").
fn printed(relay: &Relay, what: &str) -> Option<u16> {
    relay.proc.log_text().lines().find_map(|l| {
        let rest = l.split(what).nth(1)?.trim().trim_end_matches("/metrics");
        rest.rsplit(':').next()?.parse().ok()
    })
}

/// The value of the series `name` (with its labels) in a scrape.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The relay's /metrics and its plain-text health port, as the Helm chart
/// uses them: what it carries, counted both ways, its agents, its stream,
/// a reconnect after the dispatcher's restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_metrics_count_what_it_carries() -> Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let _serial = serial().await;
    let dir = tempfile::tempdir()?;
    let mut d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "1000", "--missed-heartbeats", "10"],
    )?;
    let extra = [
        "--metrics-listen=127.0.0.1:0".to_string(),
        "--health-listen=127.0.0.1:0".to_string(),
    ];
    let relay = Relay::start_with(dir.path(), &d.url, 0, &extra)?;
    let metrics_port =
        printed(&relay, "dispatch-relay metrics on ").context("no metrics address printed")?;
    let health_port =
        printed(&relay, "dispatch-relay health on ").context("no health address printed")?;
    let health_url = format!("http://127.0.0.1:{health_port}");
    let scrape = move || -> Result<String> {
        let (status, body) = e2e::http_get(metrics_port, "/metrics")?;
        ensure!(status == 200, "GET /metrics: {status}");
        Ok(body)
    };
    let serving = ServingStatus::Serving as i32;
    eventually(T, "the health port SERVING", || async {
        (relay_health(&health_url).await == Some([serving; 2])).then_some(())
    })
    .await
    .with_context(|| relay.proc.log_text())?;
    let text = scrape()?;
    ensure!(
        series(&text, "dispatch_relay_upstream_connected") == Some(1.0)
            && series(&text, "dispatch_relay_agents") == Some(0.0)
            && series(&text, "dispatch_relay_queue_capacity") == Some(4096.0)
            && series(&text, "dispatch_relay_queue_depth") == Some(0.0),
        "before any agent:\n{text}"
    );
    let agents = agents_through(dir.path(), &relay.url)?;
    wait_nodes(&d, NODES.len(), T)
        .await
        .with_context(|| relay.proc.log_text())?;
    let jobs = d.jobs().await?;
    let id = submit_on(&d.url, NODES[0], "echo counted").await?;
    in_state(&jobs, &id, JobState::Succeeded).await?;
    let text = scrape()?;
    let get = |name: &str| series(&text, name).unwrap_or(-1.0);
    ensure!(
        get("dispatch_relay_agents") == 2.0,
        "two agents attached:\n{text}"
    );
    // Up: two Registers, load reports, the job's statuses; down: two
    // Registereds, the Assign. Bytes at least a few per message.
    for dir in ["up", "down"] {
        let frames = get(&format!(
            "dispatch_relay_frames_total{{direction=\"{dir}\"}}"
        ));
        let messages = get(&format!(
            "dispatch_relay_messages_total{{direction=\"{dir}\"}}"
        ));
        let bytes = get(&format!(
            "dispatch_relay_bytes_total{{direction=\"{dir}\"}}"
        ));
        ensure!(
            frames >= 2.0 && messages >= frames && bytes >= 2.0 * messages,
            "{dir}: {frames} frames, {messages} messages, {bytes} bytes\n{text}"
        );
    }
    ensure!(
        get("dispatch_relay_reconnects_total") == 0.0,
        "no reconnect yet:\n{text}"
    );
    // The dispatcher restarts: the relay's stream breaks and reopens,
    // and the agents come back through it.
    d.kill9_and_restart(dir.path())?;
    wait_nodes(&d, NODES.len(), T)
        .await
        .with_context(|| relay.proc.log_text())?;
    let text = eventually(T, "one reconnect and both agents back", || async {
        let text = scrape().ok()?;
        (series(&text, "dispatch_relay_reconnects_total") == Some(1.0)
            && series(&text, "dispatch_relay_agents") == Some(2.0)
            && series(&text, "dispatch_relay_upstream_connected") == Some(1.0))
        .then_some(text)
    })
    .await
    .with_context(|| {
        format!(
            "{}\n{}",
            scrape().unwrap_or_default(),
            relay.proc.log_text()
        )
    })?;
    ensure!(
        text.contains("# TYPE dispatch_relay_connect_failures_total counter"),
        "{text}"
    );
    drop(agents);
    drop(dir);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_restart_mid_run_ends_every_job_visibly() -> Result<()> {
    let _serial = serial().await;
    let mut s = setup().await?;
    let jobs = s.d.jobs().await?;
    // Jobs that outlive the relay's restart.
    let release = s.dir.path().join("release");
    let mut ids = Vec::new();
    for node in NODES {
        let cmd = format!(
            "while [ ! -e {} ]; do sleep 0.1; done; echo {node}",
            release.display()
        );
        ids.push(submit_on(&s.d.url, node, &cmd).await?);
    }
    let mut attempts = Vec::new();
    for id in &ids {
        attempts.push(in_state(&jobs, id, JobState::Running).await?.attempt);
    }
    let old_log = s.relay.proc.log_text();
    let port = s.relay.port;
    s.relay.proc.kill9();
    // The agents' streams broke; they retry until the relay is back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.relay = Relay::start(s.dir.path(), &s.d.url, port)?;
    let relay_log = || s.relay.proc.log_text();
    eventually(T, "both agents reattached through the new relay", || {
        let ok = s.attached_through_relay(&relay_log());
        async move { ok.then_some(()) }
    })
    .await
    .with_context(|| format!("old relay:\n{old_log}\nnew relay:\n{}", relay_log()))?;
    std::fs::write(&release, b"")?;
    for (id, attempt) in ids.iter().zip(attempts) {
        let j = in_state(&jobs, id, JobState::Succeeded)
            .await
            .with_context(relay_log)?;
        ensure!(
            j.attempt == attempt,
            "job {id} was retried (attempt {} after {attempt}): its run was lost",
            j.attempt
        );
    }
    // And new work still flows through the new relay.
    for node in NODES {
        let id = submit_on(&s.d.url, node, "true").await?;
        let j = in_state(&jobs, &id, JobState::Succeeded).await?;
        ensure!(j.node == node, "{id} ran on {}", j.node);
    }
    Ok(())
}

/// TLS all the way: the dispatcher requires client certificates; the
/// relay presents one naming its nodes (`gen-certs --relay`), serves its
/// agents over TLS and requires theirs, each naming its node.
///
/// * ra and rb, with their own certificates, attach through the relay
///   and run a job;
/// * rx is in the relay's certificate, but its agent presents ra's
///   certificate: the relay refuses it (PERMISSION_DENIED naming
///   `register.node`) though the dispatcher would have taken it;
/// * rc has a valid certificate of its own, but the relay's does not name
///   it: the dispatcher refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_through_the_relay() -> Result<()> {
    let _serial = serial().await;
    let dir = tempfile::tempdir()?;
    let p = |s: &str| dir.path().join(s).display().to_string();
    gen_certs(&[
        "--ca-dir",
        &p("ca"),
        "--server-name",
        "localhost",
        "--agent",
        "ra",
        "--agent",
        "rb",
        "--agent",
        "rc",
        "--relay",
        "rack1",
        "--relay-node",
        "ra,rb,rx",
    ])?;
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
            "1000",
            "--missed-heartbeats",
            "10",
        ],
    )?;
    d.url = format!("https://localhost:{}", d.port);
    let relay_flags: Vec<String> = [
        "--tls-ca",
        &p("ca/ca.pem"),
        "--tls-cert",
        &p("ca/relay-rack1.pem"),
        "--tls-key",
        &p("ca/relay-rack1.key"),
        "--serve-tls-cert",
        &p("ca/server.pem"),
        "--serve-tls-key",
        &p("ca/server.key"),
        "--tls-client-ca",
        &p("ca/ca.pem"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let relay = Relay::start_with(dir.path(), &d.url, 0, &relay_flags)?;
    ensure!(relay.url.starts_with("https://"), "{}", relay.url);
    let relay_url = format!("https://localhost:{}", relay.port);
    let agent = |node: &str, cert: &str| {
        let ca = p("ca/ca.pem");
        let (c, k) = (
            p(&format!("ca/agent-{cert}.pem")),
            p(&format!("ca/agent-{cert}.key")),
        );
        let label = format!("node={node}");
        Agent::start(
            dir.path(),
            &relay_url,
            node,
            "1s:2c:1t",
            &[&label],
            &["--tls-ca", &ca, "--tls-cert", &c, "--tls-key", &k],
        )
    };
    let agents = [
        agent("ra", "ra")?,
        agent("rb", "rb")?,
        agent("rx", "ra")?,
        agent("rc", "rc")?,
    ];
    let tls = ClientTls {
        ca: Some(dir.path().join("ca/ca.pem")),
        ..ClientTls::default()
    };
    let channel = proto::endpoints::endpoint(&d.url, &tls)?.connect().await?;
    let nodes = NodeServiceClient::new(channel.clone());
    let ready = || {
        let mut c = nodes.clone();
        async move {
            let list = c.list_nodes(ListNodesRequest::default()).await.ok()?;
            let mut ready: Vec<String> = list
                .into_inner()
                .nodes
                .into_iter()
                .filter(|n| n.state == NodeState::Ready as i32)
                .map(|n| n.name)
                .collect();
            ready.sort();
            Some(ready)
        }
    };
    let logs = || {
        let mut all = relay.proc.log_text();
        for a in &agents {
            all.push_str(&a.proc.log_text());
        }
        all
    };
    eventually(T, "ra and rb ready", || async {
        ready()
            .await
            .filter(|r| r.contains(&"ra".into()) && r.contains(&"rb".into()))
    })
    .await
    .with_context(logs)?;
    // The refused ones say why, in their logs.
    // The refused ones say why, in their logs: rx by the relay's check
    // (`register.node`), rc by the dispatcher's (`node`).
    eventually(T, "rx and rc refused", || async {
        let rx = agents[2].proc.log_text();
        let rc = agents[3].proc.log_text();
        (rx.contains("register.node: the client certificate is for")
            && rc.contains("can only register as itself")
            && !rc.contains("register.node"))
        .then_some(())
    })
    .await
    .with_context(logs)?;
    let r = ready().await.context("listing nodes")?;
    ensure!(r == ["ra", "rb"], "ready nodes: {r:?}");
    let mut jobs = JobServiceClient::new(channel);
    let id = jobs
        .submit_job(SubmitJobRequest {
            spec: Some(JobSpec {
                command: vec!["/bin/sh".into(), "-c".into(), "echo over-relay-tls".into()],
                node_selector: [("node".to_string(), "rb".to_string())].into(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .jobs
        .first()
        .context("no job")?
        .id
        .clone();
    let j = in_state(&jobs, &id, JobState::Succeeded)
        .await
        .with_context(logs)?;
    ensure!(j.node == "rb", "{id} ran on {}", j.node);
    Ok(())
}

/// Whether the replica at `url` answers as the leader (a follower answers
/// UNAVAILABLE with a hint).
async fn is_leader(url: &str) -> bool {
    e2e::answers_as_leader(url, &ClientTls::default()).await
}

async fn leader_of(urls: &[String], except: Option<usize>) -> Result<usize> {
    eventually(Duration::from_secs(60), "a leader", || async {
        for (i, url) in urls.iter().enumerate() {
            if Some(i) != except && is_leader(url).await {
                return Some(i);
            }
        }
        None
    })
    .await
}

/// Two dispatcher replicas on etcd; the relay is given the follower
/// first and follows its hint to the leader. Jobs run through it; the
/// leader is SIGKILLed mid-run: the relay's stream breaks, it finds the
/// new leader, its agents reattach and re-register their running jobs,
/// and every job ends visibly (SUCCEEDED), a new one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_follows_the_leader() -> Result<()> {
    let _serial = serial().await;
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path())?;
    let mut replicas = (0..2)
        .map(|_| Dispatcher::start_replica(dir.path(), &etcd.url, &["--lease-ttl-secs", "3"]))
        .collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = replicas.iter().map(|d| d.url.clone()).collect();
    let leader = leader_of(&urls, None).await?;
    let follower = 1 - leader;
    // The follower first: the relay must follow its hint.
    let list = format!("{},{}", urls[follower], urls[leader]);
    let relay = Relay::start(dir.path(), &list, 0)?;
    let agents = NODES
        .iter()
        .map(|node| {
            let label = format!("node={node}");
            Agent::start(dir.path(), &relay.url, node, "1s:2c:1t", &[&label], &[])
        })
        .collect::<Result<Vec<_>>>()?;
    let logs = || {
        let mut all = relay.proc.log_text();
        for a in &agents {
            all.push_str(&a.proc.log_text());
        }
        all
    };
    wait_nodes(&replicas[leader], NODES.len(), T)
        .await
        .with_context(logs)?;
    ensure!(
        relay.proc.log_text().contains("following the hint"),
        "the relay did not follow the follower's hint:\n{}",
        relay.proc.log_text()
    );
    let release = dir.path().join("release");
    let mut ids = Vec::new();
    for node in NODES {
        let cmd = format!(
            "while [ ! -e {} ]; do sleep 0.1; done; echo {node}",
            release.display()
        );
        ids.push(submit_on(&urls[leader], node, &cmd).await?);
    }
    let jobs = replicas[leader].jobs().await?;
    for id in &ids {
        in_state(&jobs, id, JobState::Running)
            .await
            .with_context(logs)?;
    }
    replicas[leader].proc.kill9();
    let new = leader_of(&urls, Some(leader)).await?;
    ensure!(new == follower, "leader {new}");
    std::fs::write(&release, b"")?;
    let jobs = replicas[new].jobs().await?;
    for id in &ids {
        let j = eventually(Duration::from_secs(120), &format!("{id} ended"), || {
            let mut c = jobs.clone();
            let id = id.clone();
            async move {
                let j = get(&mut c, &id).await.ok()?;
                is_terminal(j.state).then_some(j)
            }
        })
        .await
        .with_context(logs)?;
        ensure!(
            j.state == JobState::Succeeded as i32,
            "job {id} ended {:?}: {}\n{}",
            JobState::try_from(j.state),
            j.reason,
            logs()
        );
    }
    wait_nodes(&replicas[new], NODES.len(), T)
        .await
        .with_context(logs)?;
    let id = submit_on(&urls[new], NODES[0], "true").await?;
    in_state(&jobs, &id, JobState::Succeeded)
        .await
        .with_context(logs)?;
    drop(etcd);
    Ok(())
}
