//! Starting a job without copying the supervisor's memory:
//! `clone3(CLONE_VM | CLONE_INTO_CGROUP)` on a stack of its own, the way
//! glibc's `posix_spawn` uses `clone(CLONE_VM | CLONE_VFORK)`.
//!
//! A fork-style clone ([`super::clone3::clone_into_cgroup`]) copies the
//! parent's page tables (`dup_mmap`), write-protects its private pages so
//! that every page the parent writes afterwards takes a copy-on-write
//! fault, and the child's exec then tears the copy down again
//! (`exit_mmap`). In `e2e-throughput` (`perf record -a -g`) these were
//! about 8% of all samples, a sixth of the CPU the whole data path spent
//! per trivial job. A child that shares the parent's memory costs none of
//! that; exec gives it its own.
//!
//! Unlike `posix_spawn`, the parent does not wait for the exec
//! (`CLONE_VFORK`): the supervisor's one thread goes on with the next job
//! while this child waits for its CPU, and learns from the report pipe, as
//! with the fork-style clone, when the exec happened. The child therefore
//! runs *concurrently* with its parent in the same memory, and obeys these
//! rules:
//!
//! - It runs on its own stack (part of [`Hold`]) and reads only the
//!   [`Plan`], which the parent neither changes nor frees until the child
//!   no longer uses the memory: the report pipe closes only once the child
//!   has exec'd (a new memory map) or exited (see [`Hold`]).
//! - It makes system calls with the `syscall` instruction ([`sys`]), never
//!   through libc: libc's wrappers set `errno`, a thread-local of the
//!   parent's thread that the child shares (its TLS register is a copy).
//!   It allocates nothing, takes no lock, and cannot panic (no indexing,
//!   no arithmetic that could overflow).
//! - Signals: the parent blocks all of them around the clone, so the child
//!   starts with every signal blocked; every caught signal goes back to its
//!   default (a handler of the parent's, run in the child, would act on the
//!   parent's memory: tokio's would tell the supervisor it got a SIGTERM
//!   meant for the child) before the child unblocks them: by the kernel in
//!   the clone itself (`CLONE_CLEAR_SIGHAND`, Linux 5.5+), else, where the
//!   kernel refuses that flag, by the child asking for each of the 64
//!   signals, as `posix_spawn` does (about 66 system calls per job).
//!
//! x86_64 only (the clone's return onto the new stack is a few instructions
//! of assembly); elsewhere, and where the kernel refuses it, the executor
//! uses the fork-style clone.

use std::arch::asm;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::libc;

use super::clone3::{CLONE_INTO_CGROUP, ChildEnds, CloneArgs, Cloned, ExecImage, SpawnError};

/// What the child does between the clone and the exec, as data: the same
/// steps, in the same order and under the same names in a failure report,
/// as `shim::child_setup`.
pub(crate) struct ChildPlan {
    /// CPUs to pin to (`sched_setaffinity`).
    pub pin: Option<libc::cpu_set_t>,
    /// `(resource, soft, hard)` rlimits.
    pub limits: Vec<(u32, u64, u64)>,
    /// `(uid, gid)` to switch to (`setgroups`, `setgid`, `setuid`).
    pub ids: Option<(u32, u32)>,
}

/// Everything the child reads, built before the clone and kept, unchanged,
/// until it has exec'd or exited.
struct Plan {
    image: ExecImage,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    setup: ChildPlan,
    /// stdin, stdout, stderr and the report pipe, as numbers in the
    /// child's copy of the descriptor table.
    null: i32,
    out: i32,
    err: i32,
    report: i32,
    /// The kernel reset the caught signals in the clone
    /// (`CLONE_CLEAR_SIGHAND`): the child resets only SIGPIPE.
    handlers_cleared: bool,
}

/// The child's stack, bytes (it calls a few small functions only).
const STACK: usize = 64 * 1024;

