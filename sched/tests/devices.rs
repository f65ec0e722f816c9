//! Property test of device choice ([`sched::devices::choose_devices`])
//! against enumeration of every set of `k` free devices: the chosen set is
//! as close as any (the innermost level at which all share their path,
//! computed here pair by pair), at that level it lies in a domain with the
//! fewest free devices that still hold `k`, and it is `None` only when
//! fewer than `k` are free. Counts the cases where the closest set was not
//! the first `k` free devices, so a generator drifting into trivial cases
//! fails.

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sched::devices::choose_devices;

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

fn subsets(
    items: &[usize],
    k: usize,
    cur: &mut Vec<usize>,
    from: usize,
    out: &mut Vec<Vec<usize>>,
) {
    if cur.len() == k {
        out.push(cur.clone());
        return;
    }
    for i in from..items.len() {
        cur.push(items[i]);
        subsets(items, k, cur, i + 1, out);
        cur.pop();
    }
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
            subsets(&free, k, &mut Vec::new(), 0, &mut all);
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
