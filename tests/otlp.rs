//! OTLP export: a real OTLP/gRPC receiver (trace and metrics services from
//! opentelemetry-proto) runs in the test; a dispatcher started with
//! `--otlp-endpoint` and two agents run jobs; the receiver must get the
//! jobs' spans (names, attributes, one trace per job) and the metrics.
//! Then the receiver goes away and the dispatcher must keep placing jobs
//! without delay.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use e2e::{Agent, all_jobs, binary, eventually, free_port, is_terminal};
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
    attrs: BTreeMap<String, String>,
    service: String,
}

/// A received metric: name, kind, attribute sets of its points.
#[derive(Debug, Clone)]
struct RxMetric {
    name: String,
    kind: &'static str,
    attrs: Vec<BTreeMap<String, String>>,
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
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attrs(&r.attributes).remove("service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(RxSpan {
                        name: s.name,
                        trace_id: s.trace_id,
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
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// The receiver on `port` until `stop` fires.
async fn receiver(port: u16, sink: Sink) -> Result<tokio::sync::oneshot::Sender<()>> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
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
    Ok(tx)
}

/// The dispatcher, started here to set the OTEL_* environment; killed
/// with its process group on drop.
struct Disp {
    child: Child,
    url: String,
    log: std::path::PathBuf,
}

impl Drop for Disp {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

fn start_dispatcher(dir: &std::path::Path, otlp_port: u16) -> Result<Disp> {
    use std::os::unix::process::CommandExt;
    let port = free_port();
    let log = dir.join("dispatcher.log");
    let file = std::fs::File::create(&log)?;
    let mut cmd = Command::new(binary("dispatcher"));
    cmd.arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(dir.join("dispatcher"))
        .arg("--heartbeat-ms")
        .arg("300")
        .arg("--otlp-endpoint")
        .arg(format!("http://127.0.0.1:{otlp_port}"))
        .env("OTEL_METRIC_EXPORT_INTERVAL", "300")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_SDK_DISABLED")
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .stdin(Stdio::null())
        .process_group(0);
    let child = cmd.spawn().context("starting the dispatcher")?;
    let d = Disp {
        child,
        url: format!("http://127.0.0.1:{port}"),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(
            Instant::now() < deadline,
            "the dispatcher did not listen: {}",
            std::fs::read_to_string(&d.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(d)
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
    let otlp_port = free_port();
    let stop = receiver(otlp_port, sink.clone()).await?;
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
                .list_nodes(proto::v1::ListNodesRequest {})
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
    assert!(
        queued
            .iter()
            .any(|s| s.attrs["dispatch.reason"].contains("queued on")),
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

    // The collector goes away: placement must not wait on it.
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        std::net::TcpStream::connect(("127.0.0.1", otlp_port)).is_err(),
        "the receiver is still listening"
    );
    for round in 0..3 {
        let (_, submit_time) = run_jobs(&mut jobs, 6, 3).await?;
        assert!(
            submit_time < Duration::from_secs(1),
            "round {round}: submit took {submit_time:?} with the collector down"
        );
    }
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}
