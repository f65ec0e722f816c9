//! Device confinement of a job's cgroup on cgroup v2: which device nodes
//! its processes may not open. cgroup v2 has no `devices.deny` file; the
//! kernel asks a `BPF_PROG_TYPE_CGROUP_DEVICE` program attached to the
//! cgroup (or an ancestor) on every open and `mknod` of a device node
//! (`devcgroup_check_permission`), and refuses with `EPERM` when it
//! returns 0. This is what runc and systemd's `DeviceAllow=` do.
//!
//! The agent denies a job the GPUs it does not hold (the nodes of
//! [`crate::topology::PciDevice::char_devices`]): [`DenyList::program`]
//! assembles a program that compares the access's device type, major and
//! minor with each denied node and allows everything else, and
//! [`attach`] loads it with `bpf(BPF_PROG_LOAD)` and attaches it to the
//! job's cgroup with `BPF_F_ALLOW_MULTI`, so programs of ancestors (a
//! systemd unit's `DevicePolicy=`) still run: the access is refused when
//! any of them refuses. The cgroup holds the program; it goes with the
//! cgroup. The program is attached before the job's process enters the
//! cgroup, so the job never runs unconfined.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::libc;
use serde::{Deserialize, Serialize};

/// Character or block device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceType {
    /// A block device (`BPF_DEVCG_DEV_BLOCK`).
    Block,
    /// A character device (`BPF_DEVCG_DEV_CHAR`); every GPU node is one.
    Char,
}

impl DeviceType {
    /// The kernel's code for the type in `bpf_cgroup_dev_ctx.access_type`.
    fn code(self) -> i32 {
        match self {
            DeviceType::Block => 1,
            DeviceType::Char => 2,
        }
    }
}

/// One device node by its numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Character or block.
    pub kind: DeviceType,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

impl DeviceNode {
    /// A character device `major:minor`.
    pub fn char(major: u32, minor: u32) -> Self {
        DeviceNode {
            kind: DeviceType::Char,
            major,
            minor,
        }
    }
}

impl std::fmt::Display for DeviceNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = match self.kind {
            DeviceType::Block => 'b',
            DeviceType::Char => 'c',
        };
        write!(f, "{t} {}:{}", self.major, self.minor)
    }
}

/// The device nodes a job may not open or create; everything else is
/// allowed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenyList(pub Vec<DeviceNode>);

/// One eBPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Insn {
    code: u8,
    /// dst register in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

// Opcodes (include/uapi/linux/bpf_common.h, bpf.h).
const LDX_MEM_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
const ALU32_AND_K: u8 = 0x54; // BPF_ALU | BPF_AND | BPF_K
const JMP_JNE_K: u8 = 0x55; // BPF_JMP | BPF_JNE | BPF_K
const ALU64_MOV_K: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
const JMP_EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | (dst & 0x0f),
        off,
        imm,
    }
}

impl DenyList {
    /// The nodes, sorted and without repeats.
    pub fn new(mut nodes: Vec<DeviceNode>) -> Self {
        nodes.sort();
        nodes.dedup();
        DenyList(nodes)
    }

    /// Nothing denied.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The program: r1 points at `struct bpf_cgroup_dev_ctx { u32
    /// access_type; u32 major; u32 minor; }` (type in the low 16 bits of
    /// `access_type`, the access in the high ones). For each denied node,
    /// return 0 (refuse) when type, major and minor all match; at the end
    /// return 1 (allow). Numbers above `i32::MAX` cannot be compared with
    /// a 32-bit immediate and are left out (no real device has them).
    pub fn program(&self) -> Vec<Insn> {
        let mut p = vec![
            insn(LDX_MEM_W, 2, 1, 0, 0),        // r2 = ctx->access_type
            insn(ALU32_AND_K, 2, 0, 0, 0xffff), // w2 &= 0xffff: the type
            insn(LDX_MEM_W, 3, 1, 4, 0),        // r3 = ctx->major
            insn(LDX_MEM_W, 4, 1, 8, 0),        // r4 = ctx->minor
        ];
        for n in &self.0 {
            let (Ok(major), Ok(minor)) = (i32::try_from(n.major), i32::try_from(n.minor)) else {
                continue;
            };
            // Each `if != goto next` skips to the next rule's first
            // instruction: past the remaining compares, the mov and exit.
            p.push(insn(JMP_JNE_K, 2, 0, 4, n.kind.code()));
            p.push(insn(JMP_JNE_K, 3, 0, 3, major));
            p.push(insn(JMP_JNE_K, 4, 0, 2, minor));
            p.push(insn(ALU64_MOV_K, 0, 0, 0, 0));
            p.push(insn(JMP_EXIT, 0, 0, 0, 0));
        }
        p.push(insn(ALU64_MOV_K, 0, 0, 0, 1));
        p.push(insn(JMP_EXIT, 0, 0, 0, 0));
        p
    }
}

/// Why the device rules could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum DeviceRulesError {
    /// `bpf(BPF_PROG_LOAD)` refused the program (no BPF in the kernel, no
    /// CAP_BPF/CAP_SYS_ADMIN, or the verifier's log says why).
    #[error("loading the device program: {error}{log}")]
    Load {
        /// The errno.
        error: io::Error,
        /// The verifier's log, when it wrote one (with a leading ": ").
        log: String,
    },
    /// Opening the cgroup directory.
    #[error("opening {path}: {error}")]
    Open {
        /// The cgroup.
        path: String,
        /// What went wrong.
        error: io::Error,
    },
    /// `bpf(BPF_PROG_ATTACH)` refused (e.g. an ancestor holds an exclusive
    /// device program, or the directory is not a cgroup v2 one).
    #[error("attaching the device program to {path}: {error}")]
    Attach {
        /// The cgroup.
        path: String,
        /// The errno.
        error: io::Error,
    },
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;

