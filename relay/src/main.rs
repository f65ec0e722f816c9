//! `dispatch-relay`: agents attach to it as to a dispatcher; it carries
//! their sessions on one AttachMany stream to the leading dispatcher (see
//! the crate's documentation). The process also serves grpc.health.v1
//! (on the agents' port and, with `--health-listen`, alone in plain text
//! for a Kubernetes gRPC probe) and its metrics (`--metrics-listen`,
//! `--otlp-endpoint`, [`relay::metrics`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use proto::client_security::ClientTls;
use proto::v1::agent_service_server::AgentServiceServer;
use relay::upstream::{Config, Upstream};

/// Messages larger than this are refused either way (the dispatcher's
/// default agent-message limit).
const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// A relay between agents and the dispatcher.
#[derive(Parser, Debug)]
#[command(name = "dispatch-relay", version)]
struct Args {
    /// Where agents attach (their --dispatcher).
    #[arg(long, default_value = "0.0.0.0:50052", env = "DISPATCH_RELAY_LISTEN")]
    listen: SocketAddr,
    /// The dispatchers' URLs, comma-separated (replicas: the relay follows
    /// the leader).
    #[arg(long, env = "DISPATCH_RELAY_DISPATCHER", required = true)]
    dispatcher: Vec<String>,
    /// Messages of the agents that may wait for the dispatcher's stream
    /// before the relay stops reading the agents (backpressure).
    #[arg(long, default_value_t = 4096)]
    queue: usize,
    /// PEM CA certificate the dispatcher's certificate must chain to.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// The relay's PEM client certificate towards the dispatcher: it must
    /// name every node the relay registers.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The name the dispatcher's certificate must carry, when it differs
    /// from the URL's host.
    #[arg(long)]
    tls_domain: Option<String>,
    /// Serve the agents over TLS with this PEM certificate.
    #[arg(long, value_name = "FILE", requires = "serve_tls_key")]
    serve_tls_cert: Option<PathBuf>,
    /// The PEM private key of --serve-tls-cert.
    #[arg(long, value_name = "FILE", requires = "serve_tls_cert")]
    serve_tls_key: Option<PathBuf>,
    /// Agents must present a client certificate from this CA naming
    /// their node (needs --serve-tls-cert).
    #[arg(long, value_name = "FILE", requires = "serve_tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Also serve grpc.health.v1 alone, in plain text, on ADDR (e.g.
    /// 0.0.0.0:50053): a Kubernetes gRPC readiness probe speaks no TLS.
    #[arg(long, env = "DISPATCH_RELAY_HEALTH_LISTEN", value_name = "ADDR")]
    health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics on `GET http://ADDR/metrics` (off by
    /// default), e.g. 0.0.0.0:9102.
    #[arg(long, env = "DISPATCH_RELAY_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Export the metrics over OTLP/gRPC to this collector (e.g.
    /// http://otel-collector:4317). Off by default; the standard
    /// OTEL_EXPORTER_OTLP_* variables also turn it on and configure it.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    dispatch_telemetry::init_logging(dispatch_telemetry::LogFormat::Text);
    let upstream = Upstream::start(Config {
        dispatchers: args.dispatcher.clone(),
        tls: ClientTls {
            ca: args.tls_ca.clone(),
            cert: args.tls_cert.clone(),
            key: args.tls_key.clone(),
            domain: args.tls_domain.clone(),
        },
        queue: args.queue,
    })
    .context("--dispatcher")?;
    let otlp = dispatch_telemetry::wanted(args.otlp_endpoint.as_deref());
    let mut exporters = None;
    if args.metrics_listen.is_some() || otlp {
        let metrics = relay::metrics::RelayMetrics::new(upstream.clone(), args.queue.max(1))
            .context("registering the metrics")?;
        if let Some(addr) = args.metrics_listen {
            let bound = dispatch_telemetry::prom::spawn_server(addr, metrics.registry.clone())
                .await
                .with_context(|| format!("binding the metrics endpoint {addr}"))?;
            println!("dispatch-relay metrics on http://{bound}/metrics");
            tracing::info!(%bound, "serving Prometheus metrics on /metrics");
        }
        if otlp {
            let e = dispatch_telemetry::Exporters::init(
                "dispatch-relay",
                args.otlp_endpoint.as_deref(),
            )
            .context("--otlp-endpoint")?;
            dispatch_telemetry::bridge_prometheus(
                &e.meter("dispatch-relay"),
                &metrics.registry,
                &metrics.families(),
            );
            tracing::info!(endpoint = ?args.otlp_endpoint, "exporting metrics over OTLP");
            exporters = Some(e);
        }
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    let mut builder = tonic::transport::Server::builder();
    let scheme = match (&args.serve_tls_cert, &args.serve_tls_key) {
        (Some(cert), Some(key)) => {
            let cfg = relay::tls::server_config(cert, key, args.tls_client_ca.as_deref())?;
            builder = builder.tls_config(cfg)?;
            "https"
        }
        _ => "http",
    };
    // Health (grpc.health.v1, as the dispatcher serves it): the agent
    // service and the server as a whole are SERVING while the stream to a
    // dispatcher is open, NOT_SERVING while the relay has none (a
    // readiness probe then keeps agents away from a relay that cannot
    // carry them).
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let mut connected = upstream.connected();
    tokio::spawn(async move {
        loop {
            let up = connected.borrow_and_update().is_some();
            let status = if up {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            health_reporter.set_service_status("", status).await;
            health_reporter
                .set_service_status(
                    <AgentServiceServer<relay::server::Relay> as tonic::server::NamedService>::NAME,
                    status,
                )
                .await;
            if connected.changed().await.is_err() {
                break;
            }
        }
    });
    let service = AgentServiceServer::new(relay::server::Relay::new(
        upstream,
        args.tls_client_ca.is_some(),
    ))
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    if let Some(addr) = args.health_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the health endpoint {addr}"))?;
        let bound = listener.local_addr()?;
        let health = health.clone();
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            if let Err(err) = tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::error!(%err, "the health endpoint stopped");
            }
        });
        println!("dispatch-relay health on http://{bound}");
    }
    println!("dispatch-relay listening on {scheme}://{addr}");
    tracing::info!(%addr, dispatchers = ?args.dispatcher, "relay started");
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("stopping: the agents reattach elsewhere or after the restart");
    };
    builder
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serving")?;
    if let Some(e) = exporters {
        e.shutdown().await;
    }
    Ok(())
}
