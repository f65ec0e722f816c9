//! The `dispatcher` binary: the gRPC server over the core, with the
//! embedded store by default. `--dev` also runs an agent for this machine
//! in the same process, so one command gives a working system.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use dispatcher::cluster::{Cluster, ClusterConfig};
use dispatcher::store::Store;
use dispatcher::store::embedded::EmbeddedStore;

#[derive(Parser, Debug)]
#[command(
    name = "dispatcher",
    version,
    about = "Topology-aware cluster job dispatcher"
)]
struct Args {
    /// Address to serve gRPC on.
    #[arg(long, env = "DISPATCH_LISTEN", default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Directory of the embedded store (and, with --dev, the local agent's
    /// job directories).
    #[arg(long, env = "DISPATCH_DATA_DIR", default_value = "dispatch-data")]
    data_dir: PathBuf,
    /// Also run an agent for this machine in this process (the
    /// single-machine default: no other process and no etcd needed).
    #[arg(long)]
    dev: bool,
    /// Synthetic topology for the --dev agent (e.g. 2s:8c:2t), mapped onto
    /// this machine's CPUs for pinning.
    #[arg(long, requires = "dev")]
    dev_topology: Option<String>,
    /// Agents must report at least this often (milliseconds).
    #[arg(long, default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Reports missed before a node is DOWN and its jobs are retried.
    #[arg(long, default_value_t = 3)]
    missed_heartbeats: u64,
    /// Label holding a node's zone.
    #[arg(long, default_value = "topology.kubernetes.io/zone")]
    zone_label: String,
    /// Label holding a node's rack.
    #[arg(long, default_value = "dispatch.io/rack")]
    rack_label: String,
    /// Node-limit gating: stealing may search domains spanning at most this
    /// many zones.
    #[arg(long, default_value_t = 2)]
    steal_zone_limit: usize,
    /// Serve the web page (`/`), its JSON API (`/api/v1/...`) and
    /// Prometheus metrics (`/metrics`) on ADDR, e.g. 0.0.0.0:9100. Off by
    /// default, except with --dev (127.0.0.1, the gRPC port + 1).
    #[arg(long, env = "DISPATCH_HTTP_LISTEN", value_name = "ADDR")]
    http_listen: Option<SocketAddr>,
    /// The same as --http-listen (its older name).
    #[arg(
        long,
        env = "DISPATCH_METRICS_LISTEN",
        value_name = "ADDR",
        conflicts_with = "http_listen"
    )]
    metrics_listen: Option<SocketAddr>,
    /// Export traces and metrics over OTLP/gRPC to this collector (e.g.
    /// http://otel-collector:4317). Off by default; the standard
    /// OTEL_EXPORTER_OTLP_* variables also turn it on and configure it.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

fn main() -> Result<()> {
    // The --dev agent starts each job under a shim: this same binary run as
    // `dispatcher shim --job-dir DIR` (see agent::exec::shim).
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("shim") {
        let dir = match (argv.get(2).map(String::as_str), argv.get(3)) {
            (Some("--job-dir"), Some(d)) => PathBuf::from(d),
            _ => anyhow::bail!("usage: dispatcher shim --job-dir DIR"),
        };
        std::process::exit(match agent::exec::shim::main(&dir) {
            std::process::ExitCode::SUCCESS => 0,
            _ => 1,
        });
    }
    let args = Args::parse();
    init_logging(&args.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(args))
}

