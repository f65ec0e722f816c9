//! The node agent's command line. Each subcommand is a thin shell over the
//! library: `agent run` attaches to a dispatcher and runs jobs
//! ([`agent::runtime`]); `agent topology` prints what [`agent::topology`]
//! discovers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use agent::topology::{self, MachineTopology, SysfsReader};

/// The node agent of the topology-aware cluster job dispatcher.
#[derive(Debug, Parser)]
#[command(name = "agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Attach to a dispatcher and run the jobs it assigns to this node.
    Run(Box<RunArgs>),
    /// Discover the machine's CPU topology and print it as a tree or JSON.
    Topology(TopologyArgs),
    /// Supervise one job (internal: the executor starts it; see
    /// `agent::exec::shim`).
    #[command(hide = true)]
    Shim(ShimArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Dispatcher URL(s), tried in order (e.g. http://10.0.0.1:50051).
    #[arg(
        long = "dispatcher",
        env = "DISPATCH_SERVER",
        value_delimiter = ',',
        required = true
    )]
    dispatchers: Vec<String>,
    /// This node's name (default: the host name).
    #[arg(long, env = "DISPATCH_NODE_NAME")]
    node_name: Option<String>,
    /// Node labels, e.g. --label topology.kubernetes.io/zone=z1 --label dispatch.io/rack=r1.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    labels: Vec<String>,
    /// Copy these labels from this node's Kubernetes Node object (e.g.
    /// topology.kubernetes.io/zone,dispatch.io/rack): the agent reads it
    /// from the API server with the pod's service account, which needs
    /// `get` on `nodes`. A --label with the same key wins; a label the
    /// node lacks is left out with a warning. Needs --node-name.
    #[arg(
        long,
        value_name = "KEY[,KEY...]",
        value_delimiter = ',',
        requires = "node_name"
    )]
    k8s_node_labels: Vec<String>,
    /// Directory of job directories (logs, status); survives restarts.
    #[arg(
        long,
        env = "DISPATCH_AGENT_STATE_DIR",
        default_value = "/var/lib/dispatch-agent"
    )]
    state_dir: PathBuf,
    /// Schedule a synthetic machine (e.g. 2s:8c:2t) mapped onto the real
    /// CPUs for pinning, instead of this machine's topology.
    #[arg(long, value_name = "SPEC")]
    topology: Option<String>,
    /// Read the topology under this root instead of /.
    #[arg(long, value_name = "DIR", conflicts_with = "topology")]
    sysfs_root: Option<PathBuf>,
    /// Accept up to N runnable jobs per CPU, time-sliced with SIGSTOP/SIGCONT
    /// in vruntime order (1 = no oversubscription).
    #[arg(long, default_value_t = 1)]
    oversubscribe: u32,
    /// Disable idle stealing between CPUs (for comparisons).
    #[arg(long)]
    no_steal: bool,
    /// Serve Prometheus metrics on `GET http://ADDR/metrics` (off by
    /// default), e.g. 0.0.0.0:9101.
    #[arg(long, env = "DISPATCH_AGENT_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Export traces and metrics over OTLP/gRPC to this collector (e.g.
    /// http://otel-collector:4317). Off by default; the standard
    /// OTEL_EXPORTER_OTLP_* variables also turn it on and configure it.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// User id:group id jobs run as when the agent is root (default 65534:65534).
    #[arg(long, value_name = "UID:GID")]
    run_as: Option<String>,
    /// Let jobs run as root (only with an explicit operator decision).
    #[arg(long)]
    allow_root: bool,
    /// Cap on each job's stdout and stderr, bytes.
    #[arg(long, default_value_t = 64 << 20)]
    log_cap_bytes: u64,
    /// A cgroup v2 directory to create one cgroup per job under.
    #[arg(long)]
    cgroup_root: Option<PathBuf>,
    /// How jobs start: as children of one supervisor process, one process
    /// per job (for jobs with a cgroup: --cgroup-root, else one made under
    /// the agent's own cgroup v2 when it can be), or each under a shim of
    /// its own (two processes per job; what jobs without a cgroup get).
    #[arg(long, value_parser = ["shim", "supervisor"], default_value = "supervisor")]
    launcher: String,
    /// On shutdown: kill jobs, or leave them running to be re-adopted.
    #[arg(long, value_parser = ["kill", "leave"], default_value = "kill")]
    on_shutdown: String,
    /// Scheduler tick, milliseconds.
    #[arg(long, default_value_t = 10)]
    tick_ms: u64,
    /// Threads of the agent's async runtime. 1 (the default): the agent's
    /// loop, its connection and its jobs' start tasks share one thread, so
    /// a job's start, its answer and its status never hop between threads
    /// (a wakeup across threads, a futex each way, cost more than the
    /// work of a trivial job's start). N > 1: a pool of N threads; 0: one
    /// per CPU.
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    /// Verify the dispatcher (https:// URLs) against this PEM CA: the agent
    /// takes work only from a dispatcher whose certificate chains to it.
    #[arg(long, env = "DISPATCH_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// This agent's PEM client certificate (issued for its node name, e.g.
    /// by `dispatcher gen-certs --agent NODE`).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The name the dispatcher's certificate must carry, when it differs
    /// from the URL's host.
    #[arg(long, value_name = "NAME")]
    tls_domain: Option<String>,
    /// Run each job as the uid:gid mapped to its owner: a file of
    /// `OWNER UID:GID` lines; other owners' jobs run as --run-as.
    #[arg(long, value_name = "FILE")]
    user_map: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ShimArgs {
    /// The job directory holding the `record` that starts with the spec.
    #[arg(long, value_name = "DIR", required_unless_present = "state_dir")]
    job_dir: Option<PathBuf>,
    /// Run as the supervisor of this state directory's jobs instead
    /// (`agent::exec::supervisor`).
    #[arg(long, value_name = "DIR", conflicts_with = "job_dir")]
    state_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct TopologyArgs {
    /// Read `<DIR>/sys/devices/system/...` instead of the live `/sys` (a
    /// captured tree of another machine).
    #[arg(long, value_name = "DIR", conflicts_with = "topology")]
    sysfs_root: Option<PathBuf>,

    /// Describe a synthetic machine from an engine spec instead of reading
    /// sysfs, e.g. `2s:22c:2t` or `4s:10c:8t:linear`.
    #[arg(long, value_name = "SPEC")]
    topology: Option<String>,

    /// Print the JSON summary instead of the tree.
    #[arg(long)]
    json: bool,

    /// Restrict to these CPUs (a CPU list such as `0-3,8`). By default the
    /// agent uses its own affinity when the root has a `proc/self/status`
    /// (the live machine), and every online CPU otherwise.
    #[arg(long, value_name = "CPULIST", conflicts_with_all = ["all_cpus", "topology"])]
    cpus: Option<String>,

    /// Ignore the process's affinity: describe every online CPU.
    #[arg(long, conflicts_with = "topology")]
    all_cpus: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => cmd_run(*args),
        Command::Topology(args) => cmd_topology(&args),
        Command::Shim(args) => {
            return match (&args.state_dir, &args.job_dir) {
                (Some(state), _) => agent::exec::supervisor::main(state),
                (None, Some(dir)) => agent::exec::shim::main(dir),
                (None, None) => ExitCode::FAILURE,
            };
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("agent: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn cmd_topology(args: &TopologyArgs) -> Result<()> {
    let machine = load_topology(args)?;
    // Check that the engine accepts what was discovered before printing it.
    machine
        .to_sched()
        .context("building the scheduling-domain tree")?;
    if args.json {
        let json = machine
            .summary()
            .to_json()
            .context("serialising the summary")?;
        println!("{json}");
    } else {
        print!("{}", machine.tree());
    }
    Ok(())
}

fn load_topology(args: &TopologyArgs) -> Result<MachineTopology> {
    if let Some(spec) = &args.topology {
        return topology::synthetic(spec).with_context(|| format!("synthetic topology {spec:?}"));
    }
    let reader = SysfsReader::new(
        args.sysfs_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/")),
    );
    let allowed = if let Some(list) = &args.cpus {
        Some(topology::parse_cpulist(list).with_context(|| format!("--cpus {list:?}"))?)
    } else if args.all_cpus {
        None
    } else {
        reader
            .default_allowed()
            .context("reading this process's CPU affinity")?
    };
    reader
        .read(allowed.as_deref())
        .with_context(|| format!("reading the topology under {}", reader.root().display()))
}

fn cmd_run(args: RunArgs) -> Result<()> {
    dispatch_telemetry::init_logging(dispatch_telemetry::LogFormat::Text);
    let reader = SysfsReader::new(
        args.sysfs_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/")),
    );
    let allowed = SysfsReader::host()
        .default_allowed()
        .context("reading this process's CPU affinity")?;
    let real = SysfsReader::host()
        .read(allowed.as_deref())
        .context("discovering this machine's CPUs")?;
    let machine = match &args.topology {
        Some(spec) => topology::synthetic(spec).with_context(|| format!("--topology {spec:?}"))?,
        None if args.sysfs_root.is_some() => reader
            .read(None)
            .with_context(|| format!("reading the topology under {}", reader.root().display()))?,
        None => real.clone(),
    };
    let mut labels = std::collections::HashMap::new();
    for l in &args.labels {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("--label {l:?}: want KEY=VALUE"))?;
        if k.is_empty() {
            anyhow::bail!("--label {l:?}: the key is empty");
        }
        labels.insert(k.to_string(), v.to_string());
    }
    let mut exec = agent::exec::ExecConfig::new(args.state_dir.clone());
    exec.log_cap_bytes = args.log_cap_bytes;
    exec.allow_root = args.allow_root;
    if let Some(path) = &args.user_map {
        exec.user_map = agent::exec::UserMap::load(path, args.allow_root)
            .with_context(|| format!("--user-map {}", path.display()))?;
    }
    exec.cgroup_root = args.cgroup_root.clone();
    exec.launcher = if args.launcher == "supervisor" {
        agent::exec::Launcher::Supervisor
    } else {
        agent::exec::Launcher::Shim
    };
    exec.shutdown = if args.on_shutdown == "leave" {
        agent::exec::ShutdownMode::LeaveRunning
    } else {
        agent::exec::ShutdownMode::KillJobs
    };
    let is_root = nix::unistd::geteuid().is_root();
    exec.run_as = match &args.run_as {
        Some(s) => {
            let (u, g) = s
                .split_once(':')
                .with_context(|| format!("--run-as {s:?}: want UID:GID"))?;
            Some((
                u.parse()
                    .with_context(|| format!("--run-as {s:?}: bad uid"))?,
                g.parse()
                    .with_context(|| format!("--run-as {s:?}: bad gid"))?,
            ))
        }
        None if is_root && !args.allow_root => Some((65534, 65534)),
        None => None,
    };
    let mut local = agent::local::LocalConfig {
        oversubscribe: args.oversubscribe > 1,
        ..agent::local::LocalConfig::default()
    };
    local.engine.steal = !args.no_steal;
    let mut opts = agent::runtime::AgentOptions {
        dispatchers: args.dispatchers.clone(),
        tls: proto::client_security::ClientTls {
            ca: args.tls_ca.clone(),
            cert: args.tls_cert.clone(),
            key: args.tls_key.clone(),
            domain: args.tls_domain.clone(),
        },
        node: args
            .node_name
            .clone()
            .unwrap_or_else(agent::runtime::hostname),
        labels,
        real_cpus: real.cpu_ids(),
        machine,
        memory_bytes: agent::runtime::memory_total(),
        exec,
        local,
        oversubscribe: args.oversubscribe.max(1),
        tick: std::time::Duration::from_millis(args.tick_ms.max(1)),
        retention: std::time::Duration::from_secs(3600),
    };
    let metrics_listen = args.metrics_listen;
    let otlp_endpoint = args.otlp_endpoint.clone();
    let otlp = dispatch_telemetry::wanted(otlp_endpoint.as_deref());
    let k8s_node_labels = args.k8s_node_labels.clone();
    let runtime = match args.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    }
    .enable_all()
    .build()
    .context("starting the async runtime")?;
    runtime.block_on(async move {
        if !k8s_node_labels.is_empty() {
            add_k8s_node_labels(&mut opts.labels, &opts.node, &k8s_node_labels).await?;
        }
        let mut exporters = None;
        if metrics_listen.is_some() || otlp {
            let metrics = std::sync::Arc::new(
                agent::metrics::AgentMetrics::new().context("registering the metrics")?,
            );
            if let Some(addr) = metrics_listen {
                let bound = dispatch_telemetry::prom::spawn_server(addr, metrics.registry.clone())
                    .await
                    .with_context(|| format!("binding the metrics endpoint {addr}"))?;
                tracing::info!(%bound, "serving Prometheus metrics on /metrics");
            }
            if otlp {
                let e = dispatch_telemetry::Exporters::init("agent", otlp_endpoint.as_deref())
                    .context("starting the OTLP exporters")?;
                dispatch_telemetry::bridge_prometheus(
                    &e.meter("agent"),
                    &metrics.registry,
                    &metrics.families(),
                );
                agent::telemetry::install_job_tracer(e.tracer("agent"));
                tracing::info!(endpoint = ?otlp_endpoint, "exporting traces and metrics over OTLP");
                exporters = Some(e);
            }
            agent::metrics::install(metrics);
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(_) => return,
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            let _ = stop_tx.send(true);
        });
        let result = agent::runtime::run(opts, stop_rx).await;
        if let Some(e) = exporters {
            e.shutdown().await;
        }
        result
    })
}

/// Adds the wanted labels of the Kubernetes Node `node` to `labels`
/// (without overriding a --label of the same key).
async fn add_k8s_node_labels(
    labels: &mut std::collections::HashMap<String, String>,
    node: &str,
    wanted: &[String],
) -> Result<()> {
    let api = agent::k8s::ApiServer::in_cluster().context("--k8s-node-labels")?;
    let all = api.node_labels(node).await.with_context(|| {
        format!(
            "--k8s-node-labels: reading node {node:?} from https://{}",
            api.authority()
        )
    })?;
    let (found, missing) = agent::k8s::select_labels(&all, wanted);
    for key in &missing {
        tracing::warn!(node, label = %key, "the Kubernetes node has no such label");
    }
    for (key, value) in found {
        match labels.get(&key) {
            Some(given) => {
                tracing::info!(node, label = %key, node_value = %value, %given, "--label overrides the Kubernetes node's label")
            }
            None => {
                tracing::info!(node, label = %key, %value, "label from the Kubernetes node");
                labels.insert(key, value);
            }
        }
    }
    Ok(())
}
