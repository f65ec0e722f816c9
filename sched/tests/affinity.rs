//! `Sched::set_cpus_allowed_ptr`: a waiting task narrowed to the leaf it
//! waits on is never stolen (the dispatcher pins a queued GPU job to the
//! node whose GPUs it holds); the same task with its affinity left open
//! is stolen by the leaf that goes idle. A set without the task's own
//! leaf is refused.

use std::sync::Arc;

use sched::topology::Topology;
use sched::{LeafSet, Sched, SchedConfig, SchedError, TaskId, TaskSpec, TaskState};

fn add(s: &mut Sched, id: u64) -> TaskId {
    let mut spec = TaskSpec::new(TaskId(id));
    spec.demand = 1;
    s.add_task(spec).unwrap();
    TaskId(id)
}

#[test]
fn a_task_narrowed_to_its_leaf_is_not_stolen() {
    for pin in [false, true] {
        // Two nodes of one rack, one CPU each.
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            1,
            SchedConfig::cluster(),
        );
        let running0 = add(&mut s, 1);
        s.wake_up_on(running0, 0, 0).unwrap();
        let running1 = add(&mut s, 2);
        s.wake_up_on(running1, 1, 0).unwrap();
        let waiting = add(&mut s, 3);
        s.wake_up_on(waiting, 0, 0).unwrap();
        assert_eq!(s.task(waiting).unwrap().state, TaskState::Queued(0));
        let elsewhere = Arc::new(LeafSet::from_leaves(2, [1]));
        assert_eq!(
            s.set_cpus_allowed_ptr(waiting, Some(elsewhere)),
            Err(SchedError::NotAllowed {
                task: waiting,
                leaf: 0
            })
        );
        if pin {
            let here = Arc::new(LeafSet::from_leaves(2, [0]));
            s.set_cpus_allowed_ptr(waiting, Some(here)).unwrap();
        }
        // Node 1 goes idle: its newidle steal looks at node 0's queue.
        s.block(running1, 10).unwrap();
        let want = if pin {
            TaskState::Queued(0)
        } else {
            TaskState::Running(1)
        };
        assert_eq!(s.task(waiting).unwrap().state, want, "pinned: {pin}");
    }
}

#[test]
fn an_unknown_task_or_an_empty_set_is_refused() {
    let mut s = Sched::new(
        Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
        1,
        SchedConfig::cluster(),
    );
    assert_eq!(
        s.set_cpus_allowed_ptr(TaskId(9), None),
        Err(SchedError::UnknownTask(TaskId(9)))
    );
    let t = add(&mut s, 1);
    let none = Arc::new(LeafSet::from_leaves(2, []));
    assert_eq!(
        s.set_cpus_allowed_ptr(t, Some(none)),
        Err(SchedError::EmptyAffinity(t))
    );
    s.set_cpus_allowed_ptr(t, None).unwrap();
}
