//! cgroup v2, where the agent may use it. **The only code that writes
//! under `/sys/fs/cgroup`** (or wherever the cgroup2 hierarchy is mounted).
//!
//! With a configured root (e.g. `/sys/fs/cgroup/dispatch`) that is a
//! writable cgroup2 directory, [`CgroupSupport::probe`] enables the
//! `cpuset` and `memory` controllers for the root's children (writing
//! `+cpuset +memory` to its `cgroup.subtree_control`, as far as its own
//! `cgroup.controllers` offers them) and each job gets `<root>/job-<id>`:
//! `cpuset.cpus` follows the job's CPUs (also on re-pin) and `memory.max`
//! its limit. The job's process enters its cgroup itself, between fork and
//! exec (the shim opens `cgroup.procs` before forking; the child writes
//! `0`), so nothing it forks can escape. The shim stays outside, in the
//! agent's cgroup: an OOM kill, `cgroup.kill` or a freeze of the job's
//! cgroup never takes down the process that records the exit.
//!
//! Even without controllers, a job cgroup tracks every process of the job
//! (also those that leave its process group with `setsid`): `cgroup.threads`
//! is used for re-pinning, `cgroup.procs` for signals and `cgroup.kill` to
//! kill everything. When something is missing (no root configured, not
//! cgroup2, not writable, a controller not offered) the executor logs the
//! reason with `tracing::warn!` and carries on; no job ever fails for lack
//! of cgroups.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::devices::{self, DenyList};
use super::error::{ExecError, Result};
use crate::topology::format_cpulist;

/// What the configured cgroup root offers to job cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupSupport {
    /// The root; job cgroups are `<root>/job-<id>`.
    pub root: PathBuf,
    /// `cpuset` is enabled for the root's children: `cpuset.cpus` is set.
    pub cpuset: bool,
    /// `memory` is enabled for the root's children: `memory.max` is set.
    pub memory: bool,
    /// BPF device programs can be loaded: a job's cgroup gets its device
    /// rules (see `devices.rs`).
    pub devices: bool,
}

