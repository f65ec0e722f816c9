//! The Standard Workload Format (Parallel Workloads Archive): one job per
//! line, 18 whitespace-separated numeric fields, `-1` for unknown, header
//! lines starting with `;` (`; MaxProcs: 100`, `; Acknowledge: ...`).
//! Files may be gzip-compressed (detected by their magic bytes, not their
//! name).
//!
//! Fields used: 1 job number, 2 submit time (s), 3 wait time, 4 run time
//! (s), 5 allocated processors, 8 requested processors, 9 requested time,
//! 11 status, 12 user, 15 queue. A job's size is its allocated processors,
//! else its requested ones; jobs with an unknown submit time, run time or
//! size are skipped (and counted).
//!
//! A job's requested time (field 9, when > 0) is its time limit in a
//! replay (the dispatcher's `timeout_ms`): the estimate the traced
//! machine's EASY backfilling used. The dispatcher's agent kills a job at
//! its limit, so a run time above it (a traced machine's grace period:
//! 1.7% of the KTH SP2 log's jobs) is clamped to the limit, and counted
//! ([`ReplayStats::clamped`]).
//!
//! A record larger than a node is split into independent parts of at most
//! a node ([`ReplayStats::split`]), or, with [`ReplayOptions::gangs`],
//! becomes one gang job whose members start together
//! ([`ReplayStats::gangs`]), as the traced MPI job did.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use sched::harness::Rng;

use crate::US_PER_S;
use crate::error::{Result, SimError};
use crate::workload::{Job, JobKind, Workload};

/// One SWF record (fields as in the file; -1 = unknown).
#[derive(Clone, Debug, PartialEq)]
pub struct SwfJob {
    /// Field 1: job number.
    pub id: i64,
    /// Field 2: submit time, seconds from the log's start.
    pub submit: i64,
    /// Field 3: wait time, seconds.
    pub wait: i64,
    /// Field 4: run time, seconds.
    pub run: i64,
    /// Field 5: allocated processors.
    pub alloc_procs: i64,
    /// Field 8: requested processors.
    pub req_procs: i64,
    /// Field 9: requested time, seconds.
    pub req_time: i64,
    /// Field 11: status (1 completed, 0 failed, 5 cancelled, ...).
    pub status: i64,
    /// Field 12: user.
    pub user: i64,
    /// Field 15: queue.
    pub queue: i64,
}

impl SwfJob {
    /// Processors used: allocated, else requested; `None` when unknown.
    pub fn procs(&self) -> Option<u32> {
        [self.alloc_procs, self.req_procs]
            .into_iter()
            .find(|&p| p > 0)
            .and_then(|p| u32::try_from(p).ok())
    }

    /// Usable in a replay: known submit time, run time and size.
    pub fn usable(&self) -> bool {
        self.submit >= 0 && self.run >= 0 && self.procs().is_some()
    }
}

/// A parsed trace.
#[derive(Clone, Debug, Default)]
pub struct SwfTrace {
    /// Where it came from.
    pub path: String,
    /// Header lines, without the leading `;`.
    pub header: Vec<String>,
    /// `MaxProcs` from the header.
    pub max_procs: Option<u32>,
    /// `MaxNodes` from the header.
    pub max_nodes: Option<u32>,
    /// Records in file order.
    pub jobs: Vec<SwfJob>,
}

fn header_value(line: &str, key: &str) -> Option<u32> {
    let rest = line.trim().strip_prefix(key)?.trim_start();
    let rest = rest.strip_prefix(':')?;
    rest.trim().parse().ok()
}