/// The leading fields of `union bpf_attr` for `BPF_PROG_LOAD`; the kernel
/// takes the size we pass and zero-fills the rest.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The fields of `union bpf_attr` for `BPF_PROG_ATTACH`.
#[repr(C)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `repr(C)` prefix of `union
    // bpf_attr` for `cmd`, and its size is passed, so the kernel reads no
    // further; every pointer inside it points at memory that outlives the
    // call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Load `program` as a device program; the fd holds it.
fn load(program: &[Insn]) -> Result<OwnedFd, DeviceRulesError> {
    let license = c"GPL";
    let mut log = vec![0u8; 64 * 1024];
    let mut name = [0u8; 16];
    name[..10].copy_from_slice(b"dispatchdv");
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: program.len() as u32,
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        prog_name: name,
        expected_attach_type: BPF_CGROUP_DEVICE,
        ..ProgLoadAttr::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        // SAFETY: a successful BPF_PROG_LOAD returns a new fd we own.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        Err(error) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(0);
            let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
            Err(DeviceRulesError::Load {
                error,
                log: if text.is_empty() {
                    String::new()
                } else {
                    format!(": {text}")
                },
            })
        }
    }
}

/// Whether this kernel and these privileges can load a device program
/// (an allow-all one, dropped at once): `Err` says why not.
pub fn probe() -> Result<(), DeviceRulesError> {
    load(&DenyList::default().program()).map(drop)
}

/// Refuse `deny`'s nodes to every process of `cgroup` (a cgroup v2
/// directory) and its descendants. Nothing to deny attaches nothing.
pub fn attach(cgroup: &Path, deny: &DenyList) -> Result<(), DeviceRulesError> {
    if deny.is_empty() {
        return Ok(());
    }
    let prog = load(&deny.program())?;
    let dir = File::open(cgroup).map_err(|error| DeviceRulesError::Open {
        path: cgroup.display().to_string(),
        error,
    })?;
    let mut attr = ProgAttachAttr {
        target_fd: dir.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
    };
    bpf(BPF_PROG_ATTACH, &mut attr).map_err(|error| DeviceRulesError::Attach {
        path: cgroup.display().to_string(),
        error,
    })?;
    // The cgroup keeps its own reference; `prog` and `dir` close here.
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the program decides for an access to `node`: `true` = allowed.
    /// An interpreter of exactly the instructions [`DenyList::program`]
    /// emits, so the program can be held against the list without a
    /// kernel (the kernel itself is exercised by `agent/tests/exec.rs`).
    fn allows(program: &[Insn], node: DeviceNode, access: u32) -> bool {
        let ctx = [
            (access << 16) | node.kind.code() as u32,
            node.major,
            node.minor,
        ];
        let mut r = [0u64; 11];
        let mut pc = 0usize;
        while let Some(i) = program.get(pc) {
            let dst = usize::from(i.regs & 0x0f);
            let src = usize::from(i.regs >> 4);
            match i.code {
                LDX_MEM_W => {
                    // src is r1, the context; offsets 0/4/8.
                    assert_eq!(src, 1, "loads only from the context");
                    r[dst] = u64::from(ctx[(i.off / 4) as usize]);
                }
                ALU32_AND_K => r[dst] = u64::from((r[dst] as u32) & (i.imm as u32)),
                JMP_JNE_K => {
                    if r[dst] != i.imm as i64 as u64 {
                        pc = (pc as i64 + 1 + i64::from(i.off)) as usize;
                        continue;
                    }
                }
                ALU64_MOV_K => r[dst] = i.imm as i64 as u64,
                JMP_EXIT => return r[0] != 0,
                other => panic!("opcode {other:#x} not emitted by program()"),
            }
            pc += 1;
        }
        panic!("the program fell off its end")
    }

    #[test]
    fn an_empty_list_allows_everything() {
        let p = DenyList::default().program();
        assert_eq!(p.len(), 6);
        assert!(allows(&p, DeviceNode::char(195, 0), 2));
        assert!(allows(
            &p,
            DeviceNode {
                kind: DeviceType::Block,
                major: 8,
                minor: 0
            },
            2
        ));
    }

    #[test]
    fn the_type_must_match_too() {
        let p = DenyList::new(vec![DeviceNode::char(8, 0)]).program();
        assert!(!allows(&p, DeviceNode::char(8, 0), 6));
        let block = DeviceNode {
            kind: DeviceType::Block,
            major: 8,
            minor: 0,
        };
        assert!(allows(&p, block, 6));
    }

    fn node() -> impl Strategy<Value = DeviceNode> {
        (any::<bool>(), 0u32..8, 0u32..8).prop_map(|(b, major, minor)| DeviceNode {
            kind: if b {
                DeviceType::Block
            } else {
                DeviceType::Char
            },
            major: 190 + major,
            minor,
        })
    }

    proptest! {
        /// The program refuses exactly the listed nodes, for every access
        /// (read, write, mknod and their combinations): the oracle is
        /// membership in the list.
        #[test]
        fn the_program_refuses_exactly_the_list(
            list in prop::collection::vec(node(), 0..12),
            probes in prop::collection::vec((node(), 1u32..8), 1..40),
        ) {
            let deny = DenyList::new(list.clone());
            let p = deny.program();
            for (n, access) in probes {
                prop_assert_eq!(allows(&p, n, access), !list.contains(&n), "{}", n);
            }
            for &n in &list {
                prop_assert!(!allows(&p, n, 2));
            }
        }
    }
}
