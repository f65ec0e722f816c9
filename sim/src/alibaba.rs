//! Alibaba's GPU cluster trace `cluster-trace-gpu-v2023` (the "Beware of
//! Fragmentation" / FGD paper, USENIX ATC'23): a node list CSV
//! (`openb_node_list_*.csv`: `sn,cpu_milli,memory_mib,gpu,model`) and a
//! pod list CSV (`openb_pod_list_*.csv`: `name,cpu_milli,memory_mib,
//! num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,
//! scheduled_time`; times in seconds). Columns are found by their header
//! names, in any order; a leading unnamed index column (as pandas writes)
//! and other extra columns are ignored. Empty fields and `nan` are
//! "unknown".
//!
//! Mapping to the simulator:
//! * a node is an agent of `cpu_milli / 1000` CPUs (one socket, one
//!   thread per core) and `gpu` GPUs, all nodes in one rack (the trace has
//!   no network topology); `memory_mib` and `model` are not modelled;
//! * a pod is a job of `ceil(cpu_milli / 1000)` CPUs (at least one) and
//!   `num_gpu` whole GPUs; a GPU-sharing pod (`num_gpu = 1`, `gpu_milli <
//!   1000`) is rounded up to one whole GPU, and counted
//!   ([`AlibabaStats::shared_rounded`]): the dispatcher hands out whole
//!   GPUs; `gpu_spec` (a GPU type constraint) is not honoured, and counted;
//! * QoS: `LS` and `Guaranteed` are the latency class, `Burstable` and
//!   `BE` batch;
//! * arrival: `creation_time` (from the first pod's); run time:
//!   `deletion_time - scheduled_time` (`creation_time` when not
//!   scheduled), at least one second; a pod without a `deletion_time` has
//!   no known run time and is skipped (counted), as is a pod larger than
//!   every node (counted).
//!
//! A malformed row is an error naming the file, the line and the column.

use std::path::Path;

use crate::US_PER_S;
use crate::error::{Result, SimError};
use crate::layout::Layout;
use crate::workload::{Job, JobKind, Workload};

/// One node of the node list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlibabaNode {
    /// `sn`: its name.
    pub sn: String,
    /// `cpu_milli`: CPUs x 1000.
    pub cpu_milli: u64,
    /// `memory_mib`.
    pub memory_mib: u64,
    /// `gpu`: GPUs.
    pub gpu: u32,
    /// `model`: GPU model (empty when none).
    pub model: String,
}

/// One pod of the pod list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlibabaPod {
    /// `name`.
    pub name: String,
    /// `cpu_milli`: CPUs requested x 1000.
    pub cpu_milli: u64,
    /// `memory_mib`.
    pub memory_mib: u64,
    /// `num_gpu`: GPUs requested (0..=8).
    pub num_gpu: u32,
    /// `gpu_milli`: share of one GPU for GPU-sharing pods, x 1000.
    pub gpu_milli: u32,
    /// `gpu_spec`: allowed GPU models, `|`-separated (empty = any).
    pub gpu_spec: String,
    /// `qos`: `LS`, `Guaranteed`, `Burstable` or `BE`.
    pub qos: String,
    /// `pod_phase`.
    pub pod_phase: String,
    /// `creation_time`, s.
    pub creation_time: u64,
    /// `deletion_time`, s.
    pub deletion_time: Option<u64>,
    /// `scheduled_time`, s.
    pub scheduled_time: Option<u64>,
}

/// Column names of the node list.
pub const NODE_COLUMNS: [&str; 5] = ["sn", "cpu_milli", "memory_mib", "gpu", "model"];
/// Column names of the pod list.
pub const POD_COLUMNS: [&str; 11] = [
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
];

/// A CSV file split into its header's column positions and rows.
struct Csv<'a> {
    path: &'a str,
    /// Position of each wanted column.
    pos: Vec<usize>,
    wanted: &'a [&'a str],
}

fn err(path: &str, line: usize, column: &str, message: impl Into<String>) -> SimError {
    SimError::Csv {
        path: path.to_string(),
        line,
        column: column.to_string(),
        message: message.into(),
    }
}

