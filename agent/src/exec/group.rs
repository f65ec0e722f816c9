//! A job's processes and threads, and what is done to all of them at once:
//! signals (stop, continue, terminate, kill) and CPU pinning.
//!
//! A job is its process group (the job's first process calls `setsid`, so
//! the group id is its pid), plus the children of its shim that left the
//! group (a double-forked daemon that called `setsid` is re-parented to
//! the shim, a child subreaper), plus everything in its cgroup when it has
//! one. The shim itself is never signalled.

use std::collections::BTreeSet;
use std::path::Path;

use nix::errno::Errno;
use nix::sched::{CpuSet, sched_setaffinity};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::cgroup;
use super::error::{ExecError, Result};
use super::procfs;
use super::spec::validate_cpus;

/// How to find one job's processes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobProcs<'a> {
    /// The job's process group (= pid of its first process).
    pub pgid: i32,
    /// Its shim, when known to be alive (children of a dead shim's pid
    /// could belong to whoever reuses that pid, so they are not looked at).
    pub shim: Option<i32>,
    /// Its cgroup, if it has one.
    pub cgroup: Option<&'a Path>,
}

impl JobProcs<'_> {
    /// Live processes of the job: `(in its process group, escaped from
    /// it)`, from one scan of /proc (plus the cgroup's list).
    fn scan(&self) -> (BTreeSet<i32>, BTreeSet<i32>) {
        let mut group = BTreeSet::new();
        let mut escaped = BTreeSet::new();
        for s in procfs::all_stats() {
            if !s.is_alive() || Some(s.pid) == self.shim {
                continue;
            }
            if s.pgrp == self.pgid {
                group.insert(s.pid);
            } else if Some(s.ppid) == self.shim {
                escaped.insert(s.pid);
            }
        }
        if let Some(cg) = self.cgroup {
            for pid in cgroup::procs(cg) {
                if Some(pid) != self.shim && !group.contains(&pid) {
                    escaped.insert(pid);
                }
            }
        }
        (group, escaped)
    }

    /// Every live process of the job.
    pub fn pids(&self) -> BTreeSet<i32> {
        let (mut group, escaped) = self.scan();
        group.extend(escaped);
        group
    }

    /// Send `sig` to the process group and to every escaped process.
    /// Returns how many targets (the group counting as one) received it;
    /// 0 means the job has no process left.
    pub fn signal(&self, sig: Signal) -> Result<usize> {
        let mut n = 0;
        match killpg(Pid::from_raw(self.pgid), sig) {
            Ok(()) => n += 1,
            Err(Errno::ESRCH) => {}
            Err(e) => {
                return Err(ExecError::sys(
                    signal_call(sig),
                    format!("process group {}", self.pgid),
                    e,
                ));
            }
        }
        let (_, escaped) = self.scan();
        for pid in escaped {
            if kill(Pid::from_raw(pid), sig).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    /// SIGKILL everything, through `cgroup.kill` too.
    pub fn kill_all(&self) {
        if let Some(cg) = self.cgroup {
            cgroup::kill_all(cg);
        }
        let _ = self.signal(Signal::SIGKILL);
    }

    /// Every thread of every process of the job, and the shim's if asked.
    pub fn tids(&self, with_shim: bool) -> BTreeSet<i32> {
        let mut out = BTreeSet::new();
        let mut pids = self.pids();
        if with_shim && let Some(shim) = self.shim {
            pids.insert(shim);
        }
        for pid in pids {
            out.extend(procfs::threads(pid));
        }
        if let Some(cg) = self.cgroup {
            out.extend(cgroup::threads(cg));
        }
        out
    }

    /// Pin every thread of the job (and of its shim) to `cpus`: the
    /// cgroup's `cpuset.cpus` first when it has one, then
    /// `sched_setaffinity` per thread, scanning again until a pass finds no
    /// thread it has not pinned (threads created during the walk inherit the
    /// mask of their creator, which may not have been pinned yet). Returns
    /// the number of threads pinned.
    pub fn pin(&self, cpus: &[u32], job: &str) -> Result<usize> {
        let set = cpu_set(cpus)?;
        if let Some(cg) = self.cgroup
            && cgroup::has_cpuset(cg)
        {
            cgroup::set_cpus(cg, cpus)?;
        }
        let mut done = BTreeSet::new();
        for _pass in 0..8 {
            let fresh: Vec<i32> = self.tids(true).difference(&done).copied().collect();
            if fresh.is_empty() {
                break;
            }
            for tid in fresh {
                match sched_setaffinity(Pid::from_raw(tid), &set) {
                    Ok(()) | Err(Errno::ESRCH) => {
                        done.insert(tid);
                    }
                    Err(e) => {
                        return Err(ExecError::sys(
                            "sched_setaffinity",
                            format!("thread {tid} of job {job}"),
                            e,
                        ));
                    }
                }
            }
        }
        Ok(done.len())
    }
}

/// A `CpuSet` of `cpus`.
pub(crate) fn cpu_set(cpus: &[u32]) -> Result<CpuSet> {
    validate_cpus(cpus)?;
    let mut set = CpuSet::new();
    for &cpu in cpus {
        set.set(cpu as usize).map_err(|e| ExecError::InvalidCpus {
            cpus: cpus.to_vec(),
            reason: format!("CPU {cpu}: {e}"),
        })?;
    }
    Ok(set)
}

fn signal_call(sig: Signal) -> &'static str {
    match sig {
        Signal::SIGSTOP => "killpg(SIGSTOP)",
        Signal::SIGCONT => "killpg(SIGCONT)",
        Signal::SIGTERM => "killpg(SIGTERM)",
        Signal::SIGKILL => "killpg(SIGKILL)",
        _ => "killpg",
    }
}
