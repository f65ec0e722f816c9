//! The discrete-event harness's evidence for seeds 000 and 001: the shape
//! of the seeds' tables, determinism, and conservation of tasks, messages
//! and CPU time.

use sched::SchedConfig;
use sched::harness::hackbench::{self, HackbenchParams, HackbenchResult};
use sched::harness::wakeaffine::{self, FanoutParams, PingpongParams, WakeResult};
use sched::harness::{HarnessConfig, report};

const GROUPS: [usize; 5] = [1, 2, 3, 4, 8];

fn hackbench_params(loops: u64, seed: u64) -> HackbenchParams {
    HackbenchParams {
        loops,
        harness: HarnessConfig {
            seed,
            ..HarnessConfig::default()
        },
        ..HackbenchParams::default()
    }
}

fn assert_sound_hb(r: &HackbenchResult) {
    assert!(
        r.problems.is_empty(),
        "grps {} steal {}: {:?}",
        r.groups,
        r.steal,
        r.problems
    );
}

fn assert_sound_wake(r: &WakeResult) {
    assert!(
        r.problems.is_empty(),
        "clients {} wake_wide {}: {:?}",
        r.clients,
        r.wake_wide,
        r.problems
    );
}

/// Seed 000: with stealing, %busy is higher and elapsed time lower than
/// without, at every group count; the baseline never steals.
#[test]
fn hackbench_steal_raises_busy_and_cuts_time_at_every_group_count() {
    let params = hackbench_params(100, 1);
    let (base, new) = hackbench::run_comparison(&params, &GROUPS).unwrap();
    let table = report::hackbench_tables(&base, &new);
    for (b, n) in base.iter().zip(&new) {
        assert_sound_hb(b);
        assert_sound_hb(n);
        assert_eq!(b.run.stats.steal, 0, "steal off never steals");
        assert!(
            n.run.stats.steal > 0,
            "grps {}: no steal\n{table}",
            n.groups
        );
        assert!(
            n.run.pct_busy() > b.run.pct_busy(),
            "grps {}: %busy {:.2} (steal) vs {:.2}\n{table}",
            n.groups,
            n.run.pct_busy(),
            b.run.pct_busy()
        );
        assert!(
            n.run.elapsed_ns < b.run.elapsed_ns,
            "grps {}: time {} (steal) vs {}\n{table}",
            n.groups,
            n.run.elapsed_ns,
            b.run.elapsed_ns
        );
        assert!(
            n.run.goidle < b.run.goidle,
            "grps {}: stealing should avoid going idle\n{table}",
            n.groups
        );
    }
}

/// The avg_idle gate is exercised: some steals are declined because the
/// leaf's average idle period is below the 10 us steal cost, and the
/// baseline never reaches the gate.
#[test]
fn hackbench_avg_idle_gate_is_exercised() {
    let params = HackbenchParams {
        groups: 2,
        ..hackbench_params(100, 1)
    };
    let off = hackbench::run(&params, &hackbench::seed_config(false)).unwrap();
    let on = hackbench::run(&params, &hackbench::seed_config(true)).unwrap();
    assert_eq!(off.run.stats.steal_skip_avg_idle, 0);
    assert!(on.run.stats.steal_skip_avg_idle > 0);
    assert!(on.run.stats.steal > 0);
}

/// Seed 001: the fan-out does better with wake_wide once the fan-out is
/// wider than the LLC factor allows, and never worse; wake_wide fires
/// only there.
#[test]
fn fanout_does_better_with_wake_wide() {
    let params = FanoutParams {
        items: 20_000,
        ..FanoutParams::default()
    };
    let workers = [8, 24, 32, 48];
    let cfg = wakeaffine::wake_wide_config(false);
    let (base, wide) = wakeaffine::fanout_comparison(&params, &workers, &cfg).unwrap();
    let table = report::wake_table("fan-out", "workers", &base, &wide);
    for (b, w) in base.iter().zip(&wide) {
        assert_sound_wake(b);
        assert_sound_wake(w);
        assert_eq!(b.run.stats.wake_wide, 0, "feature off never fires");
        assert!(
            w.throughput() >= 0.99 * b.throughput(),
            "{} workers: wake_wide worse\n{table}",
            b.clients
        );
    }
    // 8 workers: no wakee flips enough, nothing changes.
    assert_eq!(wide[0].run.stats.wake_wide, 0, "{table}");
    assert_eq!(base[0].run, wide[0].run, "{table}");
    // 24 and 32 workers: spread, faster, lower wakeup latency.
    for i in [1, 2] {
        let (b, w) = (&base[i], &wide[i]);
        assert!(w.run.stats.wake_wide > 0, "{table}");
        assert!(
            w.throughput() > 1.01 * b.throughput(),
            "{} workers: {:.0} vs {:.0}\n{table}",
            b.clients,
            w.throughput(),
            b.throughput()
        );
        assert!(
            w.run.mean_wake_latency_ns() < b.run.mean_wake_latency_ns(),
            "{table}"
        );
    }
}

