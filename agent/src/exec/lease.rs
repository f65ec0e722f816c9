//! The agent's lease from the dispatcher, as the shims see it: one file,
//! `<state dir>/lease`, holding the moment the lease runs out on
//! `CLOCK_BOOTTIME` (nanoseconds; monotonic, shared by every process of
//! the machine and still counting through a suspend).
//!
//! The agent writes it on every renewal (`agent::runtime`). Each shim
//! reads it when the deadline it last read has passed, and on its own
//! tick; once the deadline has passed without a renewal it SIGSTOPs its
//! job. That is what fences a node whose agent is itself stalled (SIGSTOP,
//! a swapped-out or wedged agent) while its jobs, in their own process
//! groups, would keep running: the dispatcher retries them elsewhere only
//! after the lease has surely run out. The agent continues the jobs when
//! a renewal comes (the shim never does). No file: no lease, no fencing
//! (a dispatcher that grants none, or a job started outside an agent).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::time::{ClockId, clock_gettime};

/// Now on `CLOCK_BOOTTIME`, nanoseconds.
pub fn now_ns() -> u64 {
    clock_gettime(ClockId::CLOCK_BOOTTIME)
        .map(|t| {
            (t.tv_sec() as u64)
                .saturating_mul(1_000_000_000)
                .saturating_add(t.tv_nsec() as u64)
        })
        .unwrap_or(0)
}

/// The lease file of one state directory.
#[derive(Clone, Debug)]
pub struct LeaseFile {
    path: PathBuf,
}

impl LeaseFile {
    /// The lease file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Record that the lease runs until `deadline_ns` (`CLOCK_BOOTTIME`),
    /// atomically (write aside, rename: a shim never reads half a number).
    /// Not synced to disk: the lease means nothing after a reboot.
    pub fn write(&self, deadline_ns: u64) -> io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        std::fs::write(&tmp, format!("{deadline_ns}\n"))?;
        std::fs::rename(&tmp, &self.path)
    }

    /// No lease any more: shims stop fencing.
    pub fn clear(&self) -> io::Result<()> {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The deadline, or `None` when there is no lease (no file). A file
    /// that cannot be parsed counts as a lease already run out: a shim
    /// must not keep running on a lease it cannot read.
    pub fn read(&self) -> Option<u64> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Some(text.trim().parse().unwrap_or(0)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(_) => Some(0),
        }
    }

    /// How long until the lease runs out (zero when it has), `None`
    /// without a lease.
    pub fn remaining(&self) -> Option<Duration> {
        self.read()
            .map(|deadline| Duration::from_nanos(deadline.saturating_sub(now_ns())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boottime_moves_forward() {
        let a = now_ns();
        std::thread::sleep(Duration::from_millis(2));
        assert!(now_ns() >= a + 2_000_000);
    }

    #[test]
    fn absent_written_garbled_and_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseFile::new(dir.path().join("lease"));
        assert_eq!(lease.read(), None);
        assert_eq!(lease.remaining(), None);
        let deadline = now_ns() + 5_000_000_000;
        lease.write(deadline).unwrap();
        assert_eq!(lease.read(), Some(deadline));
        assert!(lease.remaining().unwrap() > Duration::from_secs(4));
        lease.write(now_ns() - 1).unwrap();
        assert_eq!(lease.remaining(), Some(Duration::ZERO));
        std::fs::write(lease.path(), "not a number").unwrap();
        assert_eq!(lease.read(), Some(0), "an unreadable lease has run out");
        lease.clear().unwrap();
        lease.clear().unwrap();
        assert_eq!(lease.read(), None);
    }
}