impl CgroupSupport {
    /// Check `root` (creating it if its parent is a cgroup2 directory),
    /// enable what it can, and say why anything is missing. `Err` carries
    /// the reason cgroups cannot be used at all.
    pub fn probe(root: &Path) -> std::result::Result<CgroupSupport, String> {
        if !root.join("cgroup.procs").exists() {
            let parent_is_cgroup2 = root
                .parent()
                .is_some_and(|p| p.join("cgroup.controllers").exists());
            if !parent_is_cgroup2 {
                return Err(format!(
                    "{} is not a cgroup v2 directory and its parent is not one either",
                    root.display()
                ));
            }
            fs::create_dir(root)
                .or_else(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| format!("mkdir {}: {e}", root.display()))?;
        }
        let controllers = root.join("cgroup.controllers");
        let available = fs::read_to_string(&controllers).map_err(|e| {
            format!(
                "{}: {e} (not a cgroup v2 directory; on a hybrid v1/v2 host the v2 tree is often /sys/fs/cgroup/unified)",
                controllers.display()
            )
        })?;
        let procs = root.join("cgroup.procs");
        OpenOptions::new()
            .write(true)
            .open(&procs)
            .map_err(|e| format!("{}: not writable: {e}", procs.display()))?;
        let available: Vec<&str> = available.split_whitespace().collect();
        let subtree = root.join("cgroup.subtree_control");
        let enabled = |subtree: &Path| -> Vec<String> {
            fs::read_to_string(subtree)
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        };
        let before = enabled(&subtree);
        for want in ["cpuset", "memory"] {
            if before.iter().any(|c| c == want) {
                continue;
            }
            if !available.contains(&want) {
                tracing::warn!(
                    root = %root.display(),
                    controller = want,
                    available = %available.join(" "),
                    "cgroup controller not offered to this cgroup root (enable it in the parent's cgroup.subtree_control); {}",
                    missing_effect(want)
                );
                continue;
            }
            if let Err(e) = write_file(&subtree, &format!("+{want}")) {
                tracing::warn!(
                    root = %root.display(),
                    controller = want,
                    error = %e,
                    "could not enable the cgroup controller for job cgroups; {}",
                    missing_effect(want)
                );
            }
        }
        let after = enabled(&subtree);
        Ok(CgroupSupport {
            root: root.to_owned(),
            cpuset: after.iter().any(|c| c == "cpuset"),
            memory: after.iter().any(|c| c == "memory"),
            devices: match super::devices::probe() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "GPUs are not confined to the jobs holding them: no BPF device programs");
                    false
                }
            },
        })
    }

    /// The cgroup of job `id`.
    pub fn job_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("job-{id}"))
    }

    /// Create the job's cgroup and write its limits.
    pub(crate) fn create_job(
        &self,
        id: &str,
        cpus: &[u32],
        memory_max: Option<u64>,
        deny_devices: &DenyList,
    ) -> Result<PathBuf> {
        let path = self.job_path(id);
        match fs::create_dir(&path) {
            Ok(()) => {}
            // Left over from a job that never started: reuse it if empty.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ExecError::io("mkdir cgroup", &path, e)),
        }
        let result = (|| {
            self.write_limits(&path, id, &Limits::FRESH, cpus, memory_max)?;
            if !deny_devices.is_empty() {
                if !self.devices {
                    tracing::warn!(
                        job = id,
                        "GPUs not held by the job are not denied to it: no BPF device programs"
                    );
                } else if let Err(e) = devices::attach(&path, deny_devices) {
                    // As for the controllers: said, and the job runs.
                    tracing::warn!(job = id, error = %e, "GPUs not held by the job are not denied to it");
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            let _ = fs::remove_dir(&path);
            return Err(e);
        }
        Ok(path)
    }

    /// Write the limits of job `id` into `path`, whose current limits are
    /// `now` (as the agent wrote them; [`Limits::FRESH`] for a new
    /// cgroup): exactly the writes [`Limits::writes`] says, and the
    /// warnings for what this root cannot enforce.
    fn write_limits(
        &self,
        path: &Path,
        id: &str,
        now: &Limits,
        cpus: &[u32],
        memory_max: Option<u64>,
    ) -> Result<Limits> {
        if memory_max.is_some() && !self.memory {
            tracing::warn!(
                job = id,
                root = %self.root.display(),
                "memory_max not enforced: the memory controller is not enabled for job cgroups"
            );
        }
        let want = self.limits_for(cpus, memory_max);
        for write in now.writes(&want) {
            match write {
                LimitWrite::Cpus(cpus) => set_cpus(path, cpus)?,
                LimitWrite::MemoryMax(bytes) => write_file(
                    &path.join("memory.max"),
                    &bytes.map_or_else(|| "max".to_owned(), |b| b.to_string()),
                )?,
            }
        }
        Ok(want)
    }

    /// The limits a job of `cpus` and `memory_max` gets here (only those
    /// of the enabled controllers).
    fn limits_for(&self, cpus: &[u32], memory_max: Option<u64>) -> Limits {
        Limits {
            cpus: self.cpuset.then(|| cpus.to_vec()),
            memory_max: memory_max.filter(|_| self.memory),
        }
    }
}

/// What the agent has written into a job cgroup: `cpuset.cpus` (`None`:
/// never written, the parent's CPUs) and `memory.max` (`None`: `max`,
/// the kernel's default). A cgroup taken from the [`CgroupPool`] carries
/// its last job's; [`Limits::writes`] turns them into the new job's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Limits {
    pub cpus: Option<Vec<u32>>,
    pub memory_max: Option<u64>,
}

/// One interface file write of [`Limits::writes`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum LimitWrite<'a> {
    Cpus(&'a [u32]),
    MemoryMax(Option<u64>),
}

impl Limits {
    /// A new cgroup: nothing written.
    pub const FRESH: Limits = Limits {
        cpus: None,
        memory_max: None,
    };

    /// The writes that turn a cgroup with these limits into one with
    /// `want`'s, none that changes nothing. `cpuset.cpus` cannot be set
    /// back to "never written", so `want.cpus == None` (no cpuset
    /// controller) writes nothing: such a root never has a written one.
    fn writes<'a>(&self, want: &'a Limits) -> Vec<LimitWrite<'a>> {
        let mut out = Vec::new();
        if let Some(cpus) = &want.cpus
            && self.cpus.as_ref() != Some(cpus)
        {
            out.push(LimitWrite::Cpus(cpus));
        }
        if self.memory_max != want.memory_max {
            out.push(LimitWrite::MemoryMax(want.memory_max));
        }
        out
    }
}

