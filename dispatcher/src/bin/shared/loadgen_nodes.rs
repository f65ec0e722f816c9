//! The fake nodes the core benches register, shaped as `loadgen`'s agents
//! register theirs (the same shapes, names `lg-NNNNN`, racks of 40 nodes over 4 zones,
//! 4 GiB per CPU), so the benches and the load generator measure the same
//! cluster. Shared by `core_costs`, `core_costs_jobs` and `node_bytes`.

use std::collections::HashMap;

use proto::v1::{CpuLoad, NodeLoad, Register};
use sched::Topology;

/// loadgen's node shapes, cycled over the nodes.
pub const SHAPES: [&str; 4] = ["2s:16c:2t", "1s:8c:2t", "2s:8c:2t", "1s:4c:2t"];

/// [`SHAPES`] as the topologies agents register.
pub fn shapes() -> anyhow::Result<Vec<proto::v1::Topology>> {
    SHAPES
        .iter()
        .map(|s| {
            Topology::from_spec(s)
                .map(|t| engine_proto::topology(&t))
                .map_err(|e| anyhow::anyhow!("{s}: {e}"))
        })
        .collect()
}

/// The registration of fake node `i` with topology `topo`; `version`
/// names the bench that registers it.
pub fn register_msg(i: usize, topo: &proto::v1::Topology, version: &str) -> Register {
    let rack = i / 40;
    let zone = rack % 4;
    Register {
        node: format!("lg-{i:05}"),
        labels: HashMap::from([
            (
                "topology.kubernetes.io/zone".to_string(),
                format!("z{zone}"),
            ),
            ("dispatch.io/rack".to_string(), format!("z{zone}-r{rack}")),
        ]),
        topology: Some(topo.clone()),
        memory_bytes: topo.cpus.len() as u64 * (4 << 30),
        version: version.into(),
        oversubscribe: 1,
        ..Default::default()
    }
}

/// loadgen's LoadReport of an idle node: every CPU, its schedstat names.
#[allow(dead_code)] // `core_costs_jobs` sends no loads.
pub fn idle_load(cpus: &[u32]) -> NodeLoad {
    NodeLoad {
        cpus: cpus
            .iter()
            .map(|&cpu| CpuLoad {
                cpu,
                busy: false,
                runnable: 0,
            })
            .collect(),
        avg_idle_ns: 500_000,
        schedstats: dispatch_telemetry::schedstat_fields(&sched::Schedstats::default())
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        ..Default::default()
    }
}