/// The memory a child cloned with `CLONE_VM` may still be using: its plan
/// and its stack. [`Hold::release`] frees it, to be called only once the
/// child's report pipe has been read to its end (at that point the child
/// has a new memory map or has exited: the kernel closes its descriptors,
/// and so the pipe, only after it let go of the old map, in exec as in
/// exit). Dropped unreleased (a start abandoned with the child maybe still
/// running), it is leaked rather than freed under the child.
pub(crate) struct Hold(Option<Box<(Plan, Stack)>>);

/// The child's stack: 16-byte aligned, and left uninitialised (only the
/// child writes it, from its top down; zeroing 64 KiB per job was a few
/// percent of the supervisor's time).
type Stack = Box<[std::mem::MaybeUninit<u128>]>;

impl Hold {
    /// Free the memory: the child's report pipe has been read to its end.
    pub(crate) fn release(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(held) = self.0.take() {
            std::mem::forget(held);
        }
    }
}

// Safety: the raw pointers point into the plan's own CStrings, which move
// with it and are never written.
unsafe impl Send for Hold {}

/// Whether this build has the `CLONE_VM` start.
pub(crate) const AVAILABLE: bool = cfg!(target_arch = "x86_64");

/// Start `image` as a child of this process born in the cgroup directory
/// `cgroup`, sharing this process's memory until its exec, with stdin
/// from `/dev/null` and stdout and stderr into new pipes, after `setup`.
/// Returns at once; [`Cloned::report`] says how the exec went (read it to
/// its end, then [`Hold::release`] the returned memory).
pub(crate) fn clone_vm_into_cgroup(
    cgroup: &Path,
    image: ExecImage,
    setup: ChildPlan,
) -> Result<(Cloned, Hold), SpawnError> {
    let ChildEnds {
        cgroup_dir,
        null,
        out: (out_r, out_w),
        err: (err_r, err_w),
        report: (report_r, report_w),
    } = ChildEnds::open(cgroup)?;
    let (argv, envp) = image.pointers();
    let plan = Plan {
        image,
        argv,
        envp,
        setup,
        null: null.as_raw_fd(),
        out: out_w.as_raw_fd(),
        err: err_w.as_raw_fd(),
        report: report_w.as_raw_fd(),
        handlers_cleared: false,
    };
    let mut held = Box::new((plan, Box::<[u128]>::new_uninit_slice(STACK / 16)));
    let stack = held.1.as_mut_ptr();
    let clear = !NO_CLEAR_SIGHAND.load(Ordering::Relaxed);
    held.0.handlers_cleared = clear;
    let mut args = CloneArgs {
        flags: CLONE_VM | CLONE_INTO_CGROUP | if clear { CLONE_CLEAR_SIGHAND } else { 0 },
        exit_signal: libc::SIGCHLD as u64,
        stack: stack as u64,
        stack_size: STACK as u64,
        cgroup: cgroup_dir.as_raw_fd() as u64,
        ..CloneArgs::default()
    };
    let ret = {
        // Every signal blocked from before the clone until the child has
        // reset the handlers (it unblocks them itself) and, here, until
        // the clone has returned.
        let _blocked = BlockSignals::all();
        // Safety: the child runs `child_main` on its own 16-byte aligned
        // stack (the slice of u128 is; the kernel starts it at stack +
        // stack_size) with the plan, both in `held`, which stays alive and
        // unchanged until the report pipe closes (see `Hold`);
        // `child_main` never returns and makes only raw system calls.
        let ret = unsafe { clone3_vm(&mut args, &held.0) };
        if ret == -(libc::EINVAL as isize) && clear {
            // A kernel before 5.5: the child resets the handlers itself,
            // from now on for every job.
            NO_CLEAR_SIGHAND.store(true, Ordering::Relaxed);
            held.0.handlers_cleared = false;
            args.flags &= !CLONE_CLEAR_SIGHAND;
            // Safety: as above.
            unsafe { clone3_vm(&mut args, &held.0) }
        } else {
            ret
        }
    };
    if ret < 0 {
        let errno = Errno::from_raw(i32::try_from(-ret).unwrap_or(libc::EINVAL));
        return Err(SpawnError::Unsupported(errno));
    }
    let pid = i32::try_from(ret).unwrap_or(i32::MAX);
    if let Some(set) = &held.0.setup.pin {
        // The child is queued on whatever CPU the fork balancing chose;
        // moved to its own now, it waits for a CPU once, there, rather
        // than first here and again after its own sched_setaffinity (which
        // stays the step that counts: its failure fails the start). A job
        // cannot have changed its mask yet: it is not past its exec.
        // Safety: `set` is a valid cpu_set_t for the call's size.
        unsafe {
            libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), set);
        }
    }
    // The child has its own copy of the descriptor table: ours go now,
    // before anything else is cloned (no later child holds a write end of
    // this one's pipes).
    drop((out_w, err_w, report_w, null, cgroup_dir));
    Ok((
        Cloned {
            pid,
            stdout: out_r,
            stderr: err_r,
            report: report_r,
        },
        Hold(Some(held)),
    ))
}

