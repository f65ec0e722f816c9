//! `core_costs_jobs`: the core thread's work per job on the data path,
//! submit -> Assign -> RUNNING -> SUCCEEDED, with every transition
//! committed to the embedded store, without gRPC.
//!
//! The real core ([`dispatcher::core::spawn`], the real embedded store in a
//! temporary directory, no observers, as `loadgen`'s dispatcher runs) is
//! driven in this process: N nodes attach through outbound queues as the
//! server's Attach does (loadgen's shapes, 40 nodes per rack over 4
//! zones), a submitter sends `Submit` commands of `--batch` specs (loadgen's
//! job specs: `sleep`, CPUs 1,1,2,4 cycled, the submit-time env variable)
//! with at most `--in-flight` calls waiting, and each node's task answers
//! an `Assign` at once with RUNNING (the lowest free CPUs of its model)
//! and then SUCCEEDED, each status its own `FromAgent` command as
//! loadgen's fake agents send them (`--status-batches`: both in one
//! `StatusBatch`, as the real agent does). Printed: jobs per second end
//! to end and the core thread's CPU time per job.
//!
//! Instructions per job, repeatable: run it twice under callgrind with
//! `--separate-threads=yes` at two job counts and divide the difference of
//! the `dispatch-core` thread's totals by the difference of the counts
//! (the set-up cancels out).
//!
//! ```text
//! cargo run --release -p dispatcher --bin core_costs_jobs -- --nodes 500 --jobs 200000
//! valgrind --tool=callgrind --separate-threads=yes ./target/release/core_costs_jobs --jobs 2000
//! ```

#[path = "shared/loadgen_nodes.rs"]
mod loadgen_nodes;
use loadgen_nodes::{register_msg, shapes};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use dispatcher::cluster::{Cluster, ClusterConfig};
use dispatcher::core::{self, Command, OnStoreFailure};
use dispatcher::observe::Observers;
use dispatcher::outbound::{self, AgentRx};
use dispatcher::store::embedded::EmbeddedStore;
use dispatcher::store::{Snapshot, Store, StoreError, Write};
use proto::v1::{JobSpec, JobState, JobStatus, StatusBatch, agent_message, dispatcher_message};
use tokio::sync::{Notify, Semaphore};

#[derive(Parser, Debug)]
#[command(
    name = "core_costs_jobs",
    about = "The core's work per job, submit to SUCCEEDED, against the real embedded store"
)]
struct Args {
    /// Nodes (loadgen's shapes cycled, 40 per rack over 4 zones).
    #[arg(long, default_value_t = 500)]
    nodes: usize,
    /// Jobs submitted.
    #[arg(long, default_value_t = 100_000)]
    jobs: u64,
    /// Specs per Submit command (loadgen's --batch).
    #[arg(long, default_value_t = 500)]
    batch: u64,
    /// Submit commands waiting for their reply at most.
    #[arg(long, default_value_t = 8)]
    in_flight: usize,
    /// Both statuses of a job in one StatusBatch (the real agent's way).
    #[arg(long)]
    status_batches: bool,
    /// A store that keeps nothing (encodes each job, as a store must):
    /// the embedded store's share by difference.
    #[arg(long)]
    null_store: bool,
}

const JOB_CPUS: [u32; 4] = [1, 1, 2, 4];

/// A store that durably stores nothing: it only encodes what it is given.
struct NullStore;

impl Store for NullStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot::default())
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        let mut bytes = 0;
        for w in writes {
            if let Write::PutJob(job) = w {
                bytes += prost::Message::encoded_len(&job.to_proto());
            }
        }
        std::hint::black_box(bytes);
        Ok(())
    }
}

/// loadgen's job spec number `seq` (its duration does not matter here).
fn job_spec(seq: u64) -> JobSpec {
    JobSpec {
        name: format!("lg-{seq}"),
        command: vec!["sleep".into(), "0.000".into()],
        cpus: JOB_CPUS[(seq % JOB_CPUS.len() as u64) as usize],
        group: "loadgen".into(),
        env: HashMap::from([("LOADGEN_SUBMIT_US".to_string(), (seq * 20).to_string())]),
        ..Default::default()
    }
}

fn status(job_id: &str, attempt: u32, state: JobState, cpus: &[u32]) -> JobStatus {
    JobStatus {
        job_id: job_id.to_string(),
        attempt,
        state: state as i32,
        cpus: cpus.to_vec(),
        time_ms: core::now_ms(),
        ..Default::default()
    }
}

/// What every node's task shares.
#[derive(Clone)]
struct Shared {
    core: core::CoreHandle,
    /// Jobs the nodes have finished.
    finished: Arc<AtomicU64>,
    /// Told once `total` jobs have finished.
    done: Arc<Notify>,
    total: u64,
    /// Both statuses in one StatusBatch.
    batches: bool,
}

