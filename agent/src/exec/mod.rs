//! The process executor: runs the jobs the local scheduler places, for
//! real, pinned on the CPUs it chose.
//!
//! A job runs under its own **shim** (`agent shim --job-dir DIR`, see
//! [`shim`]), or, with [`Launcher::Supervisor`] and a cgroup for the job,
//! as a direct child of the agent's one [`supervisor`] process (one
//! process per job instead of two, same guarantees). The shim is
//! containerd-style: the shim is the job's parent, a child
//! subreaper in its own session; it owns the job's pipes, limits, timeout
//! and exit status, and writes everything a restarted agent needs into the
//! job directory. The agent side, [`Executor`], is a thin tokio-friendly
//! controller over those directories and process groups, so an agent
//! restart loses nothing: [`Executor::readopt`] re-attaches to running
//! shims and reports the exits that happened meanwhile.
//!
//! What the scheduler calls: [`Executor::spawn`] with a [`JobExec`];
//! [`Executor::stop`] / [`Executor::cont`] (SIGSTOP/SIGCONT of the whole
//! job, for time slicing); [`Executor::repin`] (every thread of every
//! process, for migrations and steals); [`Executor::cancel`];
//! [`Executor::status`]; the exit channel from [`Executor::take_exits`]
//! ([`JobExit`] with a [`JobOutcome`]); [`Executor::shutdown`].
//!
//! Module map (each file owns one thing):
//! - `executor.rs`: the [`Executor`] API, job tracking, exit delivery,
//!   re-adoption, shutdown.
//! - [`shim`]: the per-job supervisor process.
//! - [`supervisor`]: the per-agent supervisor process, which runs every
//!   job that has a cgroup as one process (no shim of its own), chosen by
//!   [`Launcher`].
//! - `spec.rs`: [`JobExec`], [`JobExit`], [`JobOutcome`], [`Rlimit`], the
//!   on-disk `spec` / `cancel` forms, validation.
//! - `jobdir.rs`: the job directory's layout (one
//!   append-only `record`: spec, shim and job pids, exit, ack) and its writes.
//! - `spares.rs`: recycled job directories (a finished job's directory
//!   that holds only its record becomes the next job's: no inode
//!   allocated per trivial job).
//! - `group.rs`: a job's processes and threads; signalling and pinning all
//!   of them.
//! - [`procfs`]: reading `/proc` (stat, process groups, threads, shim
//!   identity).
//! - `logcap.rs`: the size-capped stdout/stderr files.
//! - [`cgroup`]: cgroup v2 per job, the only code that writes under
//!   `/sys/fs/cgroup`.
//! - [`usermap`]: which local uid:gid runs which owner's jobs.
//! - `clone3.rs`, `vmclone.rs`: a job born in its cgroup
//!   (`clone3(CLONE_INTO_CGROUP)`), fork-style or sharing the parent's
//!   memory until its exec (`CLONE_VM`, x86_64).
//! - `error.rs`: [`ExecError`].

pub mod cgroup;
mod clone3;
pub mod devices;
mod error;
mod executor;
mod group;
mod jobdir;
pub mod lease;
mod logcap;
pub mod procfs;
pub mod shim;
mod spares;
mod spec;
pub mod supervisor;
pub mod usermap;
mod vmclone;

pub use cgroup::CgroupSupport;
pub use error::{ExecError, Result};
pub use executor::{
    ExecConfig, Executor, JobHandle, JobState, JobStatus, Launcher, ReadoptReport, ShutdownMode,
};
pub use spec::{
    DEFAULT_KILL_GRACE, DEFAULT_PATH, JobExec, JobExit, JobOutcome, RLIM_INFINITY, Rlimit,
    RlimitResource,
};
pub use usermap::{UserMap, UserMapError};

use std::path::Path;

/// `renameat2(2)` of `from` to `to` with `flags` (`RENAME_NOREPLACE`,
/// `RENAME_EXCHANGE`), both paths relative to the working directory.
pub(crate) fn renameat2(from: &Path, to: &Path, flags: nix::libc::c_uint) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in a path")
        })
    };
    let (from, to) = (c(from)?, c(to)?);
    // Safety: two valid C strings; the call reads them only.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_renameat2,
            nix::libc::AT_FDCWD,
            from.as_ptr(),
            nix::libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Read a one-line file whole (`/proc/PID/stat`, the lease), with one
/// `read(2)` where one is enough: a read that leaves room in the buffer
/// and ends in a newline is the whole line, which these files produce or
/// are written in one piece. `std::fs::read` also asks for the size
/// (`statx`, which procfs answers with 0) and reads until a read returns
/// nothing: three more system calls, paid per job by the supervisor.
pub(crate) fn read_line_file(path: &Path) -> std::io::Result<Vec<u8>> {
    read_to_end_plain(&mut std::fs::File::open(path)?, 1024, true)
}

/// The rest of `file`, read into a buffer of `first` bytes (doubled when
/// full) without `File::read_to_end`'s size query (a `statx`, and an
/// `lseek` for the position). Until a read returns nothing, or, with
/// `line_ends`, until a read leaves room and ends in a newline (see
/// [`read_line_file`]).
pub(crate) fn read_to_end_plain(
    file: &mut std::fs::File,
    first: usize,
    line_ends: bool,
) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut buf = vec![0u8; first.max(1)];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        let n = match file.read(&mut buf[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        len += n;
        if n == 0 || (line_ends && len < buf.len() && buf[len - 1] == b'\n') {
            buf.truncate(len);
            return Ok(buf);
        }
    }
}

/// Dirty and under-writeback pages of `path` (the `cachestat` system
/// call, Linux 6.5+), or `None` where the kernel has no such call.
#[cfg(test)]
pub(crate) fn page_states(path: &Path) -> Option<(u64, u64)> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    #[allow(dead_code)] // the kernel's layout, not all of it read
    struct Stat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    use nix::libc;
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = std::fs::File::open(path).unwrap();
    let range = Range { off: 0, len: 0 };
    let mut st = Stat::default();
    // Safety: a valid fd and two valid structs of the kernel's layout.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            &range as *const Range,
            &mut st as *mut Stat,
            0,
        )
    };
    (r == 0 && st.cache > 0).then_some((st.dirty, st.writeback))
}

#[cfg(test)]
mod tests {
    /// One line in one read, longer files and files without a final
    /// newline whole, as `std::fs::read` gives them.
    #[test]
    fn read_line_file_reads_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let long: String = (0..3000).map(|i| format!("{i}\n")).collect();
        for text in ["", "1\n", "no newline", "a\nb\n", long.as_str()] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(super::read_line_file(&path).unwrap(), text.as_bytes());
        }
        let stat = super::read_line_file(std::path::Path::new("/proc/self/stat")).unwrap();
        assert_eq!(stat, std::fs::read("/proc/self/stat").unwrap());
        assert!(super::read_line_file(&dir.path().join("none")).is_err());
    }
}
