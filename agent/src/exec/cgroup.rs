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
            if self.cpuset {
                set_cpus(&path, cpus)?;
            }
            match memory_max {
                Some(bytes) if self.memory => {
                    write_file(&path.join("memory.max"), &bytes.to_string())?
                }
                Some(_) => tracing::warn!(
                    job = id,
                    root = %self.root.display(),
                    "memory_max not enforced: the memory controller is not enabled for job cgroups"
                ),
                None => {}
            }
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

/// Thread ids in the job cgroup (empty if it is gone).
pub(crate) fn threads(cgroup: &Path) -> Vec<i32> {
    read_ids(&cgroup.join("cgroup.threads"))
}

/// Kill every process in the job cgroup: `cgroup.kill` (Linux 5.14+),
/// else SIGKILL to each pid of `cgroup.procs`.
pub(crate) fn kill_all(cgroup: &Path) {
    if write_file(&cgroup.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in procs(cgroup) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// Remove a job cgroup once its processes are gone, killing stragglers.
/// Gone already is fine.
pub(crate) async fn remove(cgroup: &Path) -> Result<()> {
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
