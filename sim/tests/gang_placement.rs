//! Property tests of the gang placement of the two gang baselines,
//! `least-loaded` and `first-fit`, driven through the [`Placer`] interface
//! against a brute-force model of the cluster kept here (free CPUs per
//! node, replayed from the policy's own starts and the test's finishes):
//!
//! * all or nothing: a job's starts in one call are exactly its members,
//!   on distinct nodes, each with room for a member when it starts;
//! * least-loaded's choice: the members' nodes are N nodes with the most
//!   free CPUs (sorted free counts equal the N largest); a single job goes
//!   to a node with the most free CPUs; after every call the oldest
//!   waiting gang does not fit and no pending single job fits;
//! * first-fit's choice: a job started by the main loop (the queue's head
//!   at that moment) spans the fewest racks any choice of nodes with room
//!   could (checked over every subset of racks), in one rack the one with
//!   the fewest nodes with room that holds it (best fit), and in each rack
//!   it takes the lowest-numbered nodes with room; after every call the
//!   queue's head (latency class, then arrival) does not fit.
//!
//! The simulator's jobs have no `within` constraint (its gangs are
//! `within any`), so none is checked here.

use proptest::prelude::*;
use sim::US_PER_S;
use sim::layout::Layout;
use sim::policy::{self, Placer, PolicySpec, Started, SubmitReq};

#[derive(Clone, Debug)]
enum Op {
    Submit {
        cpus: u32,
        nodes: u32,
        latency: bool,
        limit_s: Option<u64>,
    },
    /// Finish the running job at this index (modulo their number).
    Finish(usize),
}

fn op(max_nodes: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u32..=4, prop_oneof![2 => Just(1u32), 3 => 1..=max_nodes], any::<bool>(),
              proptest::option::of(1u64..200))
            .prop_map(|(cpus, nodes, latency, limit_s)| Op::Submit { cpus, nodes, latency, limit_s }),
        2 => any::<usize>().prop_map(Op::Finish),
    ]
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Which {
    LeastLoaded,
    FirstFit,
}

/// A waiting job of the model: (job, cpus, nodes, latency, arrival).
type Waiting = (u32, u32, u32, bool, u64);

struct Model {
    layout: Layout,
    free: Vec<u32>,
    /// Running jobs: (job, cpus, nodes).
    running: Vec<(u32, u32, Vec<u32>)>,
    waiting: Vec<Waiting>,
}

impl Model {
    fn fits(&self, cpus: u32, nodes: u32) -> bool {
        self.free.iter().filter(|&&f| f >= cpus).count() >= nodes as usize
    }

    fn rack(&self, n: u32) -> usize {
        self.layout.rack_of(n) as usize
    }

    /// Fewest racks whose nodes with room for `cpus` number `nodes`,
    /// trying every subset of racks.
    fn min_racks(&self, cpus: u32, nodes: u32) -> u32 {
        let racks = self.free.len() / self.layout.nodes_per_rack;
        let mut per = vec![0u32; racks];
        for (n, &f) in self.free.iter().enumerate() {
            if f >= cpus {
                per[self.rack(n as u32)] += 1;
            }
        }
        let mut best = u32::MAX;
        for mask in 1u32..(1 << racks) {
            let sum: u32 = (0..racks)
                .filter(|r| mask >> r & 1 == 1)
                .map(|r| per[r])
                .sum();
            if sum >= nodes {
                best = best.min(mask.count_ones());
            }
        }
        best
    }