/// Empty job cgroups kept for the next jobs: `<root>/slot-<n>`.
///
/// A job cgroup's `mkdir` and `rmdir` were the largest items of the
/// agent's own CPU per trivial job (the kernel allocates and, after an
/// RCU grace period, frees the cgroup's state on every one). cgroup v2
/// cannot rename a cgroup, so a pooled one keeps a neutral name and a job
/// that gets one runs in `slot-<n>` (its `JobStatus` and the `spec` of
/// its `record` name it) instead of `job-<id>`.
///
/// A cgroup comes back to the pool only when nothing can have changed it
/// behind the agent, and never after a `cgroup.kill` (by the supervisor,
/// the shim or the agent: `JobExit::cgroup_killed`, [`take_killed`]): on
/// this machine's kernel (6.18) every later `clone3(CLONE_INTO_CGROUP)`
/// child of a cgroup once killed is SIGKILLed at birth. Otherwise only
/// when no BPF device program was attached to it (only jobs
/// with an empty deny list get a slot), the job ran as a user who cannot
/// write the cgroup's files (not root, not the agent's own user: the
/// executor decides, `Executor::start`), so its limits are those the
/// agent wrote, remembered as [`Limits`] and rewritten for the next job
/// where they differ; and it is empty (`cgroup.events` says
/// `populated 0`: no process and no thread of the job, nor of anything
/// it forked, is left; nothing can enter it afterwards, since only the
/// agent may write its `cgroup.procs`). Anything else is removed as
/// before. Slots are never written to disk as such: after an agent
/// restart the empty `slot-*` left by the earlier agent are removed (those
/// still populated belong to re-adopted jobs and are removed when those
/// end).
#[derive(Debug)]
pub(crate) struct CgroupPool {
    state: std::sync::Mutex<PoolState>,
}

#[derive(Debug)]
struct PoolState {
    free: Vec<(PathBuf, Limits)>,
    /// The next slot's number.
    next: u64,
    /// After `close`: slots given back are removed.
    closed: bool,
}

/// Free slots kept at most (more ends at once are removed).
pub(crate) const POOL_MAX: usize = 256;

impl CgroupPool {
    /// The pool of `support`'s root, removing the empty slots an earlier
    /// agent left.
    pub(crate) fn open(support: &CgroupSupport) -> CgroupPool {
        let mut next = 0;
        if let Ok(entries) = fs::read_dir(&support.root) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(n) = name
                    .to_str()
                    .and_then(|s| s.strip_prefix("slot-"))
                    .and_then(|s| s.parse::<u64>().ok())
                else {
                    continue;
                };
                next = next.max(n + 1);
                // Busy: a re-adopted job's, removed when it ends.
                let _ = fs::remove_dir(entry.path());
            }
        }
        CgroupPool {
            state: std::sync::Mutex::new(PoolState {
                free: Vec::new(),
                next,
                closed: false,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // Every update is a single push, pop or assignment.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Free slots.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.state().free.len()
    }

    /// A cgroup for job `id` with its limits: a free slot (one whose CPUs
    /// are already the job's if there is one), else a new one. Returns its
    /// path and its limits, to give back with [`CgroupPool::keep`].
    pub(crate) fn take(
        &self,
        support: &CgroupSupport,
        id: &str,
        cpus: &[u32],
        memory_max: Option<u64>,
    ) -> Result<(PathBuf, Limits)> {
        let want_cpus = support.cpuset.then_some(cpus);
        let reused = {
            let mut s = self.state();
            let same = s
                .free
                .iter()
                .rposition(|(_, l)| l.cpus.as_deref() == want_cpus);
            match same {
                Some(i) => Some(s.free.swap_remove(i)),
                None => s.free.pop(),
            }
        };
        let (path, now) = match reused {
            Some(slot) => slot,
            None => (self.make(support)?, Limits::FRESH),
        };
        match support.write_limits(&path, id, &now, cpus, memory_max) {
            Ok(limits) => Ok((path, limits)),
            Err(e) => {
                let _ = fs::remove_dir(&path);
                Err(e)
            }
        }
    }

    /// `mkdir` a new slot.
    fn make(&self, support: &CgroupSupport) -> Result<PathBuf> {
        loop {
            let path = {
                let mut s = self.state();
                s.next += 1;
                support.root.join(format!("slot-{}", s.next - 1))
            };
            match fs::create_dir(&path) {
                Ok(()) => return Ok(path),
                // A busy slot of an earlier agent's: the next number.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(ExecError::io("mkdir cgroup", &path, e)),
            }
        }
    }

    /// A pooled job's cgroup after the job: kept for a later job if it is
    /// empty and the pool has room (true); false: the caller removes it
    /// ([`remove`], killing stragglers) as a job's own cgroup.
    pub(crate) fn keep(&self, path: &Path, limits: Limits) -> bool {
        if !is_unpopulated(path) {
            return false;
        }
        let mut s = self.state();
        if s.closed || s.free.len() >= POOL_MAX {
            return false;
        }
        s.free.push((path.to_owned(), limits));
        true
    }

    /// Remove every free slot; later ones given back are removed too
    /// (agent shutdown, so that the root can go once empty).
    pub(crate) fn close(&self) {
        let free = {
            let mut s = self.state();
            s.closed = true;
            std::mem::take(&mut s.free)
        };
        for (path, _) in free {
            if let Err(e) = fs::remove_dir(&path) {
                tracing::warn!(cgroup = %path.display(), error = %e, "could not remove a spare job cgroup");
            }
        }
    }
}

/// Whether `cgroup.events` says `populated 0`: no process in the cgroup
/// or below it. Unreadable counts as populated.
fn is_unpopulated(cgroup: &Path) -> bool {
    // The file is two short lines (`populated N`, `frozen N`): one read.
    let mut buf = [0u8; 128];
    File::open(cgroup.join("cgroup.events"))
        .and_then(|mut f| io::Read::read(&mut f, &mut buf))
        .is_ok_and(|n| buf[..n].split(|&b| b == b'\n').any(|l| l == b"populated 0"))
}

fn missing_effect(controller: &str) -> &'static str {
    if controller == "cpuset" {
        "jobs are confined by sched_setaffinity only"
    } else {
        "memory_max is not enforced"
    }
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| ExecError::io("write", path, e))
}