/// Parse SWF text. `path` names the source in errors.
pub fn parse<R: BufRead>(reader: R, path: &str) -> Result<SwfTrace> {
    let mut t = SwfTrace {
        path: path.to_string(),
        ..SwfTrace::default()
    };
    for (i, line) in reader.lines().enumerate() {
        let lineno = i + 1;
        let line = line.map_err(|e| SimError::Swf {
            path: path.to_string(),
            line: lineno,
            message: format!("unreadable: {e}"),
        })?;
        let s = line.trim();
        if s.is_empty() {
            continue;
        }
        if let Some(h) = s.strip_prefix(';') {
            if let Some(v) = header_value(h, "MaxProcs") {
                t.max_procs = Some(v);
            }
            if let Some(v) = header_value(h, "MaxNodes") {
                t.max_nodes = Some(v);
            }
            t.header.push(h.to_string());
            continue;
        }
        let mut f = [-1i64; 18];
        let mut n = 0;
        for (k, tok) in s.split_whitespace().enumerate() {
            if k >= 18 {
                return Err(SimError::Swf {
                    path: path.to_string(),
                    line: lineno,
                    message: "more than 18 fields".into(),
                });
            }
            // Some logs write averages with decimals: keep the integer part.
            let v: f64 = tok.parse().map_err(|_| SimError::Swf {
                path: path.to_string(),
                line: lineno,
                message: format!("field {} is {tok:?}, not a number", k + 1),
            })?;
            if !v.is_finite() {
                return Err(SimError::Swf {
                    path: path.to_string(),
                    line: lineno,
                    message: format!("field {} is not finite", k + 1),
                });
            }
            f[k] = v as i64;
            n = k + 1;
        }
        if n < 5 {
            return Err(SimError::Swf {
                path: path.to_string(),
                line: lineno,
                message: format!("{n} fields; a job needs at least 5 (up to allocated processors)"),
            });
        }
        t.jobs.push(SwfJob {
            id: f[0],
            submit: f[1],
            wait: f[2],
            run: f[3],
            alloc_procs: f[4],
            req_procs: f[7],
            req_time: f[8],
            status: f[10],
            user: f[11],
            queue: f[14],
        });
    }
    Ok(t)
}

/// Read a trace file, plain or gzip-compressed.
pub fn read(path: &Path) -> Result<SwfTrace> {
    let name = path.display().to_string();
    let io = |source| SimError::Io {
        path: name.clone(),
        source,
    };
    let mut file = BufReader::new(File::open(path).map_err(io)?);
    let magic = file.fill_buf().map_err(io)?;
    let gz = magic.starts_with(&[0x1f, 0x8b]);
    if gz {
        let dec = flate2::bufread::MultiGzDecoder::new(file);
        parse(BufReader::new(dec), &name)
    } else {
        parse(file, &name)
    }
}

/// Read SWF text from any reader (tests, stdin).
pub fn read_from(mut r: impl Read, name: &str) -> Result<SwfTrace> {
    let mut buf = Vec::new();
    r.read_to_end(&mut buf).map_err(|source| SimError::Io {
        path: name.to_string(),
        source,
    })?;
    if buf.starts_with(&[0x1f, 0x8b]) {
        parse(
            BufReader::new(flate2::bufread::MultiGzDecoder::new(&buf[..])),
            name,
        )
    } else {
        parse(&buf[..], name)
    }
}

/// A trace's user id as the workload's (unknown, -1, becomes `u32::MAX`:
/// one more user).
fn user_id(user: i64) -> u32 {
    u32::try_from(user).unwrap_or(u32::MAX)
}

/// How a trace becomes a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayOptions {
    /// CPUs of a node: larger jobs are split into parts of at most this.
    pub node_cpus: u32,
    /// Copies of every job (for a cluster scaled by the same factor).
    pub replicas: u32,
    /// Divide inter-arrival times by this (> 1 raises the load).
    pub time_scale: f64,
    /// Use only the first jobs.
    pub limit: Option<usize>,
    /// Fraction of jobs put in the latency class (the archive's logs have
    /// no latency notion; chosen by a seeded draw).
    pub latency_frac: f64,
    /// Seed of that draw.
    pub seed: u64,
    /// A record larger than a node becomes one gang job of
    /// `ceil(procs / node_cpus)` members (within any) of
    /// `ceil(procs / members)` CPUs each, started all at once, instead of
    /// independent parts.
    pub gangs: bool,
    /// Jobs keep their trace's user (field 12; [`Workload::users`]), else
    /// they are anonymous.
    pub users: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            node_cpus: 4,
            replicas: 1,
            time_scale: 1.0,
            limit: None,
            latency_frac: 0.1,
            seed: 1,
            gangs: false,
            users: true,
        }
    }
}

