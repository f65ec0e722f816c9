//! Gangs in a synthetic workload (`synthetic --gangs PROB:MAX`): each
//! independent root job becomes, with probability PROB, a gang of a
//! uniform 2..=MAX members, each with the job's CPUs and run time; then
//! every arrival time is stretched by the ratio of the new work to the
//! old, so the offered load stays what the workload was generated for.
//! Fan-out parents, children and pipeline stages stay single jobs.

use sched::harness::Rng;

use crate::error::{Result, bad_spec};
use crate::workload::{JobKind, Workload};

/// Turn jobs of `w` into gangs (see the module comment) with at most
/// `max_nodes` members (the cluster's nodes); returns how many.
pub fn make_gangs(w: &mut Workload, spec: &str, max_nodes: u32, seed: u64) -> Result<usize> {
    let (p, max) = spec
        .split_once(':')
        .and_then(|(p, m)| Some((p.parse::<f64>().ok()?, m.parse::<u32>().ok()?)))
        .filter(|&(p, m)| (0.0..=1.0).contains(&p) && m >= 2)
        .ok_or_else(|| bad_spec("gangs", spec, "want PROB:MAX, PROB in 0..=1, MAX >= 2"))?;
    if max > max_nodes {
        return Err(bad_spec(
            "gangs",
            spec,
            format!("MAX is more than the cluster's {max_nodes} nodes"),
        ));
    }
    let before = w.work_cpu_us();
    let mut rng = Rng::new(seed ^ 0x6a6e_6773);
    let mut made = 0;
    for j in &mut w.jobs {
        if j.kind != JobKind::Single || j.after.is_some() {
            continue;
        }
        if rng.unit() < p {
            j.nodes = 2 + rng.below(u64::from(max - 1)) as u32;
            made += 1;
        }
    }
    let after = w.work_cpu_us();
    if before > 0.0 && after > before {
        let stretch = after / before;
        for j in &mut w.jobs {
            if j.after.is_none() {
                j.submit_us = (j.submit_us as f64 * stretch) as u64;
            }
        }
    }
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{SyntheticParams, synthetic};

    #[test]
    fn gangs_keep_the_offered_load() {
        let params = SyntheticParams {
            jobs: 2000,
            ..SyntheticParams::default()
        };
        let mut w = synthetic(&params, 1024, 16).unwrap();
        let load = |w: &Workload| {
            let span = w.jobs[*w.roots().last().unwrap() as usize].submit_us as f64;
            w.work_cpu_us() / span
        };
        let before = load(&w);
        let made = make_gangs(&mut w, "0.2:8", 64, 1).unwrap();
        assert!(made > 100, "{made}");
        assert!(w.jobs.iter().all(|j| j.nodes <= 8));
        assert!(
            (load(&w) / before - 1.0).abs() < 0.01,
            "{} {}",
            load(&w),
            before
        );
        assert!(make_gangs(&mut w, "0.2:80", 64, 1).is_err());
        assert!(make_gangs(&mut w, "2:8", 64, 1).is_err());
    }
}
