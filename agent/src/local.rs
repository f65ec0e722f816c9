//! The agent's local scheduler: the `sched` engine at CPU level (leaves =
//! this machine's CPUs, capacity 1) deciding which CPUs each job runs on,
//! when it runs, and when it moves. Pure and synchronous like the engine:
//! the runtime feeds it jobs, exits and ticks and carries out the
//! [`Action`]s it returns (spawn pinned, SIGSTOP, SIGCONT, re-pin).
//!
//! A job asking for `k` CPUs is `k` engine tasks ("shares"):
//!
//! * `k = 1`: one free-floating task. It is placed by `select_task_rq`,
//!   may wait in a CPU's queue when oversubscription is allowed, is
//!   time-sliced with the other tasks of its CPU in vruntime order (latency
//!   class first when fair), and may be stolen by an idle CPU (SMT sibling
//!   first, then the LLC; node-limit and avg_idle gates), which re-pins it.
//! * `k > 1`: a gang. It starts only when `find_aligned` finds `k` idle
//!   CPUs inside one domain of its alignment (core, LLC, NUMA node,
//!   package, any); each share is then pinned to one of them. Until then
//!   the job waits in the local queue, latency class first, then by
//!   arrival. If a share is preempted (a 1-CPU task time-slices its CPU),
//!   the whole job is stopped and continued when every share runs again.
//!
//! Without oversubscription a 1-CPU job also waits for an idle CPU instead
//! of queueing behind a running one.
//!
//! A job asking for GPUs starts like a gang (on idle CPUs, never queued
//! behind a running task) and only when the machine has that many free
//! GPUs; once its CPUs are found, its GPUs are chosen by
//! [`GpuPool::choose`] (the CPUs' NUMA nodes first) and held until it
//! exits ([`LocalScheduler::gpus_of`]), whatever happens to its CPUs.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use sched::{
    Align, LeafId, LeafSet, Policy, Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState,
    Topology,
};

use crate::gpus::GpuPool;

/// What the local scheduler needs to know of a job.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalJob {
    /// The dispatcher's job id (with the attempt, so retries differ).
    pub id: String,
    /// CPUs wanted.
    pub cpus: u32,
    /// Where they must be.
    pub align: Align,
    /// Spread or pack.
    pub policy: Policy,
    /// Weight when time-sliced.
    pub nice: i32,
    /// Latency class when negative.
    pub latency_nice: i32,
    /// GPUs wanted.
    pub gpus: u32,
}

/// What the runtime must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start the job's processes pinned to these CPUs (CPU numbers of the
    /// scheduler's topology).
    Start {
        /// Job id.
        id: String,
        /// CPUs.
        cpus: Vec<u32>,
    },
    /// SIGSTOP the job (time-sliced out).
    Stop {
        /// Job id.
        id: String,
    },
    /// Re-pin and SIGCONT the job.
    Cont {
        /// Job id.
        id: String,
        /// CPUs.
        cpus: Vec<u32>,
    },
    /// Re-pin a running job (a steal or migration moved a share).
    Repin {
        /// Job id.
        id: String,
        /// CPUs.
        cpus: Vec<u32>,
    },
}

/// Local scheduler configuration.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Allow more runnable tasks than CPUs (time-sliced with SIGSTOP /
    /// SIGCONT). Off: a job waits until it has idle CPUs of its own.
    pub oversubscribe: bool,
    /// The engine's tunables (process-level slices are longer than the
    /// kernel's: stopping and continuing a process group costs far more).
    pub engine: SchedConfig,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            oversubscribe: false,
            engine: SchedConfig {
                sched_latency: 200_000_000,
                min_granularity: 50_000_000,
                wakeup_granularity: 50_000_000,
                // Idle periods of job slots are long; the steal gate compares
                // against the cost of re-pinning a process, ~50 us.
                steal_cost: 50_000,
                ..SchedConfig::default()
            },
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    job: LocalJob,
    shares: Vec<TaskId>,
    /// The job's processes exist.
    started: bool,
    /// The job is SIGSTOPped.
    stopped: bool,
    /// CPUs it is pinned to now.
    cpus: Vec<u32>,
}