/// Set `cpuset.cpus` of a job cgroup (on creation and on re-pin).
pub(crate) fn set_cpus(cgroup: &Path, cpus: &[u32]) -> Result<()> {
    write_file(&cgroup.join("cpuset.cpus"), &format_cpulist(cpus))
}

/// Whether the job cgroup has `cpuset.cpus` (the controller is enabled).
pub(crate) fn has_cpuset(cgroup: &Path) -> bool {
    cgroup.join("cpuset.cpus").exists()
}

/// Open the job cgroup's `cgroup.procs` for [`enter_self`] (in the shim,
/// before forking the job).
pub(crate) fn open_procs(cgroup: &Path) -> Result<File> {
    let path = cgroup.join("cgroup.procs");
    OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| ExecError::io("open", &path, e))
}

/// Move the calling process into the cgroup whose `cgroup.procs` is open
/// as `procs`. Async-signal-safe (one `write(2)` of a constant): meant for
/// the child between fork and exec.
pub(crate) fn enter_self(procs: &File) -> nix::Result<()> {
    nix::unistd::write(procs, b"0").map(drop)
}

fn read_ids(path: &Path) -> Vec<i32> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|t| t.parse().ok())
        .collect()
}

/// Pids in the job cgroup (empty if it is gone).
pub(crate) fn procs(cgroup: &Path) -> Vec<i32> {
    read_ids(&cgroup.join("cgroup.procs"))
}

