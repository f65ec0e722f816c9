//! Smart wake-affine (seed 001, the merged form): `record_wakee` counts a
//! task's `wakee_flips`, wiped once a second, and `wake_wide` stops pulling
//! a wakee to its waker when the waker fans out to many wakees.

use crate::task::Task;

/// Wipe period of `wakee_flips` (the seed's `HZ` jiffies: one second).
pub const WAKEE_FLIP_DECAY: u64 = 1_000_000_000;

/// `record_wakee`: the waker (`current`) wakes `wakee_id` at `now`.
pub fn record_wakee(waker: &mut Task, wakee_id: crate::task::TaskId, now: u64) {
    // Rough decay (wiping) for cost saving, as in the seed.
    if now > waker.wakee_flip_decay_ts + WAKEE_FLIP_DECAY {
        waker.wakee_flips = 0;
        waker.wakee_flip_decay_ts = now;
    }
    if waker.last_wakee != Some(wakee_id) {
        waker.last_wakee = Some(wakee_id);
        waker.wakee_flips += 1;
    }
}

/// `wake_wide`: true when `wakee.flips > factor && waker.flips > factor *
/// wakee.flips`, with `factor` = `sd_llc_size` of the waker's leaf
/// (cluster: nodes per rack). Then the wakee is spread, not pulled.
pub fn wake_wide(wakee: &Task, waker: &Task, factor: usize) -> bool {
    let factor = factor as u64;
    let wakee_flips = wakee.wakee_flips as u64;
    wakee_flips > factor && waker.wakee_flips as u64 > factor * wakee_flips
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::task::{TaskId, TaskSpec};

    fn task(id: u64) -> Task {
        Task::new(TaskSpec::new(TaskId(id)), Policy::Spread, 6_000_000)
    }

    #[test]
    fn flips_count_switches_and_wipe_each_second() {
        let mut w = task(0);
        record_wakee(&mut w, TaskId(1), 10);
        record_wakee(&mut w, TaskId(1), 20);
        assert_eq!(w.wakee_flips, 1, "same wakee twice is one flip");
        record_wakee(&mut w, TaskId(2), 30);
        record_wakee(&mut w, TaskId(1), 40);
        assert_eq!(w.wakee_flips, 3);
        record_wakee(&mut w, TaskId(2), 2 * WAKEE_FLIP_DECAY);
        assert_eq!(w.wakee_flips, 1, "wiped, then counted");
    }

    #[test]
    fn wide_only_for_fan_out() {
        let mut waker = task(0);
        let mut wakee = task(1);
        wakee.wakee_flips = 5;
        waker.wakee_flips = 100;
        assert!(wake_wide(&wakee, &waker, 4));
        assert!(!wake_wide(&wakee, &waker, 5), "wakee not above factor");
        waker.wakee_flips = 20;
        assert!(!wake_wide(&wakee, &waker, 4), "waker not factor x hotter");
        // 1:1 ping-pong never flips.
        let (mut a, mut b) = (task(10), task(11));
        for t in 0..1000 {
            record_wakee(&mut a, TaskId(11), t);
            record_wakee(&mut b, TaskId(10), t);
        }
        assert!(!wake_wide(&b, &a, 1));
    }
}
