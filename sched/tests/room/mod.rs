//! A node's room as the proptests draw it (`[core, llc, numa, package,
//! any]`, or none): the form the claiming-start and freeing-remove tests
//! share.

use sched::FreeSummary;

/// The [`FreeSummary`] of a drawn room.
pub fn summary(r: Option<[u32; 5]>) -> Option<FreeSummary> {
    r.map(|f| FreeSummary {
        core: f[0],
        llc: f[1],
        numa: f[2],
        package: f[3],
        any: f[4],
    })
}
