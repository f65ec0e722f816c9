//! Starting a job straight into its cgroup: `clone3(CLONE_INTO_CGROUP)`.
//!
//! Entering a cgroup by writing `0` to its `cgroup.procs` between fork and
//! exec migrates the new process, which takes the cgroup core's
//! threadgroup lock for writing: the first such write after a quiet spell
//! waits for an RCU grace period (measured here: 9-16 ms for an isolated
//! job start, 0.02 ms when starts come back to back). A child created by
//! `clone3` with `CLONE_INTO_CGROUP` is born in the cgroup (Linux 5.7) and
//! needs no migration, so a lone job starts without that wait.
//!
//! `std::process::Command` cannot pass clone3 arguments, so this module
//! forks by hand: everything the child needs (argv, envp, the program's
//! candidate paths, cwd, the stdio descriptors) is built before the
//! clone; between clone and exec the child only makes system calls, like
//! a `pre_exec` closure. Where `clone3` or `CLONE_INTO_CGROUP` is not
//! available (an older kernel, a seccomp filter) [`clone_into_cgroup`]
//! says so and the caller falls back to the `cgroup.procs` write.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{OFlag, open};
use nix::libc;
use nix::sys::stat::Mode;

/// What the child needs to exec, built before the clone.
pub(crate) struct ExecImage {
    /// The paths to try, in order (`PATH` search of a bare name).
    pub(super) candidates: Vec<CString>,
    pub(super) argv: Vec<CString>,
    pub(super) envp: Vec<CString>,
    pub(super) cwd: CString,
}

impl ExecImage {
    /// `argv` and `envp` as the NULL-terminated arrays of pointers exec
    /// takes; they point into this image's strings, whose buffers stay put
    /// when the image is moved.
    pub(super) fn pointers(&self) -> (Vec<*const libc::c_char>, Vec<*const libc::c_char>) {
        let terminated = |strings: &[CString]| {
            strings
                .iter()
                .map(|a| a.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        (terminated(&self.argv), terminated(&self.envp))
    }

    /// The image of `command args...` with exactly `env` (whose `PATH`, or
    /// `default_path`, finds a command without a slash) run in `cwd`.
    pub(crate) fn new<'a>(
        command: &str,
        args: &[String],
        env: impl IntoIterator<Item = (&'a String, &'a String)>,
        default_path: &str,
        cwd: &Path,
    ) -> io::Result<Self> {
        let c = |s: &[u8]| {
            CString::new(s).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the command")
            })
        };
        let mut envp = Vec::new();
        let mut path = None;
        for (k, v) in env {
            if k == "PATH" {
                path = Some(v.clone());
            }
            envp.push(c(format!("{k}={v}").as_bytes())?);
        }
        if path.is_none() {
            envp.push(c(format!("PATH={default_path}").as_bytes())?);
        }
        let path = path.unwrap_or_else(|| default_path.to_string());
        let candidates = if command.contains('/') {
            vec![c(command.as_bytes())?]
        } else {
            path.split(':')
                .map(|dir| if dir.is_empty() { "." } else { dir })
                .map(|dir| c(format!("{dir}/{command}").as_bytes()))
                .collect::<io::Result<_>>()?
        };
        let mut argv = vec![c(command.as_bytes())?];
        for a in args {
            argv.push(c(a.as_bytes())?);
        }
        Ok(Self {
            candidates,
            argv,
            envp,
            cwd: c(OsStr::as_bytes(cwd.as_os_str()))?,
        })
    }
}

/// Why [`clone_into_cgroup`] started nothing.
#[derive(Debug)]
pub(crate) enum SpawnError {
    /// `clone3` into a cgroup is not available here (or the cgroup cannot
    /// be opened): nothing was started; use the `cgroup.procs` way.
    Unsupported(Errno),
    /// The child failed at `step` (empty: at exec) with `errno`; it has
    /// been reaped.
    Failed { step: String, errno: Errno },
    /// A pipe or `/dev/null` could not be made.
    Setup(io::Error),
}

