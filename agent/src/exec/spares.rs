//! Recycled job directories: `<state_dir>/spare/<n>/`.
//!
//! A job directory costs two inodes (the directory and its `record`), and
//! on ext4 allocating them is most of a trivial job's file-system work
//! (`__ext4_new_inode` -> `find_inode_bit` -> `recently_deleted`: about a
//! fifth of the machine's CPU in `e2e-throughput`). A finished job whose
//! exit was reported and whose directory holds nothing but its `record`
//! (no output, no diagnostic) keeps nothing anyone reads: instead of
//! marking it `acked` and leaving it forever, the executor renames the
//! directory into this pool, and the next job's directory is a spare
//! renamed into `jobs/` (its `record` started again by
//! `JobDir::create_record`), so a steady stream of trivial jobs allocates
//! no inode.
//!
//! Crash safety, by the rename's atomicity: a directory is either a job's
//! (in `jobs/`, with that job's record, read by `readopt` as before) or a
//! spare (never read; its old record is overwritten on reuse). A spare
//! renamed to a job's name but not yet given its spec line is a record
//! without `spec`, which `readopt` already skips (as a `mkdir`ed directory
//! before its record). The pool holds at most [`SPARES_MAX`]; spares left
//! by an earlier agent are taken up at start (the extra ones removed).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::libc;

/// Spare directories kept at most (a burst of ends beyond it removes
/// directories as before).
pub(crate) const SPARES_MAX: usize = 1024;

/// The pool of spare job directories.
#[derive(Debug)]
pub(crate) struct Spares {
    dir: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    free: Vec<PathBuf>,
    /// The next spare's name.
    next: u64,
    /// Renames without replacing are refused here (an old kernel or a
    /// file system without them): spares are not used.
    off: bool,
}

impl Spares {
    /// The pool under `state_dir`, taking up the spares already there.
    pub(crate) fn open(state_dir: &Path) -> io::Result<Spares> {
        let dir = state_dir.join("spare");
        fs::create_dir_all(&dir)?;
        let mut free = Vec::new();
        let mut next = 0;
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            let number = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok());
            match number {
                Some(n) if free.len() < SPARES_MAX && entry.file_type()?.is_dir() => {
                    next = next.max(n + 1);
                    free.push(path);
                }
                _ => {
                    let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
                }
            }
        }
        Ok(Spares {
            dir,
            state: Mutex::new(State {
                free,
                next,
                off: false,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is a single push, pop or assignment.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spares in the pool.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.state().free.len()
    }

    /// Make the directory `target` (which must not exist: `AlreadyExists`
    /// otherwise): a spare renamed there, else a new directory. A reused
    /// one may still hold its last job's `record`, which
    /// `JobDir::create_record` starts again.
    pub(crate) fn make(&self, target: &Path) -> io::Result<()> {
        let spare = {
            let mut s = self.state();
            if s.off { None } else { s.free.pop() }
        };
        if let Some(spare) = spare {
            match rename_noreplace(&spare, target) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    self.state().free.push(spare);
                    return Err(e);
                }
                Err(e) => {
                    tracing::info!(error = %e, "job directories are not recycled here");
                    let mut s = self.state();
                    s.off = true;
                    s.free.push(spare);
                }
            }
        }
        fs::create_dir(target)
    }

    /// Take `dir`, a finished job's directory whose exit was consumed,
    /// into the pool if it holds nothing but its `record` and the pool has
    /// room: true if it did (the directory is gone from `jobs/`), false if
    /// the directory stays as it is.
    pub(crate) fn recycle(&self, dir: &Path) -> io::Result<bool> {
        let target = {
            let mut s = self.state();
            if s.off || s.free.len() >= SPARES_MAX {
                return Ok(false);
            }
            s.next += 1;
            self.dir.join((s.next - 1).to_string())
        };
        for entry in fs::read_dir(dir)? {
            if entry?.file_name() != "record" {
                return Ok(false);
            }
        }
        match rename_noreplace(dir, &target) {
            Ok(()) => {
                self.state().free.push(target);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) if is_unsupported(&e) => {
                self.state().off = true;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS))
}

/// `rename(from, to)` that fails with `AlreadyExists` instead of replacing
/// an existing (empty directory) `to`: `renameat2(RENAME_NOREPLACE)`, by
/// its system call so that any libc will do.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    super::renameat2(from, to, libc::RENAME_NOREPLACE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_dir(root: &Path, id: &str, files: &[&str]) -> PathBuf {
        let d = root.join("jobs").join(id);
        fs::create_dir_all(&d).unwrap();
        for f in files {
            fs::write(d.join(f), b"x").unwrap();
        }
        d
    }

    /// A directory with its record alone is recycled and reused (the same
    /// inode), one with output is not, and an existing target is never
    /// replaced.
    #[test]
    fn record_only_directories_are_recycled_and_reused() {
        use std::os::unix::fs::MetadataExt;
        let root = tempfile::tempdir().unwrap();
        let spares = Spares::open(root.path()).unwrap();
        let a = job_dir(root.path(), "a", &["record"]);
        let ino = fs::metadata(&a).unwrap().ino();
        assert!(spares.recycle(&a).unwrap());
        assert!(!a.exists());
        assert_eq!(spares.len(), 1);
        let b = job_dir(root.path(), "b", &["record", "stdout"]);
        assert!(!spares.recycle(&b).unwrap());
        assert!(b.join("stdout").exists());
        // An existing target: AlreadyExists, the spare stays.
        let err = spares.make(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(spares.len(), 1);
        assert_eq!(fs::read(b.join("stdout")).unwrap(), b"x");
        let c = root.path().join("jobs").join("c");
        spares.make(&c).unwrap();
        assert_eq!(fs::metadata(&c).unwrap().ino(), ino);
        assert_eq!(fs::read(c.join("record")).unwrap(), b"x");
        assert_eq!(spares.len(), 0);
        // None left: a new directory.
        let d = root.path().join("jobs").join("d");
        spares.make(&d).unwrap();
        assert!(d.is_dir() && fs::read_dir(&d).unwrap().next().is_none());
    }

    /// A new pool takes up the spares an earlier one left (and removes
    /// what is not a numbered directory); new spares get fresh names.
    #[test]
    fn spares_survive_a_restart() {
        let root = tempfile::tempdir().unwrap();
        let first = Spares::open(root.path()).unwrap();
        for id in ["a", "b"] {
            let d = job_dir(root.path(), id, &["record"]);
            assert!(first.recycle(&d).unwrap());
        }
        fs::write(root.path().join("spare").join("junk"), b"").unwrap();
        drop(first);
        let second = Spares::open(root.path()).unwrap();
        assert_eq!(second.len(), 2);
        assert!(!root.path().join("spare").join("junk").exists());
        let d = job_dir(root.path(), "c", &["record"]);
        assert!(second.recycle(&d).unwrap());
        let mut names: Vec<String> = fs::read_dir(root.path().join("spare"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["0", "1", "2"]);
    }

    /// The pool never holds more than its bound.
    #[test]
    fn the_pool_is_bounded() {
        let root = tempfile::tempdir().unwrap();
        let spares = Spares::open(root.path()).unwrap();
        for i in 0..SPARES_MAX + 3 {
            let d = job_dir(root.path(), &format!("j{i}"), &["record"]);
            let kept = spares.recycle(&d).unwrap();
            assert_eq!(kept, i < SPARES_MAX, "job {i}");
        }
        assert_eq!(spares.len(), SPARES_MAX);
    }
}
