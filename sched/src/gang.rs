//! Gangs: placing `n` members of one job on `n` distinct leaves inside one
//! domain of a chosen level, all at once or not at all, and the reservation
//! a gang that cannot start now holds so that smaller work cannot starve
//! it. At cluster level a leaf is a node, the LLC level a rack and the NUMA
//! level a zone, so `--nodes 8 --within rack` is a gang of 8 aligned at
//! [`Align::Llc`].
//!
//! This is not in the seeds either: the kernel has no gangs. It is the
//! multi-node analogue of [`crate::alloc`]'s aligned allocation, with the
//! same policies. *Spread* takes the best-fitting domain (the fewest leaves
//! with room that still hold the gang, as Slurm's topology/tree picks the
//! lowest switch with enough nodes and the fullest one of those), so whole
//! racks stay free for the next large gang; inside it the members span
//! the fewest racks that can hold them (a gang allowed a zone or the whole
//! cluster is still as compact as the free racks allow: largest racks
//! first, the rest in the best-fitting rack), and in a rack the leaves
//! with the least room left once a member is placed (best fit again). *Pack*
//! takes the lowest-numbered domain with room and its lowest leaves (seed
//! 002's priority order).
//!
//! Both functions take the leaves' state as closures, like
//! [`crate::alloc::find_aligned_in`], so that the dispatcher (its model of
//! each node), the simulator and an engine share them.

use crate::alloc::{Align, align_groups};
use crate::config::Policy;
use crate::topology::{LeafId, Topology};

/// Choose `members` distinct leaves inside one domain of level `within`
/// where a member fits now; `None` when no domain has that many (the gang
/// waits: nothing is held).
///
/// `room(leaf)` is `None` when a member does not fit on `leaf`, else the
/// room the leaf would have left with the member placed (CPUs, or any unit
/// in which less means fuller); best fit prefers small values.
pub fn find_gang_in(
    topo: &Topology,
    members: usize,
    within: Align,
    policy: Policy,
    room: impl Fn(LeafId) -> Option<u32>,
) -> Option<Vec<LeafId>> {
    if members == 0 {
        return Some(Vec::new());
    }
    let mut best: Option<(usize, Vec<(u32, LeafId)>)> = None;
    for group in align_groups(topo, within) {
        let fitting: Vec<(u32, LeafId)> = group
            .iter()
            .filter_map(|&l| room(l).map(|r| (r, l)))
            .collect();
        if fitting.len() < members {
            continue;
        }
        match policy {
            Policy::Pack => {
                best = Some((fitting.len(), fitting));
                break;
            }
            Policy::Spread => {
                if best.as_ref().is_none_or(|(n, _)| fitting.len() < *n) {
                    best = Some((fitting.len(), fitting));
                }
            }
        }
    }
    let (_, mut fitting) = best?;
    let mut out: Vec<LeafId> = match policy {
        Policy::Pack => {
            fitting.sort_unstable_by_key(|&(_, l)| l);
            fitting.into_iter().take(members).map(|(_, l)| l).collect()
        }
        Policy::Spread => fewest_racks(topo, fitting, members),
    };
    out.sort_unstable();
    Some(out)
}

