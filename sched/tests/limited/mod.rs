//! Adding a task with a demand and a time limit to an engine: the setup
//! the backfill, domain-reservation and limit-aging tests share.

use sched::{Sched, TaskId, TaskSpec};

/// Adds task `id` needing `demand` CPUs with time limit `limit` (ns) to
/// `s` and returns its id.
pub fn add(s: &mut Sched, id: u64, demand: u32, limit: Option<u64>) -> TaskId {
    let mut spec = TaskSpec::new(TaskId(id));
    spec.demand = demand;
    spec.time_limit = limit;
    s.add_task(spec).unwrap();
    TaskId(id)
}
