//! Fuzz job-spec validation and acceptance: arbitrary bytes are decoded as
//! a `SubmitJobsRequest` (a `JobSpec` is a prefix of its encoding's
//! domain too), each spec is validated, and the whole call is submitted to
//! a real `Cluster` with two registered nodes. Nothing may panic; a valid
//! spec is valid again after normalisation; a refused call creates nothing
//! and writes nothing; an accepted one creates one job per element.
//!
//! The cluster runs with `max_array` lowered to [`FUZZ_MAX_ARRAY`]: with
//! the default (100,000 elements per call) the corpus fills with calls
//! that create tens of thousands of jobs each, and the rate falls from
//! ~10k to <1k executions per second. The refusal path is the same code
//! (`check_call`), only its threshold is smaller; the default's own
//! refusal is a unit test (`spec::tests`).
#![no_main]

use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use dispatcher::spec::{SpecLimits, align_of, check_call, policy_of, validate};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use proto::v1::{JobSpec, Register, SubmitJobsRequest};

/// Elements per call the fuzzed cluster accepts (see the module comment).
const FUZZ_MAX_ARRAY: u32 = 64;

fn limits() -> SpecLimits {
    SpecLimits {
        max_array: FUZZ_MAX_ARRAY,
        ..SpecLimits::default()
    }
}

fn cluster() -> Cluster {
    let mut c = Cluster::new(ClusterConfig {
        limits: limits(),
        ..ClusterConfig::default()
    });
    let mut fx = Effects::default();
    for (name, shape, rack) in [("n1", "1s:4c:2t", "r1"), ("n2", "2s:2c:1t", "r2")] {
        let topo = sched::Topology::from_spec(shape).expect("a valid shape");
        let mut labels = std::collections::HashMap::new();
        labels.insert("dispatch.io/rack".to_string(), rack.to_string());
        c.register(
            Register {
                node: name.into(),
                labels,
                topology: Some(engine_proto::topology(&topo)),
                ..Default::default()
            },
            0,
            &mut fx,
        )
        .expect("a valid Register");
    }
    c.settle(0, &mut fx);
    c
}

fuzz_target!(|data: &[u8]| {
    let limits = limits();
    if let Ok(spec) = JobSpec::decode(data) {
        let mut s = spec;
        if validate(&mut s, "spec", &limits).is_ok() {
            assert!(s.cpus >= 1);
            let mut again = s.clone();
            validate(&mut again, "spec", &limits).expect("a normalised spec stays valid");
            assert_eq!(again, s);
            let _ = (align_of(&s), policy_of(&s));
        }
    }
    let Ok(req) = SubmitJobsRequest::decode(data) else {
        return;
    };
    let _ = check_call(&req.specs, &limits);
    let mut c = cluster();
    let mut fx = Effects::default();
    let elements: usize = req
        .specs
        .iter()
        .map(|s| s.array_count.max(1) as usize)
        .sum();
    match c.submit(req.specs, true, 1, &mut fx) {
        Ok(jobs) => {
            assert!(elements <= FUZZ_MAX_ARRAY as usize);
            assert_eq!(jobs.len(), elements);
            assert_eq!(c.nr_jobs(), elements);
        }
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().starts_with("specs"), "{status:?}");
            assert_eq!(c.nr_jobs(), 0);
            assert!(fx.writes.is_empty() && fx.dirty.is_empty());
        }
    }
    c.settle(2, &mut fx);
    c.tick(3, &mut fx);
});
