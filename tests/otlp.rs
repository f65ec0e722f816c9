//! OTLP export: a real OTLP/gRPC receiver (trace and metrics services from
//! opentelemetry-proto) runs in the test.
//!
//! 1. A dispatcher started with `--otlp-endpoint` and two agents run jobs;
//!    the receiver must get the jobs' spans (names, attributes, one trace
//!    per job) and the metrics. Then the receiver goes away and the
//!    dispatcher must keep placing jobs without delay.
//! 2. A dispatcher (`--otlp-endpoint`) and an agent (`OTEL_*` environment
//!    only) both export: a job's trace crosses the process boundary (the
//!    agent's `job.start` / `job.run` are children of the dispatcher's `run`
//!    span, same trace id), continues a client's `traceparent` (gRPC
//!    metadata, and `dispatchctl submit` with `TRACEPARENT`), and the
//!    agent's metrics arrive by name; with the receiver gone the agent
//!    keeps running jobs.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use e2e::{Agent, all_jobs, binary, eventually, is_terminal};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{JobSpec, JobState, SubmitJobsRequest};
use tonic::transport::Channel;

/// A received span, flattened.
#[derive(Debug, Clone)]
struct RxSpan {
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    attrs: BTreeMap<String, String>,
    service: String,
}

/// A received metric: name, kind, attribute sets of its points.
#[derive(Debug, Clone)]
struct RxMetric {
    name: String,
    kind: &'static str,
    attrs: Vec<BTreeMap<String, String>>,
    service: String,
}

fn service_of(r: &Option<opentelemetry_proto::tonic::resource::v1::Resource>) -> String {
    r.as_ref()
        .and_then(|r| attrs(&r.attributes).remove("service.name"))
        .unwrap_or_default()
}

