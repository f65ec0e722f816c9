//! `node_bytes`: the heap bytes the dispatcher keeps per registered node,
//! outside its agent's connection (issue 14: "<= 2 KiB per node").
//!
//! For each fleet and each size, a cluster is built in this process as
//! the core builds it, under a counting global allocator: N nodes
//! register (the registry: names, labels, place, topology, CPU model,
//! devices), the node-level engine is built (`settle`), each node sends
//! one idle LoadReport (kept packed), and the web snapshot the core
//! publishes is built and held. Each phase's heap growth divided by N is
//! a row; "a node" is the first three (what the cluster holds for it).
//!
//! Fleets: `cpu` (2 sockets x 16 cores x 2 threads, 2 NUMA nodes per
//! socket, five labels, one of them the host name), `gpu` (the same with
//! 8 GPUs and 2 NICs), `loadgen` (`loadgen`'s four shapes, two labels,
//! as `core_costs` registers them).
//!
//! ```text
//! cargo build --release -p dispatcher --bin node_bytes
//! ./target/release/node_bytes --nodes 1000,10000
//! ```
//!
//! The bin uses only the cluster's public API, so the same file builds
//! against an older dispatcher for a same-run baseline.

#[path = "shared/heap_count.rs"]
mod heap_count;
#[path = "shared/loadgen_nodes.rs"]
mod loadgen_nodes;
use heap_count::in_use;
use loadgen_nodes::idle_load;

use std::collections::HashMap;

use anyhow::{Result, anyhow};
use clap::Parser;
use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use proto::v1::{Device, DeviceKind, Register};

#[derive(Parser, Debug)]
#[command(about = "Heap bytes the dispatcher keeps per registered node, by phase")]
struct Args {
    /// Cluster sizes, each measured on a fresh cluster.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    nodes: Vec<usize>,
    /// Fleets to measure: cpu, gpu, loadgen.
    #[arg(long, value_delimiter = ',', default_value = "cpu,gpu,loadgen")]
    fleets: Vec<String>,
    /// A label for the binary measured (printed in each row).
    #[arg(long, default_value = "")]
    tag: String,
    /// Fail unless a node (registry, engine, load) is under this many
    /// bytes in every measurement (0: no bound).
    #[arg(long, default_value_t = 0)]
    max_per_node: usize,
}

/// The CPU shape of the `cpu` and `gpu` fleets.
const BIG: &str = "2s:16c:2t:numa=2";

/// The 8 GPUs and 2 NICs of a `gpu` node, as an agent reports them: two
/// GPUs per PCIe switch, two switches per host bridge, one host bridge
/// per socket.
fn gpu_devices() -> Vec<Device> {
    let gpu = |i: u32| Device {
        kind: DeviceKind::Gpu as i32,
        index: i,
        pci_address: format!("0000:{:02x}:00.0", 0x18 + 0x10 * i),
        numa_node: Some(i / 2),
        vendor_id: 0x10de,
        device_id: 0x20b0,
        vendor: "nvidia".into(),
        model: "10de:20b0".into(),
        host_bridge: format!("pci0000:{:02x}", if i < 4 { 0x17 } else { 0x97 }),
        bridges: vec![
            format!("0000:{:02x}:00.0", 0x16 + 0x10 * (i / 2)),
            format!("0000:{:02x}:00.0", 0x17 + 0x10 * i),
        ],
        locality: vec![u64::from(i / 2), u64::from(i / 4), u64::from(i / 2), 0],
        nvidia_minor: Some(i),
    };
    let nic = |i: u32| Device {
        kind: DeviceKind::Nic as i32,
        index: i,
        pci_address: format!("0000:{:02x}:00.0", 0x5e + 0x80 * i),
        numa_node: Some(i * 2),
        vendor_id: 0x15b3,
        device_id: 0x101b,
        vendor: "15b3".into(),
        model: "15b3:101b".into(),
        host_bridge: format!("pci0000:{:02x}", if i == 0 { 0x5d } else { 0xdd }),
        ..Default::default()
    };
    (0..8).map(gpu).chain((0..2).map(nic)).collect()
}