/// Serve the web page, its API and /metrics on `addr`; with none given
/// (--dev), on 127.0.0.1 at the gRPC port + 1, or any free port if that
/// one is taken.
async fn serve_http(
    addr: Option<SocketAddr>,
    grpc: &SocketAddr,
    web: std::sync::Arc<dispatcher::web::Web>,
    registry: prometheus::Registry,
) -> Result<SocketAddr> {
    if let Some(addr) = addr {
        return dispatcher::web::spawn_server(addr, web, registry)
            .await
            .with_context(|| format!("binding the web endpoint {addr}"));
    }
    let port = match grpc.port() {
        0 => 0,
        p => p.checked_add(1).unwrap_or(0),
    };
    let next = SocketAddr::from(([127, 0, 0, 1], port));
    match dispatcher::web::spawn_server(next, web.clone(), registry.clone()).await {
        Ok(bound) => Ok(bound),
        Err(err) => {
            tracing::warn!(%next, %err, "the web page's default port is taken: using a free one");
            let any = SocketAddr::from(([127, 0, 0, 1], 0));
            dispatcher::web::spawn_server(any, web, registry)
                .await
                .context("binding the web endpoint on 127.0.0.1")
        }
    }
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn run(args: Args) -> Result<()> {
    let store = EmbeddedStore::open(&args.data_dir.join("store"))
        .with_context(|| format!("opening the store in {}", args.data_dir.display()))?;
    let snapshot = store.load().context("reading the store")?;
    let mut cfg = ClusterConfig {
        heartbeat_interval_ms: args.heartbeat_ms,
        missed_heartbeats: args.missed_heartbeats,
        zone_label: args.zone_label.clone(),
        rack_label: args.rack_label.clone(),
        ..ClusterConfig::default()
    };
    cfg.engine.steal_node_limit = args.steal_zone_limit;
    let grace = (args.heartbeat_ms * args.missed_heartbeats * 2) as i64;
    let restored = snapshot.jobs.len();
    let otlp = dispatcher::telemetry::wanted(args.otlp_endpoint.as_deref());
    let mut telemetry = None;
    let http_listen = args.http_listen.or(args.metrics_listen);
    let dev_http = http_listen.is_none() && args.dev;
    if http_listen.is_some() || dev_http || otlp {
        let metrics = std::sync::Arc::new(
            dispatcher::metrics::Metrics::new().context("registering the metrics")?,
        );
        if http_listen.is_some() || dev_http {
            let web = std::sync::Arc::new(dispatcher::web::Web::new(metrics.clone()));
            dispatcher::web::install(web.clone());
            let bound =
                serve_http(http_listen, &args.listen, web, metrics.registry.clone()).await?;
            tracing::info!(%bound, "serving the web page, its API and /metrics");
            println!("web page on http://{bound}/ (Prometheus metrics on /metrics)");
        }
        if otlp {
            let t = dispatcher::telemetry::Telemetry::init(
                args.otlp_endpoint.as_deref(),
                metrics.clone(),
            )
            .context("starting the OTLP exporters")?;
            let t = std::sync::Arc::new(t);
            // The --dev agent's job spans go out with the dispatcher's.
            if let Some(tracer) = t.tracer("agent") {
                agent::telemetry::install_job_tracer(tracer);
            }
            dispatcher::telemetry::install(t.clone());
            telemetry = Some(t);
            tracing::info!(endpoint = ?args.otlp_endpoint, "exporting traces and metrics over OTLP");
        }
        dispatcher::metrics::install(metrics);
    }
    let mut cluster = Cluster::new(cfg);
    cluster.restore(snapshot, dispatcher::core::now_ms(), grace);
    let (core, core_thread) = dispatcher::core::spawn(cluster, Box::new(store));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    tracing::info!(%addr, restored, "dispatcher listening");
    println!(
        "dispatcher listening on {addr} (data in {})",
        args.data_dir.display()
    );
    println!("point dispatchctl at it:  export DISPATCH_SERVER=http://{addr}");

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut agent_task = None;
    if args.dev {
        let url = format!("http://{addr}");
        let dir = args.data_dir.join("agent");
        let topo = args.dev_topology.clone();
        let stop = stop_rx.clone();
        agent_task = Some(tokio::spawn(async move {
            if let Err(err) = agent::runtime::run_dev(url, dir, topo, stop).await {
                tracing::error!("the --dev agent stopped: {err:#}");
            }
        }));
        println!("a local agent for this machine is attached (--dev)");
    }

    let shutdown = async move {
        let ctrl_c = tokio::signal::ctrl_c();
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    };
    let stopper = stop_tx.clone();
    let shutdown = async move {
        shutdown.await;
        tracing::info!("shutting down");
        let _ = stopper.send(true);
    };
    dispatcher::server::serve(core.clone(), listener, shutdown)
        .await
        .context("serving gRPC")?;
    let _ = stop_tx.send(true);
    if let Some(task) = agent_task {
        let _ = task.await;
    }
    core.send(dispatcher::core::Command::Shutdown);
    let _ = tokio::task::spawn_blocking(move || core_thread.join()).await;
    if let Some(t) = telemetry {
        t.shutdown().await;
    }
    Ok(())
}
