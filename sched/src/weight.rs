//! Load weights: the kernel's nice-to-weight table and the fair-time
//! arithmetic built on it (`calc_delta_fair`, latency offsets).
//!
//! Fairness is by weight: a task of weight `w` receives CPU time in
//! proportion to `w` among runnable tasks. Nice 0 is [`NICE_0_LOAD`]; each
//! nice step is ~1.25x (the kernel's `sched_prio_to_weight`).

/// Weight of a nice-0 task.
pub const NICE_0_LOAD: u64 = 1024;

/// The kernel's `sched_prio_to_weight`, nice -20 ..= 19.
pub const SCHED_PRIO_TO_WEIGHT: [u64; 40] = [
    88761, 71755, 56483, 46273, 36291, // -20 .. -16
    29154, 23254, 18705, 14949, 11916, // -15 .. -11
    9548, 7620, 6100, 4904, 3906, // -10 .. -6
    3121, 2501, 1991, 1586, 1277, // -5 .. -1
    1024, 820, 655, 526, 423, // 0 .. 4
    335, 272, 215, 172, 137, // 5 .. 9
    110, 87, 70, 56, 45, // 10 .. 14
    36, 29, 23, 18, 15, // 15 .. 19
];

/// Lowest nice value.
pub const MIN_NICE: i32 = -20;
/// Highest nice value.
pub const MAX_NICE: i32 = 19;

/// Width of the latency-nice range (seed 004 series: `NICE_LATENCY_WIDTH`).
pub const NICE_LATENCY_WIDTH: i64 = 40;

/// True when `nice` is in -20..=19 (also the latency-nice range).
pub fn nice_in_range(nice: i32) -> bool {
    (MIN_NICE..=MAX_NICE).contains(&nice)
}

/// Weight of a task at `nice`; out-of-range values are clamped (callers
/// validate outside input before it gets here).
pub fn nice_to_weight(nice: i32) -> u64 {
    let idx = (nice.clamp(MIN_NICE, MAX_NICE) - MIN_NICE) as usize;
    SCHED_PRIO_TO_WEIGHT[idx]
}

/// Virtual time for `delta` of real execution at `weight`:
/// `delta * NICE_0_LOAD / weight` (the kernel's `calc_delta_fair`).
pub fn calc_delta_fair(delta: u64, weight: u64) -> u64 {
    if weight == NICE_0_LOAD {
        return delta;
    }
    ((delta as u128 * NICE_0_LOAD as u128) / weight.max(1) as u128) as u64
}

