//! The `dispatcher` binary: the gRPC server over the core, with the
//! embedded store by default. `--dev` also runs an agent for this machine
//! in the same process, so one command gives a working system.
//! `--store etcd` makes it one of several replicas sharing etcd: it
//! campaigns for leadership and, while a follower, redirects.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use dispatcher::cluster::{Cluster, ClusterConfig};
use dispatcher::store::Store;
use dispatcher::store::embedded::EmbeddedStore;
use dispatcher::store::etcd::TxnLimits;

/// mimalloc instead of glibc's malloc: the core allocates a job's records
/// and messages, and the store, gRPC and list threads free many of them;
/// glibc's per-thread arenas make those frees take the owning arena's
/// lock, and its fastbin consolidation showed as a quarter of the core's
/// time under load (docs/BENCHMARKS.md, "The allocator"). Word-aligned
/// requests take its plain entry points ([`dispatcher::allocator`]).
#[global_allocator]
static ALLOCATOR: dispatcher::allocator::Mimalloc = dispatcher::allocator::Mimalloc;

/// mimalloc's options as the dispatcher runs it
/// ([`dispatcher::allocator::tune`]), set before the first allocation:
/// this runs from `.init_array`, after mimalloc's own constructor
/// (priority 101) and before the Rust runtime starts.
#[used]
#[unsafe(link_section = ".init_array")]
static TUNE_ALLOCATOR: extern "C" fn() = dispatcher::allocator::tune;

/// How often the allocator's upkeep thread runs the purges that are due.
const PURGE_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// mimalloc runs the purges that are due (pages freed more than
/// `allocator::PURGE_DELAY_MS` ago) only when a thread frees another page: the pages
/// a burst of work freed last (a 1,000-job array's reply: its jobs, the
/// encoded message, the store's transaction) stayed resident until the
/// next burst, on an idle dispatcher indefinitely: ~0.1-0.2 KB per
/// pending job of `loadgen`'s figure at 10,000 jobs
/// (docs/BENCHMARKS.md, "Memory per pending job: the last burst's freed
/// pages"). This thread asks for them every
/// `PURGE_EVERY`: a clock read and an atomic load when none is due, and
/// a due purge is done once, here or by the thread that frees next.
fn start_allocator_upkeep() -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("dispatch-alloc".into())
        .spawn(|| {
            // SAFETY: initialises this thread's mimalloc heap (a thread
            // whose heap is not initialised collects nothing).
            unsafe { libmimalloc_sys::mi_thread_init() };
            loop {
                std::thread::sleep(PURGE_EVERY);
                // SAFETY: collects this thread's (empty) heap and runs the
                // arenas' purges that are due; no pointer is passed.
                unsafe { libmimalloc_sys::mi_collect(false) };
                wake_owing_workers();
            }
        })
        .map(drop)
}