const CLONE_VM: u64 = libc::CLONE_VM as u64;

/// `CLONE_CLEAR_SIGHAND` (linux/sched.h): the child's caught signals back
/// to their defaults in the clone (ignored ones stay ignored).
const CLONE_CLEAR_SIGHAND: u64 = 0x1_0000_0000;

/// The kernel refused `CLONE_CLEAR_SIGHAND` once: not asked again.
static NO_CLEAR_SIGHAND: AtomicBool = AtomicBool::new(false);

/// Every signal blocked in this thread while it lives; the mask before is
/// restored on drop.
struct BlockSignals(libc::sigset_t);

impl BlockSignals {
    fn all() -> Self {
        // Safety: sigset_t is plain data; sigfillset and pthread_sigmask
        // write only the sets passed, both valid for the calls.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            Self(old)
        }
    }
}

impl Drop for BlockSignals {
    fn drop(&mut self) {
        // Safety: restores the mask saved by `all`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut());
        }
    }
}

/// `clone3` whose child starts `child_main(plan)` on the stack given in
/// `args`. Returns the child's pid, or `-errno`, in the parent.
///
/// # Safety
/// `args` must name a valid stack, and `plan` must stay valid and
/// unchanged for as long as the child runs in this memory.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_vm(args: &mut CloneArgs, plan: &Plan) -> isize {
    let ret: isize;
    // Safety (of the block): in the parent this is a plain system call
    // (rcx and r11 are clobbered by `syscall`). In the child (rax == 0)
    // every register but rax is the parent's and rsp is the top of the new
    // stack, 16-byte aligned: the call leaves it as the ABI expects at a
    // function's entry, and `child_main` never returns (the `ud2` is never
    // reached).
    unsafe {
        asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "mov rdi, r12",
            "call {entry}",
            "ud2",
            "2:",
            entry = sym child_main,
            inlateout("rax") libc::SYS_clone3 as isize => ret,
            in("rdi") args as *mut CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") plan as *const Plan,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_vm(_args: &mut CloneArgs, _plan: &Plan) -> isize {
    -(libc::ENOSYS as isize)
}

/// A system call without libc: the kernel's result (`-errno` on failure),
/// and no `errno` written (see the module documentation).
///
/// # Safety
/// As for the system call `n` with these arguments.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sys(n: libc::c_long, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    // Safety: the x86_64 system call convention; `syscall` clobbers rcx
    // and r11 and touches no user memory but what the arguments name.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            in("r10") d,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn sys(_n: libc::c_long, _a: usize, _b: usize, _c: usize, _d: usize) -> isize {
    -(libc::ENOSYS as isize)
}