/// Spread inside the chosen domain, as topology/tree does below the
/// switch it picked: the members span the fewest racks (LLC domains) that
/// can hold them. While no single rack holds the rest, the rack with the
/// most leaves with room is taken whole (lowest on ties); the rest goes to
/// the best-fitting rack (the fewest leaves with room that still hold it),
/// on its leaves with the least room left (best fit). `fitting` holds at
/// least `members` (room, leaf) pairs.
///
/// Cost: O(n log n) in the `n` pairs (grouped by sorting, not by a scan
/// of the racks seen so far per leaf).
fn fewest_racks(topo: &Topology, mut fitting: Vec<(u32, LeafId)>, members: usize) -> Vec<LeafId> {
    fitting.sort_unstable_by_key(|&(room, leaf)| (topo.llc_of(leaf), room, leaf));
    let mut racks: Vec<(usize, Vec<(u32, LeafId)>)> = Vec::new();
    for (room, leaf) in fitting {
        let rack = topo.llc_of(leaf);
        match racks.last_mut() {
            Some((r, v)) if *r == rack => v.push((room, leaf)),
            _ => racks.push((rack, vec![(room, leaf)])),
        }
    }
    // Most leaves first, then the lowest rack.
    racks.sort_unstable_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    let mut out = Vec::with_capacity(members);
    let mut rest = &racks[..];
    while out.len() < members {
        let need = members - out.len();
        // The best-fitting rack that holds the rest (racks are sorted by
        // size, descending: the last that is large enough).
        if let Some(fit) = rest.iter().rposition(|(_, v)| v.len() >= need) {
            let mut leaves = rest[fit].1.clone();
            leaves.sort_unstable();
            out.extend(leaves.into_iter().take(need).map(|(_, l)| l));
            break;
        }
        let Some(((_, largest), others)) = rest.split_first() else {
            break;
        };
        out.extend(largest.iter().map(|&(_, l)| l));
        rest = others;
    }
    out
}

/// Where and when a waiting gang will start: the earliest time at which
/// some domain of its level has `members` leaves ready, and those leaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GangReservation {
    /// When the last of the reserved leaves is ready (µs, the caller's
    /// clock).
    pub start: u64,
    /// The reserved leaves, ascending.
    pub leaves: Vec<LeafId>,
}

/// The reservation of a gang of `members` at level `within`: for each
/// domain, the time its `members`-th ready leaf is ready; the earliest
/// such domain and, among its leaves ready by then, `members` on the
/// fewest racks ([`fewest_racks`]: the start is the same whichever of
/// them are taken, so the gang is made as compact as Slurm's
/// topology/tree would make it at that time; within the rack that
/// completes it, the earliest-ready leaves). On equal starts, the domain
/// whose choice spans fewer racks, then the lowest-ranked. `ready_at(leaf)`
/// is when a member could start on the leaf (now, or when enough of its
/// running work ends by its time limits); `None` when it never can (too
/// small, or work without a limit).
///
/// Like EASY backfill's single reservation, later work may start on the
/// reserved leaves only if it ends by `start`.
pub fn gang_reservation_in(
    topo: &Topology,
    members: usize,
    within: Align,
    mut ready_at: impl FnMut(LeafId) -> Option<u64>,
) -> Option<GangReservation> {
    if members == 0 {
        return None;
    }
    let mut best: Option<(GangReservation, usize)> = None;
    // One buffer for every domain (a pass over the whole cluster runs
    // once per dispatcher tick).
    let mut ready: Vec<(u64, LeafId)> = Vec::new();
    for group in align_groups(topo, within) {
        ready.clear();
        ready.extend(group.iter().filter_map(|&l| ready_at(l).map(|t| (t, l))));
        if ready.len() < members {
            continue;
        }
        ready.sort_unstable();
        let start = ready[members - 1].0;
        if best.as_ref().is_some_and(|(b, _)| start > b.start) {
            continue;
        }
        // Every leaf ready by `start` may take a member without moving
        // it; "room" is the rank by ready time (earliest first in a rack).
        let by_start: Vec<(u32, LeafId)> = ready
            .iter()
            .take_while(|&&(t, _)| t <= start)
            .enumerate()
            .map(|(i, &(_, l))| (u32::try_from(i).unwrap_or(u32::MAX), l))
            .collect();
        let mut leaves = fewest_racks(topo, by_start, members);
        leaves.sort_unstable();
        let racks = nr_racks(topo, &leaves);
        if best
            .as_ref()
            .is_none_or(|(b, r)| (start, racks) < (b.start, *r))
        {
            best = Some((GangReservation { start, leaves }, racks));
        }
    }
    best.map(|(r, _)| r)
}

/// How many distinct racks (LLC domains) `leaves` span.
fn nr_racks(topo: &Topology, leaves: &[LeafId]) -> usize {
    let mut racks: Vec<usize> = leaves.iter().map(|&l| topo.llc_of(l)).collect();
    racks.sort_unstable();
    racks.dedup();
    racks.len()
}