#[derive(Clone, Default)]
struct Sink {
    spans: Arc<Mutex<Vec<RxSpan>>>,
    metrics: Arc<Mutex<Vec<RxMetric>>>,
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.spans.lock().unwrap();
        let req = req.into_inner();
        for rs in req.resource_spans {
            let service = service_of(&rs.resource);
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(RxSpan {
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent_span_id: s.parent_span_id,
                        attrs: attrs(&s.attributes),
                        service: service.clone(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Sink {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let mut out = self.metrics.lock().unwrap();
        for rm in req.into_inner().resource_metrics {
            let service = service_of(&rm.resource);
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    let (kind, points) = match &m.data {
                        Some(Data::Gauge(g)) => (
                            "gauge",
                            g.data_points.iter().map(|p| attrs(&p.attributes)).collect(),
                        ),
                        Some(Data::Sum(s)) => (
                            if s.is_monotonic { "counter" } else { "sum" },
                            s.data_points.iter().map(|p| attrs(&p.attributes)).collect(),
                        ),
                        Some(Data::Histogram(h)) => (
                            "histogram",
                            h.data_points.iter().map(|p| attrs(&p.attributes)).collect(),
                        ),
                        _ => ("other", Vec::new()),
                    };
                    out.push(RxMetric {
                        name: m.name,
                        kind,
                        attrs: points,
                        service: service.clone(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// The receiver on `port` until `stop` fires.
/// A running receiver: its port (bound on port 0) and how to stop it.
struct Receiver {
    port: u16,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Stop it and wait until the server has ended and closed its port
    /// (an event, not a pause).
    async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.served.await?;
        ensure!(
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err(),
            "the receiver is still listening"
        );
        Ok(())
    }
}

async fn receiver(sink: Sink) -> Result<Receiver> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let port = listener.local_addr()?.port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(sink.clone()))
            .add_service(MetricsServiceServer::new(sink))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = rx.await;
                },
            )
            .await;
    });
    Ok(Receiver {
        port,
        stop: tx,
        served,
    })
}

/// A process started here (to set the OTEL_* environment) in its own
/// process group, killed with the group on drop.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.0.wait();
    }
}

/// Start `cmd` in its own process group with its output in `log`.
fn spawn(mut cmd: Command, log: &std::path::Path) -> Result<Group> {
    use std::os::unix::process::CommandExt;
    let file = std::fs::File::create(log)?;
    cmd.env("OTEL_METRIC_EXPORT_INTERVAL", "300")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_SDK_DISABLED")
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .stdin(Stdio::null())
        .process_group(0);
    Ok(Group(cmd.spawn().context("starting a process")?))
}

/// The dispatcher.
struct Disp {
    _group: Group,
    url: String,
    log: std::path::PathBuf,
}

fn start_dispatcher(dir: &std::path::Path, otlp_port: u16) -> Result<Disp> {
    let log = dir.join("dispatcher.log");
    let mut cmd = Command::new(binary("dispatcher"));
    // Port 0: the address it bound is read from what it prints.
    cmd.arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(dir.join("dispatcher"))
        .arg("--heartbeat-ms")
        .arg("300")
        .arg("--otlp-endpoint")
        .arg(format!("http://127.0.0.1:{otlp_port}"))
        .env_remove("OTEL_SERVICE_NAME");
    let mut d = Disp {
        _group: spawn(cmd, &log)?,
        url: String::new(),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&d.log).unwrap_or_default();
        if let Some(port) = e2e::printed_port(&text)
            && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        {
            d.url = format!("http://127.0.0.1:{port}");
            return Ok(d);
        }
        ensure!(
            Instant::now() < deadline,
            "the dispatcher did not listen: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn run_jobs(
    jobs: &mut JobServiceClient<Channel>,
    n: usize,
    latency_every: usize,
) -> Result<(Vec<String>, Duration)> {
    let specs: Vec<JobSpec> = (0..n)
        .map(|i| JobSpec {
            command: vec!["sh".into(), "-c".into(), "sleep 0.3".into()],
            cpus: 1,
            latency_nice: if i % latency_every == 0 { -5 } else { 0 },
            ..Default::default()
        })
        .collect();
    let started = Instant::now();
    let ids: Vec<String> = jobs
        .submit_jobs(SubmitJobsRequest { specs })
        .await?
        .into_inner()
        .jobs
        .into_iter()
        .map(|j| j.id)
        .collect();
    let submit_time = started.elapsed();
    let want: BTreeSet<String> = ids.iter().cloned().collect();
    eventually(Duration::from_secs(60), "jobs terminal", || {
        let mut c = jobs.clone();
        let want = want.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            let mine: Vec<_> = all.iter().filter(|j| want.contains(&j.id)).collect();
            (mine.len() == want.len() && mine.iter().all(|j| is_terminal(j.state))).then_some(())
        }
    })
    .await?;
    let all = all_jobs(jobs).await?;
    for j in all.iter().filter(|j| want.contains(&j.id)) {
        ensure!(j.state == JobState::Succeeded as i32, "{j:?}");
    }
    Ok((ids, submit_time))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_and_metrics_reach_an_otlp_receiver_and_placement_survives_its_loss() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let sink = Sink::default();
    let rx = receiver(sink.clone()).await?;
    let otlp_port = rx.port;
    let d = start_dispatcher(dir.path(), otlp_port)?;
    let _agents = [
        Agent::start(
            dir.path(),
            &d.url,
            "n1",
            "1s:1c:2t",
            &["dispatch.io/rack=r1"],
            &[],
        )?,
        Agent::start(
            dir.path(),
            &d.url,
            "n2",
            "1s:1c:2t",
            &["dispatch.io/rack=r2"],
            &[],
        )?,
    ];
    let ch = Channel::from_shared(d.url.clone())?.connect().await?;
    let mut jobs = JobServiceClient::new(ch);
    // Wait for both nodes (a job needs a node to be placed at once).
    let ch = Channel::from_shared(d.url.clone())?.connect().await?;
    let nodes = proto::v1::node_service_client::NodeServiceClient::new(ch);
    eventually(Duration::from_secs(20), "2 ready nodes", || {
        let mut c = nodes.clone();
        async move {
            let n = c
                .list_nodes(proto::v1::ListNodesRequest::default())
                .await
                .ok()?
                .into_inner()
                .nodes;
            (n.iter()
                .filter(|x| x.state == proto::v1::NodeState::Ready as i32)
                .count()
                == 2)
                .then_some(())
        }
    })
    .await?;

    // 8 one-CPU jobs on 4 CPUs: half wait in a node's queue.
    let (ids, _) = run_jobs(&mut jobs, 8, 2).await?;
    let spans = eventually(Duration::from_secs(20), "every job's root span", || {
        let sink = sink.clone();
        let ids = ids.clone();
        async move {
            let spans = sink.spans.lock().unwrap().clone();
            let roots: BTreeSet<String> = spans
                .iter()
                .filter(|s| s.name == "job")
                .filter_map(|s| s.attrs.get("job.id").cloned())
                .collect();
            ids.iter().all(|id| roots.contains(id)).then_some(spans)
        }
    })
    .await?;
    for id in &ids {
        let mine: Vec<&RxSpan> = spans
            .iter()
            .filter(|s| s.attrs.get("job.id") == Some(id))
            .collect();
        let names: BTreeSet<&str> = mine.iter().map(|s| s.name.as_str()).collect();
        for want in [
            "job", "submit", "queued", "placed", "run", "started", "finished",
        ] {
            assert!(names.contains(want), "{id}: no {want} span in {names:?}");
        }
        // One trace per job.
        let traces: BTreeSet<&Vec<u8>> = mine.iter().map(|s| &s.trace_id).collect();
        assert_eq!(traces.len(), 1, "{id}: {mine:?}");
        let root = mine.iter().find(|s| s.name == "job").unwrap();
        assert_eq!(root.service, "dispatcher");
        assert_eq!(root.attrs["job.state"], "succeeded", "{root:?}");
        assert!(["latency", "normal"].contains(&root.attrs["job.class"].as_str()));
        let placed = mine.iter().find(|s| s.name == "placed").unwrap();
        assert!(
            ["n1", "n2"].contains(&placed.attrs["dispatch.node"].as_str()),
            "{placed:?}"
        );
        assert!(!placed.attrs["dispatch.reason"].is_empty(), "{placed:?}");
        let started = mine.iter().find(|s| s.name == "started").unwrap();
        assert!(!started.attrs["job.cpus_used"].is_empty(), "{started:?}");
        let finished = mine.iter().find(|s| s.name == "finished").unwrap();
        assert_eq!(finished.attrs["job.exit_code"], "0");
    }
    // Some jobs waited in a node's queue.
    let queued: Vec<&RxSpan> = spans.iter().filter(|s| s.name == "queued").collect();
    assert!(!queued.is_empty(), "no queued spans");
    // A job that waited in a node's queue either started there ("queued
    // on") or was taken from it by an idle node ("took it from
    // overloaded": a steal or, for the latency class, a latency pull);
    // which of the two happens depends on which node frees room first.
    assert!(
        queued.iter().any(|s| {
            let why = &s.attrs["dispatch.reason"];
            why.contains("queued on") || why.contains("took it from overloaded")
        }),
        "no job waited in a node's queue: {queued:?}"
    );

    // Metrics: the bridged Prometheus metrics and the placement histogram.
    let metrics = eventually(Duration::from_secs(20), "metrics", || {
        let sink = sink.clone();
        async move {
            let m = sink.metrics.lock().unwrap().clone();
            let names: BTreeSet<&str> = m.iter().map(|m| m.name.as_str()).collect();
            [
                "dispatch_jobs",
                "dispatch_placements",
                "dispatch_placement_seconds",
                "dispatch_steals",
                "dispatch_utilization",
                "dispatch_schedstat",
            ]
            .iter()
            .all(|n| names.contains(n))
            .then_some(m)
        }
    })
    .await
    .with_context(|| {
        let m = sink.metrics.lock().unwrap();
        let names: BTreeSet<&str> = m.iter().map(|m| m.name.as_str()).collect();
        format!("metrics received: {names:?}")
    })?;
    let kind = |name: &str| metrics.iter().find(|m| m.name == name).map(|m| m.kind);
    assert_eq!(kind("dispatch_jobs"), Some("gauge"));
    assert_eq!(kind("dispatch_placements"), Some("counter"));
    assert_eq!(kind("dispatch_placement_seconds"), Some("histogram"));
    assert_eq!(kind("dispatch_steals"), Some("counter"));
    assert_eq!(kind("dispatch_utilization"), Some("gauge"));
    assert_eq!(kind("dispatch_schedstat"), Some("counter"));
    let job_attrs = &metrics
        .iter()
        .find(|m| m.name == "dispatch_jobs")
        .unwrap()
        .attrs;
    assert!(
        job_attrs
            .iter()
            .any(|a| a.get("state").map(String::as_str) == Some("pending")
                && a.get("class").map(String::as_str) == Some("latency")),
        "{job_attrs:?}"
    );

    // The collector goes away: placement goes on without it. Every round
    // of jobs is placed and succeeds (run_jobs checks) with exports
    // failing. How long a submission takes then is a benchmark's question:
    // printed, never asserted.
    rx.stop().await?;
    for round in 0..3 {
        let (_, submit_time) = run_jobs(&mut jobs, 6, 3).await?;
        eprintln!("round {round}: submit took {submit_time:?} with the collector down");
    }
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}

/// An agent exporting over OTLP to `otlp_port`, configured by the standard
/// environment alone (the dispatcher gets the flag), as `service`; and its
/// log.
fn start_agent(
    dir: &std::path::Path,
    dispatcher_url: &str,
    node: &str,
    otlp_port: u16,
    service: &str,
) -> Result<(Agent, std::path::PathBuf)> {
    let env = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{otlp_port}"),
        ),
        ("OTEL_SERVICE_NAME", service.to_owned()),
        // As `spawn` sets them for the dispatcher.
        ("OTEL_METRIC_EXPORT_INTERVAL", "300".to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
        ("OTEL_SDK_DISABLED", "false".to_owned()),
    ];
    let agent = Agent::start_with_env(dir, dispatcher_url, node, "1s:2c:2t", &env)?;
    let log = agent.proc.log.clone();
    Ok((agent, log))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn wait_terminal(
    jobs: &JobServiceClient<Channel>,
    ids: &[String],
) -> Result<Vec<proto::v1::Job>> {
    let want: BTreeSet<String> = ids.iter().cloned().collect();
    eventually(Duration::from_secs(60), "jobs terminal", || {
        let mut c = jobs.clone();
        let want = want.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            let mine: Vec<_> = all.into_iter().filter(|j| want.contains(&j.id)).collect();
            (mine.len() == want.len() && mine.iter().all(|j| is_terminal(j.state))).then_some(mine)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_trace_spans_client_dispatcher_and_agent() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let sink = Sink::default();
    let rx = receiver(sink.clone()).await?;
    let otlp_port = rx.port;
    let d = start_dispatcher(dir.path(), otlp_port)?;
    let (_agent, agent_log) = start_agent(dir.path(), &d.url, "n1", otlp_port, "agent-n1")?;
    let ch = Channel::from_shared(d.url.clone())?.connect().await?;
    let mut jobs = JobServiceClient::new(ch.clone());
    let nodes = proto::v1::node_service_client::NodeServiceClient::new(ch);
    eventually(Duration::from_secs(20), "the node ready", || {
        let mut c = nodes.clone();
        async move {
            let n = c
                .list_nodes(proto::v1::ListNodesRequest::default())
                .await
                .ok()?
                .into_inner()
                .nodes;
            n.iter()
                .any(|x| x.state == proto::v1::NodeState::Ready as i32)
                .then_some(())
        }
    })
    .await?;

    // A client's trace: job A continues it (traceparent in the metadata).
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut req = tonic::Request::new(proto::v1::SubmitJobRequest {
        spec: Some(JobSpec {
            command: vec!["sh".into(), "-c".into(), "sleep 0.2".into()],
            cpus: 1,
            ..Default::default()
        }),
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{client_trace}-{client_span}-01").parse()?,
    );
    let a = jobs.submit_job(req).await?.into_inner().jobs.remove(0);
    // Job B: no client trace, two CPUs, fails with 3.
    let b = jobs
        .submit_jobs(SubmitJobsRequest {
            specs: vec![JobSpec {
                command: vec!["sh".into(), "-c".into(), "exit 3".into()],
                cpus: 2,
                ..Default::default()
            }],
        })
        .await?
        .into_inner()
        .jobs
        .remove(0);
    // Job C: dispatchctl passes on the environment's TRACEPARENT.
    let ctl_trace = "0af7651916cd43dd8448eb211c80319c";
    let ctl_span = "b7ad6b7169203331";
    let out = Command::new(binary("dispatchctl"))
        .arg("--server")
        .arg(&d.url)
        .args(["submit", "--", "true"])
        .env_remove("DISPATCH_SERVER")
        .env("DISPATCH_CONFIG", "/nonexistent/dispatch-config.json")
        .env("TRACEPARENT", format!("00-{ctl_trace}-{ctl_span}-01"))
        .output()?;
    ensure!(out.status.success(), "dispatchctl submit: {out:?}");
    let c_id = String::from_utf8(out.stdout)?.trim().to_string();
    let ids = vec![a.id.clone(), b.id.clone(), c_id.clone()];
    let done = wait_terminal(&jobs, &ids).await?;
    let job = |id: &str| done.iter().find(|j| j.id == id).unwrap().clone();
    assert_eq!(
        job(&a.id).state,
        JobState::Succeeded as i32,
        "{:?}",
        job(&a.id)
    );
    assert_eq!(
        job(&b.id).state,
        JobState::Failed as i32,
        "{:?}",
        job(&b.id)
    );

    let spans = eventually(
        Duration::from_secs(20),
        "both jobs' spans from both sides",
        || {
            let sink = sink.clone();
            let ids = ids.clone();
            async move {
                let spans = sink.spans.lock().unwrap().clone();
                let has = |id: &str, name: &str| {
                    spans.iter().any(|s| {
                        s.name == name && s.attrs.get("job.id").map(String::as_str) == Some(id)
                    })
                };
                ids.iter()
                    .all(|id| {
                        ["job", "run", "job.start", "job.run"]
                            .iter()
                            .all(|n| has(id, n))
                    })
                    .then_some(spans)
            }
        },
    )
    .await
    .with_context(|| {
        format!(
            "spans: {:#?}\ndispatcher log:\n{}\nagent log:\n{}",
            sink.spans.lock().unwrap(),
            std::fs::read_to_string(&d.log).unwrap_or_default(),
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        )
    })?;

    for (id, cpus, state, exit) in [(&a.id, 1, "succeeded", "0"), (&b.id, 2, "failed", "3")] {
        let mine: Vec<&RxSpan> = spans
            .iter()
            .filter(|s| s.attrs.get("job.id") == Some(id))
            .collect();
        let one = |name: &str| -> &RxSpan {
            let found: Vec<&&RxSpan> = mine.iter().filter(|s| s.name == name).collect();
            assert_eq!(found.len(), 1, "{id}: {name}: {mine:#?}");
            found[0]
        };
        let root = one("job");
        let run = one("run");
        let start = one("job.start");
        let agent_run = one("job.run");
        assert_eq!(root.service, "dispatcher");
        assert_eq!(run.service, "dispatcher");
        assert_eq!(start.service, "agent-n1", "{start:?}");
        assert_eq!(agent_run.service, "agent-n1", "{agent_run:?}");
        // One trace across both processes; the agent's spans are children
        // of the dispatcher's run span.
        for s in [run, start, agent_run] {
            assert_eq!(s.trace_id, root.trace_id, "{id}: {s:?} vs {root:?}");
        }
        assert_eq!(run.parent_span_id, root.span_id);
        assert_eq!(start.parent_span_id, run.span_id, "{id}: {start:?}");
        assert_eq!(agent_run.parent_span_id, run.span_id, "{id}: {agent_run:?}");
        assert_eq!(start.attrs["dispatch.node"], "n1");
        assert_eq!(start.attrs["job.attempt"], job(id).attempt.to_string());
        let used: Vec<&str> = start.attrs["job.cpus_used"].split(',').collect();
        assert_eq!(used.len(), cpus, "{start:?}");
        assert!(used.iter().all(|c| c.parse::<u32>().is_ok()), "{start:?}");
        assert!(!start.attrs["job.pinned_cpus"].is_empty(), "{start:?}");
        assert_eq!(agent_run.attrs["job.state"], state, "{agent_run:?}");
        assert_eq!(agent_run.attrs["job.exit_code"], exit, "{agent_run:?}");
    }
    // Job A's trace is the client's; B's is its own.
    let root = |id: &str| {
        spans
            .iter()
            .find(|s| s.name == "job" && s.attrs.get("job.id").map(String::as_str) == Some(id))
            .unwrap()
            .clone()
    };
    assert_eq!(hex(&root(&a.id).trace_id), client_trace);
    assert_eq!(hex(&root(&a.id).parent_span_id), client_span);
    assert_eq!(hex(&root(&c_id).trace_id), ctl_trace);
    assert_eq!(hex(&root(&c_id).parent_span_id), ctl_span);
    assert_ne!(hex(&root(&b.id).trace_id), client_trace);
    assert!(root(&b.id).parent_span_id.is_empty());

    // The agent's metrics, by name, kind and labels.
    let want = [
        ("dispatch_agent_jobs", "gauge", "state"),
        ("dispatch_agent_steals", "counter", "level"),
        ("dispatch_agent_steal_failures", "counter", ""),
        ("dispatch_agent_busy_skip", "counter", ""),
        ("dispatch_agent_overload_mask_weight", "gauge", "llc"),
        ("dispatch_agent_utilization", "gauge", "domain"),
        ("dispatch_agent_schedstat", "counter", "stat"),
    ];
    let metrics = eventually(Duration::from_secs(20), "the agent's metrics", || {
        let sink = sink.clone();
        async move {
            let m: Vec<RxMetric> = sink
                .metrics
                .lock()
                .unwrap()
                .iter()
                .filter(|m| m.service == "agent-n1")
                .cloned()
                .collect();
            want.iter()
                .all(|(n, _, _)| m.iter().any(|x| x.name == *n))
                .then_some(m)
        }
    })
    .await
    .with_context(|| {
        let m = sink.metrics.lock().unwrap();
        let names: BTreeSet<(&str, &str)> = m
            .iter()
            .map(|m| (m.service.as_str(), m.name.as_str()))
            .collect();
        format!("metrics received: {names:?}")
    })?;
    for (name, kind, label) in want {
        let m = metrics.iter().rev().find(|m| m.name == name).unwrap();
        assert_eq!(m.kind, kind, "{m:?}");
        if !label.is_empty() {
            assert!(m.attrs.iter().all(|a| a.contains_key(label)), "{m:?}");
        }
    }
    let steals = metrics
        .iter()
        .rev()
        .find(|m| m.name == "dispatch_agent_steals")
        .unwrap();
    let levels: BTreeSet<&str> = steals.attrs.iter().map(|a| a["level"].as_str()).collect();
    assert_eq!(
        levels,
        BTreeSet::from(["smt", "llc", "cross_llc"]),
        "{steals:?}"
    );
    let util = metrics
        .iter()
        .rev()
        .find(|m| m.name == "dispatch_agent_utilization")
        .unwrap();
    assert!(
        util.attrs.iter().any(|a| a["domain"] == "machine"),
        "{util:?}"
    );

    // The collector goes away: the agent keeps running jobs.
    rx.stop().await?;
    let (more, _) = run_jobs(&mut jobs, 3, 3).await?;
    assert_eq!(more.len(), 3);
    let log = std::fs::read_to_string(&agent_log).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}
