//! Reading `/proc` to find a job's processes and threads: `stat` parsing
//! (state, parent, process group, CPU times), process-group and children
//! scans, the threads of a process, and the identity check of a shim
//! (its command line names its job directory) that guards against pid
//! reuse after an agent restart. Read-only.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The fields of `/proc/<pid>/stat` the executor uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// The pid.
    pub pid: i32,
    /// State letter: `R`, `S`, `D`, `T` (stopped), `t`, `Z` (zombie), ...
    pub state: char,
    /// Parent pid.
    pub ppid: i32,
    /// Process group.
    pub pgrp: i32,
    /// Session.
    pub session: i32,
    /// User CPU time, clock ticks.
    pub utime: u64,
    /// System CPU time, clock ticks.
    pub stime: u64,
    /// Start time after boot, clock ticks (with the pid, an identity).
    pub starttime: u64,
}

impl ProcStat {
    /// Parse the text of a `stat` file. The command name (field 2) may
    /// hold spaces and parentheses, so fields are counted after the last
    /// `)`.
    pub fn parse(text: &str) -> Option<ProcStat> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        let pid = text[..open].trim().parse().ok()?;
        let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
        // rest[0] is field 3 (state); field n is rest[n - 3].
        let field = |n: usize| rest.get(n - 3).copied();
        Some(ProcStat {
            pid,
            state: field(3)?.chars().next()?,
            ppid: field(4)?.parse().ok()?,
            pgrp: field(5)?.parse().ok()?,
            session: field(6)?.parse().ok()?,
            utime: field(14)?.parse().ok()?,
            stime: field(15)?.parse().ok()?,
            starttime: field(22)?.parse().ok()?,
        })
    }

    /// Whether the process still runs (exists and is not a zombie).
    pub fn is_alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// `/proc/<pid>/stat`, or `None` if the process is gone (or unreadable).
pub fn stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    ProcStat::parse(&text)
}

/// Every process in `/proc` (pids only).
pub fn all_pids() -> Vec<i32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Every process's `stat` (processes that vanish during the scan are
/// skipped).
pub fn all_stats() -> Vec<ProcStat> {
    all_pids().into_iter().filter_map(stat).collect()
}

/// Live members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    all_stats()
        .into_iter()
        .filter(|s| s.pgrp == pgid && s.is_alive())
        .map(|s| s.pid)
        .collect()
}

/// Live children of `ppid`.
pub fn children_of(ppid: i32) -> Vec<i32> {
    all_stats()
        .into_iter()
        .filter(|s| s.ppid == ppid && s.is_alive())
        .map(|s| s.pid)
        .collect()
}

/// Thread ids of `pid` (empty if it is gone).
pub fn threads(pid: i32) -> Vec<i32> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Whether `pid` is a live shim for `job_dir`: its command line is
/// `<exe> shim --job-dir <job_dir>`. Zombies have an empty command line,
/// so an exited but unreaped shim is not alive.
pub fn is_shim_for(pid: i32, job_dir: &Path) -> bool {
    let Ok(raw) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = raw.split(|&b| b == 0).collect();
    let dir = job_dir.as_os_str().as_bytes();
    args.windows(3)
        .any(|w| w[0] == b"shim" && w[1] == b"--job-dir" && w[2] == dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let text =
            "1234 (a b) c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 17 3 0 0 20 0 1 0 98765 1000 200";
        let s = ProcStat::parse(text).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 1234,
                state: 'S',
                ppid: 1,
                pgrp: 1234,
                session: 1234,
                utime: 17,
                stime: 3,
                starttime: 98765,
            }
        );
        assert!(ProcStat::parse("garbage").is_none());
        assert!(ProcStat::parse("1 (x) S 1").is_none());
    }

    #[test]
    fn reads_itself() {
        let me = std::process::id() as i32;
        let s = stat(me).unwrap();
        assert_eq!(s.pid, me);
        assert!(s.is_alive());
        assert!(threads(me).contains(&me));
        assert!(group_members(s.pgrp).contains(&me));
        assert!(children_of(s.ppid).contains(&me));
        assert!(all_pids().contains(&me));
        assert!(!is_shim_for(me, Path::new("/nonexistent")));
    }
}
