//! A node's last LoadReport as the dispatcher keeps it: packed, shared by
//! the cluster and the reader of the node's stream, and given back whole
//! (`to_proto`) for the views.
//!
//! A decoded `NodeLoad` of a 64-CPU node is about 2 KB of heap: a 12-byte
//! `CpuLoad` per CPU and a map of 23 schedstat names, each name its own
//! `String`. The dispatcher reads four numbers of it on its own (jobs
//! running and waiting, busy and overloaded CPUs, for the web page); the
//! rest is shown as reported (ListNodes, GetNode, `dispatchctl nodes`).
//! [`PackedLoad`] keeps those numbers and the scalars as fields and the
//! lists as varints in one buffer: the CPUs as runs (consecutive CPU
//! numbers in one state: the gap from the previous run, whether the run
//! is longer than one CPU, the state `runnable << 1 | busy`, and the
//! length), then the overloaded CPUs as gaps, then the schedstats in a
//! canonical order, a known name (the engine's `schedstat_fields`) by its
//! index, any other by its bytes. An idle 64-CPU node packs into about 55
//! bytes (one run); a CPU alone in its state costs its two bytes as before
//! runs were kept. The packing is exact:
//! `PackedLoad::new(l).to_proto() == l` for every `l` (a proptest below),
//! and two loads pack to equal values exactly when they are equal, so the
//! stream's reader compares packed loads to find a changed report.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use proto::v1::{CpuLoad, FreeSummary, NodeLoad};

/// A node's last LoadReport, packed (the empty load allocates nothing).
/// Cloning shares it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackedLoad(Option<Arc<Packed>>);

#[derive(Debug, PartialEq, Eq)]
struct Packed {
    scalars: Scalars,
    /// The CPUs, the overloaded CPUs and the schedstats, as varints.
    lists: Box<[u8]>,
}

/// The report's numbers, and the counts the dispatcher reads.
#[derive(Debug, PartialEq, Eq)]
struct Scalars {
    avg_idle_ns: u64,
    free: Option<[u32; 5]>,
    running_jobs: u32,
    waiting_jobs: u32,
    busy_cpus: u32,
    overloaded_cpus: u32,
}

/// Known schedstat names beyond this many pack as other names.
const MAX_KNOWN: usize = 32;

/// The engine's schedstat names (what agents report), by index.
fn known_names() -> &'static (Vec<&'static str>, HashMap<&'static str, u64>) {
    static NAMES: OnceLock<(Vec<&'static str>, HashMap<&'static str, u64>)> = OnceLock::new();
    NAMES.get_or_init(|| {
        let names: Vec<&'static str> =
            dispatch_telemetry::schedstat_fields(&sched::Schedstats::default())
                .iter()
                .map(|&(name, _)| name)
                .collect();
        let index = names
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, i as u64))
            .collect();
        (names, index)
    })
}

