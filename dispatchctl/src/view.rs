//! Serde views of the API messages for `-o json` and `-o yaml`.
//!
//! prost types are not serde, and their shape (i32 enums, zero-means-unset,
//! hash maps) is not what a script wants, so each message has a view here:
//! snake_case field names that stay stable, enums as lower-case strings
//! (`"running"`, `"llc"`), maps sorted by key, and `null` for what the
//! dispatcher has not set (times that are 0, the exit status of a job that
//! has not ended, the array fields of a single job). Enum values this
//! version does not know become `"unknown"`.

use std::collections::BTreeMap;

use proto::v1 as pb;
use serde::Serialize;

macro_rules! lower_enum {
    ($(#[$m:meta])* $name:ident from $pb:ty { $($variant:ident = $pbv:ident => $text:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($variant,)*
            /// A value this version of dispatchctl does not know.
            Unknown,
        }

        impl $name {
            /// From the wire value.
            pub fn from_i32(v: i32) -> Self {
                match <$pb>::try_from(v) {
                    $(Ok(<$pb>::$pbv) => $name::$variant,)*
                    #[allow(unreachable_patterns)]
                    _ => $name::Unknown,
                }
            }

            /// The lower-case name used in tables, JSON and YAML.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                    $name::Unknown => "unknown",
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.as_str())
            }
        }
    };
}

lower_enum!(
    /// `dispatch.v1.JobState`.
    JobStateView from pb::JobState {
        Unspecified = Unspecified => "unspecified",
        Pending = Pending => "pending",
        Assigned = Assigned => "assigned",
        Running = Running => "running",
        Succeeded = Succeeded => "succeeded",
        Failed = Failed => "failed",
        Cancelled = Cancelled => "cancelled",
        Lost = Lost => "lost",
    }
);

impl JobStateView {
    /// SUCCEEDED, FAILED, CANCELLED or LOST: the job will not change again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobStateView::Succeeded
                | JobStateView::Failed
                | JobStateView::Cancelled
                | JobStateView::Lost
        )
    }
}

lower_enum!(
    /// `dispatch.v1.Alignment`.
    AlignmentView from pb::Alignment {
        Any = Any => "any",
        Core = Core => "core",
        Llc = Llc => "llc",
        Numa = Numa => "numa",
        Package = Package => "package",
    }
);

lower_enum!(
    /// `dispatch.v1.Within`: where a gang's members must be.
    WithinView from pb::Within {
        Any = Any => "any",
        Rack = Rack => "rack",
        Zone = Zone => "zone",
    }
);

lower_enum!(
    /// `dispatch.v1.GangRetry`: a gang's answer to a lost member.
    GangRetryView from pb::GangRetry {
        Restart = RestartAll => "restart",
        Replace = ReplaceMember => "replace",
    }
);

impl WithinView {
    /// A spec's `within`, its default (unspecified = any) resolved.
    pub fn of_spec(s: &pb::JobSpec) -> Self {
        match pb::Within::try_from(s.within) {
            Ok(pb::Within::Unspecified) => WithinView::Any,
            _ => WithinView::from_i32(s.within),
        }
    }
}

impl GangRetryView {
    /// A spec's `gang_retry`, its default (unspecified = restart) resolved.
    pub fn of_spec(s: &pb::JobSpec) -> Self {
        match pb::GangRetry::try_from(s.gang_retry) {
            Ok(pb::GangRetry::Unspecified) => GangRetryView::Restart,
            _ => GangRetryView::from_i32(s.gang_retry),
        }
    }
}

lower_enum!(
    /// `dispatch.v1.PlacementPolicy`.
    PolicyView from pb::PlacementPolicy {
        Spread = Spread => "spread",
        Pack = Pack => "pack",
    }
);

lower_enum!(
    /// `dispatch.v1.NodeState`.
    NodeStateView from pb::NodeState {
        Unspecified = Unspecified => "unspecified",
        Ready = Ready => "ready",
        Cordoned = Cordoned => "cordoned",
        Draining = Draining => "draining",
        Down = Down => "down",
    }
);

fn nonzero_time(ms: i64) -> Option<i64> {
    (ms != 0).then_some(ms)
}

