//! Utilization while work waits: the share of the cluster's CPUs that run
//! jobs, averaged over the time during which at least one job waits to
//! start. A work-conserving placement keeps it near 100% (less what
//! fragmentation leaves: CPUs too few, on one node, for any waiting job);
//! the whole-run utilization cannot show it, since it also counts the
//! arrival ramp and the drain, when nothing waits. The issue's "utilization
//! at saturation" target compares this figure between policies.

/// One job's span: submitted, started and ended (µs; `u64::MAX` when it
/// never started or never ended) and the CPUs it held while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Submitted.
    pub submit: u64,
    /// Started, or `u64::MAX`.
    pub start: u64,
    /// Ended, or `u64::MAX`.
    pub end: u64,
    /// CPUs held from start to end.
    pub cpus: u64,
}

/// Percent of `capacity` CPUs busy, averaged over the time when at least
/// one job of `spans` had been submitted and not yet started; `None` when
/// no job ever waited. Time is integrated up to the last finite event.
pub fn busy_while_waiting(spans: &[Span], capacity: u64) -> Option<f64> {
    // (time, change of busy CPUs, change of waiting jobs)
    let mut events: Vec<(u64, i64, i64)> = Vec::with_capacity(spans.len() * 3);
    for s in spans {
        if s.submit == u64::MAX {
            continue;
        }
        events.push((s.submit, 0, 1));
        if s.start != u64::MAX {
            events.push((s.start, s.cpus as i64, -1));
            if s.end != u64::MAX {
                events.push((s.end, -(s.cpus as i64), 0));
            }
        }
    }
    events.sort_unstable_by_key(|e| e.0);
    let (mut busy, mut waiting) = (0i64, 0i64);
    let (mut busy_time, mut wait_time) = (0f64, 0f64);
    let mut i = 0;
    while i < events.len() {
        let t = events[i].0;
        while i < events.len() && events[i].0 == t {
            busy += events[i].1;
            waiting += events[i].2;
            i += 1;
        }
        if let Some(&(next, _, _)) = events.get(i)
            && waiting > 0
        {
            let dt = (next - t) as f64;
            busy_time += busy as f64 * dt;
            wait_time += dt;
        }
    }
    (wait_time > 0.0 && capacity > 0).then(|| 100.0 * busy_time / (capacity as f64 * wait_time))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn span(submit: u64, start: u64, end: u64, cpus: u64) -> Span {
        Span {
            submit,
            start,
            end,
            cpus,
        }
    }

    #[test]
    fn only_the_time_when_a_job_waits_counts() {
        // 4 CPUs. A (2 CPUs) runs 0-10; B (4 CPUs) waits 0-10 then runs
        // 10-20; C (1 CPU) arrives at 12 and waits until 20. Waiting:
        // 0-10 with 2 busy, 12-20 with 4 busy: (20 + 32) / (4 * 18).
        let spans = [span(0, 0, 10, 2), span(0, 10, 20, 4), span(12, 20, 21, 1)];
        let got = busy_while_waiting(&spans, 4).unwrap();
        assert!((got - 100.0 * 52.0 / 72.0).abs() < 1e-9, "{got}");
        // Nobody waits: no figure.
        assert_eq!(busy_while_waiting(&[span(0, 0, 5, 1)], 4), None);
        // A job that never starts waits until the last event.
        let got = busy_while_waiting(&[span(0, 0, 10, 1), span(2, u64::MAX, u64::MAX, 8)], 4);
        assert_eq!(got, Some(25.0));
    }

    /// Brute force: step through every microsecond.
    fn oracle(spans: &[Span], capacity: u64) -> Option<f64> {
        let last = spans
            .iter()
            .flat_map(|s| [s.submit, s.start, s.end])
            .filter(|&t| t != u64::MAX)
            .max()?;
        let (mut busy_time, mut wait_time) = (0u64, 0u64);
        for t in 0..last {
            let waiting = spans.iter().any(|s| s.submit <= t && t < s.start);
            if waiting {
                wait_time += 1;
                busy_time += spans
                    .iter()
                    .filter(|s| s.start <= t && t < s.end)
                    .map(|s| s.cpus)
                    .sum::<u64>();
            }
        }
        (wait_time > 0).then(|| 100.0 * busy_time as f64 / (capacity as f64 * wait_time as f64))
    }

    proptest! {
        #[test]
        fn matches_stepping_through_time(
            jobs in prop::collection::vec((0u64..40, 0u64..20, 1u64..20, 1u64..5, 0u8..8), 1..12),
        ) {
            let spans: Vec<Span> = jobs
                .iter()
                .map(|&(submit, wait, run, cpus, kind)| match kind {
                    0 => span(submit, u64::MAX, u64::MAX, cpus),
                    1 => span(submit, submit + wait, u64::MAX, cpus),
                    _ => span(submit, submit + wait, submit + wait + run, cpus),
                })
                .collect();
            let got = busy_while_waiting(&spans, 8);
            let want = oracle(&spans, 8);
            match (got, want) {
                (Some(g), Some(w)) => prop_assert!((g - w).abs() < 1e-9, "{} vs {}", g, w),
                (g, w) => prop_assert_eq!(g, w),
            }
        }
    }
}