impl<'a> Csv<'a> {
    fn header(path: &'a str, header: &str, wanted: &'a [&'a str]) -> Result<Self> {
        let names: Vec<&str> = header.split(',').map(str::trim).collect();
        let mut pos = Vec::with_capacity(wanted.len());
        for w in wanted {
            let p = names
                .iter()
                .position(|n| n == w)
                .ok_or_else(|| err(path, 1, w, "missing from the header"))?;
            pos.push(p);
        }
        Ok(Self { path, pos, wanted })
    }

    /// The wanted fields of a row, in `wanted` order.
    fn row<'r>(&self, line: usize, text: &'r str) -> Result<Vec<&'r str>> {
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        self.pos
            .iter()
            .zip(self.wanted)
            .map(|(&p, w)| {
                fields.get(p).copied().ok_or_else(|| {
                    err(
                        self.path,
                        line,
                        w,
                        format!("missing: the row has {} fields", fields.len()),
                    )
                })
            })
            .collect()
    }

    fn uint(&self, line: usize, col: usize, v: &str) -> Result<u64> {
        v.parse::<u64>()
            .ok()
            .or_else(|| {
                // pandas writes integers of float columns as "12.0".
                v.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0 && *f < 1e15)
                    .map(|f| f as u64)
            })
            .ok_or_else(|| {
                err(
                    self.path,
                    line,
                    self.wanted[col],
                    format!("{v:?} is not a non-negative integer"),
                )
            })
    }

    fn opt_uint(&self, line: usize, col: usize, v: &str) -> Result<Option<u64>> {
        if unknown(v) {
            Ok(None)
        } else {
            self.uint(line, col, v).map(Some)
        }
    }
}

fn unknown(v: &str) -> bool {
    v.is_empty() || v.eq_ignore_ascii_case("nan") || v.eq_ignore_ascii_case("none")
}

fn known(v: &str) -> String {
    if unknown(v) {
        String::new()
    } else {
        v.to_string()
    }
}

/// Non-empty lines with their 1-based numbers, after the header.
fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .skip(1)
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty())
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| SimError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Parse a node list.
pub fn parse_nodes(text: &str, path: &str) -> Result<Vec<AlibabaNode>> {
    let header = text.lines().next().unwrap_or("");
    let csv = Csv::header(path, header, &NODE_COLUMNS)?;
    let mut out = Vec::new();
    for (line, l) in lines(text) {
        let f = csv.row(line, l)?;
        if unknown(f[0]) {
            return Err(err(path, line, "sn", "empty node name"));
        }
        let cpu_milli = csv.uint(line, 1, f[1])?;
        if cpu_milli < 1000 {
            return Err(err(path, line, "cpu_milli", "a node has at least 1000"));
        }
        let gpu = csv.uint(line, 3, f[3])?;
        if gpu > 1024 {
            return Err(err(path, line, "gpu", format!("{gpu} GPUs on one node")));
        }
        out.push(AlibabaNode {
            sn: f[0].to_string(),
            cpu_milli,
            memory_mib: csv.uint(line, 2, f[2])?,
            gpu: gpu as u32,
            model: known(f[4]),
        });
    }
    if out.is_empty() {
        return Err(err(path, 2, "sn", "no nodes"));
    }
    Ok(out)
}

/// Parse a pod list.
pub fn parse_pods(text: &str, path: &str) -> Result<Vec<AlibabaPod>> {
    let header = text.lines().next().unwrap_or("");
    let csv = Csv::header(path, header, &POD_COLUMNS)?;
    let mut out = Vec::new();
    for (line, l) in lines(text) {
        let f = csv.row(line, l)?;
        let num_gpu = csv.uint(line, 3, f[3])?;
        if num_gpu > 1024 {
            return Err(err(path, line, "num_gpu", format!("{num_gpu} GPUs")));
        }
        let gpu_milli = if unknown(f[4]) {
            0
        } else {
            csv.uint(line, 4, f[4])?
        };
        if gpu_milli > 1000 {
            return Err(err(
                path,
                line,
                "gpu_milli",
                format!("{gpu_milli} is more than one GPU (1000)"),
            ));
        }
        let qos = f[6].to_string();
        if !matches!(qos.as_str(), "LS" | "Guaranteed" | "Burstable" | "BE") {
            return Err(err(
                path,
                line,
                "qos",
                format!("{qos:?}: want LS, Guaranteed, Burstable or BE"),
            ));
        }
        let creation_time = csv.uint(line, 8, f[8])?;
        let deletion_time = csv.opt_uint(line, 9, f[9])?;
        let scheduled_time = csv.opt_uint(line, 10, f[10])?;
        if let Some(d) = deletion_time
            && d < creation_time
        {
            return Err(err(
                path,
                line,
                "deletion_time",
                format!("{d} is before creation_time {creation_time}"),
            ));
        }
        if let Some(s) = scheduled_time
            && s < creation_time
        {
            return Err(err(
                path,
                line,
                "scheduled_time",
                format!("{s} is before creation_time {creation_time}"),
            ));
        }
        out.push(AlibabaPod {
            name: f[0].to_string(),
            cpu_milli: csv.uint(line, 1, f[1])?,
            memory_mib: csv.uint(line, 2, f[2])?,
            num_gpu: num_gpu as u32,
            gpu_milli: gpu_milli as u32,
            gpu_spec: known(f[5]),
            qos,
            pod_phase: f[7].to_string(),
            creation_time,
            deletion_time,
            scheduled_time,
        });
    }
    Ok(out)
}

/// Read a node list file.
pub fn read_nodes(path: &Path) -> Result<Vec<AlibabaNode>> {
    parse_nodes(&read_text(path)?, &path.display().to_string())
}

