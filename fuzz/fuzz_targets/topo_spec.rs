//! Fuzz the `TopoSpec` string parser (`2s:22c:2t`, `2z:4r:8n`): parsing
//! never panics, and every spec it accepts builds a topology (small ones
//! are built here; every accepted spec has a leaf count that fits).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sched::topology::TopoSpec;

/// Larger accepted specs are valid but slow to build in a fuzz loop.
const BUILD_AT_MOST: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(spec) = TopoSpec::parse(text) else {
        return;
    };
    let leaves = spec.nr_leaves().expect("an accepted spec has a leaf count");
    assert!(leaves >= 1 && leaves <= TopoSpec::MAX_LEAVES, "{spec:?}");
    if leaves <= BUILD_AT_MOST {
        let topo = spec.build().expect("an accepted spec builds");
        assert_eq!(topo.nr_leaves(), leaves, "{spec:?}");
    }
});