/// How often at most a thread collects its allocator heap as it goes idle.
const COLLECT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A thread about to wait (an async worker parking, the core waiting for
/// commands, the store after a commit: `dispatcher::idle`) collects its
/// mimalloc heap, at most every `COLLECT_EVERY`. mimalloc gives back a
/// page only once its owner thread has taken back the blocks other
/// threads freed into it, which the owner does when it allocates there
/// again or collects, and a normal collect skips the pages that were full:
/// after a relay attached 10,000 nodes the workers' and the core's pages
/// held freed Registers, LoadReports and replies, resident, until the
/// thread next allocated in their size. The forced collect visits the
/// full pages too (and runs the arenas' purges at once, as the upkeep
/// thread would within 50 ms). -300 to -500 B of RSS per relayed node
/// (docs/BENCHMARKS.md, section "mem3"); once a second a thread is idle, so no cost
/// under load.
fn collect_when_idle() {
    let now = std::time::Instant::now();
    if LAST_COLLECT
        .get()
        .is_some_and(|t| now.duration_since(t) < COLLECT_EVERY)
    {
        return;
    }
    collect_now(now);
}

thread_local! {
    /// When this thread last collected its heap.
    static LAST_COLLECT: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
    /// This async worker skipped a collect as it parked (`COLLECT_EVERY`
    /// had not passed) and has not collected since ([`WORKERS_OWING`]).
    static OWES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// This async worker woke since it last collected: a park that skips
    /// the collect owes one only then (a park right after a collect has
    /// nothing to give back).
    static WOKE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Collect this thread's heap (forced) now.
fn collect_now(now: std::time::Instant) {
    LAST_COLLECT.set(Some(now));
    WOKE.set(false);
    if OWES.replace(false) {
        WORKERS_OWING.fetch_sub(1, Ordering::Relaxed);
    }
    // SAFETY: collects this thread's heap; no pointer is passed.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

/// The async runtime's workers that owe a collect: each skipped its
/// collect as it parked, because it had collected less than
/// `COLLECT_EVERY` before, and has not collected since.
static WORKERS_OWING: AtomicUsize = AtomicUsize::new(0);

/// When an async worker last woke, in ms since [`EPOCH`].
static LAST_UNPARK_MS: AtomicU64 = AtomicU64::new(0);

/// The clock of [`LAST_UNPARK_MS`].
static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();

/// The async runtime, its handle and number of workers, for
/// [`wake_owing_workers`].
static RUNTIME: OnceLock<(tokio::runtime::Handle, usize)> = OnceLock::new();

/// How long the async workers must have been quiet (no worker woke)
/// before the upkeep thread wakes the ones that owe a collect.
const QUIET_MS: u64 = 100;

fn ms_since_epoch() -> u64 {
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// An async worker parks: [`collect_when_idle`], and if it skipped the
/// collect, it owes one.
fn worker_parks() {
    let before = LAST_COLLECT.get();
    collect_when_idle();
    if LAST_COLLECT.get() == before && WOKE.get() && !OWES.replace(true) {
        WORKERS_OWING.fetch_add(1, Ordering::Relaxed);
    }
}

/// An async worker wakes: it has work since its last collect, and the
/// workers are not quiet (a relaxed store).
fn worker_unparks() {
    WOKE.set(true);
    stamp_unpark();
}

/// [`LAST_UNPARK_MS`] is now.
fn stamp_unpark() {
    LAST_UNPARK_MS.store(ms_since_epoch(), Ordering::Relaxed);
}

/// The trailing collect of a burst (the upkeep thread, every
/// `PURGE_EVERY`): once the async workers have been quiet for `QUIET_MS`
/// and one of them owes a collect, a task per worker collects the heap of
/// the worker that runs it, if that worker owes one. Why: the throttle
/// skips the collect of a worker that parks less than `COLLECT_EVERY`
/// after its last one, and a worker that then has nothing to do parks
/// indefinitely: the blocks the core freed into its pages after its last
/// collect (the end of a relay's burst of Registers and LoadReports)
/// stayed resident, 100-230 B per relayed node of an idle dispatcher
/// after 10,000 attached (docs/BENCHMARKS.md, section "mem8"). Under load the
/// workers wake constantly: this never fires, and the throttle holds.
fn wake_owing_workers() {
    if WORKERS_OWING.load(Ordering::Relaxed) == 0
        || ms_since_epoch().saturating_sub(LAST_UNPARK_MS.load(Ordering::Relaxed)) < QUIET_MS
    {
        return;
    }
    let Some((handle, workers)) = RUNTIME.get() else {
        return;
    };
    // The tasks' wake-ups count as the workers' (no new round for
    // QUIET_MS; one comes then if a worker still owes).
    stamp_unpark();
    for _ in 0..*workers {
        handle.spawn(async {
            // Hold this worker a moment, so that the next task goes to
            // another (the runtime wakes a second worker for it).
            std::thread::sleep(std::time::Duration::from_micros(200));
            if OWES.get() {
                collect_now(std::time::Instant::now());
            } else {
                // This wake was the task's, not work: the worker's next
                // park owes nothing for it (no endless rounds).
                WOKE.set(false);
            }
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// One file under --data-dir; a single dispatcher.
    Embedded,
    /// etcd (--etcd-endpoints); several replicas, one elected leader.
    Etcd,
}

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
    /// Threads of the async runtime, which serves the gRPC streams (their
    /// decoding and encoding, the agents' heartbeats) and the RPC
    /// handlers. 0 (the default): one per CPU less the two that the core's
    /// and the store's threads keep busy, at least one. Workers beyond
    /// the CPUs left only add wakeups across threads: on 2 CPUs one worker
    /// gave ~4% more jobs/s end to end than two, and 10,000 agents' submit
    /// -> Assign p99 ~5 ms more (docs/BENCHMARKS.md, "Session 29").
    #[arg(long, env = "DISPATCH_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
    /// Wipe period of wake_wide's flip records (milliseconds): a waker
    /// (a job named as `--waker`, else a user and group) that released more
    /// jobs within it than its rack has room for spreads them.
    #[arg(long, default_value_t = dispatcher::cluster::WAKE_FLIP_DECAY_MS)]
    wake_flip_decay_ms: u64,
    /// A finished, failed, cancelled or lost job stays readable (GetJob,
    /// ListJobs, the store) at least this long after it ended (seconds;
    /// Slurm's MinJobAge), then is deleted...
    #[arg(long, default_value_t = ClusterConfig::default().retention.min_age_ms as u64 / 1000)]
    job_retention_s: u64,
    /// ... unless more terminal jobs than this are kept: the ones that
    /// ended first are then deleted first, younger or not.
    #[arg(long, default_value_t = ClusterConfig::default().retention.max_done_jobs)]
    max_done_jobs: usize,
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
    /// EASY backfill within a node: a queue's blocked head gets a
    /// reservation from the running jobs' timeouts and later jobs start
    /// now only if they cannot delay it (`--backfill false` to turn off).
    #[arg(long, default_value_t = ClusterConfig::default().engine.backfill, action = clap::ArgAction::Set)]
    backfill: bool,
    /// The idle-balance pass (the kernel's periodic / nohz idle balance)
    /// on the tick, after every finish and when a node gains room: nodes
    /// with room pull waiting jobs from their steal domain.
    #[arg(long, default_value_t = ClusterConfig::default().engine.idle_balance, action = clap::ArgAction::Set)]
    idle_balance: bool,
    /// Pulls (steals, idle balance) take the job that has waited longest
    /// at each level of the search (latency class first), not the first
    /// found from the puller's position.
    #[arg(long, default_value_t = ClusterConfig::default().engine.pull_longest_wait, action = clap::ArgAction::Set)]
    pull_longest_wait: bool,
    /// Latency-class jobs (latency_nice < 0) waiting in a node's steal
    /// domain start first where room opens, before that node's own queue
    /// (`--latency-pull false` to turn off).
    #[arg(long, default_value_t = ClusterConfig::default().engine.latency_pull, action = clap::ArgAction::Set)]
    latency_pull: bool,
    /// With backfill, one reservation per steal domain: only the head
    /// that has waited longest in a node's steal domain holds back work
    /// that could delay it; other nodes start any waiting job that fits.
    #[arg(long, default_value_t = ClusterConfig::default().engine.domain_reservation, action = clap::ArgAction::Set)]
    domain_reservation: bool,
    /// With backfill, one queue per steal domain: a node with room starts
    /// the job that has waited longest in its steal domain (latency class
    /// first) among those that can start on it now.
    #[arg(long, default_value_t = ClusterConfig::default().engine.domain_fifo, action = clap::ArgAction::Set)]
    domain_fifo: bool,
    /// With the domain's queue, start the shortest remaining time limit
    /// first (shortest-job-first backfilling); the job that has waited
    /// longest keeps the reservation, so none starves.
    #[arg(long, default_value_t = ClusterConfig::default().engine.shortest_limit_first, action = clap::ArgAction::Set)]
    shortest_limit_first: bool,
    /// With the domain's queue, order it by deadline (when the job began
    /// to wait plus its remaining time limit) instead of the remaining
    /// limit alone: a job is passed over only by jobs that arrived before
    /// its deadline. Lower tail waits and higher utilization under load,
    /// a higher mean response (docs/BENCHMARKS.md, quality2's notes).
    #[arg(long, default_value_t = ClusterConfig::default().engine.deadline_order, action = clap::ArgAction::Set)]
    deadline_order: bool,
    /// With shortest limit first (and no deadline order): a job that has
    /// waited as long as its own remaining time limit goes ahead of every
    /// job that has not, so large, long jobs are not passed over without
    /// end (docs/BENCHMARKS.md, "The limit_aging default"). Off: shortest
    /// limit first alone, only the domain's reservation bounding a wait.
    #[arg(long, default_value_t = ClusterConfig::default().engine.limit_aging, action = clap::ArgAction::Set)]
    limit_aging: bool,
    /// Which jobs of the domain's queue start widest first where room
    /// opens, before the queue's own order (a narrow job can start on any
    /// CPU that frees, a wide one only where as many free at once):
    /// `always`, `overdue` (only jobs that have waited as long as their
    /// limit, with limit aging) or `never` (README, "Queue order").
    #[arg(long, default_value = ClusterConfig::default().engine.widest_first.as_str(), value_parser = clap::builder::PossibleValuesParser::new(sched::WidestFirst::NAMES))]
    widest_first: String,
    /// Run-time predictions from each user's last two run times (EASY++),
    /// which backfill counts on: `off`; `unlimited`, for jobs without a
    /// timeout (a waiting head gets a date where it had none); `all`, for
    /// every job, capped by its timeout. A prediction that fails stops
    /// backfill from counting on predictions past the head it delayed.
    #[arg(long, default_value = "off", value_parser = ["off", "unlimited", "all"])]
    predict_runtimes: String,
    /// How a job whose only waker is its owner (no --waker job, no group)
    /// is placed: `idlest`, the idlest node, as an anonymous job; `fork`,
    /// the fork path from the zone of the node the owner's last job went
    /// to (kept in its rack within the imbalance bias); `affine`, wake-affine
    /// toward that node, as a job's waker.
    #[arg(long, default_value = "idlest", value_parser = ["affine", "fork", "idlest"])]
    owner_wake: String,
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
    /// The state store: `embedded` (a file under --data-dir, one
    /// dispatcher) or `etcd` (replicas with leader election).
    #[arg(long, value_enum, env = "DISPATCH_STORE", default_value = "embedded")]
    store: StoreKind,
    /// etcd client URLs, comma-separated (with --store etcd).
    #[arg(long, env = "DISPATCH_ETCD_ENDPOINTS", value_delimiter = ',')]
    etcd_endpoints: Vec<String>,
    /// Prefix of every key this dispatcher group keeps in etcd.
    #[arg(long, env = "DISPATCH_ETCD_PREFIX", default_value = "/dispatch")]
    etcd_prefix: String,
    /// The URL clients and agents should use to reach this replica
    /// (default: http(s)://LISTEN).
    #[arg(long, env = "DISPATCH_ADVERTISE_URL", value_name = "URL")]
    advertise_url: Option<String>,
    /// The URL of this replica's web page (--http-listen) as people and
    /// peers should reach it; a follower's page links to the leader's.
    /// Default: http://ADDR of --http-listen unless it binds all
    /// addresses (0.0.0.0, ::).
    #[arg(long, env = "DISPATCH_ADVERTISE_HTTP_URL", value_name = "URL")]
    advertise_http_url: Option<String>,
    /// TTL of the leader lease, seconds (etcd's minimum is 2): a leader
    /// that stops renewing is replaced within about this long.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..=60))]
    lease_ttl_secs: u64,
    /// The etcd servers' --max-txn-ops: larger batches of writes go
    /// through the store's redo log.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(2..))]
    etcd_max_txn_ops: u64,
    /// The etcd servers' --election-timeout, milliseconds: a store request
    /// with no answer for twice this long (a member waiting for a new
    /// leader) is sent again.
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    etcd_election_timeout_ms: u64,
    /// Largest request a client may send, in bytes (responses may be 16
    /// times larger, agents' messages 4 times). Over it a call fails with
    /// OUT_OF_RANGE or RESOURCE_EXHAUSTED before it is read.
    #[arg(long, value_name = "BYTES", default_value_t = dispatcher::limits::DEFAULT_MAX_MESSAGE_BYTES)]
    max_message_bytes: usize,
    /// Sustained job submissions (specs) per second per client (the
    /// user of its bearer token, else its address); 0 = no limit. Over
    /// it a submission fails with RESOURCE_EXHAUSTED saying when to retry.
    #[arg(long, value_name = "PER_SEC", default_value_t = dispatcher::limits::DEFAULT_SUBMIT_RATE)]
    submit_rate: f64,
    /// Submissions (specs) a client may send at once before the rate
    /// applies.
    #[arg(long, value_name = "N", default_value_t = dispatcher::limits::DEFAULT_SUBMIT_BURST)]
    submit_burst: u32,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
    /// Serve TLS with this PEM certificate chain (with --tls-key).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        conflicts_with = "dev_tls"
    )]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require agents to present a client certificate signed by this PEM CA
    /// and naming their node (needs --tls-cert).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Require a bearer token on every JobService and NodeService call:
    /// a file of `TOKEN ROLE USER` lines (ROLE: user, reader or admin).
    #[arg(long, value_name = "FILE", env = "DISPATCH_TOKENS")]
    tokens: Option<PathBuf>,
    /// Make (or reuse) a local CA, a server certificate for localhost, the
    /// local node's agent certificate and an admin token in DIR, and serve
    /// with them (TLS, agent certificates and tokens all on). More
    /// certificates from the same CA: `dispatcher gen-certs --help`.
    #[arg(long, value_name = "DIR")]
    dev_tls: Option<PathBuf>,
}

/// `dispatcher gen-certs`: issue certificates from the CA in a directory
/// (made there when missing), e.g. an agent's client certificate.
#[derive(Parser, Debug)]
#[command(name = "dispatcher gen-certs")]
struct GenCertsArgs {
    /// Directory of the CA (`ca.pem`, `ca.key`); created with a new CA when
    /// it has none (the --dev-tls directory works).
    #[arg(long, value_name = "DIR")]
    ca_dir: PathBuf,
    /// Issue a client certificate for the agent of this node (repeatable):
    /// written to OUT/agent-NODE.pem and OUT/agent-NODE.key.
    #[arg(long = "agent", value_name = "NODE")]
    agents: Vec<String>,
    /// Issue a server certificate (CA_DIR/server.pem, server.key) for these
    /// names or addresses (repeatable).
    #[arg(long = "server-name", value_name = "NAME")]
    server_names: Vec<String>,
    /// Issue a relay's client certificate (`dispatch-relay --tls-cert`)
    /// named RELAY and naming every --relay-node: written to
    /// OUT/relay-RELAY.pem and .key.
    #[arg(long, value_name = "RELAY", requires = "relay_nodes")]
    relay: Option<String>,
    /// A node the --relay certificate may register (repeatable, or
    /// comma-separated).
    #[arg(
        long = "relay-node",
        value_name = "NODE",
        value_delimiter = ',',
        requires = "relay"
    )]
    relay_nodes: Vec<String>,
    /// Where agent and relay certificates go (default: the CA directory).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Certificates are valid for this many days.
    #[arg(long, default_value_t = 365)]
    valid_days: u32,
    /// Start the validity this many days in the past (with a short
    /// --valid-days, makes an already expired certificate for tests).
    #[arg(long, default_value_t = 0)]
    backdate_days: u32,
}

fn gen_certs(args: GenCertsArgs) -> Result<()> {
    let pki = dispatcher::tls::Pki::open_or_create(&args.ca_dir)
        .with_context(|| format!("the CA in {}", args.ca_dir.display()))?;
    let validity = dispatcher::tls::Validity {
        backdate_days: args.backdate_days,
        days: args.valid_days,
    };
    println!("CA certificate: {}", pki.ca_cert().display());
    if !args.server_names.is_empty() {
        let issued = pki.issue_server(&args.server_names, validity)?;
        println!(
            "server certificate: {} (key {})",
            issued.cert.display(),
            issued.key.display()
        );
    }
    let out = args.out.unwrap_or_else(|| args.ca_dir.clone());
    if let Some(relay) = &args.relay {
        let issued = pki.issue_relay(relay, &args.relay_nodes, validity, &out)?;
        println!(
            "relay certificate for {relay} ({} nodes): {} (key {})",
            args.relay_nodes.len(),
            issued.cert.display(),
            issued.key.display()
        );
    }
    for node in &args.agents {
        let issued = pki.issue_agent(node, validity, &out)?;
        println!(
            "agent certificate for {node}: {} (key {})",
            issued.cert.display(),
            issued.key.display()
        );
    }
    Ok(())
}

/// The security the flags ask for, and what clients need to know.
fn security(args: &Args) -> Result<(dispatcher::server::Security, Option<AgentTls>)> {
    use dispatcher::auth::{Access, TokenTable};
    use dispatcher::tls::{ServerTlsFiles, server_config};
    let mut files = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(ServerTlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: args.tls_client_ca.clone(),
        }),
        _ => None,
    };
    let mut tokens = args.tokens.clone();
    let mut dev_agent = None;
    if let Some(dir) = &args.dev_tls {
        let dev = dispatcher::tls::ensure_dev_tls(dir, &agent::runtime::hostname())
            .with_context(|| format!("--dev-tls {}", dir.display()))?;
        files = Some(ServerTlsFiles {
            cert: dev.server.cert.clone(),
            key: dev.server.key.clone(),
            client_ca: Some(dev.ca.clone()),
        });
        if tokens.is_none() {
            tokens = Some(dev.tokens.clone());
        }
        dev_agent = Some(AgentTls {
            tls: proto::client_security::ClientTls {
                ca: Some(dev.ca.clone()),
                cert: Some(dev.agent.cert.clone()),
                key: Some(dev.agent.key.clone()),
                domain: Some("localhost".into()),
            },
            admin_token: dev.admin_token.clone(),
        });
    }
    let access = match &tokens {
        Some(path) => Access::with_tokens(
            TokenTable::load(path).with_context(|| format!("--tokens {}", path.display()))?,
        ),
        None => Access::open(),
    };
    let tls = files
        .as_ref()
        .map(server_config)
        .transpose()
        .context("the server's TLS files")?;
    let require_agent_cert = files.as_ref().is_some_and(|f| f.client_ca.is_some());
    if access.is_enforced() && !require_agent_cert {
        tracing::warn!(
            "--tokens without --tls-client-ca: clients need tokens but agents are not authenticated"
        );
    }
    if access.is_enforced() && tls.is_none() {
        tracing::warn!("--tokens without TLS: tokens cross the network in plain text");
    }
    Ok((
        dispatcher::server::Security {
            tls,
            access,
            require_agent_cert,
        },
        dev_agent,
    ))
}

