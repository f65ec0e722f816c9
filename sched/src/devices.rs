//! Accelerators as leaves of a machine's topology: choosing `k` free
//! devices (GPUs) for a job so that they sit as close together as the
//! machine allows, and on the NUMA nodes of the job's CPUs.
//!
//! A device's place is a path of keys, innermost level first: for a GPU
//! the PCIe switch above it, its host bridge, its NUMA node, the machine
//! (the agent builds these from sysfs). Two devices are as close as the
//! innermost level at which their keys agree, which is how
//! `nvidia-smi topo -m` ranks links (PIX < PHB < NODE < SYS). Choosing
//! `k` devices with the closest worst pair is then the aligned allocation
//! of [`crate::alloc`] over this tree: the innermost level at which one
//! domain holds `k` free devices, and, at that level, the best-fitting
//! domain (fewest free devices that still hold `k`), so that whole switches
//! stay free for larger requests; devices inside it in path order.

/// Choose `k` of the devices for which `free(i)` holds, where `keys[i]` is
/// device `i`'s path (innermost level first; every device has the same
/// number of levels, the last normally one key for the whole machine).
/// `None` when fewer than `k` are free. Indices are returned ascending.
pub fn choose_devices(
    k: usize,
    keys: &[Vec<u64>],
    free: impl Fn(usize) -> bool,
) -> Option<Vec<usize>> {
    if k == 0 {
        return Some(Vec::new());
    }
    let candidates: Vec<usize> = (0..keys.len()).filter(|&i| free(i)).collect();
    if candidates.len() < k {
        return None;
    }
    let levels = keys.first().map_or(0, Vec::len);
    for level in 0..levels {
        // Free devices per domain at this level: the domain is the key path
        // from this level outwards (a switch key is only unique inside its
        // host bridge).
        let mut domains: Vec<(&[u64], Vec<usize>)> = Vec::new();
        for &i in &candidates {
            let path = &keys[i][level..];
            match domains.iter_mut().find(|(p, _)| *p == path) {
                Some((_, members)) => members.push(i),
                None => domains.push((path, vec![i])),
            }
        }
        let best = domains
            .into_iter()
            .filter(|(_, m)| m.len() >= k)
            .min_by_key(|(_, m)| (m.len(), m[0]));
        if let Some((_, members)) = best {
            return Some(members.into_iter().take(k).collect());
        }
    }
    Some(candidates.into_iter().take(k).collect())
}

/// [`choose_devices`] for a job whose CPUs are already placed: first among
/// the free devices for which `near(i)` holds (those on the NUMA nodes of
/// the job's CPUs), and only when fewer than `k` of those are free, among
/// all free devices, in the same closeness order. The devices' own
/// closeness comes first *within* each step: `k` near devices spread over
/// two switches beat `k` far ones on one switch, because a job's transfers
/// between host memory and its GPUs cross the socket interconnect
/// otherwise (Slurm's `--gres-flags=enforce-binding` makes the same
/// choice, as a requirement).
pub fn choose_devices_near(
    k: usize,
    keys: &[Vec<u64>],
    free: impl Fn(usize) -> bool,
    near: impl Fn(usize) -> bool,
) -> Option<Vec<usize>> {
    choose_devices(k, keys, |i| free(i) && near(i)).or_else(|| choose_devices(k, keys, free))
}

