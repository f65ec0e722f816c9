//! Per-policy results computed from a run's job records: utilization,
//! makespan and its lower bound, response time (mean, p50, p99), wait,
//! bounded slowdown, the latency class's tails, steals and how far they
//! moved jobs, locality of released jobs to their waker, active nodes
//! (packing), and the scheduler's cost.
//!
//! Definitions. A *logical job* is a workload job, or all parts of a split
//! trace job (submitted together; it ends with its last part). Response =
//! end - submit; wait = last part's start - submit; bounded slowdown =
//! max(1, response / max(run, tau)) with tau = 10 s (Feitelson's bound, so
//! that very short jobs do not dominate). Utilization = total work /
//! (capacity x makespan); makespan = last end - first submit; its lower
//! bound = total work / capacity. Jobs submitted before `warmup` are run
//! but not measured (response metrics only).
//!
//! Floors. The *zero-wait response* of a logical job is its run time (its
//! longest part's): its response had it started the instant it was
//! submitted. Its mean over the measured jobs is the mean response no
//! policy can beat on the workload (a job ends no earlier than submit +
//! run), so it says how much of a baseline's mean response any placement
//! can take off (the baseline's mean wait, at most). The bounded slowdown's
//! floor needs no column: at zero wait response = run, so each job's
//! bounded slowdown is max(1, run / max(run, tau)) = 1.
//!
//! Locality score. A job's *related jobs* are its waker (the job whose end
//! released it, `Job::after`) and its siblings (the other jobs released
//! by the same waker), counting only those that ran. A job with at least
//! one related job scores the share of its related jobs that ran in its
//! rack; the locality score is the mean of those scores over all such
//! jobs, in percent (not warm-up filtered, like the near-waker shares).
//! A pipeline stage's only related job is its waker; a fan-out child of
//! k has k. Workloads without released jobs (the SWF traces) have no
//! score. It is there so that no policy buys response time by scattering
//! related jobs unseen.

use serde::Serialize;

use crate::US_PER_S;
use crate::cpu::CpuStats;
use crate::engine::{JobRecord, RunOutput, Sample};
use crate::layout::Layout;
use crate::policy::Counters;
use crate::workload::{JobKind, Workload};

/// The slowdown bound tau, µs.
pub const BSLD_TAU_US: u64 = 10 * US_PER_S;

