//! Reading `/proc` to find a job's processes and threads: `stat` parsing
//! (state, parent, process group, CPU times), process-group and children
//! scans, the threads of a process, and the identity check of a shim
//! (its command line names its job directory) that guards against pid
//! reuse after an agent restart, and whether a process is stopped (state
//! `T`, or SIGSTOP pending: `status`'s `SigPnd`/`ShdPnd`). Read-only.

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
    stat_in(Path::new("/proc"), pid)
}

fn stat_in(proc_root: &Path, pid: i32) -> Option<ProcStat> {
    let bytes = super::read_line_file(&proc_root.join(pid.to_string()).join("stat")).ok()?;
    ProcStat::parse(std::str::from_utf8(&bytes).ok()?)
}

/// The signals pending for a process, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pending {
    /// `SigPnd`: pending for the thread.
    pub thread: u64,
    /// `ShdPnd`: pending for the whole process (shared).
    pub process: u64,
}

impl Pending {
    /// Parse the text of a `status` file (hex masks; bit `n - 1` is
    /// signal `n`). `None` when either mask is missing or malformed.
    pub fn parse(text: &str) -> Option<Pending> {
        let mask = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        };
        Some(Pending {
            thread: mask("SigPnd")?,
            process: mask("ShdPnd")?,
        })
    }

    /// Whether signal `sig` is pending (for the thread or the process).
    pub fn has(&self, sig: i32) -> bool {
        (1..=64).contains(&sig) && (self.thread | self.process) & (1u64 << (sig - 1)) != 0
    }
}

/// Whether `pid` is stopped from the executor's point of view: in state
/// `T`, or with SIGSTOP pending. The second is a process that cannot take
/// the stop yet: a shell in `vfork()` waits uninterruptibly (state `D`)
/// for its child to exec, and takes the group stop only when the child
/// goes on (dash starts a command that way). Judged by `T` alone, a job
/// the agent had stopped looked running after a readopt (the same cause
/// as the flake of `readopts_after_the_agent_process_exits` in
/// agent/tests/exec.rs). False when the process is gone or a zombie.
pub fn is_stopped(pid: i32) -> bool {
    stopped_in(Path::new("/proc"), pid)
}

fn stopped_in(proc_root: &Path, pid: i32) -> bool {
    const SIGSTOP: i32 = 19;
    let Some(st) = stat_in(proc_root, pid) else {
        return false;
    };
    if !st.is_alive() {
        return false;
    }
    st.state == 'T'
        || fs::read_to_string(proc_root.join(pid.to_string()).join("status"))
            .ok()
            .and_then(|t| Pending::parse(&t))
            .is_some_and(|p| p.has(SIGSTOP))
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
/// `<exe> shim --job-dir <job_dir>`, or the supervisor of the state
/// directory holding it, `<exe> shim --state-dir <state_dir>` with
/// `job_dir` = `<state_dir>/jobs/<id>`. Zombies have an empty command
/// line, so an exited but unreaped shim is not alive.
pub fn is_shim_for(pid: i32, job_dir: &Path) -> bool {
    let Ok(raw) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = raw.split(|&b| b == 0).collect();
    let dir = job_dir.as_os_str().as_bytes();
    let jobs = job_dir.parent().filter(|p| p.ends_with("jobs"));
    let state = jobs
        .and_then(Path::parent)
        .map(|s| s.as_os_str().as_bytes());
    args.windows(3).any(|w| {
        w[0] == b"shim"
            && ((w[1] == b"--job-dir" && w[2] == dir)
                || (w[1] == b"--state-dir" && Some(w[2]) == state))
    })
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

    /// A `/proc/<pid>` with these `stat` state and `status` masks.
    fn fixture(root: &Path, pid: i32, state: char, sig_pnd: &str, shd_pnd: &str) {
        let dir = root.join(pid.to_string());
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("stat"),
            format!("{pid} (sh) {state} 1 {pid} {pid} 0 -1 0 0 0 0 0 5 1 0 0 20 0 1 0 777 0 0"),
        )
        .unwrap();
        fs::write(
            dir.join("status"),
            format!(
                "Name:\tsh\nState:\t{state} (x)\nTgid:\t{pid}\nSigQ:\t1/63360\n\
                 SigPnd:\t{sig_pnd}\nShdPnd:\t{shd_pnd}\nSigBlk:\t0000000000000000\n\
                 SigIgn:\t0000000000000004\nSigCgt:\t0000000000010002\n"
            ),
        )
        .unwrap();
    }

    #[test]
    fn stopped_is_state_t_or_sigstop_pending() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let none = "0000000000000000";
        // SIGSTOP (19) is bit 18: 0x40000.
        let stop = "0000000000040000";
        fixture(r, 10, 'T', none, none);
        // The vfork parent: uninterruptible, the group stop pending for
        // the process (ShdPnd) or for the thread (SigPnd).
        fixture(r, 11, 'D', none, stop);
        fixture(r, 12, 'D', stop, none);
        // Running, or with other signals pending (SIGTSTP, 20: 0x80000;
        // SIGCONT, 18: 0x20000): not stopped.
        fixture(r, 13, 'S', none, none);
        fixture(r, 14, 'D', "0000000000080000", "0000000000020000");
        // A zombie with a stale pending stop is not a stopped job.
        fixture(r, 15, 'Z', none, stop);
        // A status without the masks says nothing: only T counts.
        fixture(r, 16, 'R', none, none);
        fs::write(r.join("16/status"), "Name:\tsh\n").unwrap();
        // 17 does not exist.
        let stopped: Vec<i32> = (10..=17).filter(|&p| stopped_in(r, p)).collect();
        assert_eq!(stopped, vec![10, 11, 12]);

        let p = Pending::parse("SigPnd:\t0000000000000001\nShdPnd:\t8000000000000000\n").unwrap();
        assert!(p.has(1) && p.has(64) && !p.has(2) && !p.has(0) && !p.has(65));
        assert_eq!(Pending::parse("SigPnd:\tzz\nShdPnd:\t0\n"), None);
    }

    #[test]
    fn sees_a_real_stop() {
        use nix::sys::signal::{Signal, kill};
        use nix::unistd::Pid;
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        assert!(!is_stopped(pid));
        kill(Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
        // Pending once kill() returns, then taken (T); between the two the
        // kernel dequeues it and runs for a moment: poll, bounded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !is_stopped(pid) {
            assert!(std::time::Instant::now() < deadline, "SIGSTOP not seen");
            std::thread::yield_now();
        }
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        child.wait().unwrap();
        assert!(!is_stopped(pid));
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
