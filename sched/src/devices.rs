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