/// Seed 001: 1:1 ping-pong never flips wakees, so wake_wide never fires
/// and the runs are identical.
#[test]
fn pingpong_is_no_worse_and_never_wide() {
    let params = PingpongParams {
        rounds: 1_000,
        ..PingpongParams::default()
    };
    let cfg = wakeaffine::wake_wide_config(false);
    let (base, wide) = wakeaffine::pingpong_comparison(&params, &[8, 24, 48], &cfg).unwrap();
    for (b, w) in base.iter().zip(&wide) {
        assert_sound_wake(b);
        assert_sound_wake(w);
        assert_eq!(w.run.stats.wake_wide, 0);
        assert_eq!(b.run, w.run, "{} pairs", b.clients);
        assert_eq!(b.completed, w.completed);
    }
    // Also with the engine's plain defaults.
    let p = PingpongParams {
        pairs: 16,
        ..params
    };
    let r = wakeaffine::run_pingpong(&p, &SchedConfig::default()).unwrap();
    assert_sound_wake(&r);
    assert_eq!(r.run.stats.wake_wide, 0);
}

/// The same seed gives identical results; another seed gives another run.
#[test]
fn runs_are_deterministic() {
    let params = HackbenchParams {
        groups: 2,
        ..hackbench_params(50, 7)
    };
    let cfg = hackbench::seed_config(true);
    let a = hackbench::run(&params, &cfg).unwrap();
    let b = hackbench::run(&params, &cfg).unwrap();
    assert_eq!(a, b);
    let other = hackbench::run(&hackbench_params(50, 8), &cfg).unwrap();
    assert_ne!(a.run, other.run);

    let fan = FanoutParams {
        workers: 24,
        items: 5_000,
        ..FanoutParams::default()
    };
    let cfg = wakeaffine::wake_wide_config(true);
    let x = wakeaffine::run_fanout(&fan, &cfg).unwrap();
    let y = wakeaffine::run_fanout(&fan, &cfg).unwrap();
    assert_eq!(x, y);
}

/// Every task ends, every message sent is received, and busy time fits in
/// the machine's time, for both workloads and both settings of each
/// feature.
#[test]
fn conservation_of_tasks_messages_and_time() {
    for steal in [false, true] {
        for groups in [1, 3] {
            let params = HackbenchParams {
                groups,
                ..hackbench_params(40, 3)
            };
            let r = hackbench::run(&params, &hackbench::seed_config(steal)).unwrap();
            assert_sound_hb(&r);
            assert_eq!(r.run.nr_exited, groups * 40);
            assert_eq!(r.messages_sent, r.messages_expected);
            assert_eq!(r.messages_received, r.messages_expected);
            assert!(r.run.busy_ns <= r.run.capacity * r.run.elapsed_ns);
            assert!(r.run.pct_busy() <= 100.0);
            assert!(r.run.stats.nr_switches > 0 && r.run.wakeups > 0);
        }
    }
    for wide in [false, true] {
        let fan = FanoutParams {
            workers: 32,
            items: 5_000,
            ..FanoutParams::default()
        };
        let r = wakeaffine::run_fanout(&fan, &wakeaffine::wake_wide_config(wide)).unwrap();
        assert_sound_wake(&r);
        assert_eq!(r.completed, 5_000);
        assert_eq!(r.run.nr_exited, 1 + 32 + fan.collectors);
        assert!(r.run.busy_ns <= r.run.capacity * r.run.elapsed_ns);
        let pp = PingpongParams {
            pairs: 12,
            rounds: 300,
            ..PingpongParams::default()
        };
        let r = wakeaffine::run_pingpong(&pp, &wakeaffine::wake_wide_config(wide)).unwrap();
        assert_sound_wake(&r);
        assert_eq!(r.completed, 12 * 300);
        assert_eq!(r.run.nr_exited, 24);
    }
}

/// Bad outside input is an error, not a panic.
#[test]
fn bad_topology_is_an_error() {
    let params = HackbenchParams {
        topology: "not a topology".to_string(),
        ..HackbenchParams::default()
    };
    assert!(hackbench::run(&params, &SchedConfig::default()).is_err());
}
