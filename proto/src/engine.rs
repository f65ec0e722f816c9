//! Conversions between the API's types and the engine's (`sched`), written
//! once for the agent, the dispatcher, the simulator and the benchmarks.
//! The engine knows nothing of the API; the API crate knows the engine.

use sched::{Align, FreeSummary, Policy, Topology};

use crate::v1;

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

/// The API's form of an engine topology over CPUs (outside ids = CPU
/// numbers): what an agent reports for a machine of that shape.
pub fn topology(t: &Topology) -> v1::Topology {
    let groups = |g: &mut dyn Iterator<Item = &[usize]>| -> Vec<v1::CpuGroup> {
        g.map(|v| v1::CpuGroup {
            cpus: v.iter().map(|&l| t.os_id(l) as u32).collect(),
        })
        .collect()
    };
    v1::Topology {
        cpus: (0..t.nr_leaves()).map(|l| t.os_id(l) as u32).collect(),
        smt: groups(&mut t.cores().iter().map(Vec::as_slice)),
        llc: groups(&mut t.llcs().iter().map(|l| l.members.as_slice())),
        numa: groups(&mut t.numa_groups().iter().map(Vec::as_slice)),
        package: groups(&mut t.package_groups().iter().map(Vec::as_slice)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
