//! `core_costs`: what the dispatcher's core thread spends on a large
//! cluster, and where the bytes of a node and of a pending job go.
//!
//! The cluster is built in this process as the core builds it (nodes
//! registered with loadgen's shapes, labels and LoadReports; jobs no node
//! can run submitted as arrays), under a counting global allocator, so
//! every figure is heap bytes the cluster holds (not RSS: the process's
//! connections are `loadgen`'s business). Times are the best of a few
//! runs, each against its baseline measured in the same run:
//!
//! - the web snapshot: built whole on the core (before) against the
//!   core's copy of it, the rest assembled off the core (after);
//! - the metrics sample of the tick;
//! - a LoadReport on the core (the old command path: the report applied
//!   to the cluster) against its stream's reader comparing it with the
//!   last one (the new path, off the core), and the core's per-tick
//!   liveness scan divided by the nodes.
//!
//! With `--connections`, the agents attached to a server in this process
//! are also measured in RSS: its growth, split by /proc/self/smaps_rollup
//! (anonymous or not), with glibc's account of its free chunks, and after
//! the allocator gave back what it could. `MEASURE_ALLOC=mimalloc` runs
//! the process on mimalloc tuned as the release dispatcher tunes it (the
//! heap figures are the same bytes requested either way).
//!
//! ```text
//! cargo run --release -p dispatcher --bin core_costs -- --nodes 10000 --pending 10000
//! cargo run -p dispatcher --bin core_costs -- --check     # small, verifies itself
//! MEASURE_ALLOC=mimalloc target/release/core_costs --nodes 10000 --connections 10000 --nodes-per-stream 1000
//! ```

#[path = "shared/loadgen_nodes.rs"]
mod loadgen_nodes;
use loadgen_nodes::{SHAPES, idle_load, register_msg, shapes};
#[path = "shared/heap_count.rs"]
mod heap_count;
use heap_count::{
    PageClass, in_use, is_mimalloc, live_classes, mimalloc_pages, trace_report, trace_reset,
};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use dispatcher::beats::{Beats, Reporter};
use dispatcher::cluster::load::PackedLoad;
use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use dispatcher::metrics::Metrics;
use dispatcher::web;
use proto::v1::{JobSpec, NodeLoad};

/// This process's resident set (VmRSS), bytes.
fn rss_bytes() -> Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .context("no VmRSS in /proc/self/status")
}

/// glibc's `struct mallinfo2` (glibc >= 2.33): the malloc of this
/// process (the counting allocator forwards to it unless
/// `MEASURE_ALLOC=mimalloc`), summed over its arenas.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

unsafe extern "C" {
    fn mallinfo2() -> MallInfo2;
    fn malloc_trim(pad: usize) -> std::ffi::c_int;
}

/// Where this process's memory is, bytes: what [`rss_bytes`] sees split
/// by /proc/self/smaps_rollup, and what malloc holds.
#[derive(Default, Clone, Copy, Debug)]
struct Memory {
    /// Resident, all of it.
    rss: i64,
    /// Resident and anonymous (heap, stacks; not the binary or files).
    anon: i64,
    /// The allocator's memory from the OS: glibc's arenas and mmapped
    /// chunks; mimalloc's committed memory.
    malloc_held: i64,
    /// Of it, in blocks handed out: glibc's chunks in use (the requested
    /// bytes and malloc's per-chunk overhead); mimalloc: the requested
    /// bytes (it does not tell the rest).
    malloc_used: i64,
    /// Of it, free memory the allocator keeps (glibc: free chunks;
    /// mimalloc: committed minus requested).
    malloc_free: i64,
}

/// The allocator gives back what it can: glibc's `malloc_trim(0)`,
/// mimalloc's `mi_collect(true)`.
fn trim() {
    if is_mimalloc() {
        // SAFETY: collects this thread's heap and purges the arenas.
        unsafe { libmimalloc_sys::mi_collect(true) };
    } else {
        // SAFETY: malloc_trim gives free memory back; no pointer passed.
        unsafe { malloc_trim(0) };
    }
}

