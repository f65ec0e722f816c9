//! Property tests of gang placement ([`sched::gang`]) and device choice
//! ([`sched::devices`]) against brute-force oracles that never ask the
//! engine: a node's rack and zone come from the cluster spec's own
//! arithmetic (`Zz:Rr:Nn` numbers nodes zone by zone, rack by rack), a
//! device's closeness from comparing paths pair by pair, the answers from
//! enumerating every subset.
//!
//! - a gang is placed if and only if some domain of its level has as many
//!   nodes with room as it has members; then on distinct nodes with room,
//!   all in one domain; never partly (all members or `None`);
//! - spread takes a feasible domain with the fewest nodes with room, and
//!   in it the nodes with the least room left; pack the lowest domain and
//!   its lowest nodes;
//! - a reservation's start is the least, over every set of `members` nodes
//!   of one domain, of the latest ready time in the set, and its nodes are
//!   all ready by then; they span the fewest racks of any such set with
//!   that start.
//!
//! - device choice ([`sched::devices::choose_devices`]) takes a set of
//!   `k` free devices as close as any (the innermost level at which all
//!   share their path, computed pair by pair), in a domain with the fewest
//!   free devices that still hold `k`; `None` only when fewer than `k` are
//!   free.
//!
//! Each property counts the cases that exercised both outcomes.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sched::Policy;
use sched::alloc::Align;
use sched::devices::choose_devices;
use sched::gang::{find_gang_in, gang_reservation_in};
use sched::topology::Topology;

/// (zones, racks per zone, nodes per rack).
const SHAPES: &[(usize, usize, usize)] = &[(1, 2, 3), (2, 2, 3), (2, 3, 2), (1, 1, 5), (3, 2, 2)];

struct Shape {
    zones: usize,
    racks: usize,
    nodes: usize,
}

impl Shape {
    fn leaves(&self) -> usize {
        self.zones * self.racks * self.nodes
    }
    /// The domain of `leaf` at `level`, by the spec's arithmetic.
    fn domain(&self, level: Align, leaf: usize) -> usize {
        match level {
            Align::Llc => leaf / self.nodes,
            Align::Numa => leaf / (self.racks * self.nodes),
            _ => 0,
        }
    }
    fn domains(&self, level: Align) -> usize {
        self.domain(level, self.leaves() - 1) + 1
    }
    fn topology(&self) -> Topology {
        Topology::from_spec(&format!("{}z:{}r:{}n", self.zones, self.racks, self.nodes))
            .expect("cluster spec")
    }
}

const LEVELS: [Align; 3] = [Align::Llc, Align::Numa, Align::Any];

fn case() -> impl Strategy<Value = (usize, usize, usize, Vec<Option<u32>>, usize)> {
    (0..SHAPES.len(), 0..LEVELS.len(), 1usize..7).prop_flat_map(|(s, level, members)| {
        let (z, r, n) = SHAPES[s];
        (
            Just(s),
            Just(level),
            Just(members),
            proptest::collection::vec(proptest::option::weighted(0.6, 0u32..6), z * r * n),
            0usize..2,
        )
    })
}