/// Read a pod list file.
pub fn read_pods(path: &Path) -> Result<Vec<AlibabaPod>> {
    parse_pods(&read_text(path)?, &path.display().to_string())
}

/// The cluster of a node list: node `i` is `1s:<cpu_milli/1000>c:1t`
/// with its GPUs, all in one rack.
pub fn to_layout(nodes: &[AlibabaNode]) -> Result<Layout> {
    let list: Vec<(String, u32)> = nodes
        .iter()
        .map(|n| (format!("1s:{}c:1t", n.cpu_milli / 1000), n.gpu))
        .collect();
    Layout::with_nodes(&list, list.len())
}

/// What [`to_workload`] did with the pods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AlibabaStats {
    /// Pods in the list.
    pub pods: usize,
    /// Pods replayed as jobs.
    pub used: usize,
    /// Skipped: no `deletion_time` (no known run time).
    pub no_end: usize,
    /// Skipped: more CPUs or GPUs than any node has.
    pub too_large: usize,
    /// Jobs asking for GPUs.
    pub gpu_jobs: usize,
    /// GPU-sharing pods (`gpu_milli` < 1000) given one whole GPU.
    pub shared_rounded: usize,
    /// Pods whose CPU request was not whole CPUs (rounded up).
    pub cpu_rounded: usize,
    /// Pods with a GPU type constraint (`gpu_spec`), not honoured.
    pub gpu_spec_ignored: usize,
    /// Jobs in the latency class (`LS`, `Guaranteed`).
    pub latency: usize,
    /// GPUs asked for by the jobs, whole.
    pub gpus_asked: u64,
}

/// The jobs of a pod list on the cluster of `layout` (see the module
/// comment), with their GPUs in [`Workload::gpus`].
pub fn to_workload(
    pods: &[AlibabaPod],
    layout: &Layout,
    name: &str,
) -> Result<(Workload, AlibabaStats)> {
    let mut st = AlibabaStats {
        pods: pods.len(),
        ..AlibabaStats::default()
    };
    let max_cpus = layout.max_node_cpus();
    let n = layout.nr_nodes() as u32;
    let fits =
        |cpus: u32, gpus: u32| (0..n).any(|i| layout.cpus(i) >= cpus && layout.gpus(i) >= gpus);
    let mut order: Vec<&AlibabaPod> = pods.iter().collect();
    order.sort_by_key(|p| p.creation_time);
    let t0 = order.first().map_or(0, |p| p.creation_time);
    let mut jobs = Vec::new();
    let mut gpus = Vec::new();
    for p in order {
        let Some(end) = p.deletion_time else {
            st.no_end += 1;
            continue;
        };
        let cpus = (p.cpu_milli.div_ceil(1000).max(1)).min(u32::MAX as u64) as u32;
        let rounded = p.num_gpu == 1 && p.gpu_milli > 0 && p.gpu_milli < 1000;
        let g = p.num_gpu;
        if cpus > max_cpus || !fits(cpus, g) {
            st.too_large += 1;
            continue;
        }
        if !p.cpu_milli.is_multiple_of(1000) || p.cpu_milli == 0 {
            st.cpu_rounded += 1;
        }
        if rounded {
            st.shared_rounded += 1;
        }
        if g > 0 {
            st.gpu_jobs += 1;
            st.gpus_asked += g as u64;
            if !p.gpu_spec.is_empty() {
                st.gpu_spec_ignored += 1;
            }
        }
        let latency = matches!(p.qos.as_str(), "LS" | "Guaranteed");
        if latency {
            st.latency += 1;
        }
        let start = p.scheduled_time.unwrap_or(p.creation_time);
        let run_s = end.saturating_sub(start).max(1);
        let i = jobs.len() as u32;
        jobs.push(Job {
            submit_us: (p.creation_time - t0).saturating_mul(US_PER_S),
            duration_us: run_s.saturating_mul(US_PER_S),
            limit_us: None,
            cpus,
            nodes: 1,
            latency,
            after: None,
            group: i,
            kind: JobKind::Single,
        });
        gpus.push(g);
        st.used += 1;
    }
    let mut w = Workload::new(name, jobs)?;
    w.gpus = gpus;
    Ok((w, st))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_by_name_in_any_order_with_an_index() {
        let nodes = parse_nodes(
            ",model,gpu,sn,memory_mib,cpu_milli\n0,nan,0,a,1024,32000\n1,V100M32,8,b,2048,96000\n",
            "n.csv",
        )
        .unwrap();
        assert_eq!(nodes[0].model, "");
        assert_eq!((nodes[1].gpu, nodes[1].cpu_milli), (8, 96000));
        let e = parse_nodes("sn,cpu_milli,memory_mib,gpu\n", "n.csv").unwrap_err();
        assert!(e.to_string().contains("model"), "{e}");
    }
}