fn nonempty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn sorted<V: Clone>(m: &std::collections::HashMap<String, V>) -> BTreeMap<String, V> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// `dispatch.v1.JobSpec`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobSpecView {
    pub name: String,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub cpus: u32,
    pub memory_bytes: u64,
    pub alignment: AlignmentView,
    pub policy: PolicyView,
    pub node_selector: BTreeMap<String, String>,
    pub latency_nice: i32,
    pub nice: i32,
    pub waker: Option<String>,
    pub group: Option<String>,
    pub retries: u32,
    pub timeout_ms: u64,
    pub array_count: u32,
    /// Gang members (`null` for a job that is not a gang).
    pub nodes: Option<u32>,
    pub within: Option<WithinView>,
    pub within_preferred: Option<bool>,
    pub relax_after_ms: Option<u64>,
    pub gang_retry: Option<GangRetryView>,
    pub gpus: u32,
}

impl From<&pb::JobSpec> for JobSpecView {
    fn from(s: &pb::JobSpec) -> Self {
        let gang = s.nodes > 1;
        JobSpecView {
            name: s.name.clone(),
            command: s.command.clone(),
            env: sorted(&s.env),
            cwd: s.cwd.clone(),
            cpus: s.cpus.max(1),
            memory_bytes: s.memory_bytes,
            alignment: AlignmentView::from_i32(s.alignment),
            policy: PolicyView::from_i32(s.policy),
            node_selector: sorted(&s.node_selector),
            latency_nice: s.latency_nice,
            nice: s.nice,
            waker: nonempty(&s.waker),
            group: nonempty(&s.group),
            retries: s.retries,
            timeout_ms: s.timeout_ms,
            array_count: s.array_count.max(1),
            nodes: gang.then_some(s.nodes),
            within: gang.then(|| WithinView::of_spec(s)),
            within_preferred: gang.then_some(s.within_preferred),
            relax_after_ms: (gang && s.within_preferred).then_some(s.relax_after_ms),
            gang_retry: gang.then(|| GangRetryView::of_spec(s)),
            gpus: s.gpus,
        }
    }
}

/// `dispatch.v1.Job`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView {
    pub id: String,
    pub name: String,
    pub state: JobStateView,
    pub node: Option<String>,
    pub cpus: Vec<u32>,
    /// The node's GPU numbers it runs on (empty without GPUs).
    pub gpus: Vec<u32>,
    /// Set only in terminal states.
    pub exit_code: Option<i32>,
    /// The signal that killed the job, when one did.
    pub signal: Option<i32>,
    pub reason: String,
    /// Why it waits (`null` once it runs or ends).
    pub pending_reason: Option<PendingReasonView>,
    pub attempt: u32,
    pub submit_time_ms: Option<i64>,
    pub start_time_ms: Option<i64>,
    pub end_time_ms: Option<i64>,
    pub array_id: Option<String>,
    pub array_index: Option<u32>,
    /// For a gang member: the gang's id, this member's index and the
    /// gang's size.
    pub gang_id: Option<String>,
    pub gang_index: Option<u32>,
    pub gang_size: Option<u32>,
    /// Who submitted it (`null` on a dispatcher without tokens).
    pub owner: Option<String>,
    pub spec: Option<JobSpecView>,
}

impl From<&pb::Job> for JobView {
    fn from(j: &pb::Job) -> Self {
        let state = JobStateView::from_i32(j.state);
        let array_id = nonempty(&j.array_id);
        JobView {
            id: j.id.clone(),
            name: j.spec.as_ref().map(|s| s.name.clone()).unwrap_or_default(),
            state,
            node: nonempty(&j.node),
            cpus: j.cpus.clone(),
            gpus: j.gpus.clone(),
            exit_code: state.is_terminal().then_some(j.exit_code),
            signal: (j.signal != 0).then_some(j.signal),
            reason: j.reason.clone(),
            pending_reason: j.pending_reason.as_ref().map(PendingReasonView::from),
            attempt: j.attempt,
            submit_time_ms: nonzero_time(j.submit_time_ms),
            start_time_ms: nonzero_time(j.start_time_ms),
            end_time_ms: nonzero_time(j.end_time_ms),
            array_index: array_id.as_ref().map(|_| j.array_index),
            array_id,
            gang_index: (!j.gang_id.is_empty()).then_some(j.gang_index),
            gang_size: (!j.gang_id.is_empty()).then_some(j.gang_size),
            gang_id: nonempty(&j.gang_id),
            owner: nonempty(&j.owner),
            spec: j.spec.as_ref().map(JobSpecView::from),
        }
    }
}