/// The kernel's `struct sigaction` (x86_64: handler, flags, restorer, mask).
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// The child: the plan's steps, then exec; on a failure the failed step's
/// name (already written by `steps`), a NUL and the errno go to the report
/// pipe, and the child exits with 127.
extern "C" fn child_main(plan: *const Plan) -> ! {
    // Safety: `plan` is the parent's, alive and unchanged while this runs
    // (see `clone_vm_into_cgroup`); everything below is raw system calls.
    unsafe {
        let plan = &*plan;
        let errno = steps(plan);
        let bytes = errno.to_ne_bytes();
        sys(
            libc::SYS_write,
            plan.report as usize,
            [0u8].as_ptr() as usize,
            1,
            0,
        );
        sys(
            libc::SYS_write,
            plan.report as usize,
            bytes.as_ptr() as usize,
            bytes.len(),
            0,
        );
        loop {
            sys(libc::SYS_exit_group, 127, 0, 0, 0);
        }
    }
}

/// The steps between clone and exec; returns only with the errno of what
/// failed (a named step has written its name to the report pipe).
///
/// # Safety
/// Only in the child of `clone3_vm`.
unsafe fn steps(p: &Plan) -> i32 {
    let err = |r: isize| i32::try_from(r.unsigned_abs()).unwrap_or(libc::EINVAL);
    let named = |name: &[u8], r: isize| {
        // Safety: writes `name` to the child's report pipe.
        unsafe {
            sys(
                libc::SYS_write,
                p.report as usize,
                name.as_ptr() as usize,
                name.len(),
                0,
            )
        };
        err(r)
    };
    // Safety (of the block): raw system calls on the plan's data and on
    // locals of this frame.
    unsafe {
        // The parent's handlers are not the job's (and would run on the
        // parent's memory): every caught signal back to its default,
        // SIGPIPE too (ignored by Rust), then the job's empty mask.
        // With `CLONE_CLEAR_SIGHAND` only SIGPIPE is left (ignored).
        let mut sig = if p.handlers_cleared {
            libc::SIGPIPE as usize
        } else {
            1usize
        };
        let last = if p.handlers_cleared {
            libc::SIGPIPE as usize
        } else {
            64
        };
        while sig <= last {
            if sig != libc::SIGKILL as usize && sig != libc::SIGSTOP as usize {
                let mut old = KernelSigaction {
                    handler: 0,
                    flags: 0,
                    restorer: 0,
                    mask: 0,
                };
                let got = sys(
                    libc::SYS_rt_sigaction,
                    sig,
                    0,
                    &mut old as *mut KernelSigaction as usize,
                    8,
                );
                let caught =
                    got == 0 && old.handler != libc::SIG_DFL && old.handler != libc::SIG_IGN;
                if caught || sig == libc::SIGPIPE as usize {
                    let dfl = KernelSigaction {
                        handler: libc::SIG_DFL,
                        flags: 0,
                        restorer: 0,
                        mask: 0,
                    };
                    sys(
                        libc::SYS_rt_sigaction,
                        sig,
                        &dfl as *const KernelSigaction as usize,
                        0,
                        8,
                    );
                }
            }
            sig += 1;
        }
        let empty: u64 = 0;
        sys(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK as usize,
            &empty as *const u64 as usize,
            0,
            8,
        );
        for (from, to) in [(p.null, 0usize), (p.out, 1), (p.err, 2)] {
            let r = sys(libc::SYS_dup2, from as usize, to, 0, 0);
            if r < 0 {
                return err(r);
            }
        }
        let r = sys(libc::SYS_chdir, p.image.cwd.as_ptr() as usize, 0, 0, 0);
        if r < 0 {
            return named(b"chdir", r);
        }
        let r = sys(libc::SYS_setsid, 0, 0, 0, 0);
        if r < 0 {
            return named(b"setsid", r);
        }
        if let Some(set) = &p.setup.pin {
            let r = sys(
                libc::SYS_sched_setaffinity,
                0,
                std::mem::size_of::<libc::cpu_set_t>(),
                set as *const libc::cpu_set_t as usize,
                0,
            );
            if r < 0 {
                return named(b"sched_setaffinity", r);
            }
        }
        for &(resource, soft, hard) in &p.setup.limits {
            let lim = [soft, hard];
            let r = sys(
                libc::SYS_prlimit64,
                0,
                resource as usize,
                lim.as_ptr() as usize,
                0,
            );
            if r < 0 {
                return named(b"setrlimit", r);
            }
        }
        if let Some((uid, gid)) = p.setup.ids {
            let groups = [gid];
            let r = sys(libc::SYS_setgroups, 1, groups.as_ptr() as usize, 0, 0);
            if r < 0 {
                return named(b"setgroups", r);
            }
            let r = sys(libc::SYS_setgid, gid as usize, 0, 0, 0);
            if r < 0 {
                return named(b"setgid", r);
            }
            let r = sys(libc::SYS_setuid, uid as usize, 0, 0, 0);
            if r < 0 {
                return named(b"setuid", r);
            }
        }
        // execvp's search, as the fork-style child does.
        let mut denied = false;
        let mut last = libc::ENOENT;
        for path in &p.image.candidates {
            let r = sys(
                libc::SYS_execve,
                path.as_ptr() as usize,
                p.argv.as_ptr() as usize,
                p.envp.as_ptr() as usize,
                0,
            );
            last = err(r);
            match last {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE => {}
                _ => return last,
            }
        }
        if denied { libc::EACCES } else { last }
    }
}

