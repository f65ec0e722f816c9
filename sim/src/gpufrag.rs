//! GPU allocation and fragmentation over a run, from its job records
//! (each job holds its CPUs and GPUs on its node from start to end; gangs
//! ask for no GPUs and are left out).
//!
//! * Allocation rate: GPUs held by running jobs / GPUs of the cluster.
//! * Fragmentation, as the FGD paper ("Beware of Fragmentation", ATC'23,
//!   section 3) defines it for whole GPUs: for a task m and a node n, the
//!   fragment F_n(m) is the node's idle GPUs when m cannot run there (too
//!   few free CPUs or GPUs), else 0 (with whole GPUs no single GPU is too
//!   small); the cluster's fragmentation is the expectation over the
//!   workload's tasks, `sum_m p_m sum_n F_n(m)`, with `p_m` the share of
//!   GPU jobs of m's shape (CPUs, GPUs) in the workload. Given as a share
//!   of the cluster's GPUs. CPU-only tasks are left out of the
//!   distribution (they cannot use a GPU, fragment or not).
//!
//! Both are sampled at evenly spaced times from the first submission to
//! the last one (the arrival window: the drain after it, with nothing left
//! to place, would dilute both); the means are time averages.

use std::collections::BTreeMap;

use crate::US_PER_S;
use crate::engine::RunOutput;
use crate::layout::Layout;
use crate::workload::Workload;

/// GPU measurements of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuReport {
    /// Policy.
    pub policy: String,
    /// GPUs of the cluster.
    pub gpus: u64,
    /// Mean allocation rate, %.
    pub alloc_mean_pct: f64,
    /// Mean fragmentation (FGD, whole GPUs), % of the cluster's GPUs.
    pub frag_mean_pct: f64,
    /// Fragmentation at the moment of highest allocation, %.
    pub frag_at_peak_pct: f64,
    /// Peak allocation rate, %.
    pub alloc_peak_pct: f64,
    /// GPU jobs finished.
    pub gpu_jobs: u64,
    /// Their mean wait, s.
    pub gpu_wait_mean_s: f64,
    /// Their p99 wait, s.
    pub gpu_wait_p99_s: f64,
    /// Samples: (time s, allocation %, fragmentation %).
    pub series: Vec<(f64, f64, f64)>,
}

/// Measure `out` (a run of `w` on `layout`) at `samples` evenly spaced
/// times.
pub fn measure(layout: &Layout, w: &Workload, out: &RunOutput, samples: usize) -> GpuReport {
    let total = layout.total_gpus();
    let nodes = layout.nr_nodes();
    // Task shapes of the GPU jobs and their shares.
    let mut shapes: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut waits = Vec::new();
    for (i, j) in w.jobs.iter().enumerate() {
        let g = w.gpus_of(i as u32);
        if g > 0 && j.nodes == 1 {
            *shapes.entry((j.cpus, g)).or_default() += 1;
            let r = &out.records[i];
            if r.end != u64::MAX && r.start != u64::MAX {
                waits.push(r.start.saturating_sub(r.submit) as f64 / US_PER_S as f64);
            }
        }
    }
    let n_gpu_jobs: u64 = shapes.values().sum();
    let shapes: Vec<((u32, u32), f64)> = shapes
        .into_iter()
        .map(|(k, c)| (k, c as f64 / n_gpu_jobs.max(1) as f64))
        .collect();
    // Start and end events: (time, is start, job).
    let mut ev: Vec<(u64, bool, u32)> = Vec::new();
    let mut t_first = u64::MAX;
    let mut t_last = 0;
    let last_submit = w
        .roots()
        .last()
        .map_or(0, |&r| w.jobs[r as usize].submit_us);
    for (i, (j, r)) in w.jobs.iter().zip(&out.records).enumerate() {
        if j.nodes != 1 || r.start == u64::MAX || r.node == u32::MAX {
            continue;
        }
        ev.push((r.start, true, i as u32));
        if r.end != u64::MAX {
            ev.push((r.end, false, i as u32));
        }
        t_last = last_submit;
        t_first = t_first.min(r.submit);
    }
    // Ends before starts at one time.
    ev.sort_unstable_by_key(|&(t, s, _)| (t, s));
    let mut free_cpu: Vec<u32> = (0..nodes as u32).map(|n| layout.cpus(n)).collect();
    let mut free_gpu: Vec<u32> = (0..nodes as u32).map(|n| layout.gpus(n)).collect();
    let mut series = Vec::new();
    let samples = samples.max(1);
    let span = t_last.saturating_sub(t_first.min(t_last));
    let mut k = 0;
    for s in 0..samples {
        let t = t_first.min(t_last) + span * s as u64 / samples as u64;
        while k < ev.len() && ev[k].0 <= t {
            let (_, start, job) = ev[k];
            let (n, c, g) = (
                out.records[job as usize].node as usize,
                w.jobs[job as usize].cpus,
                w.gpus_of(job),
            );
            if start {
                free_cpu[n] = free_cpu[n].saturating_sub(c);
                free_gpu[n] = free_gpu[n].saturating_sub(g);
            } else {
                free_cpu[n] += c;
                free_gpu[n] += g;
            }
            k += 1;
        }
        let idle: u64 = free_gpu.iter().map(|&g| g as u64).sum();
        let alloc = 100.0 * (total - idle.min(total)) as f64 / total.max(1) as f64;
        let mut frag = 0.0;
        for &((c, g), p) in &shapes {
            let f: u64 = (0..nodes)
                .filter(|&n| free_gpu[n] > 0 && (free_gpu[n] < g || free_cpu[n] < c))
                .map(|n| free_gpu[n] as u64)
                .sum();
            frag += p * f as f64;
        }
        let frag = 100.0 * frag / total.max(1) as f64;
        series.push((t as f64 / US_PER_S as f64, alloc, frag));
    }
    let mean = |f: fn(&(f64, f64, f64)) -> f64| {
        series.iter().map(f).sum::<f64>() / series.len().max(1) as f64
    };
    let peak = series
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0.0, 0.0, 0.0));
    waits.sort_by(f64::total_cmp);
    let p99 = if waits.is_empty() {
        0.0
    } else {
        waits[((waits.len() - 1) as f64 * 0.99).round() as usize]
    };
    GpuReport {
        policy: out.policy.clone(),
        gpus: total,
        alloc_mean_pct: mean(|s| s.1),
        frag_mean_pct: mean(|s| s.2),
        frag_at_peak_pct: peak.2,
        alloc_peak_pct: peak.1,
        gpu_jobs: waits.len() as u64,
        gpu_wait_mean_s: waits.iter().sum::<f64>() / waits.len().max(1) as f64,
        gpu_wait_p99_s: p99,
        series,
    }
}

/// A markdown table of the reports.
pub fn table(reports: &[GpuReport]) -> String {
    let mut s = String::from(
        "| policy | GPUs | GPU alloc mean % | GPU alloc peak % | GPU frag mean % | GPU frag at peak % | GPU jobs | GPU wait mean s | GPU wait p99 s |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    for r in reports {
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.1} | {:.1} |\n",
            r.policy,
            r.gpus,
            r.alloc_mean_pct,
            r.alloc_peak_pct,
            r.frag_mean_pct,
            r.frag_at_peak_pct,
            r.gpu_jobs,
            r.gpu_wait_mean_s,
            r.gpu_wait_p99_s
        ));
    }
    s
}
