//! The engine configuration of the differential proptests (`lazy_tick`,
//! `fast_start`, `steal_skip`): ten random switches, in this order, on the
//! CPU or the cluster defaults, with stealing made free and the node limit
//! fixed so that only the switches vary.

use sched::SchedConfig;

/// `[cluster, preempt, backfill, steal_cross_llc, latency_pull,
/// domain_reservation, domain_fifo, idle_balance, latency,
/// shortest_limit_first]` as a configuration (`latency_pull` implies
/// `latency`).
pub fn config_of(switches: [bool; 10]) -> SchedConfig {
    let [
        cluster,
        preempt,
        backfill,
        cross,
        latency_pull,
        domains,
        fifo,
        balance,
        latency,
        shortest,
    ] = switches;
    let mut config = if cluster {
        SchedConfig::cluster()
    } else {
        SchedConfig::default()
    };
    config.preempt = preempt;
    config.backfill = backfill;
    config.steal_cross_llc = cross;
    config.latency_pull = latency_pull;
    config.domain_reservation = domains;
    config.domain_fifo = fifo;
    config.shortest_limit_first = shortest;
    config.idle_balance = balance;
    config.latency = latency || latency_pull;
    config.steal_cost = 0;
    config.steal_node_limit = 8;
    config
}