#[test]
fn gang_is_placed_whole_in_one_domain_iff_one_has_room() {
    let placed = Cell::new(0);
    let waited = Cell::new(0);
    let spread_one_rack = Cell::new(0);
    let spread_racks = Cell::new(0);
    let mut runner = TestRunner::new(Config::with_cases(2000));
    runner
        .run(&case(), |(s, level, members, room, pol)| {
            let (zones, racks, nodes) = SHAPES[s];
            let shape = Shape {
                zones,
                racks,
                nodes,
            };
            let level = LEVELS[level];
            let policy = [Policy::Spread, Policy::Pack][pol];
            let topo = shape.topology();
            let got = find_gang_in(&topo, members, level, policy, |l| room[l]);

            // Nodes with room per domain, by the oracle.
            let mut with_room: Vec<Vec<usize>> = vec![Vec::new(); shape.domains(level)];
            for (leaf, r) in room.iter().enumerate() {
                if r.is_some() {
                    with_room[shape.domain(level, leaf)].push(leaf);
                }
            }
            let feasible: Vec<usize> = (0..with_room.len())
                .filter(|&d| with_room[d].len() >= members)
                .collect();
            match got {
                None => {
                    prop_assert!(feasible.is_empty(), "a domain had room: {feasible:?}");
                    waited.set(waited.get() + 1);
                }
                Some(leaves) => {
                    placed.set(placed.get() + 1);
                    prop_assert_eq!(leaves.len(), members, "all members or none");
                    let mut distinct = leaves.clone();
                    distinct.dedup();
                    prop_assert_eq!(distinct.len(), members, "distinct nodes");
                    prop_assert!(leaves.iter().all(|&l| room[l].is_some()), "room");
                    let d = shape.domain(level, leaves[0]);
                    prop_assert!(
                        leaves.iter().all(|&l| shape.domain(level, l) == d),
                        "one domain"
                    );
                    match policy {
                        Policy::Pack => {
                            prop_assert_eq!(d, feasible[0], "lowest domain");
                            let lowest: Vec<usize> =
                                with_room[d].iter().copied().take(members).collect();
                            prop_assert_eq!(leaves, lowest);
                        }
                        Policy::Spread => {
                            let fewest = feasible.iter().map(|&f| with_room[f].len()).min();
                            prop_assert_eq!(Some(with_room[d].len()), fewest, "best-fit domain");
                            // Racks of the domain by nodes with room; the
                            // fewest racks that can hold the gang: the
                            // largest counts first.
                            let mut per_rack: Vec<(usize, Vec<usize>)> = Vec::new();
                            for &l in &with_room[d] {
                                let r = shape.domain(Align::Llc, l);
                                match per_rack.iter_mut().find(|(x, _)| *x == r) {
                                    Some((_, v)) => v.push(l),
                                    None => per_rack.push((r, vec![l])),
                                }
                            }
                            let mut counts: Vec<usize> =
                                per_rack.iter().map(|(_, v)| v.len()).collect();
                            counts.sort_unstable_by(|a, b| b.cmp(a));
                            let min_racks = (1..=counts.len())
                                .find(|&k| counts[..k].iter().sum::<usize>() >= members)
                                .unwrap_or(counts.len());
                            let mut used: Vec<usize> = leaves
                                .iter()
                                .map(|&l| shape.domain(Align::Llc, l))
                                .collect();
                            used.sort_unstable();
                            used.dedup();
                            prop_assert_eq!(used.len(), min_racks, "fewest racks");
                            if min_racks == 1 {
                                spread_one_rack.set(spread_one_rack.get() + 1);
                                // The best-fitting rack, and its fullest nodes.
                                let best = per_rack
                                    .iter()
                                    .filter(|(_, v)| v.len() >= members)
                                    .map(|(_, v)| v.len())
                                    .min();
                                let (_, nodes) =
                                    per_rack.iter().find(|(r, _)| *r == used[0]).unwrap();
                                prop_assert_eq!(Some(nodes.len()), best, "best-fit rack");
                                let mut rooms: Vec<u32> =
                                    nodes.iter().filter_map(|&l| room[l]).collect();
                                rooms.sort_unstable();
                                let mut chosen: Vec<u32> =
                                    leaves.iter().filter_map(|&l| room[l]).collect();
                                chosen.sort_unstable();
                                prop_assert_eq!(
                                    chosen,
                                    rooms[..members].to_vec(),
                                    "best-fit nodes"
                                );
                            } else {
                                spread_racks.set(spread_racks.get() + 1);
                            }
                        }
                    }
                }
            }
            Ok(())
        })
        .expect("property");
    assert!(
        placed.get() > 300 && waited.get() > 300,
        "placed {} waited {}",
        placed.get(),
        waited.get()
    );
    assert!(
        spread_one_rack.get() > 100 && spread_racks.get() > 30,
        "spread in one rack {} over several {}",
        spread_one_rack.get(),
        spread_racks.get()
    );
}

/// Every `k`-subset of `items`.
fn subsets(
    items: &[usize],
    k: usize,
    out: &mut Vec<Vec<usize>>,
    cur: &mut Vec<usize>,
    from: usize,
) {
    if cur.len() == k {
        out.push(cur.clone());
        return;
    }
    for i in from..items.len() {
        cur.push(items[i]);
        subsets(items, k, out, cur, i + 1);
        cur.pop();
    }
}