    /// Check one job's start (its members, in the policy's order) against
    /// the state before it, then apply it.
    fn start(&mut self, which: Which, job: u32, members: &[u32]) -> Result<(), TestCaseError> {
        let i = self
            .waiting
            .iter()
            .position(|w| w.0 == job)
            .ok_or_else(|| TestCaseError::fail(format!("job {job} started but not waiting")))?;
        let head = self.waiting.iter().map(|w| (!w.3, w.4)).min();
        let is_head = head == Some((!self.waiting[i].3, self.waiting[i].4));
        let (_, cpus, nodes, _, _) = self.waiting.remove(i);
        prop_assert_eq!(members.len(), nodes as usize, "job {}: all or nothing", job);
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), members.len(), "job {}: distinct nodes", job);
        for &n in members {
            prop_assert!(self.free[n as usize] >= cpus, "job {job}: node {n} full");
        }
        match which {
            Which::LeastLoaded => {
                let mut all: Vec<u32> = self.free.clone();
                all.sort_unstable_by(|a, b| b.cmp(a));
                let mut got: Vec<u32> = members.iter().map(|&n| self.free[n as usize]).collect();
                got.sort_unstable_by(|a, b| b.cmp(a));
                prop_assert_eq!(&got[..], &all[..got.len()], "job {}: most free", job);
            }
            // Backfilled jobs choose among the CPUs the head's reservation
            // leaves, which the model does not know: the choice is checked
            // for the main loop's starts (the queue's head each time).
            Which::FirstFit if is_head => {
                let mut racks: Vec<usize> = members.iter().map(|&n| self.rack(n)).collect();
                racks.sort_unstable();
                racks.dedup();
                prop_assert_eq!(
                    racks.len() as u32,
                    self.min_racks(cpus, nodes),
                    "job {}: fewest racks",
                    job
                );
                let room_in = |r: usize| {
                    (0..self.free.len() as u32)
                        .filter(|&n| self.rack(n) == r && self.free[n as usize] >= cpus)
                        .count()
                };
                if racks.len() == 1 {
                    // Best fit: no rack that holds it has fewer nodes with
                    // room.
                    let nr = self.free.len() / self.layout.nodes_per_rack;
                    let fewest = (0..nr).map(room_in).filter(|&c| c >= nodes as usize).min();
                    prop_assert_eq!(Some(room_in(racks[0])), fewest, "job {}: best fit", job);
                }
                for &r in &racks {
                    let with_room: Vec<u32> = (0..self.free.len() as u32)
                        .filter(|&n| self.rack(n) == r && self.free[n as usize] >= cpus)
                        .collect();
                    let mine: Vec<u32> = sorted
                        .iter()
                        .copied()
                        .filter(|&n| self.rack(n) == r)
                        .collect();
                    prop_assert_eq!(&mine[..], &with_room[..mine.len()], "job {}: lowest", job);
                }
            }
            Which::FirstFit => {}
        }
        for &n in members {
            self.free[n as usize] -= cpus;
        }
        self.running.push((job, cpus, members.to_vec()));
        Ok(())
    }

    /// Replay one call's starts, grouped by job.
    fn apply(&mut self, which: Which, out: &[Started]) -> Result<(), TestCaseError> {
        let mut k = 0;
        while k < out.len() {
            let job = out[k].job;
            let mut e = k;
            while e < out.len() && out[e].job == job {
                e += 1;
            }
            let members: Vec<u32> = out[k..e].iter().map(|s| s.node).collect();
            self.start(which, job, &members)?;
            k = e;
        }
        Ok(())
    }

    /// What must not be left waiting after a call.
    fn settled(&self, which: Which) -> Result<(), TestCaseError> {
        match which {
            Which::LeastLoaded => {
                if let Some(g) = self.waiting.iter().filter(|w| w.2 > 1).min_by_key(|w| w.4) {
                    prop_assert!(!self.fits(g.1, g.2), "oldest gang {} fits", g.0);
                }
                for w in self.waiting.iter().filter(|w| w.2 == 1) {
                    prop_assert!(!self.fits(w.1, 1), "pending job {} fits", w.0);
                }
            }
            Which::FirstFit => {
                if let Some(h) = self.waiting.iter().min_by_key(|w| (!w.3, w.4)) {
                    prop_assert!(!self.fits(h.1, h.2), "head {} fits", h.0);
                }
            }
        }
        Ok(())
    }
}

fn run(which: Which, racks: u32, per_rack: u32, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let layout = Layout::new(&format!("1z:{racks}r:{per_rack}n"), "1s:4c:1t").unwrap();
    let name = match which {
        Which::LeastLoaded => "least-loaded",
        Which::FirstFit => "first-fit",
    };
    let mut p: Box<dyn Placer> =
        policy::build(&PolicySpec::parse(name).unwrap(), &layout, US_PER_S, 1).unwrap();
    let mut m = Model {
        free: vec![4; layout.nr_nodes()],
        layout,
        running: Vec::new(),
        waiting: Vec::new(),
    };
    let mut out = Vec::new();
    for (t, o) in ops.into_iter().enumerate() {
        let now = t as u64 * US_PER_S;
        out.clear();
        match o {
            Op::Submit {
                cpus,
                nodes,
                latency,
                limit_s,
            } => {
                let job = t as u32;
                m.waiting.push((job, cpus, nodes, latency, t as u64));
                let req = SubmitReq {
                    job,
                    cpus,
                    nodes,
                    latency,
                    waker: None,
                    limit_us: limit_s.map(|s| s * US_PER_S),
                    gpus: 0,
                    user: None,
                };
                p.submit(now, &[req], &mut out).unwrap();
                m.apply(which, &out)?;
            }
            Op::Finish(i) => {
                if m.running.is_empty() {
                    continue;
                }
                let (job, cpus, nodes) = m.running.remove(i % m.running.len());
                for &n in &nodes {
                    m.free[n as usize] += cpus;
                }
                for &n in &nodes {
                    p.finished(now, job, n, &mut out).unwrap();
                }
                m.apply(which, &out)?;
            }
        }
        m.settled(which)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn least_loaded_gangs_match_the_oracle(
        racks in 1u32..=3, per_rack in 1u32..=4,
        ops in proptest::collection::vec(op(8), 1..60),
    ) {
        let total = racks * per_rack;
        let ops = ops.into_iter().map(|o| match o {
            Op::Submit { cpus, nodes, latency, limit_s } =>
                Op::Submit { cpus, nodes: nodes.min(total), latency, limit_s },
            f => f,
        }).collect();
        run(Which::LeastLoaded, racks, per_rack, ops)?;
    }

    #[test]
    fn first_fit_gangs_match_the_oracle(
        racks in 1u32..=4, per_rack in 1u32..=4,
        ops in proptest::collection::vec(op(10), 1..60),
    ) {
        let total = racks * per_rack;
        let ops = ops.into_iter().map(|o| match o {
            Op::Submit { cpus, nodes, latency, limit_s } =>
                Op::Submit { cpus, nodes: nodes.min(total), latency, limit_s },
            f => f,
        }).collect();
        run(Which::FirstFit, racks, per_rack, ops)?;
    }
}