/// `struct clone_args` of `clone3(2)` up to `cgroup` (CLONE_ARGS_SIZE_VER2).
#[repr(C)]
#[derive(Default)]
pub(super) struct CloneArgs {
    pub flags: u64,
    pub pidfd: u64,
    pub child_tid: u64,
    pub parent_tid: u64,
    pub exit_signal: u64,
    pub stack: u64,
    pub stack_size: u64,
    pub tls: u64,
    pub set_tid: u64,
    pub set_tid_size: u64,
    pub cgroup: u64,
}

pub(super) const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// A child cloned into its cgroup that may not have exec'd yet: its
/// `report` pipe says how that ended ([`exec_report`] of everything read
/// from it to its end).
pub(crate) struct Cloned {
    pub pid: i32,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    /// Closed by the exec (nothing written) or carrying the failed step.
    pub report: OwnedFd,
}

/// What a child's report pipe held once closed: nothing after a
/// successful exec, else the failed step (empty: the exec itself), a NUL
/// and the errno, and the child has exited (status 127; the caller
/// reaps it).
pub(crate) fn exec_report(report: &[u8]) -> Result<(), SpawnError> {
    if report.is_empty() {
        return Ok(());
    }
    // The last five bytes are the NUL and the errno (the errno may hold
    // NULs itself); anything before them is the step.
    let (step, errno) = match report.len().checked_sub(5) {
        Some(nul) if report[nul] == 0 => {
            let mut e = [0u8; 4];
            e.copy_from_slice(&report[nul + 1..]);
            (
                String::from_utf8_lossy(&report[..nul]).into_owned(),
                Errno::from_raw(i32::from_ne_bytes(e)),
            )
        }
        _ => (
            String::from_utf8_lossy(report).into_owned(),
            Errno::UnknownErrno,
        ),
    };
    Err(SpawnError::Failed { step, errno })
}

/// Start `image` as a child of this process, inside the cgroup directory
/// `cgroup`, stdin from `/dev/null`, stdout and stderr into new pipes (the
/// read ends are returned). Between clone and exec the child resets its
/// signal mask and SIGPIPE, sets up stdio, changes to the image's cwd and
/// runs `setup` (which must only make async-signal-safe system calls and
/// report a failed step on `err_pipe`, as `shim::child_setup` does).
/// This returns once the child is cloned: the caller reads
/// [`Cloned::report`] to its end (the supervisor without blocking its
/// thread, so that one job's exec does not hold up the next job's start)
/// and reaps the child if [`exec_report`] says it failed.
///
/// # Safety
/// `setup` runs in the cloned child of a possibly multi-threaded process:
/// it must not allocate, take locks or touch state shared with other
/// threads.
pub(crate) unsafe fn clone_into_cgroup(
    cgroup: &Path,
    image: &ExecImage,
    setup: &dyn Fn(&OwnedFd) -> io::Result<()>,
) -> Result<Cloned, SpawnError> {
    let ChildEnds {
        cgroup_dir,
        null,
        out: (out_r, out_w),
        err: (err_r, err_w),
        report: (report_r, report_w),
    } = ChildEnds::open(cgroup)?;
    let (argv, envp) = image.pointers();
    let mut args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup_dir.as_raw_fd() as u64,
        ..CloneArgs::default()
    };
    // Safety: clone3 without CLONE_VM and without a stack behaves like
    // fork: the child gets a copy of this thread's stack and returns 0.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &mut args as *mut CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        // The child: system calls only, then exec or _exit.
        let errno = unsafe { child(image, &argv, &envp, null, &out_w, &err_w, &report_w, setup) };
        let bytes = errno.to_ne_bytes();
        unsafe {
            libc::write(report_w.as_raw_fd(), [0u8].as_ptr().cast(), 1);
            libc::write(report_w.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127);
        }
    }
    if pid < 0 {
        return Err(SpawnError::Unsupported(Errno::last()));
    }
    let pid = pid as i32;
    // Closed here before anything else is cloned, so that no later child
    // holds a write end of this one's pipes: the report pipe closes on
    // this child's exec (success, nothing written) or carries the failed
    // step, a NUL and the errno.
    drop((out_w, err_w, report_w, null, cgroup_dir));
    Ok(Cloned {
        pid,
        stdout: out_r,
        stderr: err_r,
        report: report_r,
    })
}