/// What the --dev agent and the printed hints need under --dev-tls.
struct AgentTls {
    tls: proto::client_security::ClientTls,
    admin_token: PathBuf,
}

fn main() -> Result<()> {
    // The --dev agent starts its jobs with this same binary: its one
    // supervisor as `dispatcher shim --state-dir DIR` (jobs with a cgroup,
    // see agent::exec::supervisor), a shim per job as `dispatcher shim
    // --job-dir DIR` (see agent::exec::shim).
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("shim") {
        let code = match (argv.get(2).map(String::as_str), argv.get(3)) {
            (Some("--job-dir"), Some(d)) => agent::exec::shim::main(&PathBuf::from(d)),
            (Some("--state-dir"), Some(d)) => agent::exec::supervisor::main(&PathBuf::from(d)),
            _ => anyhow::bail!("usage: dispatcher shim (--job-dir DIR | --state-dir DIR)"),
        };
        std::process::exit(match code {
            std::process::ExitCode::SUCCESS => 0,
            _ => 1,
        });
    }
    if argv.get(1).map(String::as_str) == Some("gen-certs") {
        let rest = argv.iter().skip(2).cloned();
        return gen_certs(GenCertsArgs::parse_from(
            std::iter::once("dispatcher gen-certs".to_string()).chain(rest),
        ));
    }
    let args = Args::parse();
    dispatcher::allocator::check_huge_pages_env().map_err(anyhow::Error::msg)?;
    init_logging(&args.log_format);
    dispatcher::idle::set_hook(collect_when_idle);
    if let Err(err) = start_allocator_upkeep() {
        tracing::warn!(%err, "no allocator upkeep thread: freed memory is given back later");
    }
    let workers = match args.worker_threads {
        0 => default_workers(std::thread::available_parallelism().map_or(1, usize::from)),
        n => n,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .on_thread_park(worker_parks)
        .on_thread_unpark(worker_unparks)
        .build()
        .context("starting the async runtime")?;
    let _ = RUNTIME.set((runtime.handle().clone(), runtime.metrics().num_workers()));
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

/// The async runtime's workers on a machine of `cpus` CPUs: those the
/// core's and the store's threads leave, at least one.
fn default_workers(cpus: usize) -> usize {
    cpus.saturating_sub(2).max(1)
}

fn init_logging(format: &str) {
    dispatch_telemetry::init_logging(if format == "json" {
        dispatch_telemetry::LogFormat::Json
    } else {
        dispatch_telemetry::LogFormat::Text
    });
}

async fn run(args: Args) -> Result<()> {
    anyhow::ensure!(
        args.submit_rate.is_finite() && args.submit_rate >= 0.0,
        "--submit-rate must be a number >= 0 (0 = no limit)"
    );
    anyhow::ensure!(
        args.max_message_bytes >= 1024,
        "--max-message-bytes must be at least 1024"
    );
    let limits = dispatcher::limits::Limits {
        max_message_bytes: args.max_message_bytes,
        submit_rate: args.submit_rate,
        submit_burst: args.submit_burst,
    };
    // Bad TLS files or tokens stop the start before anything is opened.
    let (security, dev_tls) = security(&args)?;
    let mut cfg = ClusterConfig {
        heartbeat_interval_ms: args.heartbeat_ms,
        missed_heartbeats: args.missed_heartbeats,
        zone_label: args.zone_label.clone(),
        rack_label: args.rack_label.clone(),
        wake_flip_decay_ms: args.wake_flip_decay_ms,
        retention: dispatcher::cluster::Retention {
            min_age_ms: args
                .job_retention_s
                .saturating_mul(1000)
                .min(i64::MAX as u64) as i64,
            max_done_jobs: args.max_done_jobs,
        },
        ..ClusterConfig::default()
    };
    cfg.engine.steal_node_limit = args.steal_zone_limit;
    cfg.engine.backfill = args.backfill;
    cfg.engine.idle_balance = args.idle_balance;
    cfg.engine.pull_longest_wait = args.pull_longest_wait;
    cfg.engine.latency_pull = args.latency_pull;
    cfg.engine.domain_reservation = args.domain_reservation;
    cfg.engine.domain_fifo = args.domain_fifo;
    cfg.engine.shortest_limit_first = args.shortest_limit_first;
    cfg.engine.deadline_order = args.deadline_order;
    cfg.engine.limit_aging = args.limit_aging;
    cfg.engine.widest_first = sched::WidestFirst::parse(&args.widest_first)
        .ok_or_else(|| anyhow::anyhow!("--widest-first: want always, overdue or never"))?;
    cfg.predict = dispatcher::cluster::runtimes::Predict::parse(&args.predict_runtimes)
        .ok_or_else(|| anyhow::anyhow!("--predict-runtimes: want off, unlimited or all"))?;
    cfg.owner_wake = dispatcher::cluster::wakers::OwnerWake::parse(&args.owner_wake)
        .ok_or_else(|| anyhow::anyhow!("--owner-wake: want affine, fork or idlest"))?;
    let grace = (args.heartbeat_ms * args.missed_heartbeats * 2) as i64;
    let otlp = dispatch_telemetry::wanted(args.otlp_endpoint.as_deref());
    let mut telemetry = None;
    let http_listen = args.http_listen.or(args.metrics_listen);
    let dev_http = http_listen.is_none() && args.dev;
    let mut web_state = None;
    // Printed with the gRPC banner, after it: whoever reads the web line
    // finds the dispatchctl line already there.
    let mut web_banner = None;
    let mut http_url = args.advertise_http_url.clone();
    // What the core reports to: the metrics first (the web snapshot reads
    // their job counts on the same tick), then the web page, then OTLP.
    let mut observers = dispatcher::observe::Observers::none();
    if http_listen.is_some() || dev_http || otlp {
        let metrics = std::sync::Arc::new(
            dispatcher::metrics::Metrics::new().context("registering the metrics")?,
        );
        observers = observers.with(metrics.clone());
        if http_listen.is_some() || dev_http {
            let web = std::sync::Arc::new(dispatcher::web::Web::new(metrics.clone()));
            observers = observers.with(web.clone());
            web_state = Some(web.clone());
            let bound =
                serve_http(http_listen, &args.listen, web, metrics.registry.clone()).await?;
            if http_url.is_none() && !bound.ip().is_unspecified() {
                http_url = Some(format!("http://{bound}"));
            }
            tracing::info!(%bound, "serving the web page, its API and /metrics");
            web_banner = Some(format!(
                "web page on http://{bound}/ (Prometheus metrics on /metrics)"
            ));
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
            observers = observers.with(t.clone());
            telemetry = Some(t);
            tracing::info!(endpoint = ?args.otlp_endpoint, "exporting traces and metrics over OTLP");
        }
    }
    let build = move |snapshot| {
        let mut cluster = Cluster::new(cfg.clone());
        cluster.restore(snapshot, dispatcher::core::now_ms(), grace);
        cluster
    };

    if args.dev && security.tls.is_some() && dev_tls.is_none() {
        anyhow::bail!(
            "--dev with --tls-cert: the local agent has no client certificate; use --dev-tls DIR"
        );
    }
    let scheme = if security.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    // The certificates name localhost: clients use that name.
    let client_url = match (&dev_tls, addr) {
        (Some(_), a) => format!("https://localhost:{}", a.port()),
        (None, a) => format!("{scheme}://{a}"),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    // The embedded store: this process is the only dispatcher and always
    // leads. etcd: a replica that campaigns; the gate follows its role.
    let mut single = None;
    let mut replica = None;
    let gate = match args.store {
        StoreKind::Embedded => {
            let store = EmbeddedStore::open(&args.data_dir.join("store"))
                .with_context(|| format!("opening the store in {}", args.data_dir.display()))?;
            let snapshot = store.load().context("reading the store")?;
            let restored = snapshot.jobs.len();
            let (core, core_thread) = dispatcher::core::spawn(
                build(snapshot),
                Box::new(store),
                dispatcher::core::OnStoreFailure::ExitProcess,
                observers.clone(),
            );
            tracing::info!(%addr, restored, "dispatcher listening");
            println!(
                "dispatcher listening on {addr} (data in {})",
                args.data_dir.display()
            );
            single = Some((core.clone(), core_thread));
            observers.leading(true);
            dispatcher::gate::Gate::always(core)
        }
        StoreKind::Etcd => {
            if args.etcd_endpoints.is_empty() {
                anyhow::bail!("--store etcd needs --etcd-endpoints URL[,URL...]");
            }
            let advertise_url = args
                .advertise_url
                .clone()
                .unwrap_or_else(|| client_url.clone());
            let ha = dispatcher::ha::HaConfig {
                endpoints: args.etcd_endpoints.clone(),
                prefix: args.etcd_prefix.clone(),
                advertise_url: advertise_url.clone(),
                advertise_http_url: http_url.clone(),
                lease_ttl: std::time::Duration::from_secs(args.lease_ttl_secs),
                limits: TxnLimits {
                    max_ops: args.etcd_max_txn_ops as usize,
                    ..TxnLimits::default()
                },
                election_timeout: std::time::Duration::from_millis(args.etcd_election_timeout_ms),
            };
            let (role_tx, role_rx) =
                tokio::sync::watch::channel(dispatcher::gate::Role::Follower {
                    leader: None,
                    leader_http: None,
                });
            if let Some(web) = &web_state {
                web.follow_role(dispatcher::gate::Gate::new(role_rx.clone()));
            }
            let stop = stop_rx.clone();
            replica = Some(tokio::spawn(dispatcher::ha::run(
                ha, build, observers, role_tx, stop,
            )));
            tracing::info!(%addr, %advertise_url, "dispatcher replica listening; campaigning on etcd");
            println!(
                "dispatcher replica listening on {addr} as {advertise_url} (etcd {})",
                args.etcd_endpoints.join(",")
            );
            dispatcher::gate::Gate::new(role_rx)
        }
    };
    println!("point dispatchctl at it:  export DISPATCH_SERVER={client_url}");
    if let Some(dev) = &dev_tls {
        if let Some(ca) = &dev.tls.ca {
            println!(
                "                          export DISPATCH_TLS_CA={}",
                ca.display()
            );
        }
        println!(
            "                          export DISPATCH_TOKEN_FILE={}",
            dev.admin_token.display()
        );
    }
    if let Some(banner) = web_banner {
        println!("{banner}");
    }

    let mut agent_task = None;
    if args.dev {
        let url = client_url.clone();
        let tls = dev_tls.map(|d| d.tls).unwrap_or_default();
        let dir = args.data_dir.join("agent");
        let topo = args.dev_topology.clone();
        let stop = stop_rx.clone();
        agent_task = Some(tokio::spawn(async move {
            if let Err(err) = agent::runtime::run_dev(url, tls, dir, topo, stop).await {
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
    dispatcher::server::serve_secured(gate, listener, security, limits, shutdown)
        .await
        .context("serving gRPC")?;
    let _ = stop_tx.send(true);
    if let Some(task) = agent_task {
        let _ = task.await;
    }
    if let Some((core, core_thread)) = single {
        core.send(dispatcher::core::Command::Shutdown);
        let _ = tokio::task::spawn_blocking(move || core_thread.join()).await;
    }
    if let Some(task) = replica {
        let _ = task.await;
    }
    if let Some(t) = telemetry {
        t.shutdown().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The core's and the store's threads keep a CPU each: the runtime
    /// gets the rest, never none.
    #[test]
    fn the_runtime_gets_the_cpus_the_core_and_the_store_leave() {
        assert_eq!(default_workers(1), 1);
        assert_eq!(default_workers(2), 1);
        assert_eq!(default_workers(3), 1);
        assert_eq!(default_workers(4), 2);
        assert_eq!(default_workers(64), 62);
    }

    /// The constructor ran before the first arena: mimalloc reports the
    /// options as set (its defaults are 2, eager commit on Linux, and
    /// 1,000 ms).
    #[test]
    fn the_allocator_commits_lazily() {
        // SAFETY: reads one integer from mimalloc's option table.
        let eager = unsafe {
            libmimalloc_sys::mi_option_get(dispatcher::allocator::MI_OPTION_ARENA_EAGER_COMMIT)
        };
        assert_eq!(eager, 0);
        // SAFETY: as above.
        let delay =
            unsafe { libmimalloc_sys::mi_option_get(dispatcher::allocator::MI_OPTION_PURGE_DELAY) };
        assert_eq!(delay, dispatcher::allocator::PURGE_DELAY_MS);
        // The allocator in use is mimalloc: a block it allocated is its own.
        let block = Box::new([0u8; 64]);
        // SAFETY: asks whether a live pointer lies in mimalloc's heap.
        let ours = unsafe { libmimalloc_sys::mi_is_in_heap_region(block.as_ptr().cast()) };
        assert!(ours);
    }

    /// This process's resident pages (`/proc/self/statm`), read without
    /// allocating: a free on this thread could run the due purges itself.
    fn resident_pages() -> u64 {
        use std::io::Read;
        let mut buf = [0u8; 128];
        let mut file = std::fs::File::open("/proc/self/statm").expect("open /proc/self/statm");
        let n = file.read(&mut buf).expect("read /proc/self/statm");
        let field = buf[..n]
            .split(|&b| b == b' ')
            .nth(1)
            .expect("statm has a resident field");
        field
            .iter()
            .fold(0, |acc, &d| acc * 10 + u64::from(d.wrapping_sub(b'0')))
    }

    /// A block freed by a thread that then frees nothing else leaves the
    /// resident set within a few upkeep periods. Without the upkeep thread
    /// it stayed resident (mimalloc purges when a thread frees a page).
    #[test]
    fn freed_memory_leaves_an_idle_process() {
        start_allocator_upkeep().expect("start the upkeep thread");
        const BLOCK: usize = 16 << 20;
        let page = 4096;
        let block = std::hint::black_box(vec![1u8; BLOCK]);
        let held = resident_pages();
        drop(block);
        let mut waited = 0;
        while resident_pages() + (BLOCK / 2 / page) as u64 > held {
            assert!(
                waited < 200,
                "16 MiB freed 4 s ago still resident ({} pages, {held} held)",
                resident_pages()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
            waited += 1;
        }
    }
}