/// The local scheduler.
pub struct LocalScheduler {
    engine: Sched,
    cfg: LocalConfig,
    jobs: HashMap<String, Entry>,
    task_job: HashMap<TaskId, String>,
    next_task: u64,
    /// Gangs (and, without oversubscription, all jobs) waiting for CPUs:
    /// (latency class first, arrival) -> id.
    waiting: BTreeMap<(bool, u64), String>,
    arrival: u64,
    /// The machine's GPUs and their holders.
    gpus: GpuPool,
}

impl LocalScheduler {
    /// A scheduler over `topo` (CPU numbers are its outside ids).
    pub fn new(topo: Arc<Topology>, cfg: LocalConfig) -> Self {
        Self {
            engine: Sched::new(topo, 1, cfg.engine.clone()),
            cfg,
            jobs: HashMap::new(),
            task_job: HashMap::new(),
            next_task: 1,
            waiting: BTreeMap::new(),
            arrival: 0,
            gpus: GpuPool::default(),
        }
    }

    /// The same, handing out the GPUs of `pool` to jobs that ask for them.
    pub fn with_gpus(mut self, pool: GpuPool) -> Self {
        self.gpus = pool;
        self
    }

    /// The GPU pool (holdings, the environment of a choice).
    pub fn gpu_pool(&self) -> &GpuPool {
        &self.gpus
    }

    /// The GPU pool, to note that its holdings were saved.
    pub fn gpu_pool_mut(&mut self) -> &mut GpuPool {
        &mut self.gpus
    }

    /// The GPUs a job holds (node indices, ascending; empty for none).
    pub fn gpus_of(&self, id: &str) -> Vec<u32> {
        self.gpus.held_by(id)
    }

    /// The engine (for reports and tests).
    pub fn engine(&self) -> &Sched {
        &self.engine
    }

    /// Jobs known (waiting, running or stopped).
    pub fn nr_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Jobs waiting for CPUs (not started, or stopped).
    pub fn nr_waiting(&self) -> usize {
        self.jobs
            .values()
            .filter(|e| !e.started || e.stopped)
            .count()
    }

    /// Jobs whose processes run now.
    pub fn nr_running(&self) -> usize {
        self.jobs
            .values()
            .filter(|e| e.started && !e.stopped)
            .count()
    }

    /// True when the job is known.
    pub fn contains(&self, id: &str) -> bool {
        self.jobs.contains_key(id)
    }

    /// True when the job's processes were started.
    pub fn is_started(&self, id: &str) -> bool {
        self.jobs.get(id).is_some_and(|e| e.started)
    }

    /// CPUs a job is pinned to.
    pub fn cpus_of(&self, id: &str) -> Option<&[u32]> {
        self.jobs.get(id).map(|e| e.cpus.as_slice())
    }

    fn cpu(&self, leaf: LeafId) -> u32 {
        self.engine.topology().os_id(leaf) as u32
    }

    /// A new job. Returns what to do now (maybe nothing: it waits).
    /// Errors when the job can never fit this machine.
    pub fn submit(&mut self, job: LocalJob, now: u64) -> Result<Vec<Action>, String> {
        if self.jobs.contains_key(&job.id) {
            return Err(format!("job {} is already on this node", job.id));
        }
        let topo = self.engine.topology().clone();
        let largest = sched::alloc::free_summary_of(&topo, |_| true).get(job.align);
        if job.cpus == 0 || job.cpus > largest {
            return Err(format!(
                "job {} wants {} CPUs aligned to {}; this node has at most {}",
                job.id,
                job.cpus,
                job.align.name(),
                largest
            ));
        }
        if job.gpus as usize > self.gpus.len() {
            return Err(format!(
                "job {} wants {} GPUs; this node has {}",
                job.id,
                job.gpus,
                self.gpus.len()
            ));
        }
        let mut shares = Vec::with_capacity(job.cpus as usize);
        for _ in 0..job.cpus {
            let t = TaskId(self.next_task);
            self.next_task += 1;
            self.task_job.insert(t, job.id.clone());
            shares.push(t);
        }
        let id = job.id.clone();
        let latency = job.latency_nice < 0;
        self.jobs.insert(
            id.clone(),
            Entry {
                job,
                shares,
                started: false,
                stopped: false,
                cpus: Vec::new(),
            },
        );
        self.arrival += 1;
        self.waiting.insert((!latency, self.arrival), id);
        let mut actions = Vec::new();
        self.try_start_waiting(now, &mut actions);
        Ok(actions)
    }