/// The results of one policy.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    /// Policy name.
    pub policy: String,
    /// Logical jobs measured (after warm-up).
    pub jobs: u64,
    /// Workload jobs (parts included).
    pub tasks: u64,
    /// Jobs never finished.
    pub unfinished: u64,
    /// Total work / (capacity x makespan).
    pub utilization: f64,
    /// Percent of the CPUs busy while at least one job waited to start
    /// ([`crate::saturation`]); `None` when no job waited.
    pub busy_while_waiting_pct: Option<f64>,
    /// Last end - first submit, seconds.
    pub makespan_s: f64,
    /// Total work / capacity, seconds.
    pub makespan_lb_s: f64,
    /// Mean response time, seconds.
    pub resp_mean_s: f64,
    /// The floor of `resp_mean_s`: the mean response at zero wait (the
    /// mean run time of the measured logical jobs), seconds.
    pub resp_floor_s: f64,
    /// Median response time, seconds.
    pub resp_p50_s: f64,
    /// 99th percentile response time, seconds.
    pub resp_p99_s: f64,
    /// Mean wait (submit to start), seconds.
    pub wait_mean_s: f64,
    /// 99th percentile wait, seconds.
    pub wait_p99_s: f64,
    /// Mean bounded slowdown.
    pub bsld_mean: f64,
    /// Latency-class jobs measured.
    pub latency_jobs: u64,
    /// Their 99th percentile response, seconds.
    pub latency_resp_p99_s: f64,
    /// Their 99th percentile wait, seconds.
    pub latency_wait_p99_s: f64,
    /// 99th percentile wait of the other jobs, seconds.
    pub batch_wait_p99_s: f64,
    /// Mean response of fan-out children, seconds (0 if none).
    pub fanout_child_resp_mean_s: f64,
    /// Jobs moved by a steal.
    pub steals: u64,
    /// Of those, to another rack.
    pub cross_rack_moves: u64,
    /// Of those, to another zone.
    pub cross_zone_moves: u64,
    /// Jobs released by another job's end (fan-out children, stages).
    pub woken_jobs: u64,
    /// Of those, percent run on their waker's node.
    pub near_waker_node_pct: f64,
    /// Of those, percent run in their waker's rack.
    pub near_waker_rack_pct: f64,
    /// Jobs with at least one related job (waker or sibling) that ran.
    pub locality_jobs: u64,
    /// The locality score (see the module's doc), percent; 0 without
    /// `locality_jobs`.
    pub locality_pct: f64,
    /// Time-averaged nodes running at least one job.
    pub active_nodes_mean: f64,
    /// Most nodes active at a sample.
    pub active_nodes_max: u32,
    /// Nodes of the cluster.
    pub nodes: u64,
    /// Fragmentation: mean over the samples of the share of racks none
    /// of whose nodes runs a job, percent.
    pub racks_free_pct: f64,
    /// Gangs (jobs on more than one node) measured.
    pub gangs: u64,
    /// Their mean wait (submit to the start of all members), seconds.
    pub gang_wait_mean_s: f64,
    /// Their 99th percentile wait, seconds.
    pub gang_wait_p99_s: f64,
    /// Large gangs (at least a rack's worth of nodes) measured.
    pub large_gangs: u64,
    /// Their mean wait, seconds.
    pub large_gang_wait_mean_s: f64,
    /// Their 99th percentile wait, seconds.
    pub large_gang_wait_p99_s: f64,
    /// The large gangs' topology success rate: the share of them whose
    /// members span the fewest racks a gang of their size can
    /// (`ceil(nodes / nodes per rack)`, what a Slurm `--switches` of that
    /// count asks), percent (0 without large gangs).
    pub large_gang_compact_pct: f64,
    /// Placement decisions (jobs submitted to the policy).
    pub decisions: u64,
    /// Decisions per second of wall time inside the policy.
    pub decisions_per_s: f64,
    /// Percent of the run's wall time spent inside the policy.
    pub sched_share_pct: f64,
    /// Wall time inside the policy, seconds.
    pub sched_wall_s: f64,
    /// Wall time of the run, seconds (setup excluded).
    pub wall_s: f64,
    /// Wall time of the setup (registering nodes), seconds.
    pub setup_s: f64,
    /// Events simulated.
    pub events: u64,
    /// The policy's counters.
    pub counters: Counters,
    /// CPU-level measurements.
    pub cpu: Option<CpuStats>,
    /// Sorted response times, seconds (for plots).
    #[serde(skip)]
    pub responses: Vec<f64>,
    /// Samples of the cluster's state (for plots).
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Compute the report of `out`. Logical jobs submitted before `warmup_us`
/// are not measured.
pub fn report(out: RunOutput, w: &Workload, layout: &Layout, warmup_us: u64) -> PolicyReport {
    let s = |us: f64| us / US_PER_S as f64;
    let recs = &out.records;
    let n = recs.len();
    // Logical jobs: (submit, last start, last end, longest run, latency).
    let mut groups: Vec<(u64, u64, u64, u64, bool, JobKind)> = Vec::new();
    let mut group_of: Vec<u32> = vec![u32::MAX; n];
    let mut first_submit = u64::MAX;
    let mut last_end = 0u64;
    let mut finished_work = 0f64;
    for (i, (j, r)) in w.jobs.iter().zip(recs).enumerate() {
        if r.end == u64::MAX {
            continue;
        }
        first_submit = first_submit.min(r.submit);
        last_end = last_end.max(r.end);
        finished_work += j.cpus as f64 * j.nodes as f64 * j.duration_us as f64;
        let g = j.group as usize;
        if group_of[g] == u32::MAX {
            group_of[g] = groups.len() as u32;
            groups.push((r.submit, r.start, r.end, j.duration_us, j.latency, j.kind));
        } else {
            let e = &mut groups[group_of[g] as usize];
            e.1 = e.1.max(r.start);
            e.2 = e.2.max(r.end);
            e.3 = e.3.max(j.duration_us);
        }
        group_of[i] = group_of[g];
    }
    let groups_total = w
        .jobs
        .iter()
        .enumerate()
        .filter(|(i, j)| j.group as usize == *i)
        .count();
    let finished_groups = groups.len();
    let mut resp = Vec::new();
    let mut run_sum = 0f64;
    let mut wait = Vec::new();
    let mut bsld = Vec::new();
    let mut lat_resp = Vec::new();
    let mut lat_wait = Vec::new();
    let mut batch_wait = Vec::new();
    let mut child_resp = Vec::new();
    for &(submit, start, end, run, latency, kind) in &groups {
        if submit < warmup_us {
            continue;
        }
        let r = (end - submit) as f64;
        let wt = start.saturating_sub(submit) as f64;
        resp.push(s(r));
        run_sum += s(run as f64);
        wait.push(s(wt));
        bsld.push((r / run.max(BSLD_TAU_US) as f64).max(1.0));
        if latency {
            lat_resp.push(s(r));
            lat_wait.push(s(wt));
        } else {
            batch_wait.push(s(wt));
        }
        if kind == JobKind::FanoutChild {
            child_resp.push(s(r));
        }
    }
    let (gang_wait, large_wait) = gang_waits(w, recs, layout, warmup_us);
    let (mut woken, mut same_node, mut same_rack) = (0u64, 0u64, 0u64);
    for (j, r) in w.jobs.iter().zip(recs) {
        if let Some(p) = j.after
            && r.node != u32::MAX
            && let Some(pr) = recs.get(p as usize)
            && pr.node != u32::MAX
        {
            woken += 1;
            if pr.node == r.node {
                same_node += 1;
            }
            if layout.rack_of(pr.node) == layout.rack_of(r.node) {
                same_rack += 1;
            }
        }
    }
    let (locality_jobs, locality_pct) = locality(w, recs, layout);
    let capacity = layout.capacity().max(1) as f64;
    let work = w.work_cpu_us();
    let makespan = last_end.saturating_sub(first_submit.min(last_end)) as f64;
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let resp = sorted(resp);
    let wait = sorted(wait);
    let lat_resp = sorted(lat_resp);
    let lat_wait = sorted(lat_wait);
    let batch_wait = sorted(batch_wait);
    PolicyReport {
        policy: out.policy,
        jobs: resp.len() as u64,
        tasks: n as u64,
        unfinished: (groups_total - finished_groups) as u64,
        utilization: if makespan > 0.0 {
            finished_work / (capacity * makespan)
        } else {
            0.0
        },
        busy_while_waiting_pct: crate::saturation::busy_while_waiting(
            &w.jobs
                .iter()
                .zip(recs)
                .map(|(j, r)| crate::saturation::Span {
                    submit: r.submit,
                    start: r.start,
                    end: r.end,
                    cpus: u64::from(j.cpus) * u64::from(j.nodes),
                })
                .collect::<Vec<_>>(),
            capacity as u64,
        ),
        makespan_s: s(makespan),
        makespan_lb_s: s(work / capacity),
        resp_mean_s: mean(&resp),
        resp_floor_s: if resp.is_empty() {
            0.0
        } else {
            run_sum / resp.len() as f64
        },
        resp_p50_s: percentile(&resp, 50.0),
        resp_p99_s: percentile(&resp, 99.0),
        wait_mean_s: mean(&wait),
        wait_p99_s: percentile(&wait, 99.0),
        bsld_mean: mean(&bsld),
        latency_jobs: lat_resp.len() as u64,
        latency_resp_p99_s: percentile(&lat_resp, 99.0),
        latency_wait_p99_s: percentile(&lat_wait, 99.0),
        batch_wait_p99_s: percentile(&batch_wait, 99.0),
        fanout_child_resp_mean_s: mean(&child_resp),
        steals: out.counters.steals,
        cross_rack_moves: out.counters.cross_rack,
        cross_zone_moves: out.counters.cross_zone,
        woken_jobs: woken,
        near_waker_node_pct: pct(same_node, woken),
        near_waker_rack_pct: pct(same_rack, woken),
        locality_jobs,
        locality_pct,
        active_nodes_mean: if last_end > 0 {
            out.active_node_us / last_end as f64
        } else {
            0.0
        },
        active_nodes_max: out
            .samples
            .iter()
            .map(|x| x.active_nodes)
            .max()
            .unwrap_or(0),
        nodes: layout.nr_nodes() as u64,
        racks_free_pct: racks_free_pct(&out.samples, out.racks),
        gangs: gang_wait.len() as u64,
        gang_wait_mean_s: mean(&gang_wait),
        gang_wait_p99_s: percentile(&gang_wait, 99.0),
        large_gangs: large_wait.len() as u64,
        large_gang_wait_mean_s: mean(&large_wait),
        large_gang_wait_p99_s: percentile(&large_wait, 99.0),
        large_gang_compact_pct: large_gang_compact_pct(w, &out.gang_members, layout, warmup_us),
        decisions: out.decisions,
        decisions_per_s: if out.sched_wall_s > 0.0 {
            out.decisions as f64 / out.sched_wall_s
        } else {
            0.0
        },
        sched_share_pct: if out.wall_s > 0.0 {
            100.0 * out.sched_wall_s / out.wall_s
        } else {
            0.0
        },
        sched_wall_s: out.sched_wall_s,
        wall_s: out.wall_s,
        setup_s: out.setup_s,
        events: out.events,
        counters: out.counters,
        cpu: out.cpu,
        responses: resp,
        samples: out.samples,
    }
}