/// `dispatch.v1.PendingReason`: why a job waits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PendingReasonView {
    /// The kind's name, e.g. `queued_behind`, `no_match_cpus`
    /// (`unknown` for a kind this version does not know).
    pub kind: String,
    pub node: Option<String>,
    pub jobs_ahead: u32,
    pub until_ms: Option<i64>,
    pub message: String,
}

impl From<&pb::PendingReason> for PendingReasonView {
    fn from(r: &pb::PendingReason) -> Self {
        PendingReasonView {
            kind: proto::pending::kind_name(r.kind),
            node: nonempty(&r.node),
            jobs_ahead: r.jobs_ahead,
            until_ms: nonzero_time(r.until_ms),
            message: r.message.clone(),
        }
    }
}

/// A list of jobs (`ls`, `submit`, `cancel`), shaped like
/// `dispatch.v1.ListJobsResponse` without its page token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobListView {
    pub jobs: Vec<JobView>,
}

/// `dispatch.v1.JobEvent` (`watch -o json` prints one per line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobEventView {
    pub time_ms: Option<i64>,
    /// `null` for current-state events.
    pub previous_state: Option<JobStateView>,
    pub job: Option<JobView>,
}

impl From<&pb::JobEvent> for JobEventView {
    fn from(e: &pb::JobEvent) -> Self {
        let prev = JobStateView::from_i32(e.previous_state);
        JobEventView {
            time_ms: nonzero_time(e.time_ms),
            previous_state: (prev != JobStateView::Unspecified).then_some(prev),
            job: e.job.as_ref().map(JobView::from),
        }
    }
}

/// `dispatch.v1.FreeSummary`: the largest number of idle CPUs inside one
/// domain of each level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FreeView {
    pub core: u32,
    pub llc: u32,
    pub numa: u32,
    pub package: u32,
    pub any: u32,
}

impl From<&pb::FreeSummary> for FreeView {
    fn from(f: &pb::FreeSummary) -> Self {
        FreeView {
            core: f.core,
            llc: f.llc,
            numa: f.numa,
            package: f.package,
            any: f.any,
        }
    }
}

/// `dispatch.v1.NodeLoad`, with the per-CPU list summarised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeLoadView {
    /// CPUs with a running task.
    pub busy_cpus: u32,
    /// CPUs with more runnable tasks than capacity.
    pub overloaded: Vec<u32>,
    pub avg_idle_ns: u64,
    pub free: FreeView,
    pub running_jobs: u32,
    pub waiting_jobs: u32,
    pub schedstats: BTreeMap<String, u64>,
}

impl From<&pb::NodeLoad> for NodeLoadView {
    fn from(l: &pb::NodeLoad) -> Self {
        NodeLoadView {
            busy_cpus: l.cpus.iter().filter(|c| c.busy).count() as u32,
            overloaded: l.overloaded.clone(),
            avg_idle_ns: l.avg_idle_ns,
            free: l.free.as_ref().map(FreeView::from).unwrap_or_default(),
            running_jobs: l.running_jobs,
            waiting_jobs: l.waiting_jobs,
            schedstats: sorted(&l.schedstats),
        }
    }
}

/// `dispatch.v1.Topology`: CPU ids and the groups of each level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopologyView {
    pub cpus: Vec<u32>,
    pub smt: Vec<Vec<u32>>,
    pub llc: Vec<Vec<u32>>,
    pub numa: Vec<Vec<u32>>,
    pub package: Vec<Vec<u32>>,
}

impl From<&pb::Topology> for TopologyView {
    fn from(t: &pb::Topology) -> Self {
        let groups = |g: &[pb::CpuGroup]| g.iter().map(|c| c.cpus.clone()).collect();
        TopologyView {
            cpus: t.cpus.clone(),
            smt: groups(&t.smt),
            llc: groups(&t.llc),
            numa: groups(&t.numa),
            package: groups(&t.package),
        }
    }
}