    /// Put the job's shares on CPUs if it can start now.
    fn try_place(&mut self, id: &str, now: u64) -> bool {
        let Some(e) = self.jobs.get(id) else {
            return false;
        };
        let job = e.job.clone();
        let shares = e.shares.clone();
        let spec = |t: TaskId, affinity: Option<Arc<LeafSet>>| TaskSpec {
            id: t,
            nice: job.nice,
            latency_nice: job.latency_nice,
            demand: 1,
            affinity,
            policy: Some(job.policy),
            align: Align::Any,
            time_limit: None,
            predicted: None,
        };
        let n = self.engine.topology().nr_leaves();
        if job.cpus == 1 && self.cfg.oversubscribe && job.gpus == 0 {
            let t = shares[0];
            if self.engine.add_task(spec(t, None)).is_err() {
                return false;
            }
            return self.engine.wake_up(t, None, false, now).is_ok();
        }
        if self.gpus.free() < job.gpus as usize {
            return false;
        }
        let Some(leaves) = self
            .engine
            .find_aligned(job.cpus as usize, job.align, job.policy, None)
        else {
            return false;
        };
        if job.gpus > 0 {
            // After the CPUs: the GPUs on their NUMA nodes first.
            let cpus: Vec<u32> = leaves.iter().map(|&l| self.cpu(l)).collect();
            let Some(gpus) = self.gpus.choose(job.gpus as usize, &cpus) else {
                return false;
            };
            self.gpus.take(&job.id, &gpus);
        }
        for (t, &leaf) in shares.iter().zip(&leaves) {
            // A 1-CPU job may be stolen or migrate later; a gang's shares are
            // pinned one per CPU.
            let affinity = if job.cpus == 1 {
                None
            } else {
                Some(Arc::new(LeafSet::from_leaves(n, [leaf])))
            };
            if self.engine.add_task(spec(*t, affinity)).is_err()
                || self.engine.wake_up_on(*t, leaf, now).is_err()
            {
                self.gpus.release(&job.id);
                return false;
            }
        }
        true
    }

    fn try_start_waiting(&mut self, now: u64, actions: &mut Vec<Action>) {
        let candidates: Vec<((bool, u64), String)> =
            self.waiting.iter().map(|(k, v)| (*k, v.clone())).collect();
        for (key, id) in candidates {
            if self.try_place(&id, now) {
                self.waiting.remove(&key);
            }
        }
        self.collect(actions);
    }

    /// The job's processes exited (or it was cancelled): free its CPUs.
    pub fn job_exited(&mut self, id: &str, now: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        let Some(e) = self.jobs.remove(id) else {
            return actions;
        };
        self.waiting.retain(|_, v| v != id);
        self.gpus.release(id);
        for t in e.shares {
            self.task_job.remove(&t);
            let _ = self.engine.remove_task(t, now);
        }
        self.collect(&mut actions);
        self.try_start_waiting(now, &mut actions);
        actions
    }

    /// Re-adopt a job that was already running on `cpus` (after an agent
    /// restart): it holds those CPUs, and `gpus` (from the ledger).
    pub fn adopt(&mut self, job: LocalJob, cpus: &[u32], gpus: &[u32], now: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        self.gpus.take(&job.id, gpus);
        let topo = self.engine.topology().clone();
        let n = topo.nr_leaves();
        let leaves: Vec<LeafId> = cpus
            .iter()
            .filter_map(|&c| topo.leaf_of_os_id(c as u64))
            .collect();
        let id = job.id.clone();
        let mut shares = Vec::new();
        for (i, _) in (0..job.cpus.max(1)).enumerate() {
            let t = TaskId(self.next_task);
            self.next_task += 1;
            self.task_job.insert(t, id.clone());
            shares.push(t);
            let leaf = leaves.get(i % leaves.len().max(1)).copied();
            let spec = TaskSpec {
                id: t,
                nice: job.nice,
                latency_nice: job.latency_nice,
                demand: 1,
                affinity: leaf.map(|l| Arc::new(LeafSet::from_leaves(n, [l]))),
                policy: Some(job.policy),
                align: Align::Any,
                time_limit: None,
                predicted: None,
            };
            if self.engine.add_task(spec).is_ok() {
                match leaf {
                    Some(l) => {
                        let _ = self.engine.wake_up_on(t, l, now);
                    }
                    None => {
                        let _ = self.engine.wake_up(t, None, false, now);
                    }
                }
            }
        }
        self.jobs.insert(
            id,
            Entry {
                job,
                shares,
                started: true,
                stopped: false,
                cpus: cpus.to_vec(),
            },
        );
        // The adopted job is already running: swallow its Started events.
        let events = self.engine.drain_events();
        self.apply_events(events, &mut actions, true);
        actions
    }