/// The fragmentation metric: the mean over `samples` of the share of the
/// `racks` racks with no active node, percent (0 without samples).
pub fn racks_free_pct(samples: &[Sample], racks: u32) -> f64 {
    if samples.is_empty() || racks == 0 {
        return 0.0;
    }
    let sum: f64 = samples
        .iter()
        .map(|x| x.free_racks as f64 / racks as f64)
        .sum();
    100.0 * sum / samples.len() as f64
}

/// Sorted waits (seconds) of the finished gangs submitted after
/// `warmup_us`, and of the large ones among them (at least a rack's worth
/// of nodes).
pub fn gang_waits(
    w: &Workload,
    recs: &[JobRecord],
    layout: &Layout,
    warmup_us: u64,
) -> (Vec<f64>, Vec<f64>) {
    let (mut all, mut large) = (Vec::new(), Vec::new());
    for (j, r) in w.jobs.iter().zip(recs) {
        if j.nodes <= 1 || r.end == u64::MAX || r.submit < warmup_us {
            continue;
        }
        let wt = r.start.saturating_sub(r.submit) as f64 / US_PER_S as f64;
        all.push(wt);
        if j.nodes as usize >= layout.nodes_per_rack {
            large.push(wt);
        }
    }
    (sorted(all), sorted(large))
}

