//! Helpers shared by the integration tests: where the traces are. Each
//! test crate uses some of them.
#![allow(dead_code)]

use std::path::PathBuf;

/// `sim/tests/data/NAME`.
pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("data")
        .join(name)
}

/// The full trace `NAME` in `../shared/traces` beside the workspace, if
/// present (CI lays shared/ there; a bare clone may not have it).
pub fn shared_trace(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("..")
        .join("shared")
        .join("traces")
        .join(name);
    p.exists().then_some(p)
}