/// The descriptors a child is cloned with, all close-on-exec: its cgroup
/// directory (`CLONE_INTO_CGROUP`), `/dev/null` for its stdin, and three
/// pipes, (read end, write end) each: stdout, stderr and the exec report.
pub(super) struct ChildEnds {
    pub(super) cgroup_dir: OwnedFd,
    pub(super) null: &'static OwnedFd,
    pub(super) out: (OwnedFd, OwnedFd),
    pub(super) err: (OwnedFd, OwnedFd),
    pub(super) report: (OwnedFd, OwnedFd),
}

impl ChildEnds {
    /// Open them for a child born in the cgroup directory `cgroup` (an
    /// unopenable cgroup is `Unsupported`: the caller falls back).
    pub(super) fn open(cgroup: &Path) -> Result<Self, SpawnError> {
        let cgroup_dir = open(
            cgroup,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(SpawnError::Unsupported)?;
        let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| SpawnError::Setup(e.into()));
        let (out, err, report) = (pipe()?, pipe()?, pipe()?);
        let null = dev_null().map_err(|e| SpawnError::Setup(e.into()))?;
        Ok(Self {
            cgroup_dir,
            null,
            out,
            err,
            report,
        })
    }
}

/// `/dev/null` for the children's stdin, opened once per process
/// (`O_CLOEXEC`: a child's `dup2` onto its stdin is what it keeps).
fn dev_null() -> nix::Result<&'static OwnedFd> {
    static NULL: std::sync::OnceLock<OwnedFd> = std::sync::OnceLock::new();
    if let Some(fd) = NULL.get() {
        return Ok(fd);
    }
    let fd = open(
        "/dev/null",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // A racing thread's open wins and ours is closed: either is fine.
    Ok(NULL.get_or_init(|| fd))
}

/// Between clone and exec; returns only with the errno of what failed
/// (a failed `setup` step has written its name to `report` already).
#[allow(clippy::too_many_arguments)]
unsafe fn child(
    image: &ExecImage,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    null: &OwnedFd,
    out: &OwnedFd,
    err: &OwnedFd,
    report: &OwnedFd,
    setup: &dyn Fn(&OwnedFd) -> io::Result<()>,
) -> i32 {
    unsafe {
        // The parent's signal mask and ignored SIGPIPE are not the job's.
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        for (from, to) in [(null, 0), (out, 1), (err, 2)] {
            if libc::dup2(from.as_raw_fd(), to) < 0 {
                return Errno::last_raw();
            }
        }
        if libc::chdir(image.cwd.as_ptr()) < 0 {
            let e = Errno::last_raw();
            libc::write(report.as_raw_fd(), b"chdir".as_ptr().cast(), 5);
            return e;
        }
        if let Err(e) = setup(report) {
            return e.raw_os_error().unwrap_or(libc::EINVAL);
        }
        // execvp's search: skip candidates that are missing (or not
        // directories on the way); report EACCES if one was seen, else the
        // last error.
        let mut denied = false;
        let mut last = libc::ENOENT;
        for path in &image.candidates {
            libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            last = Errno::last_raw();
            match last {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE => {}
                _ => return last,
            }
        }
        if denied { libc::EACCES } else { last }
    }
}

/// A pipe's read end, read to its end (for tests).
#[cfg(test)]
fn read_all(fd: OwnedFd) -> String {
    use std::io::Read;
    let mut s = String::new();
    let _ = std::fs::File::from(fd).read_to_string(&mut s);
    s
}