impl Memory {
    /// Now; under mimalloc after the purges that are due (what the
    /// dispatcher's upkeep thread asks for every 50 ms).
    fn now() -> Result<Self> {
        let mut commit = 0usize;
        if is_mimalloc() {
            let mut x = [0usize; 7];
            // SAFETY: mi_collect(false) runs due purges; mi_process_info
            // writes eight counters through valid pointers.
            unsafe {
                libmimalloc_sys::mi_collect(false);
                libmimalloc_sys::mi_process_info(
                    &mut x[0],
                    &mut x[1],
                    &mut x[2],
                    &mut x[3],
                    &mut x[4],
                    &mut commit,
                    &mut x[5],
                    &mut x[6],
                );
            }
        }
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup")
            .context("reading /proc/self/smaps_rollup")?;
        let field = |name: &str| -> Result<i64> {
            rollup
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse::<i64>().ok())
                .map(|kb| kb * 1024)
                .with_context(|| format!("no {name} in smaps_rollup"))
        };
        let (rss, anon) = (field("Rss:")?, field("Anonymous:")?);
        if is_mimalloc() {
            let used = in_use() as i64;
            return Ok(Self {
                rss,
                anon,
                malloc_held: commit as i64,
                malloc_used: used,
                malloc_free: commit as i64 - used,
            });
        }
        // SAFETY: mallinfo2 reads malloc's statistics into a plain struct.
        let m = unsafe { mallinfo2() };
        Ok(Self {
            rss,
            anon,
            malloc_held: (m.arena + m.hblkhd) as i64,
            malloc_used: (m.uordblks + m.hblkhd) as i64,
            malloc_free: m.fordblks as i64,
        })
    }

    fn minus(&self, o: &Self) -> Self {
        Self {
            rss: self.rss - o.rss,
            anon: self.anon - o.anon,
            malloc_held: self.malloc_held - o.malloc_held,
            malloc_used: self.malloc_used - o.malloc_used,
            malloc_free: self.malloc_free - o.malloc_free,
        }
    }
}

/// Heap bytes `f`'s result holds (what it allocated and kept).
fn held<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let before = in_use();
    let v = f();
    (v, in_use() - before)
}

#[derive(Parser, Debug)]
#[command(
    name = "core_costs",
    about = "The core's time per tick and the heap bytes per node and per pending job"
)]
struct Args {
    /// Nodes (loadgen's shapes cycled, 40 per rack over 4 zones).
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Pending jobs (a selector no node matches), as arrays of 1,000.
    #[arg(long, default_value_t = 10_000)]
    pending: usize,
    /// Timed runs per figure (the best is shown).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Agents attached to a dispatcher server in this process over real
    /// HTTP/2 connections (from a child process), for the heap
    /// and RSS of an attached agent's connection; 0 = skip.
    #[arg(long, default_value_t = 1_000)]
    connections: usize,
    /// Agents per HTTP/2 connection for `--connections` (each its own
    /// Attach stream, as `loadgen --agents-per-connection` attaches them):
    /// 1 is the real agents' way; more tells the connection's bytes from
    /// the stream's.
    #[arg(long, default_value_t = 1)]
    agents_per_connection: usize,
    /// Attach the `--connections` agents as a relay would: this many nodes
    /// on one AttachMany stream (each stream on its own HTTP/2
    /// connection); 0 = each agent its own Attach stream.
    #[arg(long, default_value_t = 0)]
    nodes_per_stream: usize,
    /// Small sizes, and exit 1 unless the figures are consistent.
    #[arg(long)]
    check: bool,
    /// The child of `--connections`: attach that many agents to this
    /// dispatcher URL, print "attached", hold the streams until stdin ends.
    #[arg(long, hide = true)]
    attach: Option<String>,
}

/// The best of `runs` timings of `f`.
fn best(runs: usize, mut f: impl FnMut()) -> Duration {
    (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e6)
}

/// The bytes tonic allocates up front for an Attach stream on the
/// dispatcher's side with our codec (`proto::codec`): the decoder of the
/// agent's messages and the encoder of the dispatcher's, each with its
/// first buffer, as the generated server builds them.
fn attach_codec_bytes() -> isize {
    use proto::v1::{AgentMessage, DispatcherMessage};
    use tonic::codec::{Codec, EncodeBody, SingleMessageCompressionOverride, Streaming};
    let mut codec = proto::codec::SmallBuffers::<DispatcherMessage, AgentMessage>::default();
    let (_d, decode) =
        held(|| Streaming::new_request(codec.decoder(), tonic::body::Body::empty(), None, None));
    let (_e, encode) = held(|| {
        EncodeBody::new_server(
            codec.encoder(),
            tokio_stream::empty::<Result<DispatcherMessage, tonic::Status>>(),
            None,
            SingleMessageCompressionOverride::Inherit,
            None,
        )
    });
    decode + encode
}