/// No process left in the job cgroup (or it is gone): one `read(2)` of
/// its `cgroup.procs`, which returns nothing exactly when it is empty
/// (the supervisor asks once per job; [`procs`] would parse the pids).
pub(crate) fn is_empty(cgroup: &Path) -> bool {
    use std::io::Read;
    let Ok(mut f) = fs::File::open(cgroup.join("cgroup.procs")) else {
        return true;
    };
    let mut first = [0u8; 16];
    loop {
        match f.read(&mut first) {
            Ok(n) => return n == 0,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

/// Thread ids in the job cgroup (empty if it is gone).
pub(crate) fn threads(cgroup: &Path) -> Vec<i32> {
    read_ids(&cgroup.join("cgroup.threads"))
}

/// Cgroups this process wrote `cgroup.kill` of, until
/// [`take_killed`] (see `JobExit::cgroup_killed`).
static KILLED: std::sync::Mutex<std::collections::BTreeSet<PathBuf>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn killed() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<PathBuf>> {
    // Every update is a single insert or remove.
    KILLED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether this process killed through `cgroup` since the last call (and
/// forget it): such a cgroup is not reused for another job.
pub(crate) fn take_killed(cgroup: &Path) -> bool {
    killed().remove(cgroup)
}

/// Kill every process in the job cgroup: `cgroup.kill` (Linux 5.14+),
/// else SIGKILL to each pid of `cgroup.procs`.
pub(crate) fn kill_all(cgroup: &Path) {
    killed().insert(cgroup.to_owned());
    if write_file(&cgroup.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in procs(cgroup) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// Remove the cgroup `root` and every cgroup below it, killing whatever
/// still runs in them, within `within`: for a harness or a tool that is
/// done with a whole tree of job cgroups (an agent's root after the agent
/// and its supervisor were killed), where the agent removes its jobs'
/// cgroups one at a time ([`remove`]). One `cgroup.kill` of the root
/// kills the whole subtree (else SIGKILL to each pid of each cgroup);
/// then each cgroup, deepest first, is removed once the kernel has
/// emptied it (`rmdir` says EBUSY until then: polled every 10 ms).
/// Blocking. Gone already is fine; an error is the last one seen when
/// `within` ran out (or any other than EBUSY at once).
pub fn remove_tree(root: &Path, within: Duration) -> io::Result<()> {
    if !root.exists() {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + within;
    if write_file(&root.join("cgroup.kill"), "1").is_err() {
        kill_each_pid_below(root);
    }
    remove_tree_by(root, deadline)
}

/// SIGKILL every pid of `dir`'s cgroup and of those below it (kernels
/// without `cgroup.kill`).
fn kill_each_pid_below(dir: &Path) {
    for pid in procs(dir) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    for child in child_cgroups(dir) {
        kill_each_pid_below(&child);
    }
}

/// The cgroups directly below `dir` (none if it is unreadable or gone).
fn child_cgroups(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

fn remove_tree_by(dir: &Path, deadline: std::time::Instant) -> io::Result<()> {
    for child in child_cgroups(dir) {
        remove_tree_by(&child, deadline)?;
    }
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            // Processes still exiting (or, without `cgroup.kill`, one
            // forked after the kill): once more, then wait for the kernel.
            Err(e)
                if e.raw_os_error() == Some(Errno::EBUSY as i32)
                    && std::time::Instant::now() < deadline =>
            {
                kill_each_pid_below(dir);
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Remove a job cgroup once its processes are gone, killing stragglers.
/// Gone already is fine.
pub(crate) async fn remove(cgroup: &Path) -> Result<()> {
    let removed = remove_dir(cgroup).await;
    take_killed(cgroup);
    removed
}

async fn remove_dir(cgroup: &Path) -> Result<()> {
    for attempt in 0..50 {
        match fs::remove_dir(cgroup) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(Errno::EBUSY as i32) && attempt < 49 => {
                kill_all(cgroup);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(ExecError::io("rmdir cgroup", cgroup, e)),
        }
    }
    Ok(())
}

/// The mount point of the cgroup2 hierarchy, from `/proc/self/mountinfo`
/// (`/sys/fs/cgroup` on unified hosts, often `/sys/fs/cgroup/unified` on
/// hybrid ones).
pub fn cgroup2_mount() -> Option<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        pre.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// The cgroup root for jobs when none is configured and the supervisor
/// launcher wants one (`super::Launcher::Supervisor`):
/// `<cgroup2 mount>/<this process's cgroup>/dispatch-<hash>`, the hash
/// (FNV-1a) of the state directory's path, so that it is the same across
/// restarts of one agent and distinct for agents side by side. `None`
/// without a cgroup2 hierarchy.
pub fn state_dir_root(state_dir: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let (mount, own) = (cgroup2_mount()?, own_cgroup()?);
    let hash = state_dir
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    Some(
        mount
            .join(own.strip_prefix("/").unwrap_or(&own))
            .join(format!("dispatch-{hash:016x}")),
    )
}

/// This process's cgroup v2 path relative to the cgroup2 mount (the `0::`
/// line of `/proc/self/cgroup`).
pub fn own_cgroup() -> Option<PathBuf> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The oracle: a cgroup's limits after the writes, applied one by one
    /// as the kernel would.
    fn apply(mut now: Limits, writes: &[LimitWrite<'_>]) -> Limits {
        for w in writes {
            match w {
                LimitWrite::Cpus(c) => now.cpus = Some(c.to_vec()),
                LimitWrite::MemoryMax(m) => now.memory_max = *m,
            }
        }
        now
    }

    fn limits() -> impl Strategy<Value = Limits> {
        (
            proptest::option::of(proptest::collection::vec(0u32..8, 1..4)),
            proptest::option::of(1u64..4),
        )
            .prop_map(|(cpus, memory_max)| Limits { cpus, memory_max })
    }

    proptest! {
        /// Whatever the last job left (as the agent wrote it), the writes
        /// make the next job's limits exactly its own, and there is no
        /// write where nothing changes. `cpus: None` wanted (no cpuset
        /// controller) is only ever asked of a cgroup that never had one
        /// written.
        #[test]
        fn a_reused_cgroup_gets_exactly_the_new_limits(now in limits(), mut want in limits()) {
            if want.cpus.is_none() && now.cpus.is_some() {
                want.cpus = now.cpus.clone();
            }
            let writes = now.writes(&want);
            prop_assert_eq!(apply(now.clone(), &writes), want.clone());
            let changed = usize::from(now.cpus != want.cpus) + usize::from(now.memory_max != want.memory_max);
            prop_assert_eq!(writes.len(), changed);
        }
    }

    /// A writable cgroup2 root under this process's cgroup (removed by the
    /// caller), or `None` where there is none (said on stderr).
    fn test_root(name: &str) -> Option<CgroupSupport> {
        let (mount, own) = (cgroup2_mount()?, own_cgroup()?);
        let root = mount
            .join(own.strip_prefix("/").unwrap_or(&own))
            .join(format!("agent-pool-test-{name}-{}", std::process::id()));
        match CgroupSupport::probe(&root) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("cgroup pool not exercised: {e}");
                None
            }
        }
    }

    /// A slot given back empty is reused with the new job's limits; one
    /// with a process left in it is not kept (removed, the process
    /// killed); closing removes the free ones.
    #[tokio::test]
    async fn slots_are_reused_empty_and_with_the_new_limits() {
        let Some(support) = test_root("reuse") else {
            return;
        };
        let pool = CgroupPool::open(&support);
        let (a, limits_a) = pool.take(&support, "a", &[0], Some(64 << 20)).unwrap();
        assert_eq!(limits_a, support.limits_for(&[0], Some(64 << 20)));
        assert!(pool.keep(&a, limits_a));
        assert_eq!(pool.len(), 1);
        let (b, limits_b) = pool.take(&support, "b", &[0], None).unwrap();
        assert_eq!(b, a, "the free slot is reused");
        assert_eq!(limits_b, support.limits_for(&[0], None));
        if support.memory {
            assert_eq!(
                fs::read_to_string(b.join("memory.max")).unwrap().trim(),
                "max"
            );
        }
        if support.cpuset {
            assert_eq!(
                fs::read_to_string(b.join("cpuset.cpus")).unwrap().trim(),
                "0"
            );
        }
        // A process left behind: the slot is not kept for another job.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        fs::write(b.join("cgroup.procs"), child.id().to_string()).unwrap();
        assert!(!is_unpopulated(&b));
        assert!(!pool.keep(&b, limits_b));
        assert_eq!(pool.len(), 0, "a populated slot is not pooled");
        remove(&b).await.unwrap();
        assert!(!b.exists(), "removed, its process killed");
        assert!(child.wait().unwrap().code().is_none());
        // A new slot, then a second one while the first is taken.
        let (c, lc) = pool.take(&support, "c", &[0], None).unwrap();
        let (d, ld) = pool.take(&support, "d", &[0], None).unwrap();
        assert_ne!(c, d);
        assert!(procs(&c).is_empty() && procs(&d).is_empty());
        assert!(pool.keep(&c, lc) && pool.keep(&d, ld));
        assert_eq!(pool.len(), 2);
        pool.close();
        assert!(!c.exists() && !d.exists());
        fs::remove_dir(&support.root).unwrap();
    }

    /// Slots left by an earlier agent are removed when empty; a busy one
    /// stays, and new slots do not take its name.
    #[tokio::test]
    async fn an_earlier_agents_slots() {
        let Some(support) = test_root("restart") else {
            return;
        };
        let first = CgroupPool::open(&support);
        let (a, la) = first.take(&support, "a", &[0], None).unwrap();
        let (b, _) = first.take(&support, "b", &[0], None).unwrap();
        assert!(first.keep(&a, la));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        fs::write(b.join("cgroup.procs"), child.id().to_string()).unwrap();
        drop(first);
        let second = CgroupPool::open(&support);
        assert!(!a.exists(), "the empty one is removed");
        assert!(b.exists(), "the busy one stays");
        let (c, _) = second.take(&support, "c", &[0], None).unwrap();
        assert_ne!(c, b);
        kill_all(&b);
        let _ = child.wait();
        remove(&b).await.unwrap();
        remove(&c).await.unwrap();
        fs::remove_dir(&support.root).unwrap();
    }
}
