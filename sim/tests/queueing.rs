//! The validation mode against closed forms: M/M/1 and the supermarket
//! model (n = 1,000 servers, load 0.9, d = 1 and d = 2) within 5%.

use sim::queueing::{QueueingParams, run};

#[test]
fn mm1_mean_response() {
    let r = run(&QueueingParams {
        servers: 1,
        load: 0.5,
        d: 1,
        horizon: 200_000.0,
        warmup: 100.0,
        seed: 1,
    })
    .unwrap();
    assert!(r.jobs > 90_000);
    assert!(r.rel_error.abs() < 0.05, "{r:?}");
}

fn supermarket(d: u32) {
    let r = run(&QueueingParams {
        servers: 1000,
        load: 0.9,
        d,
        horizon: 1500.0,
        warmup: 300.0,
        seed: 2,
    })
    .unwrap();
    assert!(r.jobs > 1_000_000);
    assert!(r.rel_error.abs() < 0.05, "{r:?}");
}

#[test]
fn supermarket_d1_is_mm1_per_server() {
    supermarket(1);
}

#[test]
fn supermarket_d2_power_of_two_choices() {
    supermarket(2);
}