/// loadgen's shapes as reported topologies.
/// The child process of `--connections`: `n` agents, `per` to an HTTP/2
/// connection (1: each on its own, as real agents are), register (loadgen's shapes and
/// labels) and send one idle LoadReport; "attached" is printed once every
/// one was answered Registered, and the streams stay open until stdin
/// ends.
fn attach_agents(url: &str, n: usize, per: usize, per_stream: usize) -> Result<()> {
    if per_stream > 0 {
        return attach_relayed(url, n, per_stream);
    }
    use proto::v1::agent_service_client::AgentServiceClient;
    use proto::v1::{AgentMessage, LoadReport, agent_message, dispatcher_message};
    use tokio_stream::wrappers::UnboundedReceiverStream;

    let topos = shapes()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the agents' runtime")?;
    let held = rt.block_on(async {
        let connect = |url: String| async move {
            tonic::transport::Endpoint::from_shared(url)?
                .tcp_nodelay(true)
                .connect()
                .await
                .context("connecting")
        };
        let per = per.max(1);
        let mut shared = Vec::new();
        if per > 1 {
            for _ in 0..n.div_ceil(per) {
                shared.push(connect(url.to_string()).await?);
            }
        }
        let gate = Arc::new(tokio::sync::Semaphore::new(64));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..n {
            let gate = gate.clone();
            let url = url.to_string();
            let conn = shared.get(i / per).cloned();
            let register = register_msg(i, &topos[i % topos.len()], "core_costs");
            let load = idle_load(&topos[i % topos.len()].cpus);
            tasks.spawn(async move {
                let _permit = gate.acquire().await?;
                let channel = match conn {
                    Some(c) => c,
                    None => connect(url).await?,
                };
                let mut client = AgentServiceClient::new(channel.clone());
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let _ = tx.send(AgentMessage {
                    msg: Some(agent_message::Msg::Register(Box::new(register))),
                });
                let _ = tx.send(AgentMessage {
                    msg: Some(agent_message::Msg::Load(LoadReport {
                        load: Some(load),
                        seq: 0,
                    })),
                });
                let mut inbound = client
                    .attach(UnboundedReceiverStream::new(rx))
                    .await
                    .context("attaching")?
                    .into_inner();
                match inbound.message().await?.and_then(|m| m.msg) {
                    Some(dispatcher_message::Msg::Registered(_)) => {}
                    other => bail!("agent {i}: not Registered but {other:?}"),
                }
                anyhow::Ok((channel, tx, inbound))
            });
        }
        let mut held = Vec::with_capacity(n);
        while let Some(r) = tasks.join_next().await {
            held.push(r.context("an agent's task")??);
        }
        anyhow::Ok(held)
    })?;
    println!("attached {}", held.len());
    std::io::Write::flush(&mut std::io::stdout())?;
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
        line.clear();
    }
    drop(held);
    Ok(())
}

/// The child of `--connections` with `--nodes-per-stream K`: `n` nodes
/// attached as relays would, K to an AttachMany stream (one connection
/// each), Registers then every node's idle LoadReport, in frames of at
/// most 16 KiB; "attached" once every node was answered Registered.
fn attach_relayed(url: &str, n: usize, per_stream: usize) -> Result<()> {
    use proto::v1::agent_service_client::AgentServiceClient;
    use proto::v1::{
        AgentMessage, LoadReport, NodeMessage, RelayMessage, agent_message, dispatcher_message,
        node_message, node_reply,
    };
    use tokio_stream::StreamExt;
    use tokio_stream::wrappers::UnboundedReceiverStream;

    let topos = shapes()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the relays' runtime")?;
    let held = rt.block_on(async {
        let mut held = Vec::new();
        for first in (0..n).step_by(per_stream) {
            let nodes: Vec<usize> = (first..n.min(first + per_stream)).collect();
            let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
                .tcp_nodelay(true)
                .connect()
                .await
                .context("connecting")?;
            let mut client = AgentServiceClient::new(channel.clone())
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20);
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let msg = |slot: usize, m: agent_message::Msg| NodeMessage {
                slot: slot as u32,
                msg: Some(node_message::Msg::Message(AgentMessage { msg: Some(m) })),
            };
            // Frames of at most 16 KiB, as a relay sends them (the
            // dispatcher reads a stream into a buffer that keeps the size
            // of its largest frame).
            let mut frame: Vec<NodeMessage> = Vec::new();
            let mut bytes = 0;
            let mut push = |m: NodeMessage, flush: bool| {
                let len = prost::Message::encoded_len(&m) + 4;
                if bytes + len > 16 << 10 && !frame.is_empty() {
                    let _ = tx.send(RelayMessage {
                        nodes: std::mem::take(&mut frame),
                    });
                    bytes = 0;
                }
                bytes += len;
                frame.push(m);
                if flush {
                    let _ = tx.send(RelayMessage {
                        nodes: std::mem::take(&mut frame),
                    });
                    bytes = 0;
                }
            };
            for (k, &i) in nodes.iter().enumerate() {
                let r = register_msg(i, &topos[i % topos.len()], "core_costs");
                push(
                    msg(i - first, agent_message::Msg::Register(Box::new(r))),
                    k + 1 == nodes.len(),
                );
            }
            for (k, &i) in nodes.iter().enumerate() {
                let load = idle_load(&topos[i % topos.len()].cpus);
                let report = agent_message::Msg::Load(LoadReport {
                    load: Some(load),
                    seq: 0,
                });
                push(msg(i - first, report), k + 1 == nodes.len());
            }
            let mut inbound = client
                .attach_many(UnboundedReceiverStream::new(rx))
                .await
                .context("AttachMany")?
                .into_inner();
            let mut registered = 0;
            while registered < nodes.len() {
                let frame = inbound.next().await.context("the relay stream ended")??;
                for r in frame.nodes {
                    match r.msg {
                        Some(node_reply::Msg::Message(m))
                            if matches!(m.msg, Some(dispatcher_message::Msg::Registered(_))) =>
                        {
                            registered += 1
                        }
                        Some(node_reply::Msg::Ended(e)) => bail!("slot {} ended: {e:?}", r.slot),
                        _ => {}
                    }
                }
            }
            held.push((channel, tx, inbound));
        }
        anyhow::Ok(held)
    })?;
    println!("attached {n}");
    std::io::Write::flush(&mut std::io::stdout())?;
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
        line.clear();
    }
    drop(held);
    Ok(())
}