    /// The periodic tick: time slices and lazy busy flags.
    pub fn tick(&mut self, now: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        for leaf in 0..self.engine.topology().nr_leaves() {
            self.engine.tick(leaf, now);
        }
        self.collect(&mut actions);
        actions
    }

    fn collect(&mut self, actions: &mut Vec<Action>) {
        let events = self.engine.drain_events();
        self.apply_events(events, actions, false);
    }

    fn apply_events(&mut self, events: Vec<SchedEvent>, actions: &mut Vec<Action>, adopting: bool) {
        let mut touched: Vec<String> = Vec::new();
        for ev in events {
            let task = match ev {
                SchedEvent::Started { task, .. }
                | SchedEvent::Preempted { task, .. }
                | SchedEvent::Migrated { task, .. } => task,
            };
            if let Some(id) = self.task_job.get(&task)
                && !touched.contains(id)
            {
                touched.push(id.clone());
            }
        }
        if adopting {
            return;
        }
        for id in touched {
            let Some(e) = self.jobs.get(&id) else {
                continue;
            };
            let mut cpus = Vec::new();
            let mut all_running = true;
            for t in &e.shares {
                match self.engine.task(*t).map(|t| t.state) {
                    Some(TaskState::Running(l)) => cpus.push(self.cpu(l)),
                    _ => all_running = false,
                }
            }
            cpus.sort_unstable();
            let Some(e) = self.jobs.get_mut(&id) else {
                continue;
            };
            if all_running {
                if !e.started {
                    e.started = true;
                    e.cpus = cpus.clone();
                    actions.push(Action::Start { id, cpus });
                } else if e.stopped {
                    e.stopped = false;
                    e.cpus = cpus.clone();
                    actions.push(Action::Cont { id, cpus });
                } else if e.cpus != cpus {
                    e.cpus = cpus.clone();
                    actions.push(Action::Repin { id, cpus });
                }
            } else if e.started && !e.stopped {
                e.stopped = true;
                actions.push(Action::Stop { id });
            }
        }
    }

    /// Per-CPU state for load reports: (cpu, busy, runnable).
    pub fn cpu_loads(&self) -> Vec<(u32, bool, u32)> {
        (0..self.engine.topology().nr_leaves())
            .map(|l| {
                let rq = self.engine.rq(l);
                (self.cpu(l), !rq.running.is_empty(), rq.nr_running)
            })
            .collect()
    }

    /// CPUs with more runnable tasks than capacity.
    pub fn overloaded(&self) -> Vec<u32> {
        (0..self.engine.topology().nr_leaves())
            .filter(|&l| self.engine.rq(l).is_overloaded())
            .map(|l| self.cpu(l))
            .collect()
    }

    /// Mean avg_idle over CPUs, ns.
    pub fn avg_idle(&self) -> u64 {
        let n = self.engine.topology().nr_leaves() as u64;
        (0..n as usize)
            .map(|l| self.engine.rq(l).avg_idle)
            .sum::<u64>()
            / n.max(1)
    }

    /// Idle CPUs per alignment level.
    pub fn free_summary(&self) -> sched::FreeSummary {
        self.engine.free_summary()
    }