/// The innermost level at which all of `chosen` share their path: how far
/// apart the worst pair of them is (0 = one switch). `levels` when they
/// share none.
pub fn spread_level(keys: &[Vec<u64>], chosen: &[usize]) -> usize {
    let levels = keys.first().map_or(0, Vec::len);
    (0..levels)
        .find(|&level| {
            chosen
                .windows(2)
                .all(|w| keys[w[0]][level..] == keys[w[1]][level..])
        })
        .unwrap_or(levels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 8-GPU server of the agent's fixture: per socket two host
    /// bridges, each with one switch of two GPUs. Keys: switch, host
    /// bridge, NUMA node, machine.
    fn eight_gpus() -> Vec<Vec<u64>> {
        (0..8u64).map(|g| vec![g / 2, g / 2, g / 4, 0]).collect()
    }

    #[test]
    fn closest_devices_first_and_best_fit_domains() {
        let keys = eight_gpus();
        assert_eq!(choose_devices(2, &keys, |_| true), Some(vec![0, 1]));
        // GPU 0 busy: the switch with one free GPU is not enough for 2; the
        // first whole switch is 2-3.
        assert_eq!(choose_devices(2, &keys, |i| i != 0), Some(vec![2, 3]));
        // One GPU: best fit takes the switch with one free (GPU 1), keeping
        // whole switches free.
        assert_eq!(choose_devices(1, &keys, |i| i != 0), Some(vec![1]));
        // Four: a whole socket.
        assert_eq!(choose_devices(4, &keys, |i| i != 0), Some(vec![4, 5, 6, 7]));
        assert_eq!(
            choose_devices(5, &keys, |_| true),
            Some(vec![0, 1, 2, 3, 4])
        );
        assert_eq!(choose_devices(8, &keys, |i| i != 3), None);
        assert_eq!(spread_level(&keys, &[0, 1]), 0);
        assert_eq!(spread_level(&keys, &[0, 2]), 2);
        assert_eq!(spread_level(&keys, &[0, 4]), 3);
    }

    #[test]
    fn near_devices_first_then_any_in_closeness_order() {
        let keys = eight_gpus();
        let node1 = |i: usize| i >= 4;
        // CPUs on NUMA node 1: its first whole switch, not GPUs 0-1.
        assert_eq!(
            choose_devices_near(2, &keys, |_| true, node1),
            Some(vec![4, 5])
        );
        // Node 1 has one free GPU per switch: still node 1's (two
        // switches), never the free switch of node 0.
        let busy = [4, 6];
        assert_eq!(
            choose_devices_near(2, &keys, |i| !busy.contains(&i), node1),
            Some(vec![5, 7])
        );
        // Node 1 has one free GPU: fall back to all, closest first (a
        // whole switch of node 0), not the near one plus a far one.
        let busy = [4, 5, 6];
        assert_eq!(
            choose_devices_near(2, &keys, |i| !busy.contains(&i), node1),
            Some(vec![0, 1])
        );
        assert_eq!(
            choose_devices_near(8, &keys, |i| i != 0, node1),
            None,
            "7 free"
        );
    }

    proptest::proptest! {
        /// Against an oracle that enumerates every k-subset of the free
        /// devices: when k near devices are free, the choice is all near
        /// and as close as the closest near subset; otherwise as close as
        /// the closest subset of all free devices. `None` only when fewer
        /// than k are free.
        #[test]
        fn near_choice_matches_the_brute_force_oracle(
            devs in proptest::collection::vec((0u64..2, 0u64..2, 0u64..2, proptest::bool::ANY), 1..9),
            k in 1usize..5,
        ) {
            let keys: Vec<Vec<u64>> = devs.iter().map(|&(s, h, n, _)| vec![s, h, n, 0]).collect();
            // Near: NUMA node 0.
            let near = |i: usize| keys[i][2] == 0;
            let free: Vec<usize> = (0..devs.len()).filter(|&i| devs[i].3).collect();
            let got = choose_devices_near(k, &keys, |i| devs[i].3, near);
            let pair = |a: usize, b: usize| {
                (0..4).find(|&l| keys[a][l..] == keys[b][l..]).unwrap_or(4)
            };
            let level = |set: &[usize]| {
                let mut worst = 0;
                for (x, &a) in set.iter().enumerate() {
                    for &b in &set[x + 1..] {
                        worst = worst.max(pair(a, b));
                    }
                }
                worst
            };
            let best = |pool: &[usize]| -> Option<usize> {
                (0u32..1 << pool.len())
                    .filter(|m| m.count_ones() as usize == k)
                    .map(|m| {
                        let set: Vec<usize> =
                            (0..pool.len()).filter(|b| m & (1 << b) != 0).map(|b| pool[b]).collect();
                        level(&set)
                    })
                    .min()
            };
            let near_free: Vec<usize> = free.iter().copied().filter(|&i| near(i)).collect();
            match got {
                None => proptest::prop_assert!(free.len() < k),
                Some(chosen) => {
                    proptest::prop_assert_eq!(chosen.len(), k);
                    proptest::prop_assert!(chosen.iter().all(|&i| devs[i].3));
                    proptest::prop_assert!(chosen.windows(2).all(|w| w[0] < w[1]));
                    if near_free.len() >= k {
                        proptest::prop_assert!(chosen.iter().all(|&i| near(i)), "near first");
                        proptest::prop_assert_eq!(Some(level(&chosen)), best(&near_free));
                    } else {
                        proptest::prop_assert_eq!(Some(level(&chosen)), best(&free));
                    }
                }
            }
        }
    }

    #[test]
    fn switch_keys_are_scoped_by_their_host_bridge() {
        // Two host bridges whose switches both number 0 locally.
        let keys = vec![
            vec![0, 10, 0],
            vec![0, 11, 0],
            vec![1, 11, 0],
            vec![1, 11, 0],
        ];
        assert_eq!(choose_devices(2, &keys, |_| true), Some(vec![2, 3]));
        assert_eq!(spread_level(&keys, &[0, 1]), 2);
    }
}