/// What a replay kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Records used.
    pub used: usize,
    /// Records skipped (unknown submit time, run time or size).
    pub skipped: usize,
    /// Records split over several nodes (independent parts).
    pub split: usize,
    /// Records replayed as gangs ([`ReplayOptions::gangs`]).
    pub gangs: usize,
    /// Records with a requested time (their time limit).
    pub limited: usize,
    /// Records whose run time exceeded their requested time, clamped to
    /// it.
    pub clamped: usize,
}

impl SwfTrace {
    /// The workload of this trace: submit times relative to the first
    /// used job, run times as durations, sizes split to fit nodes.
    pub fn to_workload(&self, opts: &ReplayOptions) -> Result<(Workload, ReplayStats)> {
        if opts.node_cpus == 0 || opts.replicas == 0 || opts.time_scale <= 0.0 {
            return Err(SimError::Workload(
                "replay needs node_cpus, replicas and time_scale > 0".into(),
            ));
        }
        let mut stats = ReplayStats::default();
        let mut usable: Vec<&SwfJob> = Vec::new();
        for j in &self.jobs {
            if opts.limit.is_some_and(|l| usable.len() >= l) {
                break;
            }
            if j.usable() {
                usable.push(j);
            } else {
                stats.skipped += 1;
            }
        }
        stats.used = usable.len();
        let t0 = usable.iter().map(|j| j.submit).min().unwrap_or(0);
        let mut rng = Rng::new(opts.seed);
        let mut order: Vec<&SwfJob> = usable;
        order.sort_by_key(|j| j.submit);
        let mut jobs = Vec::new();
        let mut users = Vec::new();
        for j in order {
            let submit_us =
                ((j.submit - t0) as f64 * US_PER_S as f64 / opts.time_scale).round() as u64;
            let limit_us = (j.req_time > 0).then(|| (j.req_time as u64).saturating_mul(US_PER_S));
            let mut duration_us = (j.run as u64).saturating_mul(US_PER_S);
            if let Some(limit) = limit_us {
                stats.limited += 1;
                if duration_us > limit {
                    stats.clamped += 1;
                    duration_us = limit;
                }
            }
            let procs = j.procs().unwrap_or(1);
            let latency = rng.unit() < opts.latency_frac;
            let gang = opts.gangs && procs > opts.node_cpus;
            if gang {
                stats.gangs += 1;
            } else if procs > opts.node_cpus {
                stats.split += 1;
            }
            for _ in 0..opts.replicas {
                if gang {
                    let nodes = procs.div_ceil(opts.node_cpus);
                    let group = jobs.len() as u32;
                    jobs.push(Job {
                        submit_us,
                        duration_us,
                        limit_us,
                        cpus: procs.div_ceil(nodes),
                        nodes,
                        latency,
                        after: None,
                        group,
                        kind: JobKind::Single,
                    });
                    users.push(user_id(j.user));
                    continue;
                }
                let group = jobs.len() as u32;
                let mut left = procs;
                while left > 0 {
                    let cpus = left.min(opts.node_cpus);
                    left -= cpus;
                    jobs.push(Job {
                        submit_us,
                        duration_us,
                        limit_us,
                        cpus,
                        nodes: 1,
                        latency,
                        after: None,
                        group,
                        kind: JobKind::Single,
                    });
                    users.push(user_id(j.user));
                }
            }
        }
        let name = Path::new(&self.path)
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| self.path.clone());
        let mut w = Workload::new(name, jobs)?;
        if opts.users {
            w.users = users;
        }
        Ok((w, stats))
    }

    /// Processors of the traced machine: `MaxProcs`, else the largest job.
    pub fn machine_procs(&self) -> u32 {
        self.max_procs
            .or_else(|| self.jobs.iter().filter_map(SwfJob::procs).max())
            .unwrap_or(1)
            .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "; Version: 2.2\n; MaxProcs: 8\n;\n\
        1 0 5 10 4 -1 -1 4 20 -1 1 1 1 -1 -1 -1 -1 -1\n\
        2 3 -1 7 -1 -1 -1 2 -1 -1 1 1 1 -1 -1 -1 -1 -1\n\
        3 4 -1 -1 2 -1 -1 -1 -1 -1 1 1 1 -1 -1 -1 -1 -1\n\
        \n   4 6 0 2.5 12 -1 -1 12 -1 -1 1 2 1 -1 -1 -1 -1 -1\n";

    #[test]
    fn header_fields_and_unknowns() {
        let t = parse(TEXT.as_bytes(), "t").unwrap();
        assert_eq!(t.max_procs, Some(8));
        assert_eq!(t.header.len(), 3);
        assert_eq!(t.jobs.len(), 4);
        assert_eq!(t.jobs[1].procs(), Some(2), "requested when allocated is -1");
        assert!(!t.jobs[2].usable(), "unknown run time");
        assert_eq!(t.jobs[3].run, 2);
        let (w, s) = t
            .to_workload(&ReplayOptions {
                node_cpus: 4,
                latency_frac: 0.0,
                ..ReplayOptions::default()
            })
            .unwrap();
        assert_eq!(s.used, 3);
        assert_eq!(s.skipped, 1);
        assert_eq!(s.split, 1);
        // 4 + 2 + (12 = 4 + 4 + 4)
        assert_eq!(w.jobs.len(), 5);
        assert_eq!(w.jobs[2].group, 2);
        assert_eq!(w.jobs[4].group, 2);
        assert_eq!(w.jobs[1].submit_us, 3 * US_PER_S);
        // Field 9: job 1 asked for 20 s (ran 10); job 2 gave no estimate.
        assert_eq!(s.limited, 1);
        assert_eq!(w.jobs[0].limit_us, Some(20 * US_PER_S));
        assert_eq!(w.jobs[1].limit_us, None);
    }

    /// A run time beyond the requested time is clamped to it: the
    /// dispatcher kills a job at its timeout.
    #[test]
    fn run_time_over_the_request_is_clamped() {
        let t = parse(
            "1 0 0 50 1 -1 -1 1 30 -1 1 1 1 -1 -1 -1 -1 -1\n2 0 0 10 1 -1 -1 1 30 -1 1 1 1 -1 -1 -1 -1 -1\n"
                .as_bytes(),
            "t",
        )
        .unwrap();
        let (w, s) = t.to_workload(&ReplayOptions::default()).unwrap();
        assert_eq!((s.limited, s.clamped), (2, 1));
        assert_eq!(w.jobs[0].duration_us, 30 * US_PER_S);
        assert_eq!(w.jobs[1].duration_us, 10 * US_PER_S);
        assert!(
            w.jobs
                .iter()
                .all(|j| j.limit_us.is_some_and(|l| j.duration_us <= l))
        );
    }

    /// A record of 3 nodes' worth (10 processors on 4-CPU nodes) becomes
    /// one gang of 3 members of 4 CPUs with `gangs`, three parts without.
    #[test]
    fn a_record_of_three_nodes_becomes_one_gang_of_three() {
        let t = parse(
            "1 0 0 50 10 -1 -1 10 60 -1 1 1 1 -1 -1 -1 -1 -1\n2 1 0 5 3 -1 -1 3 60 -1 1 1 1 -1 -1 -1 -1 -1\n"
                .as_bytes(),
            "t",
        )
        .unwrap();
        let opts = ReplayOptions {
            node_cpus: 4,
            gangs: true,
            ..ReplayOptions::default()
        };
        let (w, s) = t.to_workload(&opts).unwrap();
        assert_eq!((s.gangs, s.split), (1, 0));
        assert_eq!(w.jobs.len(), 2);
        assert_eq!((w.jobs[0].nodes, w.jobs[0].cpus), (3, 4));
        assert_eq!((w.jobs[1].nodes, w.jobs[1].cpus), (1, 3));
        assert!(w.has_gangs());
        assert_eq!(w.work_cpu_us(), (12 * 50 + 3 * 5) as f64 * US_PER_S as f64);
        let (w, s) = t
            .to_workload(&ReplayOptions {
                gangs: false,
                ..opts
            })
            .unwrap();
        assert_eq!((s.gangs, s.split), (0, 1));
        assert_eq!(w.jobs.len(), 4);
        assert!(w.jobs.iter().all(|j| j.nodes == 1));
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let e = parse("; x\n1 2 3\n".as_bytes(), "f.swf").unwrap_err();
        assert!(e.to_string().starts_with("f.swf:2:"), "{e}");
        let e = parse("1 2 3 4 x\n".as_bytes(), "f.swf").unwrap_err();
        assert!(e.to_string().contains("field 5"), "{e}");
    }
}