/// One node: answers every Assign with RUNNING on its lowest free CPUs,
/// then SUCCEEDED.
async fn agent(s: Shared, node: String, session: u64, cpus: Vec<u32>, mut rx: AgentRx) {
    let mut free = cpus;
    free.reverse();
    while let Some(item) = rx.recv().await {
        let Ok(msg) = item else { return };
        let Some(dispatcher_message::Msg::Assign(a)) = msg.msg else {
            continue;
        };
        let want = a.spec.as_ref().map_or(1, |s| s.cpus.max(1)) as usize;
        let at = free.len().saturating_sub(want);
        let taken: Vec<u32> = free.drain(at..).rev().collect();
        let running = status(&a.job_id, a.attempt, JobState::Running, &taken);
        let succeeded = status(&a.job_id, a.attempt, JobState::Succeeded, &taken);
        free.extend(taken.iter().rev());
        let msgs = if s.batches {
            vec![agent_message::Msg::Statuses(StatusBatch {
                statuses: vec![running, succeeded],
            })]
        } else {
            vec![
                agent_message::Msg::Status(running),
                agent_message::Msg::Status(succeeded),
            ]
        };
        for msg in msgs {
            s.core.send(Command::FromAgent {
                node: node.clone(),
                session,
                msg,
            });
        }
        if s.finished.fetch_add(1, Ordering::Relaxed) + 1 == s.total {
            s.done.notify_one();
        }
    }
}

/// CPU seconds of this process's thread named `name` (utime + stime).
fn thread_cpu_s(name: &str) -> Option<f64> {
    let ticks = 100.0; // USER_HZ on Linux
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let path = entry.path();
        let comm = std::fs::read_to_string(path.join("comm")).ok()?;
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(path.join("stat")).ok()?;
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = f.get(11)?.parse().ok()?;
        let stime: f64 = f.get(12)?.parse().ok()?;
        return Some((utime + stime) / ticks);
    }
    None
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.nodes > 0 && args.jobs > 0 && args.batch > 0,
        "sizes: at least 1"
    );
    let dir = std::env::temp_dir().join(format!("core_costs_jobs.{}", std::process::id()));
    let store: Box<dyn Store> = if args.null_store {
        Box::new(NullStore)
    } else {
        Box::new(EmbeddedStore::open(&dir).map_err(|e| anyhow::anyhow!("{e}"))?)
    };
    // loadgen's baseline: heartbeats are never missed.
    let cfg = ClusterConfig {
        heartbeat_interval_ms: 2_000,
        missed_heartbeats: 1_000_000_000,
        ..ClusterConfig::default()
    };
    let (handle, thread) = core::spawn(
        Cluster::new(cfg),
        store,
        OnStoreFailure::Stop,
        Observers::none(),
    );
    let topos = shapes()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("the async runtime")?;
    let total = args.jobs;
    let (wall, core_s) = runtime.block_on(async {
        let shared = Shared {
            core: handle.clone(),
            finished: Arc::new(AtomicU64::new(0)),
            done: Arc::new(Notify::new()),
            total,
            batches: args.status_batches,
        };
        for i in 0..args.nodes {
            let topo = &topos[i % topos.len()];
            let register = register_msg(i, topo, "core_costs_jobs");
            let node = register.node.clone();
            let (tx, rx) = outbound::channel();
            let (session, _beat) = handle
                .call(|reply| Command::Attach {
                    register: Box::new(register),
                    tx,
                    reply,
                })
                .await
                .map_err(|s| anyhow::anyhow!("attach: {s}"))?;
            tokio::spawn(agent(shared.clone(), node, session, topo.cpus.clone(), rx));
        }
        // Let the registrations' engine rebuild settle.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let core0 = thread_cpu_s("dispatch-core").unwrap_or(0.0);
        let start = Instant::now();
        let gate = Arc::new(Semaphore::new(args.in_flight.max(1)));
        let mut next = 0;
        while next < total {
            let n = args.batch.min(total - next);
            let specs: Vec<JobSpec> = (next..next + n).map(job_spec).collect();
            next += n;
            let permit = gate.clone().acquire_owned().await?;
            let h = handle.clone();
            tokio::spawn(async move {
                let r = h
                    .call(|reply| Command::Submit {
                        specs,
                        batch: true,
                        trace_context: HashMap::new(),
                        owner: String::new(),
                        reply,
                    })
                    .await;
                if let Err(s) = r {
                    eprintln!("submit failed: {s}");
                    std::process::exit(1);
                }
                drop(permit);
            });
        }
        if shared.finished.load(Ordering::Relaxed) < total {
            shared.done.notified().await;
        }
        // The last statuses were sent: a read behind them in the core's
        // queue answers once they are applied and committed.
        let _ = handle
            .call(|reply| Command::Get {
                id: "j-1".into(),
                reply,
            })
            .await;
        let wall = start.elapsed();
        let core_s = thread_cpu_s("dispatch-core").unwrap_or(0.0) - core0;
        anyhow::Ok((wall, core_s))
    })?;
    handle.send(Command::Shutdown);
    let _ = thread.join();
    let _ = std::fs::remove_dir_all(&dir);
    let jobs = total as f64;
    println!(
        "nodes {} jobs {} batch {} statuses {} store {}: {:.3} s, {:.0} jobs/s end to end; \
         core thread {:.2} s CPU, {:.1} us per job",
        args.nodes,
        total,
        args.batch,
        if args.status_batches {
            "batched"
        } else {
            "one per message"
        },
        if args.null_store { "null" } else { "embedded" },
        wall.as_secs_f64(),
        jobs / wall.as_secs_f64(),
        core_s,
        core_s / jobs * 1e6,
    );
    Ok(())
}