/// A cgroup v2 directory `<test>-test-<pid>-<name>` under this process's
/// own, or None where the machine has none writable (the test then checks
/// nothing it cannot). For the tests of both clone starts.
#[cfg(test)]
pub(super) fn scratch_cgroup(test: &str, name: &str) -> Option<std::path::PathBuf> {
    let (mount, own) = (
        super::cgroup::cgroup2_mount()?,
        super::cgroup::own_cgroup()?,
    );
    let dir = mount
        .join(own.strip_prefix("/").unwrap_or(&own))
        .join(format!("{test}-test-{}-{name}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    Some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::fs::File;
    use std::io::Read;

    fn image(command: &str, args: &[&str]) -> ExecImage {
        let env: BTreeMap<String, String> = [("X".to_string(), "y".to_string())].into();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        ExecImage::new(command, &args, &env, "/usr/bin:/bin", Path::new("/")).unwrap()
    }

    #[test]
    fn a_bare_name_is_searched_on_the_path_and_env_gets_a_default_path() {
        let i = image("sh", &["-c", "true"]);
        let c: Vec<_> = i.candidates.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(c, ["/usr/bin/sh", "/bin/sh"]);
        let e: Vec<_> = i.envp.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(e, ["X=y", "PATH=/usr/bin:/bin"]);
        let i = image("./run.sh", &[]);
        assert_eq!(i.candidates.len(), 1);
        assert!(ExecImage::new("a\0b", &[], &BTreeMap::new(), "/bin", Path::new("/")).is_err());
    }

    fn scratch_cgroup(name: &str) -> Option<std::path::PathBuf> {
        super::scratch_cgroup("clone3", name)
    }

    /// A child started and its exec waited for, as `shim::start_job` does.
    struct Spawned {
        pid: i32,
        stdout: OwnedFd,
        stderr: OwnedFd,
    }

    unsafe fn spawn_into_cgroup(
        cgroup: &Path,
        image: &ExecImage,
        setup: &dyn Fn(&OwnedFd) -> io::Result<()>,
    ) -> Result<Spawned, SpawnError> {
        let c = unsafe { clone_into_cgroup(cgroup, image, setup) }?;
        let mut report = Vec::new();
        let _ = File::from(c.report).read_to_end(&mut report);
        match exec_report(&report) {
            Ok(()) => Ok(Spawned {
                pid: c.pid,
                stdout: c.stdout,
                stderr: c.stderr,
            }),
            Err(e) => {
                let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(c.pid), None);
                Err(e)
            }
        }
    }

    #[test]
    fn the_child_is_born_in_the_cgroup_with_its_env_and_output() {
        let Some(cg) = scratch_cgroup("born") else {
            eprintln!("no writable cgroup v2 here: skipped");
            return;
        };
        let i = image(
            "sh",
            &["-c", "echo $X; cat /proc/self/cgroup; echo oops >&2"],
        );
        let setup = |_: &OwnedFd| Ok(());
        let r = unsafe { spawn_into_cgroup(&cg, &i, &setup) };
        let s = match r {
            Ok(s) => s,
            Err(SpawnError::Unsupported(e)) => {
                eprintln!("clone3 into a cgroup unsupported here ({e}): skipped");
                let _ = std::fs::remove_dir(&cg);
                return;
            }
            Err(e) => panic!("{e:?}"),
        };
        let out = read_all(s.stdout);
        let err = read_all(s.stderr);
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(s.pid), None).unwrap();
        let _ = std::fs::remove_dir(&cg);
        assert_eq!(
            status,
            nix::sys::wait::WaitStatus::Exited(nix::unistd::Pid::from_raw(s.pid), 0)
        );
        let name = cg.file_name().unwrap().to_str().unwrap();
        assert!(out.starts_with("y\n"), "{out}");
        assert!(out.contains(name), "not born in {name}: {out}");
        assert_eq!(err, "oops\n");
    }

    #[test]
    fn failures_name_the_step_and_the_errno() {
        let Some(cg) = scratch_cgroup("fail") else {
            eprintln!("no writable cgroup v2 here: skipped");
            return;
        };
        let missing = image("no-such-command-here", &[]);
        let ok = |_: &OwnedFd| Ok(());
        let r = unsafe { spawn_into_cgroup(&cg, &missing, &ok) };
        if let Err(SpawnError::Unsupported(_)) = r {
            let _ = std::fs::remove_dir(&cg);
            return;
        }
        match r {
            Err(SpawnError::Failed { step, errno }) => {
                assert_eq!(step, "");
                assert_eq!(errno, Errno::ENOENT);
            }
            other => panic!("{:?}", other.map(|s| s.pid)),
        }
        let refuse = |report: &OwnedFd| {
            let _ = nix::unistd::write(report, b"setrlimit");
            Err(io::Error::from_raw_os_error(libc::EPERM))
        };
        let r = unsafe { spawn_into_cgroup(&cg, &image("true", &[]), &refuse) };
        let _ = std::fs::remove_dir(&cg);
        match r {
            Err(SpawnError::Failed { step, errno }) => {
                assert_eq!(step, "setrlimit");
                assert_eq!(errno, Errno::EPERM);
            }
            other => panic!("{:?}", other.map(|s| s.pid)),
        }
    }
}