/// `dispatch.v1.Node`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    pub name: String,
    pub state: NodeStateView,
    pub zone: String,
    pub rack: String,
    pub labels: BTreeMap<String, String>,
    /// Number of CPUs the agent may use.
    pub cpus: u32,
    pub sockets: u32,
    pub numa_nodes: u32,
    pub llcs: u32,
    pub cores: u32,
    pub threads_per_core: u32,
    pub last_heartbeat_ms: Option<i64>,
    pub load: Option<NodeLoadView>,
    pub topology: Option<TopologyView>,
    /// GPUs, and those no job holds.
    pub gpus: u32,
    pub gpus_free: u32,
    /// The gangs with a member holding the node (`j-N`).
    pub gangs: Vec<String>,
    pub devices: Vec<DeviceView>,
}

/// `dispatch.v1.Device`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceView {
    /// `gpu`, `accelerator`, `nic` (`unspecified` for an unknown kind).
    pub kind: String,
    pub index: u32,
    pub pci_address: String,
    pub numa_node: Option<u32>,
    pub vendor: String,
    pub model: String,
    pub nvidia_minor: Option<u32>,
    /// Switch, host bridge, NUMA node, machine keys (GPUs).
    pub locality: Vec<u64>,
}

impl From<&pb::Device> for DeviceView {
    fn from(d: &pb::Device) -> Self {
        DeviceView {
            kind: pb::DeviceKind::try_from(d.kind)
                .unwrap_or(pb::DeviceKind::Unspecified)
                .as_str_name()
                .trim_start_matches("DEVICE_KIND_")
                .to_ascii_lowercase(),
            index: d.index,
            pci_address: d.pci_address.clone(),
            numa_node: d.numa_node,
            vendor: d.vendor.clone(),
            model: d.model.clone(),
            nvidia_minor: d.nvidia_minor,
            locality: d.locality.clone(),
        }
    }
}

impl From<&pb::Node> for NodeView {
    fn from(n: &pb::Node) -> Self {
        NodeView {
            name: n.name.clone(),
            state: NodeStateView::from_i32(n.state),
            zone: n.zone.clone(),
            rack: n.rack.clone(),
            labels: sorted(&n.labels),
            cpus: node_cpus(n),
            sockets: n.sockets,
            numa_nodes: n.numa_nodes,
            llcs: n.llcs,
            cores: n.cores,
            threads_per_core: n.threads_per_core,
            last_heartbeat_ms: nonzero_time(n.last_heartbeat_ms),
            load: n.load.as_ref().map(NodeLoadView::from),
            topology: n.topology.as_ref().map(TopologyView::from),
            gpus: n.gpus,
            gpus_free: n.gpus_free,
            gangs: n.gangs.clone(),
            devices: n.devices.iter().map(DeviceView::from).collect(),
        }
    }
}

/// A node's CPU count: its topology's CPUs, else the CPUs of its load
/// report, else cores x threads.
pub fn node_cpus(n: &pb::Node) -> u32 {
    if let Some(t) = n.topology.as_ref().filter(|t| !t.cpus.is_empty()) {
        return t.cpus.len() as u32;
    }
    if let Some(l) = n.load.as_ref().filter(|l| !l.cpus.is_empty()) {
        return l.cpus.len() as u32;
    }
    n.cores * n.threads_per_core.max(1)
}

/// The node list (`nodes`), shaped like `dispatch.v1.ListNodesResponse`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeListView {
    pub nodes: Vec<NodeView>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_are_lower_case_and_tolerate_unknown_values() {
        assert_eq!(JobStateView::from_i32(3), JobStateView::Running);
        assert_eq!(JobStateView::from_i32(99), JobStateView::Unknown);
        assert_eq!(
            serde_json::to_string(&JobStateView::Running).expect("json"),
            "\"running\""
        );
        assert_eq!(
            serde_json::to_string(&AlignmentView::Llc).expect("json"),
            "\"llc\""
        );
        assert_eq!(
            serde_json::to_string(&JobStateView::Unknown).expect("json"),
            "\"unknown\""
        );
        assert_eq!(NodeStateView::from_i32(3).as_str(), "draining");
        assert_eq!(PolicyView::from_i32(1).to_string(), "pack");
        assert!(JobStateView::Lost.is_terminal());
        assert!(!JobStateView::Assigned.is_terminal());
    }
}