fn put(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// The gap from `prev` to `next` (zigzag: any order of numbers packs).
fn zigzag(prev: i64, next: u32) -> u64 {
    let d = i64::from(next) - prev - 1;
    ((d << 1) ^ (d >> 63)) as u64
}

fn put_gap(buf: &mut Vec<u8>, prev: i64, next: u32) {
    put(buf, zigzag(prev, next));
}

/// Reads back what [`put`] wrote. The buffer is always one this module
/// packed; a short one reads as zeros rather than panicking.
fn unzigzag(prev: i64, z: u64) -> u32 {
    let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
    (prev + 1 + d) as u32
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn get(&mut self) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some((&b, rest)) = self.0.split_first() else {
                return v;
            };
            self.0 = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                break;
            }
        }
        v
    }

    fn gap(&mut self, prev: i64) -> u32 {
        let z = self.get();
        unzigzag(prev, z)
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// Packs `load`'s lists into `lists` (cleared first); returns its numbers.
fn pack(load: &NodeLoad, lists: &mut Vec<u8>) -> Scalars {
    lists.clear();
    put(lists, load.cpus.len() as u64);
    // Runs: maximal stretches of consecutive CPU numbers in one state
    // (the encoding is canonical, so equal loads pack to equal bytes).
    let mut prev = -1i64;
    let mut busy_cpus = 0u32;
    let cpus = &load.cpus;
    let mut i = 0;
    while i < cpus.len() {
        let c = &cpus[i];
        let mut j = i + 1;
        while j < cpus.len()
            && i64::from(cpus[j].cpu) == i64::from(cpus[j - 1].cpu) + 1
            && cpus[j].busy == c.busy
            && cpus[j].runnable == c.runnable
        {
            j += 1;
        }
        let run = j - i;
        put(lists, zigzag(prev, c.cpu) << 1 | u64::from(run > 1));
        put(lists, u64::from(c.runnable) << 1 | u64::from(c.busy));
        if run > 1 {
            put(lists, (run - 2) as u64);
        }
        busy_cpus += u32::from(c.busy) * run as u32;
        prev = i64::from(cpus[j - 1].cpu);
        i = j;
    }
    put(lists, load.overloaded.len() as u64);
    let mut prev = -1i64;
    for &cpu in &load.overloaded {
        put_gap(lists, prev, cpu);
        prev = i64::from(cpu);
    }
    // Schedstats in one order whatever the map's: the known names by
    // index, then the others by name.
    let (_, index) = known_names();
    let mut known = [None::<u64>; MAX_KNOWN];
    let mut other: Vec<(&str, u64)> = Vec::new();
    for (name, &v) in &load.schedstats {
        match index.get(name.as_str()) {
            Some(&i) if (i as usize) < MAX_KNOWN => known[i as usize] = Some(v),
            _ => other.push((name, v)),
        }
    }
    put(lists, known.iter().flatten().count() as u64);
    for (i, v) in known.iter().enumerate() {
        if let Some(v) = v {
            put(lists, i as u64);
            put(lists, *v);
        }
    }
    other.sort_unstable();
    put(lists, other.len() as u64);
    for (name, v) in other {
        put(lists, name.len() as u64);
        lists.extend_from_slice(name.as_bytes());
        put(lists, v);
    }
    Scalars {
        avg_idle_ns: load.avg_idle_ns,
        free: load
            .free
            .as_ref()
            .map(|f| [f.core, f.llc, f.numa, f.package, f.any]),
        running_jobs: load.running_jobs,
        waiting_jobs: load.waiting_jobs,
        busy_cpus,
        overloaded_cpus: load.overloaded.len() as u32,
    }
}

impl PackedLoad {
    /// `load`, packed.
    pub fn new(load: &NodeLoad) -> Self {
        if *load == NodeLoad::default() {
            return Self(None);
        }
        let mut lists = Vec::with_capacity(8 + load.cpus.len() * 2 + load.schedstats.len() * 3);
        let scalars = pack(load, &mut lists);
        Self(Some(Arc::new(Packed {
            scalars,
            lists: lists.into_boxed_slice(),
        })))
    }

    /// `load` packed if it differs from this one, else None. `scratch` is
    /// the caller's buffer, kept between calls: an unchanged report (the
    /// common heartbeat) allocates nothing.
    pub fn changed(&self, load: &NodeLoad, scratch: &mut Vec<u8>) -> Option<Self> {
        let Some(p) = &self.0 else {
            return (*load != NodeLoad::default()).then(|| Self::new(load));
        };
        let scalars = pack(load, scratch);
        if scalars == p.scalars && *p.lists == scratch[..] {
            return None;
        }
        Some(Self(Some(Arc::new(Packed {
            scalars,
            lists: scratch.as_slice().into(),
        }))))
    }

    /// The load as reported.
    pub fn to_proto(&self) -> NodeLoad {
        let Some(p) = &self.0 else {
            return NodeLoad::default();
        };
        let (s, mut r) = (&p.scalars, Reader(&p.lists));
        let n = r.get() as usize;
        let mut cpus = Vec::with_capacity(n);
        let mut prev = -1i64;
        // Every count is bounded by the bytes left (each entry takes at
        // least one), so that no buffer, even a wrong one, decodes into
        // more than it holds.
        while cpus.len() < n && !r.0.is_empty() {
            let head = r.get();
            let first = unzigzag(prev, head >> 1);
            let state = r.get();
            let run = if head & 1 == 1 {
                (r.get() as usize).saturating_add(2)
            } else {
                1
            };
            for k in 0..run.min(n - cpus.len()) {
                let cpu = first.wrapping_add(k as u32);
                prev = i64::from(cpu);
                cpus.push(CpuLoad {
                    cpu,
                    busy: state & 1 == 1,
                    runnable: (state >> 1) as u32,
                });
            }
        }
        let n = (r.get() as usize).min(r.0.len());
        let mut overloaded = Vec::with_capacity(n);
        let mut prev = -1i64;
        for _ in 0..n {
            let cpu = r.gap(prev);
            prev = i64::from(cpu);
            overloaded.push(cpu);
        }
        let (names, _) = known_names();
        let mut schedstats = HashMap::new();
        for _ in 0..r.get().min(r.0.len() as u64) {
            let i = r.get() as usize;
            let v = r.get();
            if let Some(name) = names.get(i) {
                schedstats.insert((*name).to_string(), v);
            }
        }
        for _ in 0..r.get().min(r.0.len() as u64) {
            let len = r.get() as usize;
            let name = String::from_utf8_lossy(r.bytes(len)).into_owned();
            schedstats.insert(name, r.get());
        }
        NodeLoad {
            cpus,
            overloaded,
            avg_idle_ns: s.avg_idle_ns,
            free: s.free.map(|[core, llc, numa, package, any]| FreeSummary {
                core,
                llc,
                numa,
                package,
                any,
            }),
            running_jobs: s.running_jobs,
            waiting_jobs: s.waiting_jobs,
            schedstats,
        }
    }

    /// Jobs running on the node.
    pub fn running_jobs(&self) -> u32 {
        self.0.as_ref().map_or(0, |p| p.scalars.running_jobs)
    }

    /// Jobs started on the node but waiting for CPUs.
    pub fn waiting_jobs(&self) -> u32 {
        self.0.as_ref().map_or(0, |p| p.scalars.waiting_jobs)
    }

    /// CPUs reported busy.
    pub fn busy_cpus(&self) -> u32 {
        self.0.as_ref().map_or(0, |p| p.scalars.busy_cpus)
    }

    /// CPUs reported overloaded.
    pub fn overloaded_cpus(&self) -> u32 {
        self.0.as_ref().map_or(0, |p| p.scalars.overloaded_cpus)
    }
}

impl From<NodeLoad> for PackedLoad {
    fn from(load: NodeLoad) -> Self {
        Self::new(&load)
    }
}

impl From<&NodeLoad> for PackedLoad {
    fn from(load: &NodeLoad) -> Self {
        Self::new(load)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn schedstats() -> impl Strategy<Value = HashMap<String, u64>> {
        let name = prop_oneof![
            (0usize..23).prop_map(|i| known_names().0[i].to_string()),
            "[a-z_é]{0,12}",
        ];
        proptest::collection::hash_map(name, any::<u64>(), 0..30)
    }

    fn load() -> impl Strategy<Value = NodeLoad> {
        (
            prop_oneof![
                proptest::collection::vec((any::<u32>(), any::<bool>(), any::<u32>()), 0..80),
                // Runs: stretches of consecutive CPUs in one state (some
                // at the end of the number range), as real reports have.
                proptest::collection::vec(
                    (
                        prop_oneof![0u32..200, any::<u32>()],
                        1u32..70,
                        any::<bool>(),
                        0u32..3
                    ),
                    0..6,
                )
                .prop_map(|runs| runs
                    .into_iter()
                    .flat_map(|(start, len, busy, runnable)| (0..len)
                        .map_while(move |k| start.checked_add(k))
                        .map(move |cpu| (cpu, busy, runnable)))
                    .collect()),
            ],
            proptest::collection::vec(prop_oneof![0u32..70, any::<u32>()], 0..10),
            any::<u64>(),
            proptest::option::of(any::<[u32; 5]>()),
            any::<u32>(),
            any::<u32>(),
            schedstats(),
        )
            .prop_map(
                |(cpus, overloaded, avg, free, running, waiting, schedstats)| NodeLoad {
                    cpus: cpus
                        .into_iter()
                        .map(|(cpu, busy, runnable)| CpuLoad {
                            cpu,
                            busy,
                            runnable,
                        })
                        .collect(),
                    overloaded,
                    avg_idle_ns: avg,
                    free: free.map(|[core, llc, numa, package, any]| FreeSummary {
                        core,
                        llc,
                        numa,
                        package,
                        any,
                    }),
                    running_jobs: running,
                    waiting_jobs: waiting,
                    schedstats,
                },
            )
    }

    proptest! {
        /// Packing is exact: the view is the report, field by field, and
        /// the numbers the dispatcher reads are counted as the brute force
        /// over the report counts them.
        #[test]
        fn a_packed_load_gives_back_the_report(l in load()) {
            let p = PackedLoad::new(&l);
            prop_assert_eq!(p.to_proto(), l.clone());
            prop_assert_eq!(p.busy_cpus() as usize, l.cpus.iter().filter(|c| c.busy).count());
            prop_assert_eq!(p.overloaded_cpus() as usize, l.overloaded.len());
            prop_assert_eq!(p.running_jobs(), l.running_jobs);
            prop_assert_eq!(p.waiting_jobs(), l.waiting_jobs);
        }

        /// Two loads pack equal exactly when they are equal (a changed
        /// report is never taken for the last one).
        #[test]
        fn packed_loads_are_equal_exactly_when_the_loads_are(
            a in load(),
            b in load(),
            how in 0u8..4,
            stat in any::<u64>(),
        ) {
            // Another load, the same, or the same numbers with one list
            // changed (a schedstat, a CPU's number).
            let b = match how {
                0 => b,
                1 => a.clone(),
                2 => {
                    let mut b = a.clone();
                    b.schedstats.insert("sis_easy".into(), stat);
                    b
                }
                _ => {
                    let mut b = a.clone();
                    if let Some(c) = b.cpus.first_mut() {
                        c.cpu = c.cpu.wrapping_add(1);
                    }
                    b
                }
            };
            prop_assert_eq!(PackedLoad::new(&a) == PackedLoad::new(&b), a == b);
            // The reader's path: a scratch buffer reused across reports.
            let mut scratch = vec![7; 3];
            let last = PackedLoad::new(&a);
            match last.changed(&b, &mut scratch) {
                None => prop_assert_eq!(&a, &b),
                Some(p) => {
                    prop_assert!(a != b);
                    prop_assert_eq!(p.to_proto(), b.clone());
                    prop_assert_eq!(p, PackedLoad::new(&b));
                }
            }
            prop_assert!(PackedLoad::default().changed(&b, &mut scratch).is_some() == (b != NodeLoad::default()));
        }
    }

    #[test]
    fn the_empty_load_packs_to_nothing_and_a_map_order_does_not_matter() {
        assert_eq!(PackedLoad::new(&NodeLoad::default()), PackedLoad::default());
        assert_eq!(PackedLoad::default().to_proto(), NodeLoad::default());
        let names = &known_names().0;
        let a: HashMap<String, u64> = names.iter().map(|n| (n.to_string(), 1)).collect();
        let mut b = HashMap::with_capacity(64);
        for n in names.iter().rev() {
            b.insert(n.to_string(), 1);
        }
        let (a, b) = (
            NodeLoad {
                schedstats: a,
                ..Default::default()
            },
            NodeLoad {
                schedstats: b,
                ..Default::default()
            },
        );
        assert_eq!(PackedLoad::new(&a), PackedLoad::new(&b));
    }
}
