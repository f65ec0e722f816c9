//! `dispatch-engine-proto`: the conversions between the API's types
//! (`dispatch-proto`) and the engine's (`sched`), written once for the
//! agent, the dispatcher, the simulator and the benchmarks.
//!
//! Neither side knows the other: the engine knows nothing of the API, and
//! the API crate does not build the engine (so `dispatchctl`, which only
//! speaks the API, never compiles it). This crate is the only bridge.

use proto::v1;
use sched::topology::DomainFlags;
use sched::{Align, FreeSummary, Policy, Topology, TopologyBuilder};

/// The engine's alignment for an API value (unknown values: `Any`;
/// validation refuses them before they get here).
pub fn align(a: i32) -> Align {
    match v1::Alignment::try_from(a).unwrap_or(v1::Alignment::Any) {
        v1::Alignment::Any => Align::Any,
        v1::Alignment::Core => Align::Core,
        v1::Alignment::Llc => Align::Llc,
        v1::Alignment::Numa => Align::Numa,
        v1::Alignment::Package => Align::Package,
    }
}

/// The engine's placement policy for an API value.
pub fn policy(p: i32) -> Policy {
    match v1::PlacementPolicy::try_from(p).unwrap_or(v1::PlacementPolicy::Spread) {
        v1::PlacementPolicy::Spread => Policy::Spread,
        v1::PlacementPolicy::Pack => Policy::Pack,
    }
}

/// The API's free summary.
pub fn free_summary(s: FreeSummary) -> v1::FreeSummary {
    v1::FreeSummary {
        core: s.core,
        llc: s.llc,
        numa: s.numa,
        package: s.package,
        any: s.any,
    }
}

/// The API's topology message from CPU numbers and, per level (SMT, LLC,
/// NUMA, package), groups of CPU numbers: what an agent reports.
pub fn topology_of_groups(
    cpus: Vec<u32>,
    [smt, llc, numa, package]: [Vec<Vec<u32>>; 4],
) -> v1::Topology {
    let groups = |g: Vec<Vec<u32>>| g.into_iter().map(|cpus| v1::CpuGroup { cpus }).collect();
    v1::Topology {
        cpus,
        smt: groups(smt),
        llc: groups(llc),
        numa: groups(numa),
        package: groups(package),
    }
}

/// The API's form of an engine topology over CPUs (outside ids = CPU
/// numbers): what an agent reports for a machine of that shape.
pub fn topology(t: &Topology) -> v1::Topology {
    let os = |leaves: &[usize]| -> Vec<u32> { leaves.iter().map(|&l| t.os_id(l) as u32).collect() };
    let levels = |g: &mut dyn Iterator<Item = &[usize]>| -> Vec<Vec<u32>> { g.map(os).collect() };
    topology_of_groups(
        (0..t.nr_leaves()).map(|l| t.os_id(l) as u32).collect(),
        [
            levels(&mut t.cores().iter()),
            levels(&mut t.llcs().iter().map(|l| l.members.as_slice())),
            levels(&mut t.numa_groups().iter()),
            levels(&mut t.package_groups().iter()),
        ],
    )
}

/// Why a reported topology cannot be built into an engine tree. The
/// message names the field (`topology.llc: ...`).
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// No CPUs.
    #[error("topology.cpus: empty")]
    NoCpus,
    /// A level's groups do not fit the CPUs or the other levels.
    #[error("topology.{level}: {source}")]
    Level {
        /// `smt`, `llc`, `numa` or `package`.
        level: &'static str,
        /// The engine's reason.
        source: sched::topology::TopologyError,
    },
    /// The tree could not be built.
    #[error("topology: {0}")]
    Build(sched::topology::TopologyError),
}

/// Build an engine tree over a node's CPUs (outside ids = CPU numbers)
/// from its reported topology; empty levels are left out.
pub fn cpu_topology(topo: &v1::Topology) -> Result<Topology, TopologyError> {
    if topo.cpus.is_empty() {
        return Err(TopologyError::NoCpus);
    }
    let ids: Vec<u64> = topo.cpus.iter().map(|&c| u64::from(c)).collect();
    let groups = |g: &[v1::CpuGroup]| -> Vec<Vec<u64>> {
        g.iter()
            .map(|x| x.cpus.iter().map(|&c| u64::from(c)).collect())
            .collect()
    };
    let mut b = TopologyBuilder::new(ids);
    for (name, level, flags, list) in [
        ("SMT", "smt", DomainFlags::SMT, &topo.smt),
        ("LLC", "llc", DomainFlags::LLC, &topo.llc),
        ("NUMA", "numa", DomainFlags::NUMA, &topo.numa),
        ("PKG", "package", DomainFlags::PACKAGE, &topo.package),
    ] {
        if !list.is_empty() {
            b = b
                .level_from_groups(name, flags, &groups(list))
                .map_err(|source| TopologyError::Level { level, source })?;
        }
    }
    b.build().map_err(TopologyError::Build)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn enums_and_topology() {
        assert_eq!(align(v1::Alignment::Llc as i32), Align::Llc);
        assert_eq!(align(99), Align::Any);
        assert_eq!(policy(v1::PlacementPolicy::Pack as i32), Policy::Pack);
        let t = Topology::from_spec("2s:2c:2t").unwrap();
        let p = topology(&t);
        assert_eq!(p.cpus.len(), 8);
        assert_eq!(p.smt.len(), 4);
        assert_eq!(p.smt[0].cpus, vec![0, 4]);
        assert_eq!(p.llc.len(), 2);
        assert_eq!(p.package.len(), 2);
    }

    #[test]
    fn bad_topologies_name_the_field() {
        let empty = v1::Topology::default();
        assert_eq!(
            cpu_topology(&empty).unwrap_err().to_string(),
            "topology.cpus: empty"
        );
        let mut t = topology(&Topology::from_spec("1s:2c:2t").unwrap());
        t.llc = vec![v1::CpuGroup { cpus: vec![0] }];
        let err = cpu_topology(&t).unwrap_err().to_string();
        assert!(err.starts_with("topology.llc: "), "{err}");
    }

    /// The groups of each level as sets of CPU numbers, sorted: the
    /// oracle's view of a topology, independent of leaf order.
    fn shape(t: &v1::Topology) -> Vec<Vec<Vec<u32>>> {
        [&t.smt, &t.llc, &t.numa, &t.package]
            .iter()
            .map(|level| {
                let mut gs: Vec<Vec<u32>> = level
                    .iter()
                    .map(|g| {
                        let mut c = g.cpus.clone();
                        c.sort_unstable();
                        c
                    })
                    .collect();
                gs.sort();
                gs
            })
            .collect()
    }

    proptest! {
        /// An agent's report of a machine, built back into an engine tree
        /// by the dispatcher and reported again, names the same CPUs in the
        /// same groups at every level.
        #[test]
        fn topology_round_trips_through_the_api(
            s in 1usize..=2, c in 1usize..=4, t in 1usize..=2, linear in any::<bool>()
        ) {
            let spec = format!("{s}s:{c}c:{t}t{}", if linear { ":linear" } else { "" });
            let engine = Topology::from_spec(&spec).unwrap();
            let sent = topology(&engine);
            let back = topology(&cpu_topology(&sent).unwrap());
            let mut a = sent.cpus.clone();
            let mut b = back.cpus.clone();
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, (0..(s * c * t) as u32).collect::<Vec<_>>());
            prop_assert_eq!(b, (0..(s * c * t) as u32).collect::<Vec<_>>());
            prop_assert_eq!(shape(&sent), shape(&back));
        }
    }
}