    /// The waiting queue, for tests and reports.
    pub fn waiting_ids(&self) -> VecDeque<String> {
        self.waiting.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, cpus: u32, align: Align) -> LocalJob {
        LocalJob {
            id: id.into(),
            cpus,
            align,
            policy: Policy::Spread,
            nice: 0,
            latency_nice: 0,
            gpus: 0,
        }
    }

    fn local(spec: &str, oversubscribe: bool) -> LocalScheduler {
        LocalScheduler::new(
            Arc::new(Topology::from_spec(spec).unwrap()),
            LocalConfig {
                oversubscribe,
                ..LocalConfig::default()
            },
        )
    }

    #[test]
    fn gang_gets_aligned_cpus_or_waits() {
        let mut l = local("2s:4c:1t", false);
        let a = l.submit(job("a", 3, Align::Llc), 0).unwrap();
        let Action::Start { cpus, .. } = &a[0] else {
            panic!("{a:?}")
        };
        assert_eq!(cpus.len(), 3);
        let llc_of = |c: u32| c / 4;
        assert!(cpus.iter().all(|&c| llc_of(c) == llc_of(cpus[0])));
        // Another 3-CPU LLC job fits the other socket; a third must wait.
        assert_eq!(l.submit(job("b", 3, Align::Llc), 1).unwrap().len(), 1);
        assert!(l.submit(job("c", 3, Align::Llc), 2).unwrap().is_empty());
        assert_eq!(l.waiting_ids(), VecDeque::from(vec!["c".to_string()]));
        // a exits: c starts on a's socket.
        let acts = l.job_exited("a", 3);
        assert!(
            matches!(&acts[0], Action::Start { id, .. } if id == "c"),
            "{acts:?}"
        );
        assert!(l.submit(job("x", 5, Align::Llc), 4).is_err(), "never fits");
    }

    #[test]
    fn oversubscribed_tasks_time_slice() {
        let mut l = local("1s:1c:1t", true);
        let a = l.submit(job("a", 1, Align::Any), 0).unwrap();
        assert_eq!(
            a,
            vec![Action::Start {
                id: "a".into(),
                cpus: vec![0]
            }]
        );
        assert!(l.submit(job("b", 1, Align::Any), 1).unwrap().is_empty());
        let mut all = Vec::new();
        let mut now = 0;
        for _ in 0..100 {
            now += 10_000_000;
            all.extend(l.tick(now));
        }
        assert!(all.contains(&Action::Stop { id: "a".into() }), "{all:?}");
        assert!(all.contains(&Action::Start {
            id: "b".into(),
            cpus: vec![0]
        }));
        assert!(all.contains(&Action::Cont {
            id: "a".into(),
            cpus: vec![0]
        }));
    }

    #[test]
    fn idle_cpu_steals_a_waiting_job_and_repins_it() {
        // Two CPUs (SMT siblings), oversubscribed: three 1-CPU jobs.
        let mut l = local("1s:1c:2t", true);
        let mut acts = Vec::new();
        for id in ["a", "b", "c"] {
            acts.extend(l.submit(job(id, 1, Align::Any), 0).unwrap());
        }
        let started: Vec<&Action> = acts
            .iter()
            .filter(|a| matches!(a, Action::Start { .. }))
            .collect();
        assert_eq!(started.len(), 2);
        // Whichever job waits was queued behind a running one; when the
        // job on the *other* CPU exits, that CPU steals it.
        let waiting = ["a", "b", "c"]
            .into_iter()
            .find(|id| !l.is_started(id))
            .unwrap();
        let steals_before = l.engine().stats().steal;
        let victim_cpu = {
            let leaf = l.engine().leaf_of(TaskId(match waiting {
                "a" => 1,
                "b" => 2,
                _ => 3,
            }));
            leaf.map(|x| x as u32)
        };
        let other = ["a", "b", "c"]
            .into_iter()
            .find(|id| l.is_started(id) && l.cpus_of(id) != victim_cpu.map(|c| vec![c]).as_deref())
            .unwrap();
        let acts = l.job_exited(other, 5_000_000_000);
        assert!(
            acts.iter()
                .any(|a| matches!(a, Action::Start { id, .. } if id == waiting)),
            "{acts:?}"
        );
        assert_eq!(l.engine().stats().steal, steals_before + 1);
    }