/// The registration of node `i` of `fleet`.
fn register_msg(fleet: &str, i: usize, topos: &[proto::v1::Topology]) -> Register {
    if fleet == "loadgen" {
        return loadgen_nodes::register_msg(i, &topos[i % topos.len()], "node_bytes");
    }
    let rack = i / 40;
    let zone = rack % 4;
    let name = format!("n-{i:05}");
    let topo = &topos[0];
    Register {
        labels: HashMap::from([
            (
                "topology.kubernetes.io/zone".to_string(),
                format!("z{zone}"),
            ),
            ("dispatch.io/rack".to_string(), format!("z{zone}-r{rack}")),
            (
                "node.kubernetes.io/instance-type".to_string(),
                if fleet == "gpu" {
                    "p4d.24xlarge"
                } else {
                    "c6i.16xlarge"
                }
                .to_string(),
            ),
            ("dispatch.io/partition".to_string(), "batch".to_string()),
            ("kubernetes.io/hostname".to_string(), name.clone()),
        ]),
        node: name,
        topology: Some(topo.clone()),
        memory_bytes: topo.cpus.len() as u64 * (4 << 30),
        version: "0.14.2".into(),
        oversubscribe: 1,
        devices: if fleet == "gpu" {
            gpu_devices()
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

/// One measurement: bytes per node by phase.
struct Row {
    registry: f64,
    engine: f64,
    load: f64,
    web: f64,
}

fn measure(fleet: &str, n: usize) -> Result<Row> {
    let topos: Vec<proto::v1::Topology> = if fleet == "loadgen" {
        loadgen_nodes::shapes()?
    } else {
        let t = sched::Topology::from_spec(BIG).map_err(|e| anyhow!("{BIG}: {e}"))?;
        vec![engine_proto::topology(&t)]
    };
    let names: Vec<String> = (0..n)
        .map(|i| register_msg(fleet, i, &topos).node)
        .collect();
    // Messages are made in the loops: what a phase keeps is what the
    // cluster took of them.
    let mut cluster = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    let now = 1_000;
    let base = in_use();
    for i in 0..n {
        cluster
            .register(register_msg(fleet, i, &topos), now, &mut fx)
            .map_err(|s| anyhow!("register: {s}"))?;
    }
    fx = Effects::default();
    let registered = in_use();
    cluster.settle(now, &mut fx);
    fx = Effects::default();
    let settled = in_use();
    for (i, name) in names.iter().enumerate() {
        let load = idle_load(&topos[i % topos.len()].cpus);
        cluster.load_report(name, load, now, &mut fx);
    }
    drop(fx);
    let reported = in_use();
    let snapshot = dispatcher::web::build(&cluster, &[], now);
    let published = in_use();
    drop(snapshot);
    drop(cluster);
    let per = |a: isize, b: isize| (b - a) as f64 / n as f64;
    Ok(Row {
        registry: per(base, registered),
        engine: per(registered, settled),
        load: per(settled, reported),
        web: per(reported, published),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!(
        "| binary | fleet | nodes | registry | engine | last load | a node (sum) | web snapshot |\n\
         |---|---|---:|---:|---:|---:|---:|---:|"
    );
    let mut worst: f64 = 0.0;
    for fleet in &args.fleets {
        anyhow::ensure!(
            ["cpu", "gpu", "loadgen"].contains(&fleet.as_str()),
            "--fleets: unknown fleet {fleet:?}"
        );
        for &n in &args.nodes {
            anyhow::ensure!(n > 0, "--nodes: at least 1");
            let r = measure(fleet, n)?;
            let node = r.registry + r.engine + r.load;
            worst = worst.max(node);
            println!(
                "| {} | {fleet} | {n} | {:.0} | {:.0} | {:.0} | {node:.0} | {:.0} |",
                args.tag, r.registry, r.engine, r.load, r.web
            );
        }
    }
    if args.max_per_node > 0 {
        anyhow::ensure!(
            worst < args.max_per_node as f64,
            "a node holds {worst:.0} bytes, want under {}",
            args.max_per_node
        );
    }
    Ok(())
}