/// A raw `cpu_set_t` holding `cpus` (those beyond its size are left out).
pub(crate) fn raw_cpu_set(cpus: impl IntoIterator<Item = usize>) -> libc::cpu_set_t {
    // Safety: cpu_set_t is plain data, and CPU_SET checks the index
    // against its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for cpu in cpus {
            if cpu < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(cpu, &mut set);
            }
        }
        set
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::io::Read;
    use std::os::fd::OwnedFd;

    fn image(command: &str, args: &[&str]) -> ExecImage {
        let env: BTreeMap<String, String> = [("X".to_string(), "y".to_string())].into();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        ExecImage::new(command, &args, &env, "/usr/bin:/bin", Path::new("/")).unwrap()
    }

    fn scratch_cgroup(name: &str) -> Option<std::path::PathBuf> {
        super::super::clone3::scratch_cgroup("vmclone", name)
    }

    fn read_all(fd: OwnedFd) -> Vec<u8> {
        let mut v = Vec::new();
        let _ = std::fs::File::from(fd).read_to_end(&mut v);
        v
    }

    /// Start, wait for the exec report, reap on failure; the child's
    /// stdout, stderr and status on success.
    fn run(cg: &Path, i: ExecImage, plan: ChildPlan) -> Result<(String, String, i32), SpawnError> {
        let (c, hold) = clone_vm_into_cgroup(cg, i, plan)?;
        let report = read_all(c.report);
        hold.release();
        let pid = nix::unistd::Pid::from_raw(c.pid);
        if let Err(e) = super::super::clone3::exec_report(&report) {
            let _ = nix::sys::wait::waitpid(pid, None);
            return Err(e);
        }
        let out = String::from_utf8_lossy(&read_all(c.stdout)).into_owned();
        let err = String::from_utf8_lossy(&read_all(c.stderr)).into_owned();
        let code = match nix::sys::wait::waitpid(pid, None).unwrap() {
            nix::sys::wait::WaitStatus::Exited(_, code) => code,
            other => panic!("{other:?}"),
        };
        Ok((out, err, code))
    }

    fn plain() -> ChildPlan {
        ChildPlan {
            pin: None,
            limits: Vec::new(),
            ids: None,
        }
    }

    #[test]
    fn born_in_the_cgroup_pinned_with_limits_env_and_output_sharing_no_memory_after_exec() {
        let Some(cg) = scratch_cgroup("born") else {
            eprintln!("no writable cgroup v2 here: skipped");
            return;
        };
        let cpu = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
            .ok()
            .and_then(|set| {
                (0..nix::sched::CpuSet::count()).find(|&c| set.is_set(c).unwrap_or(false))
            })
            .unwrap_or(0);
        let script = "echo $X; cat /proc/self/cgroup; grep -E 'Cpus_allowed_list|SigBlk' /proc/self/status; ulimit -n; echo oops >&2; exit 3";
        let plan = ChildPlan {
            pin: Some(raw_cpu_set([cpu])),
            limits: vec![(libc::RLIMIT_NOFILE, 77, 77)],
            ids: None,
        };
        let r = run(&cg, image("sh", &["-c", script]), plan);
        let _ = std::fs::remove_dir(&cg);
        let (out, err, code) = match r {
            Ok(r) => r,
            Err(SpawnError::Unsupported(e)) => {
                eprintln!("clone3 with CLONE_VM into a cgroup unsupported here ({e}): skipped");
                return;
            }
            Err(e) => panic!("{e:?}"),
        };
        let name = cg.file_name().unwrap().to_str().unwrap();
        assert!(out.starts_with("y\n"), "{out}");
        assert!(out.contains(name), "not born in {name}: {out}");
        assert!(
            out.contains(&format!("Cpus_allowed_list:\t{cpu}\n")),
            "{out}"
        );
        assert!(
            out.contains("SigBlk:\t0000000000000000\n"),
            "signals unblocked: {out}"
        );
        assert!(out.trim_end().ends_with("77"), "{out}");
        assert_eq!((err.as_str(), code), ("oops\n", 3));
    }

    #[test]
    fn failures_name_the_step_and_the_errno() {
        let Some(cg) = scratch_cgroup("fail") else {
            eprintln!("no writable cgroup v2 here: skipped");
            return;
        };
        let missing = run(&cg, image("no-such-command-here", &[]), plain());
        // A soft limit above the hard one: EINVAL from prlimit64.
        let bad_limit = ChildPlan {
            pin: None,
            limits: vec![(libc::RLIMIT_NOFILE, 10, 5)],
            ids: None,
        };
        let limit = run(&cg, image("true", &[]), bad_limit);
        let _ = std::fs::remove_dir(&cg);
        match missing {
            Err(SpawnError::Unsupported(_)) => return,
            Err(SpawnError::Failed { step, errno }) => {
                assert_eq!((step.as_str(), errno), ("", Errno::ENOENT));
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        match limit {
            Err(SpawnError::Failed { step, errno }) => {
                assert_eq!((step.as_str(), errno), ("setrlimit", Errno::EINVAL));
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    /// A handler of the parent's is not run by the child: a SIGUSR2 sent to
    /// the child before its exec is handled by default (it ends the
    /// child), never by the parent's handler, which would set the flag in
    /// the shared memory.
    #[test]
    fn the_parents_handlers_do_not_run_in_the_child() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static HANDLED: AtomicBool = AtomicBool::new(false);
        extern "C" fn on_usr2(_: libc::c_int) {
            HANDLED.store(true, Ordering::SeqCst);
        }
        let Some(cg) = scratch_cgroup("sig") else {
            eprintln!("no writable cgroup v2 here: skipped");
            return;
        };
        // Safety: installs a handler that only stores to an atomic.
        unsafe {
            libc::signal(
                libc::SIGUSR2,
                on_usr2 as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
        // A child that runs long enough to be signalled after its exec too:
        // the signal reaches it at whatever point it has got to.
        let mut ended = Vec::new();
        for _ in 0..20 {
            let r = clone_vm_into_cgroup(&cg, image("sleep", &["5"]), plain());
            let Ok((c, hold)) = r else {
                break;
            };
            let pid = nix::unistd::Pid::from_raw(c.pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR2);
            let _ = read_all(c.report);
            hold.release();
            ended.push(nix::sys::wait::waitpid(pid, None).unwrap());
        }
        // Safety: back to the default disposition.
        unsafe {
            libc::signal(libc::SIGUSR2, libc::SIG_DFL);
        }
        let _ = std::fs::remove_dir(&cg);
        assert!(!HANDLED.load(Ordering::SeqCst), "the parent's handler ran");
        for status in ended {
            assert!(
                matches!(
                    status,
                    nix::sys::wait::WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGUSR2, _)
                ),
                "{status:?}"
            );
        }
    }
}