/// The share of the finished large gangs (at least a rack's worth of
/// nodes, submitted after `warmup_us`) whose members span the fewest
/// racks they can, percent.
pub fn large_gang_compact_pct(
    w: &Workload,
    members: &[(u32, Vec<u32>)],
    layout: &Layout,
    warmup_us: u64,
) -> f64 {
    let per_rack = layout.nodes_per_rack.max(1);
    let (mut large, mut compact) = (0u64, 0u64);
    for (job, nodes) in members {
        let j = &w.jobs[*job as usize];
        if (j.nodes as usize) < per_rack || (j.after.is_none() && j.submit_us < warmup_us) {
            continue;
        }
        let mut racks: Vec<u32> = nodes.iter().map(|&n| layout.rack_of(n)).collect();
        racks.sort_unstable();
        racks.dedup();
        large += 1;
        if racks.len() == (j.nodes as usize).div_ceil(per_rack) {
            compact += 1;
        }
    }
    if large == 0 {
        0.0
    } else {
        100.0 * compact as f64 / large as f64
    }
}

/// The locality score: (jobs scored, mean share of related jobs in the
/// job's rack, percent). Per waker, its released jobs are grouped by rack
/// (sorted), so the cost is O(jobs x log(children)), not O(children^2).
pub fn locality(w: &Workload, recs: &[JobRecord], layout: &Layout) -> (u64, f64) {
    let rack_of = |i: u32| {
        recs.get(i as usize)
            .map(|r| r.node)
            .filter(|&n| n != u32::MAX)
            .map(|n| layout.rack_of(n))
    };
    let (mut scored, mut sum) = (0u64, 0f64);
    let mut racks: Vec<u32> = Vec::new();
    for p in 0..w.jobs.len() as u32 {
        let children = w.children(p);
        if children.is_empty() {
            continue;
        }
        let waker = rack_of(p);
        racks.clear();
        racks.extend(children.iter().filter_map(|&c| rack_of(c)));
        racks.sort_unstable();
        // Each child's related jobs: the other children that ran, and the
        // waker if it ran.
        let related = (racks.len() + usize::from(waker.is_some())).saturating_sub(1);
        if related == 0 {
            continue;
        }
        let mut lo = 0;
        while lo < racks.len() {
            let rack = racks[lo];
            let hi = lo + racks[lo..].partition_point(|&r| r == rack);
            let near = (hi - lo - 1) + usize::from(waker == Some(rack));
            sum += (hi - lo) as f64 * near as f64 / related as f64;
            scored += (hi - lo) as u64;
            lo = hi;
        }
    }
    let pct = if scored == 0 {
        0.0
    } else {
        100.0 * sum / scored as f64
    };
    (scored, pct)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The score by its definition, pair by pair.
    fn locality_oracle(w: &Workload, recs: &[JobRecord], layout: &Layout) -> (u64, f64) {
        let ran = |i: usize| recs[i].node != u32::MAX;
        let rack = |i: usize| layout.rack_of(recs[i].node);
        let (mut n, mut sum) = (0u64, 0f64);
        for (j, job) in w.jobs.iter().enumerate() {
            let Some(p) = job.after.map(|p| p as usize) else {
                continue;
            };
            if !ran(j) {
                continue;
            }
            let mut related: Vec<usize> = (0..w.jobs.len())
                .filter(|&s| s != j && w.jobs[s].after == job.after && ran(s))
                .collect();
            if ran(p) {
                related.push(p);
            }
            if related.is_empty() {
                continue;
            }
            let near = related.iter().filter(|&&r| rack(r) == rack(j)).count();
            sum += near as f64 / related.len() as f64;
            n += 1;
        }
        (n, if n == 0 { 0.0 } else { 100.0 * sum / n as f64 })
    }

    proptest::proptest! {
        #[test]
        fn locality_matches_its_definition(
            shape in proptest::collection::vec((proptest::option::of(0usize..6), 0u32..10), 1..40),
        ) {
            // 3 racks of 3 nodes; node 9 = never ran.
            let layout = Layout::new("1z:3r:3n", "1s:2c:1t").unwrap();
            let mut jobs = Vec::new();
            let mut recs = Vec::new();
            for (i, &(after, node)) in shape.iter().enumerate() {
                let after = after.filter(|&p| p < i).map(|p| p as u32);
                jobs.push(crate::workload::Job {
                    submit_us: 0,
                    duration_us: 1,
                    limit_us: None,
                    cpus: 1,
                    nodes: 1,
                    latency: false,
                    after,
                    group: i as u32,
                    kind: JobKind::Single,
                });
                recs.push(JobRecord {
                    node: if node == 9 { u32::MAX } else { node },
                    ..JobRecord::default()
                });
            }
            let w = Workload::new("p", jobs).unwrap();
            let (n, pct) = locality(&w, &recs, &layout);
            let (on, opct) = locality_oracle(&w, &recs, &layout);
            proptest::prop_assert_eq!(n, on);
            proptest::prop_assert!((pct - opct).abs() < 1e-9, "{} vs {}", pct, opct);
        }
    }

    #[test]
    fn locality_of_a_fan_out_and_a_pipeline() {
        let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
        let job = |after: Option<u32>| crate::workload::Job {
            submit_us: 0,
            duration_us: 1,
            limit_us: None,
            cpus: 1,
            nodes: 1,
            latency: false,
            after,
            group: 0,
            kind: JobKind::Single,
        };
        // Waker 0 on rack 0; children 1, 2 on rack 0, child 3 on rack 1;
        // pipeline 4 -> 5 -> 6 on racks 1, 1, 0.
        let mut jobs = vec![job(None), job(Some(0)), job(Some(0)), job(Some(0))];
        jobs.extend([job(None), job(Some(4)), job(Some(5))]);
        for (i, j) in jobs.iter_mut().enumerate() {
            j.group = i as u32;
        }
        let w = Workload::new("t", jobs).unwrap();
        let recs: Vec<JobRecord> = [0, 1, 1, 2, 3, 2, 0]
            .into_iter()
            .map(|node| JobRecord {
                node,
                ..JobRecord::default()
            })
            .collect();
        let (n, pct) = locality(&w, &recs, &layout);
        assert_eq!(n, 5);
        // Children 1, 2: 2 of 3 related in rack 0; child 3: 0 of 3;
        // stage 5: its waker 4 in rack 1 (1/1); stage 6: rack 1 vs 0 (0/1).
        let want = 100.0 * (2.0 / 3.0 + 2.0 / 3.0 + 0.0 + 1.0 + 0.0) / 5.0;
        assert!((pct - want).abs() < 1e-9, "{pct} vs {want}");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(percentile(&[7.0], 1.0), 7.0);
    }
}
