//! One run's jobs, one CSV line each (`dispatch-sim ... --jobs-out DIR`):
//! what the summary tables fold away, for the analyses they do not make
//! (which jobs form a tail, the wait by size, where each job ran), in the
//! spirit of Slurm's `sacct` dump.
//!
//! Columns ([`HEADER`]): the job's index in the workload, its logical
//! job (`group`), kind, CPUs per node, nodes, latency class (0/1), time
//! limit and run time (s, the limit empty without one), then what the
//! policy did: submitted, started and ended (s, empty when it never
//! did), the wait (start - submit, empty when it never started), the
//! node's index (empty when never placed) and how far a steal moved it.

use std::io::{self, Write};

use crate::US_PER_S;
use crate::engine::JobRecord;
use crate::policy::Move;
use crate::workload::{JobKind, Workload};

/// The first line of every file.
pub const HEADER: &str =
    "job,group,kind,cpus,nodes,latency,limit_s,duration_s,submit_s,start_s,end_s,wait_s,node,moved";

/// A time in µs as seconds, empty for "never" (`u64::MAX`).
fn secs(us: u64) -> String {
    if us == u64::MAX {
        String::new()
    } else {
        format!("{:.6}", us as f64 / US_PER_S as f64)
    }
}

fn kind(k: JobKind) -> &'static str {
    match k {
        JobKind::Single => "single",
        JobKind::FanoutParent => "fanout-parent",
        JobKind::FanoutChild => "fanout-child",
        JobKind::PipelineStage => "pipeline-stage",
    }
}

fn moved(m: Move) -> &'static str {
    match m {
        Move::None => "none",
        Move::SameRack => "same-rack",
        Move::CrossRack => "cross-rack",
        Move::CrossZone => "cross-zone",
    }
}

/// Write [`HEADER`] and one line per job of `w` with its record (`records`
/// in the workload's order, as a run returns them; a job without one is
/// written as never submitted).
pub fn write(out: &mut impl Write, w: &Workload, records: &[JobRecord]) -> io::Result<()> {
    writeln!(out, "{HEADER}")?;
    let never = JobRecord::default();
    for (i, j) in w.jobs.iter().enumerate() {
        let r = records.get(i).unwrap_or(&never);
        let wait = if r.start == u64::MAX || r.submit == u64::MAX {
            u64::MAX
        } else {
            r.start.saturating_sub(r.submit)
        };
        let node = if r.node == u32::MAX {
            String::new()
        } else {
            r.node.to_string()
        };
        writeln!(
            out,
            "{i},{},{},{},{},{},{},{},{},{},{},{},{node},{}",
            j.group,
            kind(j.kind),
            j.cpus,
            j.nodes,
            u8::from(j.latency),
            j.limit_us.map_or(String::new(), secs),
            secs(j.duration_us),
            secs(r.submit),
            secs(r.start),
            secs(r.end),
            secs(wait),
            moved(r.moved),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{SimConfig, simulate};
    use crate::layout::Layout;
    use crate::policy::PolicySpec;
    use crate::workload::{SyntheticParams, synthetic};

    /// A real run's file: one line per job with the header's columns,
    /// each job's times in order and its wait the difference, and the
    /// columns that describe the job equal to the workload's.
    #[test]
    fn a_runs_jobs_round_trip_through_the_file() {
        let layout = Layout::new("1z:2r:2n", "1s:4c:1t").unwrap();
        let params = SyntheticParams {
            jobs: 300,
            load: 1.2,
            ..SyntheticParams::default()
        };
        let w = synthetic(&params, layout.capacity(), layout.min_node_cpus()).unwrap();
        let policy = &PolicySpec::parse_list("ours").unwrap()[0];
        let out = simulate(&layout, &w, policy, &SimConfig::default(), &mut |_| {}).unwrap();
        let mut buf = Vec::new();
        write(&mut buf, &w, &out.records).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(HEADER));
        let cols = HEADER.split(',').count();
        let mut n = 0;
        let mut waited = 0;
        for (i, line) in lines.enumerate() {
            let f: Vec<&str> = line.split(',').collect();
            assert_eq!(f.len(), cols, "line {i}: {line}");
            let j = &w.jobs[i];
            assert_eq!(f[0], i.to_string());
            assert_eq!(f[3], j.cpus.to_string());
            assert_eq!(f[5], if j.latency { "1" } else { "0" });
            let t = |k: usize| f[k].parse::<f64>().unwrap();
            // Every job of this run ends: submitted <= started <= ended.
            let (submit, start, end, wait) = (t(8), t(9), t(10), t(11));
            assert!(submit <= start && start <= end, "line {i}: {line}");
            assert!((wait - (start - submit)).abs() < 1e-5, "line {i}: {line}");
            let r = &out.records[i];
            assert_eq!(f[12], r.node.to_string());
            if r.start > r.submit {
                waited += 1;
            }
            n += 1;
        }
        assert_eq!(n, w.jobs.len());
        // At load 1.2 on 8 CPUs, jobs queue: the waits are not all 0.
        assert!(waited > 0, "no job waited");
    }

    #[test]
    fn never_is_an_empty_field() {
        assert_eq!(secs(u64::MAX), "");
        assert_eq!(secs(1_500_000), "1.500000");
    }
}
