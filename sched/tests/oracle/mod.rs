//! Brute-force oracles shared by the engine's property tests (a test
//! target includes this with `mod oracle;`). They never ask the engine.

/// Earliest instant >= `now` at which `demand` fits in `cap` when every
/// running task `(demand, end)` leaves at its end (`None`: it never
/// leaves), by trying every instant where something ends; `None` when no
/// such instant exists.
pub fn oracle_start(
    cap: u32,
    running: &[(u32, Option<u64>)],
    demand: u32,
    now: u64,
) -> Option<u64> {
    let mut instants = vec![now];
    instants.extend(running.iter().filter_map(|r| r.1).map(|e| e.max(now)));
    instants
        .into_iter()
        .filter(|&t| {
            let used: u32 = running
                .iter()
                .filter(|r| r.1.is_none_or(|e| e > t))
                .map(|r| r.0)
                .sum();
            used + demand <= cap
        })
        .min()
}
