//! What this replica is ([`Role`]) and the [`Gate`] through which every
//! RPC and the web page learn it: the leader's core, or the status a
//! follower answers (UNAVAILABLE naming the leader).
//!
//! A leaf: it knows the core's handle and nothing else of the dispatcher,
//! so the servers, the web page and the election ([`crate::ha`]) all use it
//! without importing each other.

use tokio::sync::watch;
use tonic::Status;

use crate::core::CoreHandle;

/// What this replica is.
#[derive(Clone)]
pub enum Role {
    /// A follower; the leader's URL when known.
    Follower {
        /// The leader's advertise URL (gRPC).
        leader: Option<String>,
        /// The leader's web page and /metrics URL (`--advertise-http-url`),
        /// when it published one.
        leader_http: Option<String>,
    },
    /// Elected, loading the state from the store.
    Starting,
    /// The leader, with its running core.
    Leader(CoreHandle),
}

/// Every RPC's view of this replica's role.
#[derive(Clone)]
pub struct Gate {
    role: watch::Receiver<Role>,
}

impl Gate {
    /// A gate following `role`.
    pub fn new(role: watch::Receiver<Role>) -> Self {
        Self { role }
    }

    /// Always the leader (the single embedded-store dispatcher).
    pub fn always(core: CoreHandle) -> Self {
        // With the sender gone the receiver keeps its value for good.
        let (_, rx) = watch::channel(Role::Leader(core));
        Self { role: rx }
    }

    /// The core when this replica leads, else the status to answer.
    pub fn core(&self) -> Result<CoreHandle, Status> {
        match &*self.role.borrow() {
            Role::Leader(core) => Ok(core.clone()),
            Role::Starting => Err(Status::unavailable(
                "this dispatcher was just elected leader and is loading its state; retry",
            )),
            Role::Follower { leader, .. } => Err(proto::endpoints::not_leader(leader.as_deref())),
        }
    }

    /// True while this replica leads.
    pub fn is_leader(&self) -> bool {
        matches!(&*self.role.borrow(), Role::Leader(_))
    }

    /// A receiver of role changes.
    pub fn watch(&self) -> watch::Receiver<Role> {
        self.role.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn a_follower_gate_redirects_to_the_leader() {
        let (tx, rx) = watch::channel(Role::Follower {
            leader: Some("http://10.0.0.7:50051".into()),
            leader_http: None,
        });
        let gate = Gate::new(rx);
        let status = gate.core().err().unwrap();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status.message(),
            "not the leader; the leader is at http://10.0.0.7:50051"
        );
        assert_eq!(
            proto::endpoints::leader_hint(&status).as_deref(),
            Some("http://10.0.0.7:50051")
        );
        assert!(!gate.is_leader());
        // Elected but still loading: unavailable, no hint (clients retry).
        tx.send(Role::Starting).unwrap();
        let status = gate.core().err().unwrap();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(proto::endpoints::leader_hint(&status), None);
        // Unknown leader: no hint either.
        tx.send(Role::Follower {
            leader: None,
            leader_http: None,
        })
        .unwrap();
        assert_eq!(
            proto::endpoints::leader_hint(&gate.core().err().unwrap()),
            None
        );
    }
}