/// The release dispatcher's `collect_when_idle`: this thread collects its
/// mimalloc heap (forced: full pages too), at most every second.
fn collect_when_idle() {
    thread_local! {
        static LAST: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    }
    let now = Instant::now();
    if LAST
        .get()
        .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
    {
        return;
    }
    LAST.set(Some(now));
    // SAFETY: collects this thread's heap; no pointer is passed.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

/// mimalloc's pages by block size ([`mimalloc_pages`]).
type Census = Vec<(usize, PageClass)>;

/// What `n` attached agents cost the dispatcher's process.
struct ConnCosts {
    n: usize,
    /// How they attached.
    how: String,
    heap: isize,
    rss: i64,
    /// The memory gained, by where it is.
    mem: Memory,
    /// The same after malloc gave back what it could (`malloc_trim`).
    trimmed: Memory,
    /// Live allocations per size class gained (count, bytes).
    classes: Vec<(isize, isize)>,
    /// mimalloc's pages by block size, before the agents and after.
    pages: (Census, Census),
    /// With `MEASURE_TRACE_MIN`: the large blocks' places (live blocks,
    /// live bytes, allocated while the agents attached, those bytes).
    traces: Vec<(usize, usize, usize, usize, String)>,
}

/// A dispatcher in this process (its core, the gRPC server on a loopback
/// port, the embedded store in a temporary directory) and `n` agents
/// attached from a child process: the heap and RSS this process gained.
fn connection_costs(n: usize, per: usize, per_stream: usize) -> Result<ConnCosts> {
    use dispatcher::core::{Command, OnStoreFailure};
    use dispatcher::gate::Gate;
    use dispatcher::observe::Observers;
    use dispatcher::store::embedded::EmbeddedStore;
    use std::io::BufRead;

    let dir = std::env::temp_dir().join(format!("core_costs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = (|| {
        // Under mimalloc, the threads collect their heaps as they go idle,
        // as in the release dispatcher (`src/bin/dispatcher.rs`).
        if is_mimalloc() {
            dispatcher::idle::set_hook(collect_when_idle);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_park(|| {
                if is_mimalloc() {
                    collect_when_idle()
                }
            })
            .build()
            .context("starting the server's runtime")?;
        let store = EmbeddedStore::open(&dir).context("opening the store")?;
        // Heartbeats are not what is measured: no node goes DOWN meanwhile.
        let cfg = ClusterConfig {
            heartbeat_interval_ms: 600_000,
            ..ClusterConfig::default()
        };
        let (core, thread) = dispatcher::core::spawn(
            Cluster::new(cfg),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
        );
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .context("binding a loopback port")?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = rt.spawn(dispatcher::server::serve(
            Gate::always(core.clone()),
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        std::thread::sleep(Duration::from_millis(200));
        // The baseline after the allocator gave back what it could, so
        // that what it gives back after the agents is theirs.
        trim();
        let (heap0, rss0, classes0) = (in_use(), rss_bytes()?, live_classes());
        let mem0 = Memory::now()?;
        let pages0 = mimalloc_pages();
        trace_reset();
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args(["--attach", &url, "--connections", &n.to_string()])
            .args(["--agents-per-connection", &per.to_string()])
            .args(["--nodes-per-stream", &per_stream.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the agents' process")?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("the child's stdout")?;
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        ensure!(
            line.trim() == format!("attached {n}"),
            "the agents' process said {line:?}"
        );
        // Registered answers follow the commit; the first LoadReports
        // reach the core as beats within a flush.
        std::thread::sleep(Duration::from_millis(500));
        let nodes = rt.block_on(core.call(|reply| Command::Nodes {
            after: String::new(),
            page_size: 0,
            reply,
        }));
        let loaded = nodes
            .map_err(|s| anyhow::anyhow!("{s}"))?
            .nodes
            .iter()
            .filter(|n| n.load.as_ref().is_some_and(|l| !l.cpus.is_empty()))
            .count();
        ensure!(loaded == n, "{loaded} of {n} nodes have their LoadReport");
        std::thread::sleep(Duration::from_millis(100));
        let (heap1, rss1, classes1) = (in_use(), rss_bytes()?, live_classes());
        let mem1 = Memory::now()?;
        let pages1 = mimalloc_pages();
        let traces = trace_report();
        trim();
        let trimmed = Memory::now()?.minus(&mem0);
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = stop.send(());
        core.send(Command::Shutdown);
        drop(core);
        let _ = rt.block_on(server);
        let _ = thread.join();
        let how = if per_stream > 0 {
            format!("{per_stream} per AttachMany stream (one connection each)")
        } else {
            format!("{per} per HTTP/2 connection (an Attach stream each)")
        };
        Ok(ConnCosts {
            n,
            how,
            heap: heap1 - heap0,
            rss: rss1 as i64 - rss0 as i64,
            mem: mem1.minus(&mem0),
            trimmed,
            classes: classes1
                .iter()
                .zip(&classes0)
                .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
                .collect(),
            pages: (pages0, pages1),
            traces,
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// mimalloc's pages gained per agent, by block size: the bytes their
/// blocks span (touched: resident unless purged) against the bytes in use,
/// so what the allocator holds idle beside the agents' blocks shows by
/// size.
fn page_census(c: &ConnCosts) -> String {
    let k = c.n as f64;
    let (before, after) = &c.pages;
    let find = |v: &[(usize, PageClass)], b: usize| {
        v.iter()
            .find(|(s, _)| *s == b)
            .map(|(_, p)| *p)
            .unwrap_or_default()
    };
    let mut out = String::from(
        "\n| mimalloc pages gained, by block size (bytes) | pages | empty pages | spanned bytes per agent | in use per agent | idle per agent | resident per agent | resident, not in use |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut sizes: Vec<usize> = before.iter().chain(after).map(|(b, _)| *b).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let (mut span, mut used, mut res) = (0.0, 0.0, 0.0);
    for b in sizes {
        let (p0, p1) = (find(before, b), find(after, b));
        let dspan = (p1.capacity as f64 - p0.capacity as f64) / k;
        let dused = (p1.used as f64 - p0.used as f64) / k;
        let dres = (p1.resident as f64 - p0.resident as f64) / k;
        span += dspan;
        used += dused;
        res += dres;
        if dspan.abs() < 8.0 && dused.abs() < 8.0 && dres.abs() < 8.0 {
            continue;
        }
        out.push_str(&format!(
            "| {b} | {:+} | {:+} | {dspan:.0} | {dused:.0} | {:.0} | {dres:.0} | {:.0} |\n",
            p1.pages as isize - p0.pages as isize,
            p1.empty as isize - p0.empty as isize,
            dspan - dused,
            dres - dused,
        ));
    }
    out.push_str(&format!(
        "| all pages | | | {span:.0} | {used:.0} | {:.0} | {res:.0} | {:.0} |\n",
        span - used,
        res - used
    ));
    out
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if let Some(url) = &args.attach {
        return attach_agents(
            url,
            args.connections,
            args.agents_per_connection,
            args.nodes_per_stream,
        );
    }
    if args.check {
        args.nodes = args.nodes.min(400);
        args.pending = args.pending.min(2_000);
        args.runs = args.runs.min(2);
        args.connections = args.connections.min(200);
    }
    ensure!(args.nodes > 0, "--nodes: at least 1");
    let topos = shapes()?;
    let mut fx = Effects::default();
    let (mut cluster, empty) = held(|| Cluster::new(ClusterConfig::default()));
    let base = in_use();

    // Nodes: registration (the registry and the node-level engine), then
    // one LoadReport each.
    let mut now = 1_000;
    for i in 0..args.nodes {
        cluster
            .register(
                register_msg(i, &topos[i % topos.len()], "core_costs"),
                now,
                &mut fx,
            )
            .map_err(|s| anyhow::anyhow!("register: {s}"))?;
    }
    let registered = in_use();
    cluster.settle(now, &mut fx);
    fx = Effects::default();
    let settled = in_use();
    let loads: Vec<NodeLoad> = topos.iter().map(|t| idle_load(&t.cpus)).collect();
    for i in 0..args.nodes {
        let name = format!("lg-{i:05}");
        cluster.load_report(&name, loads[i % loads.len()].clone(), now, &mut fx);
    }
    fx = Effects::default();
    let reported = in_use();
    let n = args.nodes as f64;
    let per_node = (reported - base) as f64 / n;
    // One node's parts, measured on copies.
    let node = cluster
        .node("lg-00000")
        .map_err(|s| anyhow::anyhow!("{s}"))?;
    // What a node would hold alone, and what it holds: its topology is
    // shared per shape, its last load packed.
    let (_t, topo_bytes) = held(|| proto::v1::Topology::clone(&node.topology));
    let (_s, topo_shared) = held(|| node.topology.clone());
    let (_l, load_bytes) = held(|| node.load.to_proto());
    let (_p, load_packed) = held(|| PackedLoad::new(&node.load.to_proto()));
    let (_b, labels_bytes) = held(|| node.labels.clone());
    let node_struct = std::mem::size_of::<dispatcher::cluster::NodeInfo>();

    // Pending jobs: unplaceable, as arrays of 1,000.
    let before_jobs = in_use();
    let mut left = args.pending;
    let mut k = 0;
    while left > 0 {
        let count = left.min(1_000);
        let spec = JobSpec {
            name: format!("lg-pending-{k}"),
            command: vec!["sleep".into(), "1".into()],
            group: "loadgen-pending".into(),
            node_selector: HashMap::from([("loadgen/unplaceable".to_string(), "true".into())]),
            array_count: count as u32,
            ..Default::default()
        };
        cluster
            .submit(vec![spec], false, now, &mut fx)
            .map_err(|s| anyhow::anyhow!("submit: {s}"))?;
        fx = Effects::default();
        left -= count;
        k += 1;
    }
    let per_job = (in_use() - before_jobs) as f64 / args.pending.max(1) as f64;
    let job = cluster
        .get_job(&format!("j-1.{}", 0))
        .or_else(|_| cluster.get_job("j-1"))
        .map_err(|s| anyhow::anyhow!("{s}"))?;
    let (_j, job_bytes) = held(|| job.clone());
    let job_proto = std::mem::size_of::<proto::v1::Job>();
    let record_inline = std::mem::size_of::<dispatcher::cluster::JobRecord>();
    let spec_inline = std::mem::size_of::<JobSpec>();
    let entry_inline = std::mem::size_of::<dispatcher::cluster::jobs::JobEntry>();

    // The core's time on its tick: the web snapshot, before and after.
    let metrics = Arc::new(Metrics::new().context("metrics")?);
    now += 1_000;
    let counts = metrics.job_counts();
    let whole = best(args.runs, || {
        std::hint::black_box(web::build(&cluster, &counts, now));
    });
    let copy = best(args.runs, || {
        std::hint::black_box(web::capture(&cluster, counts.clone(), now));
    });
    let assembly = best(args.runs, || {
        let c = web::capture(&cluster, counts.clone(), now);
        std::hint::black_box(web::assemble(c));
    });
    // ListNodes: every node's view built on the core (as it was, in
    // slices), against the copy the core takes now (the views are built
    // on the list worker) and that build, off the core.
    let views_on_core = best(args.runs, || {
        let views: Vec<_> = cluster.nodes().map(|n| cluster.node_proto(n)).collect();
        std::hint::black_box(views);
    });
    let views_copy = best(args.runs, || {
        std::hint::black_box(cluster.node_copies());
    });
    let views_off_core = best(args.runs, || {
        let copies = Arc::new(cluster.node_copies());
        std::hint::black_box(dispatcher::cluster::listing::views(copies));
    })
    .saturating_sub(views_copy);
    let sample = best(args.runs, || metrics.sample(&cluster, now));
    let sample_copy = best(args.runs, || {
        std::hint::black_box(metrics.copy(&cluster, now));
    });

    // A LoadReport: the old path applied each to the cluster on the core;
    // the new one compares it on its stream's reader and queues nothing
    // when it is unchanged.
    let names: Vec<String> = (0..args.nodes).map(|i| format!("lg-{i:05}")).collect();
    let old_path = best(args.runs, || {
        for (i, name) in names.iter().enumerate() {
            cluster.load_report(name, loads[i % loads.len()].clone(), now, &mut fx);
        }
    }) / args.nodes as u32;
    let beats = Arc::new(Beats::default());
    let mut scratch = Vec::new();
    let mut readers: Vec<Reporter> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let tx = dispatcher::outbound::channel().0;
            let mut r = Reporter::new(beats.beat(name, i as u64, tx, now));
            r.report(&beats, loads[i % loads.len()].clone(), 0, now, &mut scratch);
            r
        })
        .collect();
    let queued = beats.drain().len();
    let reports: Vec<NodeLoad> = (0..args.nodes)
        .map(|i| loads[i % loads.len()].clone())
        .collect();
    // Each run reports a clone of the same loads (a decoded message is a
    // fresh value); the clones are made outside the timing.
    let mut new_path = Duration::MAX;
    for _ in 0..args.runs.max(1) {
        let batch = reports.clone();
        let t = Instant::now();
        for (r, load) in readers.iter_mut().zip(batch) {
            r.report(&beats, load, 0, now + 1, &mut scratch);
        }
        new_path = new_path.min(t.elapsed());
    }
    let new_path = new_path / args.nodes as u32;
    let requeued = beats.drain().len();

    let mut out = String::new();
    out.push_str(&format!(
        "core_costs: {} nodes (shapes {} cycled, 40 per rack, 4 zones), {} pending jobs \
         (arrays of 1,000, a selector no node matches); best of {} runs\n\n",
        args.nodes,
        SHAPES.join(", "),
        args.pending,
        args.runs
    ));
    out.push_str("| heap bytes (counting allocator) | total | per node / job |\n|---|---:|---:|\n");
    let row = |out: &mut String, what: &str, total: isize, per: f64| {
        out.push_str(&format!("| {what} | {total} | {per:.0} |\n"));
    };
    row(&mut out, "empty cluster", empty, 0.0);
    row(
        &mut out,
        "nodes registered (registry, labels, topology, CPU model)",
        registered - base,
        (registered - base) as f64 / n,
    );
    row(
        &mut out,
        "node-level engine built (settle)",
        settled - registered,
        (settled - registered) as f64 / n,
    );
    row(
        &mut out,
        "one LoadReport kept per node",
        reported - settled,
        (reported - settled) as f64 / n,
    );
    row(&mut out, "all of a node", reported - base, per_node);
    row(
        &mut out,
        "pending jobs",
        (per_job * args.pending as f64) as isize,
        per_job,
    );
    out.push_str("\n| one part, on a copy | heap bytes | inline bytes |\n|---|---:|---:|\n");
    out.push_str(&format!(
        "| a node's topology as reported (proto): a copy / the node's share | {topo_bytes} / {topo_shared} | |\n\
         | a node's last LoadReport: decoded / packed | {load_bytes} / {load_packed} | |\n\
         | a node's labels | {labels_bytes} | |\n\
         | NodeInfo | | {node_struct} |\n\
         | a pending job's proto Job, as read (spec included) | {job_bytes} | {job_proto} |\n\
         | the table's record of it (the spec shared by an array's elements) | | {record_inline} |\n\
         | a JobSpec (one per submitted spec) | | {spec_inline} |\n\
         | its entry in the job table (phase, task, CPUs, requeues) | | {entry_inline} |\n"
    ));
    out.push_str(&format!(
        "\n| core work | before (ms) | after (ms) | ratio |\n|---|---:|---:|---:|\n\
         | web snapshot on the core per publish: built whole / copied ({} off the core) | {} | {} | {:.3} |\n\
         | metrics sample per tick: taken whole / copied (the rest off the core) | {} | {} | {:.3} |\n\
         | ListNodes: every view built / copied ({} off the core) | {} | {} | {:.3} |\n",
        ms(assembly),
        ms(whole),
        ms(copy),
        copy.as_secs_f64() / whole.as_secs_f64().max(1e-12),
        ms(sample),
        ms(sample_copy),
        sample_copy.as_secs_f64() / sample.as_secs_f64().max(1e-12),
        ms(views_off_core),
        ms(views_on_core),
        ms(views_copy),
        views_copy.as_secs_f64() / views_on_core.as_secs_f64().max(1e-12),
    ));
    out.push_str(&format!(
        "\n| a LoadReport that changes nothing | before: core (us) | after: stream reader, off the core (us) |\n|---|---:|---:|\n\
         | per report | {} | {} |\n\
         | beats queued for the core: first report / unchanged report | {queued} | {requeued} |\n",
        us(old_path),
        us(new_path),
    ));
    let conn = if args.connections > 0 {
        Some(connection_costs(
            args.connections,
            args.agents_per_connection.max(1),
            args.nodes_per_stream,
        )?)
    } else {
        None
    };
    if let Some(c) = &conn {
        let k = c.n as f64;
        let per_agent = c.heap as f64 / k;
        // Our parts of a stream, on copies: its outbound queue (the
        // channel's first block is allocated with it) and its beat with
        // the reader's last load, after the core took the first report.
        let (_q, queue_bytes) = held(dispatcher::outbound::channel);
        let tx = dispatcher::outbound::channel().0;
        let (_b, beat_bytes) = held(|| {
            let beats = Arc::new(Beats::default());
            let mut r = Reporter::new(beats.beat("lg-00000", 1, tx, now));
            r.report(&beats, loads[0].clone(), 0, now, &mut Vec::new());
            for b in beats.drain() {
                drop(b.take());
            }
            r
        });
        out.push_str(&format!(
            "\n| {} agents attached, {} (a server in this process) | heap bytes per agent |\n|---|---:|\n\
             | all of an attached agent (this process's heap) | {per_agent:.0} |\n\
             | of which its node in the cluster (\"all of a node\" above) | {per_node:.0} |\n\
             | the rest: its connection, stream, tasks and queues | {:.0} |\n\
             | of which ours: the stream's outbound queue, on a copy | {queue_bytes} |\n\
             | of which ours: the stream's beat and its reader's last load, on a copy | {beat_bytes} |\n\
             | of which ours: its codec's first buffers, both directions, on a copy | {} |\n\
             | RSS per agent (VmRSS growth / agents) | {:.0} |\n\
             | RSS per agent once the allocator's due purges ran (smaps_rollup Rss / of which anonymous) | {:.0} / {:.0} |\n\
             | RSS per agent after the allocator gave back all it could (Rss / anonymous) | {:.0} / {:.0} |\n",
            c.n,
            c.how,
            per_agent - per_node,
            attach_codec_bytes(),
            c.rss as f64 / k,
            c.mem.rss as f64 / k,
            c.mem.anon as f64 / k,
            c.trimmed.rss as f64 / k,
            c.trimmed.anon as f64 / k,
        ));
        // glibc tells what it holds; mimalloc's commit figure on Linux is
        // its reserved memory, which says nothing of the agents.
        if !is_mimalloc() {
            out.push_str(&format!(
                "| glibc malloc's memory from the OS per agent (arenas + mmapped) | {:.0} |\n\
                 | of which in chunks handed out (the heap above and malloc's overhead) | {:.0} |\n\
                 | of which free chunks malloc keeps | {:.0} |\n",
                c.mem.malloc_held as f64 / k,
                c.mem.malloc_used as f64 / k,
                c.mem.malloc_free as f64 / k,
            ));
        }
        out.push_str(
            "\n| live allocations gained, by size (bytes) | allocations per agent | bytes per agent |\n|---|---:|---:|\n",
        );
        for (class, &(count, bytes)) in c.classes.iter().enumerate() {
            if (count as f64 / k).abs() < 0.05 && (bytes as f64 / k).abs() < 32.0 {
                continue;
            }
            let lo = if class == 0 {
                0
            } else {
                (1usize << (class - 1)) + 1
            };
            out.push_str(&format!(
                "| {lo}-{} | {:.2} | {:.0} |\n",
                1usize << class,
                count as f64 / k,
                bytes as f64 / k
            ));
        }
    }
    if let Some(c) = conn.as_ref().filter(|_| is_mimalloc()) {
        out.push_str(&page_census(c));
    }
    if let Some(c) = conn.as_ref().filter(|c| !c.traces.is_empty()) {
        out.push_str(
            "\n| large blocks by place | live | live bytes | allocated while attaching | bytes |\n|---|---:|---:|---:|---:|\n",
        );
        for (live, bytes, made, made_bytes, place) in &c.traces {
            out.push_str(&format!(
                "| {place} | {live} | {bytes} | {made} | {made_bytes} |\n"
            ));
        }
    }
    print!("{out}");
    if args.check {
        if let Some(c) = &conn {
            let per_agent = c.heap as f64 / c.n as f64;
            // The server holds the node's cluster record and more.
            if per_agent < per_node {
                bail!(
                    "an attached agent counted {per_agent:.0} bytes, less than its node's {per_node:.0}"
                );
            }
            // An idle queue preallocates no block of slots: not even one
            // of 32 boxed messages' pointers (tokio's mpsc: 512 bytes
            // with its header, 800 with the channel).
            let (_q, queue) = held(dispatcher::outbound::channel);
            let block = 32 * std::mem::size_of::<Box<dispatcher::outbound::Item>>();
            if queue as usize >= block {
                bail!(
                    "an agent's idle outbound queue holds {queue} bytes, a block of 32 pointers is {block}"
                );
            }
        }
        // An Attach stream's codec starts small in both directions (the
        // buffers grow to the messages a stream carries): under 512 bytes
        // up front, where tonic's default gave 16 KiB and 1 KiB first
        // buffers 2 KiB, held by every idle agent.
        let codec = attach_codec_bytes();
        if codec >= 512 {
            bail!("an Attach stream's codec holds {codec} bytes up front, want under 512");
        }
        if per_node <= 0.0 || per_job <= 0.0 {
            bail!("no bytes counted: per node {per_node}, per job {per_job}");
        }
        // Regression bounds from this run's own figures: a node holds its
        // topology shared and its load packed, so all of it costs less
        // than a copy of its topology and its decoded load would (before
        // the sharing it cost more); the stream's queue is a block of
        // pointers, not of messages.
        if per_node >= (topo_bytes + load_bytes) as f64 || topo_shared != 0 {
            bail!(
                "a node costs {per_node:.0} bytes (its topology's share {topo_shared}): not less \
                 than a copy of its topology ({topo_bytes}) and its decoded load ({load_bytes})"
            );
        }
        if load_packed * 2 > load_bytes {
            bail!(
                "the packed load ({load_packed}) is not under half the decoded one ({load_bytes})"
            );
        }
        if queued != args.nodes || requeued != 0 {
            bail!(
                "{queued} first reports queued (want {}), {requeued} unchanged",
                args.nodes
            );
        }
        // The snapshot assembled from the copy equals the one built whole.
        let a = web::build(&cluster, &counts, now);
        let b = web::assemble(web::capture(&cluster, counts.clone(), now));
        if a.cluster != b.cluster || a.racks != b.racks {
            bail!("the assembled snapshot differs from the one built whole");
        }
        if a.cluster.totals.nodes as usize != args.nodes {
            bail!("snapshot of {} nodes", a.cluster.totals.nodes);
        }
        println!("\ncheck: ok");
    }
    Ok(())
}
