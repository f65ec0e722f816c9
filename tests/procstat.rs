//! What the benchmarks read from `/proc`: a process's resident memory
//! (`VmRSS` in `status`), CPU time (`utime + stime` in `stat`, and that of
//! its reaped children), its children, the time spent runnable but
//! waiting for a CPU (the run delay in each thread's `schedstat`), the
//! CPU time of its threads by name, and the machine's load average.

use anyhow::{Context, Result, bail};

/// Resident set size of `pid`, bytes.
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_vm_rss(&text).with_context(|| format!("no VmRSS line in {path}"))
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => Some(value * 1024),
        Some(_) => None,
    }
}

/// CPU time (user + system) `pid` has used, seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let ticks = parse_stat_ticks(&text).with_context(|| format!("unexpected format of {path}"))?;
    let hz = clock_ticks_per_second()?;
    Ok(ticks as f64 / hz)
}

/// utime + stime from a `/proc/PID/stat` line: fields 14 and 15, counted
/// after the command name, which is in parentheses and may hold spaces.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    parse_stat(stat).map(|s| s.own)
}

/// What a `/proc/PID/stat` line says of a process's CPU time, in ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StatTicks {
    /// Field 4.
    ppid: u32,
    /// utime + stime (fields 14, 15).
    own: u64,
    /// cutime + cstime (fields 16, 17): its children's, once reaped.
    reaped: u64,
}

fn parse_stat(stat: &str) -> Option<StatTicks> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state).
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(StatTicks {
        ppid: u32::try_from(field(4)?).ok()?,
        own: field(14)? + field(15)?,
        reaped: field(16)? + field(17)?,
    })
}

/// CPU seconds of a process: its own, and its reaped children's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcCpu {
    pub own: f64,
    pub reaped: f64,
}

/// [`ProcCpu`] of `pid`.
pub fn proc_cpu(pid: u32) -> Result<ProcCpu> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let s = parse_stat(&text).with_context(|| format!("unexpected format of {path}"))?;
    let hz = clock_ticks_per_second()?;
    Ok(ProcCpu {
        own: s.own as f64 / hz,
        reaped: s.reaped as f64 / hz,
    })
}

/// The live processes whose parent is `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|t| parse_stat(&t))
                .is_some_and(|s| s.ppid == pid)
        })
        .collect()
}

/// CPU seconds (user + system) of the threads of `pid` alive now, summed
/// by thread name (`/proc/PID/task/TID/comm`: a dispatcher's
/// `dispatch-core`, `dispatch-store`, its runtime's `tokio-rt-worker`s).
/// A thread that ended took its time with it: read it while the threads
/// of interest run, and compare two readings.
pub fn threads_cpu(pid: u32) -> Result<std::collections::BTreeMap<String, f64>> {
    let dir = format!("/proc/{pid}/task");
    let hz = clock_ticks_per_second()?;
    let mut by_name = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let task = entry?.path();
        // A thread may end between the listing and the reads.
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("stat")),
        ) else {
            continue;
        };
        if let Some(s) = parse_stat(&stat) {
            *by_name.entry(comm.trim_end().to_string()).or_insert(0.0) += s.own as f64 / hz;
        }
    }
    Ok(by_name)
}

/// Time the threads of `pid` alive now have spent waiting on a run queue
/// (runnable, no CPU free), seconds: the second field of
/// `/proc/PID/task/TID/schedstat`, in nanoseconds.
pub fn run_delay_seconds(pid: u32) -> Result<f64> {
    let dir = format!("/proc/{pid}/task");
    let mut total_ns = 0u64;
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = entry?.path().join("schedstat");
        // A thread may end between the listing and the read.
        if let Ok(text) = std::fs::read_to_string(&path) {
            total_ns += parse_run_delay_ns(&text).unwrap_or(0);
        }
    }
    Ok(total_ns as f64 / 1e9)
}

fn parse_run_delay_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().nth(1)?.parse().ok()
}

/// The 1-minute load average of the machine.
pub fn loadavg_1m() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn clock_ticks_per_second() -> Result<f64> {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(hz)) if hz > 0 => Ok(hz as f64),
        Ok(_) => bail!("sysconf(CLK_TCK) gave no value"),
        Err(e) => bail!("sysconf(CLK_TCK): {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tdispatcher\nVmPeak:\t  99 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n";
        assert_eq!(parse_vm_rss(status), Some(12345 * 1024));
        assert_eq!(parse_vm_rss("Name:\tx\n"), None);
    }

    #[test]
    fn stat_ticks_skip_a_command_name_with_spaces() {
        let stat = "42 (dispatch core) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 4 0 1000";
        assert_eq!(parse_stat_ticks(stat), Some(325));
    }

    #[test]
    fn stat_gives_the_parent_and_the_reaped_childrens_time() {
        let stat = "42 (dispatch core) S 7 42 42 0 -1 4194560 100 0 0 0 250 75 30 12 20 0 4 0 1000";
        assert_eq!(
            parse_stat(stat),
            Some(StatTicks {
                ppid: 7,
                own: 325,
                reaped: 42
            })
        );
        assert_eq!(parse_stat("42 (x) S 7 1 2"), None);
    }

    #[test]
    fn this_process_is_a_child_of_its_parent() {
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        assert!(children(parent).contains(&me));
        assert!(proc_cpu(me).unwrap().own >= 0.0);
    }

    #[test]
    fn this_process_threads_are_read_by_name() {
        let name = "procstat-probe";
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                ready_tx.send(()).unwrap();
                let _ = stop_rx.recv();
            })
            .unwrap();
        ready_rx.recv().unwrap();
        let threads = threads_cpu(std::process::id()).unwrap();
        stop_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(threads.get(name).is_some_and(|&s| s >= 0.0), "{threads:?}");
        assert!(threads.values().all(|&s| s >= 0.0));
    }

    #[test]
    fn run_delay_is_the_second_schedstat_field() {
        assert_eq!(parse_run_delay_ns("123 456 7\n"), Some(456));
        assert_eq!(parse_run_delay_ns("123"), None);
    }

    #[test]
    fn this_process_has_memory_and_cpu_time() {
        let me = std::process::id();
        assert!(rss_bytes(me).unwrap() > 0);
        assert!(cpu_seconds(me).unwrap() >= 0.0);
        assert!(run_delay_seconds(me).unwrap() >= 0.0);
        assert!(loadavg_1m().is_some());
    }
}