    /// The 8-GPU X6-2 fixture (2 sockets x 22 cores x 2 threads, GPUs
    /// 0-3 on NUMA node 0, 4-7 on node 1).
    fn gpu_machine() -> LocalScheduler {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/x6-2-8gpu");
        let m = crate::topology::SysfsReader::new(root).read(None).unwrap();
        LocalScheduler::new(Arc::new(m.to_sched().unwrap()), LocalConfig::default())
            .with_gpus(GpuPool::new(&m))
    }

    fn gpu_job(id: &str, cpus: u32, align: Align, gpus: u32) -> LocalJob {
        LocalJob {
            gpus,
            ..job(id, cpus, align)
        }
    }

    fn started_cpus(actions: &[Action], id: &str) -> Vec<u32> {
        actions
            .iter()
            .find_map(|a| match a {
                Action::Start { id: i, cpus } if i == id => Some(cpus.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{id} did not start: {actions:?}"))
    }

    fn socket(cpu: u32) -> u32 {
        (cpu % 44) / 22
    }

    #[test]
    fn gpus_follow_the_cpus_numa_node_and_wait_until_freed() {
        let mut l = gpu_machine();
        // A job filling one NUMA node's CPUs, then a GPU job: its CPUs are
        // on the other node, and so are its GPUs (not GPUs 0-1 by default).
        let a = l.submit(job("numa", 44, Align::Numa), 0).unwrap();
        let busy = socket(started_cpus(&a, "numa")[0]);
        let b = l.submit(gpu_job("g2", 2, Align::Any, 2), 1).unwrap();
        let cpus = started_cpus(&b, "g2");
        assert!(cpus.iter().all(|&c| socket(c) != busy), "{cpus:?}");
        let gpus = l.gpus_of("g2");
        assert_eq!(gpus.len(), 2);
        assert!(
            gpus.iter()
                .all(|&g| l.gpu_pool().numa_node(g) == Some(socket(cpus[0]))),
            "GPUs {gpus:?} for CPUs {cpus:?}"
        );
        // The other six GPUs, then one more job: it waits for a GPU, not
        // for CPUs (plenty are idle).
        l.submit(gpu_job("g6", 1, Align::Any, 6), 2).unwrap();
        assert_eq!(l.gpu_pool().free(), 0);
        assert!(
            l.submit(gpu_job("g1", 1, Align::Any, 1), 3)
                .unwrap()
                .is_empty()
        );
        assert_eq!(l.waiting_ids(), VecDeque::from(vec!["g1".to_string()]));
        // A job without GPUs still starts.
        assert_eq!(l.submit(job("cpu", 1, Align::Any), 4).unwrap().len(), 1);
        let acts = l.job_exited("g2", 5);
        started_cpus(&acts, "g1");
        assert_eq!(l.gpus_of("g1").len(), 1);
        assert!(l.gpus_of("g2").is_empty());
        assert!(
            l.submit(gpu_job("g9", 1, Align::Any, 9), 6).is_err(),
            "more GPUs than the machine has"
        );
    }

    #[test]
    fn adopted_jobs_keep_their_gpus() {
        let mut l = gpu_machine();
        l.adopt(gpu_job("old", 1, Align::Any, 2), &[30], &[6, 7], 0);
        assert_eq!(l.gpus_of("old"), vec![6, 7]);
        assert_eq!(l.gpu_pool().free(), 6);
        l.job_exited("old", 1);
        assert_eq!(l.gpu_pool().free(), 8);
    }

    #[test]
    fn latency_class_waits_less() {
        let mut l = local("1s:2c:1t", false);
        l.submit(job("a", 2, Align::Any), 0).unwrap();
        l.submit(job("batch", 1, Align::Any), 1).unwrap();
        let mut lat = job("lat", 1, Align::Any);
        lat.latency_nice = -10;
        l.submit(lat, 2).unwrap();
        assert_eq!(l.waiting_ids().front().map(String::as_str), Some("lat"));
        let acts = l.job_exited("a", 3);
        let first = acts.iter().find_map(|a| match a {
            Action::Start { id, .. } => Some(id.clone()),
            _ => None,
        });
        assert_eq!(first.as_deref(), Some("lat"));
    }
}
