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
//! a renewal comes (the shim never does). The supervisor's jobs share
//! their last read ([`LeaseFile::sharing`]): a job reads the file only
//! once the latest deadline any of them read has passed. No file: no
//! lease, no fencing
//! (a dispatcher that grants none, or a job started outside an agent).

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::libc;
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

/// Swap the names `a` and `b` (both must exist).
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    super::renameat2(a, b, libc::RENAME_EXCHANGE)
}

/// The lease file of one state directory.
#[derive(Clone, Debug)]
pub struct LeaseFile {
    path: PathBuf,
    /// The latest deadline read, shared by the jobs of one supervisor
    /// ([`LeaseFile::sharing`]); 0 when none is known.
    seen: Option<Arc<AtomicU64>>,
}

impl LeaseFile {
    /// The lease file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            seen: None,
        }
    }

    /// The same file, read through `seen`, the latest deadline read by any
    /// holder of the same `seen`: [`LeaseFile::deadline`] reads the file
    /// only once that one has passed. A supervisor's jobs share one, so a
    /// job's start does not read the file again (each job read it on
    /// every turn of its loop). A renewal only moves the deadline on, so
    /// one read before it fences no later than the file says; that is
    /// what a shim's own cache of its last read already does.
    pub fn sharing(self, seen: Arc<AtomicU64>) -> Self {
        Self {
            seen: Some(seen),
            ..self
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Record that the lease runs until `deadline_ns` (`CLOCK_BOOTTIME`),
    /// atomically (write aside, swap in: a shim never reads half a
    /// number). Not synced to disk: the lease means nothing after a
    /// reboot.
    ///
    /// The new file is swapped with the old one (`renameat2`
    /// `RENAME_EXCHANGE`), which is then removed, rather than renamed
    /// over it: ext4 (its default `auto_da_alloc`) takes a rename over an
    /// existing file for a file being replaced and writes the new one back
    /// at once, a block write on the agent's loop at every renewal (0.65
    /// ms at the median, 6 ms at p90 on this machine's disk, up to 14 ms).
    /// Where the exchange is refused (another file system, an old kernel)
    /// the rename over it is used.
    pub fn write(&self, deadline_ns: u64) -> io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        // A new file, never one truncated (which ext4 would flush too).
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::File::create_new(&tmp)?.write_all(format!("{deadline_ns}\n").as_bytes())?;
        match exchange(&tmp, &self.path) {
            // `tmp` is the old lease now.
            Ok(()) => std::fs::remove_file(&tmp),
            Err(_) => std::fs::rename(&tmp, &self.path),
        }
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
        let deadline = self.read_file();
        if let Some(seen) = &self.seen {
            seen.store(deadline.unwrap_or(0), Ordering::Relaxed);
        }
        deadline
    }

    /// The deadline as [`LeaseFile::read`] says, except that while the
    /// latest deadline read through the shared `seen` has not passed, that
    /// one, without a read.
    pub fn deadline(&self) -> Option<u64> {
        if let Some(seen) = &self.seen {
            let d = seen.load(Ordering::Relaxed);
            if d > now_ns() {
                return Some(d);
            }
        }
        self.read()
    }

    fn read_file(&self) -> Option<u64> {
        match super::read_line_file(&self.path) {
            Ok(bytes) => Some(
                std::str::from_utf8(&bytes)
                    .ok()
                    .and_then(|text| text.trim().parse().ok())
                    .unwrap_or(0),
            ),
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

    /// Through a shared `seen`, a deadline still ahead is answered without
    /// a read (the file changed behind it is not seen); once it has passed
    /// the file is read again, and a fresh `read` always goes to the file
    /// and updates what the other holders see.
    #[test]
    fn a_shared_deadline_is_read_again_only_once_it_has_passed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lease");
        let seen = Arc::new(AtomicU64::new(0));
        let a = LeaseFile::new(&path).sharing(Arc::clone(&seen));
        let b = LeaseFile::new(&path).sharing(Arc::clone(&seen));
        assert_eq!(a.deadline(), None, "no file, no lease");
        let far = now_ns() + 3_600_000_000_000;
        a.write(far).unwrap();
        assert_eq!(a.deadline(), Some(far));
        std::fs::write(&path, "7\n").unwrap();
        assert_eq!(
            b.deadline(),
            Some(far),
            "a deadline ahead is not read again"
        );
        assert_eq!(LeaseFile::new(&path).deadline(), Some(7), "unshared reads");
        assert_eq!(b.read(), Some(7), "a fresh read goes to the file");
        assert_eq!(a.deadline(), Some(7), "and the passed one is read again");
        std::fs::write(&path, "not a number\n").unwrap();
        assert_eq!(a.deadline(), Some(0), "unreadable: run out");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(b.deadline(), None);
        assert_eq!(seen.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn boottime_moves_forward() {
        let a = now_ns();
        std::thread::sleep(Duration::from_millis(2));
        assert!(now_ns() >= a + 2_000_000);
    }

    /// A renewal leaves the lease's page dirty in the page cache, not
    /// written back at once (ext4 flushed the file renamed over the old
    /// one), and leaves no temporary file behind.
    #[test]
    fn a_renewal_is_not_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let lease = LeaseFile::new(dir.path().join("lease"));
        lease.write(1).unwrap();
        if crate::exec::page_states(lease.path()).is_none_or(|(dirty, _)| dirty == 0) {
            eprintln!("no dirty pages to see here (tmpfs, or no cachestat(2)): not checked");
            return;
        }
        for deadline in 2..22 {
            lease.write(deadline).unwrap();
            assert_eq!(lease.read(), Some(deadline));
            let (dirty, writeback) = crate::exec::page_states(lease.path()).unwrap_or_default();
            assert!(
                dirty > 0 && writeback == 0,
                "renewal {deadline}: written back at once (dirty {dirty}, writeback {writeback})"
            );
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["lease"]);
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