#[test]
fn reservation_is_the_earliest_time_a_domain_holds_the_gang() {
    let reserved = Cell::new(0);
    let never = Cell::new(0);
    let mut runner = TestRunner::new(Config::with_cases(1500));
    let strategy = case().prop_flat_map(|(s, level, members, _, _)| {
        let (z, r, n) = SHAPES[s];
        (
            Just(s),
            Just(level),
            Just(members),
            proptest::collection::vec(proptest::option::weighted(0.8, 0u64..20), z * r * n),
        )
    });
    runner
        .run(&strategy, |(s, level, members, ready)| {
            let (zones, racks, nodes) = SHAPES[s];
            let shape = Shape {
                zones,
                racks,
                nodes,
            };
            let level = LEVELS[level];
            let got = gang_reservation_in(&shape.topology(), members, level, |l| ready[l]);
            let mut best: Option<u64> = None;
            // Per start time, the fewest racks of a set with that start.
            let mut racks_at: std::collections::HashMap<u64, usize> = Default::default();
            for d in 0..shape.domains(level) {
                let ready_leaves: Vec<usize> = (0..shape.leaves())
                    .filter(|&l| shape.domain(level, l) == d && ready[l].is_some())
                    .collect();
                let mut all = Vec::new();
                subsets(&ready_leaves, members, &mut all, &mut Vec::new(), 0);
                for set in all {
                    let t = set.iter().filter_map(|&l| ready[l]).max().unwrap_or(0);
                    best = Some(best.map_or(t, |b: u64| b.min(t)));
                    let mut racks: Vec<usize> =
                        set.iter().map(|&l| shape.domain(Align::Llc, l)).collect();
                    racks.sort_unstable();
                    racks.dedup();
                    let e = racks_at.entry(t).or_insert(usize::MAX);
                    *e = (*e).min(racks.len());
                }
            }
            match got {
                None => {
                    prop_assert_eq!(best, None);
                    never.set(never.get() + 1);
                }
                Some(r) => {
                    reserved.set(reserved.get() + 1);
                    prop_assert_eq!(Some(r.start), best);
                    prop_assert_eq!(r.leaves.len(), members);
                    let d = shape.domain(level, r.leaves[0]);
                    for &l in &r.leaves {
                        prop_assert_eq!(shape.domain(level, l), d);
                        prop_assert!(ready[l].is_some_and(|t| t <= r.start));
                    }
                    let mut racks: Vec<usize> = r
                        .leaves
                        .iter()
                        .map(|&l| shape.domain(Align::Llc, l))
                        .collect();
                    racks.sort_unstable();
                    racks.dedup();
                    prop_assert_eq!(
                        racks.len(),
                        racks_at[&r.start],
                        "{:?} span more racks than needed at {}",
                        &r.leaves,
                        r.start
                    );
                }
            }
            Ok(())
        })
        .expect("property");
    assert!(
        reserved.get() > 300 && never.get() > 100,
        "reserved {} never {}",
        reserved.get(),
        never.get()
    );
}

/// The innermost level at which devices `a` and `b` share their path.
fn pair_level(keys: &[Vec<u64>], a: usize, b: usize) -> usize {
    let levels = keys[a].len();
    (0..levels)
        .find(|&l| (l..levels).all(|m| keys[a][m] == keys[b][m]))
        .unwrap_or(levels)
}

fn set_level(keys: &[Vec<u64>], set: &[usize]) -> usize {
    let mut worst = 0;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            worst = worst.max(pair_level(keys, a, b));
        }
    }
    worst
}

#[test]
fn chosen_devices_are_the_closest_and_best_fitting() {
    let nontrivial = Cell::new(0);
    let refused = Cell::new(0);
    let strategy = (
        proptest::collection::vec((0u64..2, 0u64..2, 0u64..2, any::<bool>()), 1..11),
        1usize..6,
    );
    TestRunner::new(Config::with_cases(3000))
        .run(&strategy, |(devs, k)| {
            // Keys: switch, host bridge, NUMA node, machine.
            let keys: Vec<Vec<u64>> = devs.iter().map(|&(s, h, n, _)| vec![s, h, n, 0]).collect();
            let free: Vec<usize> = (0..devs.len()).filter(|&i| devs[i].3).collect();
            let got = choose_devices(k, &keys, |i| devs[i].3);
            let mut all = Vec::new();
            subsets(&free, k, &mut all, &mut Vec::new(), 0);
            let Some(chosen) = got else {
                prop_assert!(all.is_empty(), "{} free, k {k}", free.len());
                refused.set(refused.get() + 1);
                return Ok(());
            };
            prop_assert_eq!(chosen.len(), k);
            prop_assert!(chosen.iter().all(|&i| devs[i].3), "only free devices");
            prop_assert!(
                chosen.windows(2).all(|w| w[0] < w[1]),
                "distinct, ascending"
            );
            let best = all.iter().map(|s| set_level(&keys, s)).min().unwrap_or(0);
            let level = set_level(&keys, &chosen);
            prop_assert_eq!(level, best, "closest set");
            if level < keys[0].len() && k > 1 {
                // Best fit: the chosen domain has the fewest free devices of
                // all domains at this level that hold k.
                let dom = |i: usize| keys[i][level..].to_vec();
                let count = |d: &Vec<u64>| free.iter().filter(|&&i| &dom(i) == d).count();
                let fewest = free
                    .iter()
                    .map(|&i| count(&dom(i)))
                    .filter(|&c| c >= k)
                    .min();
                prop_assert_eq!(Some(count(&dom(chosen[0]))), fewest, "best-fit domain");
            }
            if chosen[..] != free[..k] {
                nontrivial.set(nontrivial.get() + 1);
            }
            Ok(())
        })
        .expect("property");
    assert!(
        nontrivial.get() > 300 && refused.get() > 100,
        "nontrivial {} refused {}",
        nontrivial.get(),
        refused.get()
    );
}
