//! `dispatch-relay`: a relay between agents and the dispatcher, as
//! Slurm's slurmd forwards node messages through a tree of daemons.
//! Agents attach to it with the ordinary `AgentService.Attach`
//! ([`server`]); it carries all their sessions on one
//! `AgentService.AttachMany` stream to the leading dispatcher
//! ([`upstream`]), so the dispatcher holds one HTTP/2 connection per
//! relay instead of one per agent. [`tls`]: who may attach to it, and
//! the relay's own identity. [`metrics`]: what it carries, for
//! Prometheus and OTLP.
//!
//! Identity: the relay authenticates its agents as the dispatcher would
//! (a client certificate naming the node, from the relay's client CA),
//! and the dispatcher authenticates the relay by its client certificate,
//! which must name every node the relay registers (a rack's relay gets
//! a certificate listing the rack's nodes). A relay can thus register
//! only the nodes it was issued for, and an agent only itself.

pub mod metrics;
pub mod server;
pub mod tls;
pub mod upstream;