/// The level a gang is placed at after waiting `waited_us`: a `required`
/// gang always at `within`; a `preferred` one at `within` until `relax_us`
/// has passed, then anywhere (Slurm's `--switches=N@time`).
pub fn effective_level(within: Align, preferred: bool, waited_us: u64, relax_us: u64) -> Align {
    if preferred && waited_us >= relax_us {
        Align::Any
    } else {
        within
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Topology {
        // 2 zones x 2 racks x 4 nodes: leaves 0-3 rack 0, 4-7 rack 1 (zone
        // 0), 8-11 rack 2, 12-15 rack 3 (zone 1).
        Topology::from_spec("2z:2r:4n").unwrap()
    }

    #[test]
    fn spread_takes_the_fullest_rack_that_holds_the_gang() {
        let t = cluster();
        // Rack 0: 4 nodes with room; rack 1: 3; rack 2: 2; rack 3: 0.
        let room = |l: LeafId| match l {
            0..=3 => Some(8),
            4..=6 => Some(2 + l as u32),
            8 | 9 => Some(1),
            _ => None,
        };
        let got = find_gang_in(&t, 3, Align::Llc, Policy::Spread, room).unwrap();
        assert_eq!(got, vec![4, 5, 6], "rack 1 is the best fit");
        let got = find_gang_in(&t, 2, Align::Llc, Policy::Spread, room).unwrap();
        assert_eq!(got, vec![8, 9]);
        assert_eq!(find_gang_in(&t, 5, Align::Llc, Policy::Spread, room), None);
        // Zone 0 has 7 nodes with room, 4 in rack 0 and 3 in rack 1: no
        // rack holds 5, so the members span two racks: all of rack 0,
        // then the fullest node of rack 1 (node 4, room 6 left).
        let got = find_gang_in(&t, 5, Align::Numa, Policy::Spread, room).unwrap();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        // Within the whole cluster, 2 members fit in one rack: the
        // best-fitting one (rack 2, 2 nodes with room), not the fullest
        // nodes of the cluster (8 and 9 are also those; 3 members: rack 1).
        let got = find_gang_in(&t, 3, Align::Any, Policy::Spread, room).unwrap();
        assert_eq!(got, vec![4, 5, 6], "one rack, the best fit");
    }

    #[test]
    fn pack_takes_the_lowest_rack_and_nodes() {
        let t = cluster();
        let room = |l: LeafId| (l != 1).then_some(4);
        assert_eq!(
            find_gang_in(&t, 3, Align::Llc, Policy::Pack, room),
            Some(vec![0, 2, 3])
        );
        assert_eq!(
            find_gang_in(&t, 4, Align::Llc, Policy::Pack, room),
            Some(vec![4, 5, 6, 7])
        );
    }

    #[test]
    fn reservation_is_the_earliest_domain_and_its_earliest_nodes() {
        let t = cluster();
        let ready = |l: LeafId| match l {
            0..=3 => Some(100 * (l as u64 + 1)),
            4..=7 => Some(250),
            8..=11 => None,
            _ => Some(50),
        };
        let r = gang_reservation_in(&t, 2, Align::Llc, ready).unwrap();
        assert_eq!(
            r,
            GangReservation {
                start: 50,
                leaves: vec![12, 13]
            }
        );
        let r = gang_reservation_in(&t, 4, Align::Llc, |l| ready(l).filter(|_| l < 12)).unwrap();
        assert_eq!(
            r,
            GangReservation {
                start: 250,
                leaves: vec![4, 5, 6, 7]
            }
        );
        let r = gang_reservation_in(&t, 6, Align::Numa, ready).unwrap();
        assert_eq!(r.start, 250);
        assert_eq!(r.leaves.len(), 6);
        assert_eq!(gang_reservation_in(&t, 5, Align::Llc, ready), None);
    }

    #[test]
    fn preferred_relaxes_after_its_wait_required_never() {
        assert_eq!(effective_level(Align::Llc, true, 9, 10), Align::Llc);
        assert_eq!(effective_level(Align::Llc, true, 10, 10), Align::Any);
        assert_eq!(effective_level(Align::Llc, false, u64::MAX, 10), Align::Llc);
    }
}