/// Latency offset of a latency-nice value: `sched_latency * latency_nice /
/// NICE_LATENCY_WIDTH` (seed 004 series, `calc_latency_offset`). Negative
/// for latency-sensitive tasks, which then enter the latency timeline.
pub fn calc_latency_offset(sched_latency: u64, latency_nice: i32) -> i64 {
    (sched_latency as i64 * latency_nice.clamp(MIN_NICE, MAX_NICE) as i64) / NICE_LATENCY_WIDTH
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shape() {
        assert_eq!(nice_to_weight(0), NICE_0_LOAD);
        assert_eq!(nice_to_weight(-20), 88761);
        assert_eq!(nice_to_weight(19), 15);
        assert_eq!(nice_to_weight(100), 15, "clamped");
        // Each step is about 1.25x.
        for w in SCHED_PRIO_TO_WEIGHT.windows(2) {
            let r = w[0] as f64 / w[1] as f64;
            assert!((1.15..1.35).contains(&r), "ratio {r}");
        }
    }

    #[test]
    fn delta_fair_scales_inversely() {
        assert_eq!(calc_delta_fair(1000, 1024), 1000);
        assert_eq!(calc_delta_fair(1000, 2048), 500);
        assert_eq!(calc_delta_fair(1000, 512), 2000);
    }

    #[test]
    fn latency_offset_sign() {
        assert_eq!(calc_latency_offset(6_000_000, 0), 0);
        assert_eq!(calc_latency_offset(6_000_000, -20), -3_000_000);
        assert!(calc_latency_offset(6_000_000, 19) > 0);
    }

    mod latency_preempt {
        //! Seed 004's `wakeup_preempt_entity` with latency offsets, checked
        //! against the plain CFS rule computed here from its definition:
        //! with latency-nice off, or both tasks at latency-nice 0, the
        //! decision is the plain one; a lower latency-nice of the waking
        //! task never makes it preempt later, a higher latency-nice of the
        //! running task never makes it harder to preempt (positive values
        //! count: the old `offset.min(0)` clamp failed the first); and the
        //! running task's lead that a positive latency-nice forgives is at
        //! most one wakeup granularity.

        use std::sync::Arc;

        use proptest::prelude::*;

        use crate::config::{Policy, SchedConfig};
        use crate::sched::Sched;
        use crate::task::{Task, TaskId, TaskSpec};
        use crate::topology::Topology;
        use crate::weight::calc_delta_fair;

        fn engine(latency: bool) -> Sched {
            let topo = Arc::new(Topology::from_spec("1s:1c:1t").unwrap());
            let config = SchedConfig {
                latency,
                ..SchedConfig::default()
            };
            Sched::new(topo, 1, config)
        }

        fn task(s: &Sched, nice: i32, latency_nice: i32, vruntime: i64) -> Task {
            let mut spec = TaskSpec::new(TaskId(1));
            spec.nice = nice;
            spec.latency_nice = latency_nice;
            let mut t = Task::new(spec, Policy::Spread, s.config().sched_latency);
            t.vruntime = vruntime;
            t
        }

        /// The plain rule: -1 when `se` is not behind `curr`, 1 when it
        /// is more than `wakeup_gran(se)` behind, else 0.
        fn plain(s: &Sched, curr_v: i64, se: &Task) -> i32 {
            let vdiff = curr_v - se.vruntime;
            let gran = calc_delta_fair(s.config().wakeup_granularity, se.weight) as i64;
            if vdiff <= 0 {
                -1
            } else if vdiff > gran {
                1
            } else {
                0
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn wakeup_preempt_entity_and_latency_nice(
                curr_ln in -20i32..=19,
                se_ln in -20i32..=19,
                nice in -5i32..=5,
                lead in -8_000_000i64..8_000_000,
            ) {
                let on = engine(true);
                let off = engine(false);
                let base = 1_000_000_000;
                let curr = task(&on, 0, curr_ln, base + lead);
                let se = task(&on, nice, se_ln, base);
                let r = on.wakeup_preempt_entity(&curr, &se);
                prop_assert_eq!(off.wakeup_preempt_entity(&curr, &se), plain(&off, curr.vruntime, &se));
                if curr_ln == 0 && se_ln == 0 {
                    prop_assert_eq!(r, plain(&on, curr.vruntime, &se));
                }
                if se_ln < 19 {
                    let later = task(&on, nice, se_ln + 1, base);
                    prop_assert!(on.wakeup_preempt_entity(&curr, &later) <= r);
                }
                if curr_ln < 19 {
                    let tolerant = task(&on, 0, curr_ln + 1, base + lead);
                    prop_assert!(on.wakeup_preempt_entity(&tolerant, &se) >= r);
                }
                // Non-negative latency-nice on both sides: the waking
                // task's own offset (sched_latency * latency_nice / 40) is
                // forgiven from the running task's lead, at most one
                // granularity; the running task's is not counted.
                if curr_ln >= 0 && se_ln >= 0 {
                    let gran = calc_delta_fair(on.config().wakeup_granularity, se.weight) as i64;
                    let offset = (6_000_000 * se_ln as i64 / 40).min(gran);
                    prop_assert_eq!(r, plain(&on, curr.vruntime - offset, &se));
                    prop_assert!(r <= plain(&on, curr.vruntime, &se));
                }
            }
        }
    }
}
