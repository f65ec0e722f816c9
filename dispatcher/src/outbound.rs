//! An agent stream's outbound queue: the messages the core sends an
//! attached agent (Registered, Assign, Cancel, Steal, Lease, LogRequest,
//! and the status that ends the stream), read by the stream's response
//! body in [`crate::server`].
//!
//! The queue is unbounded (the core never waits for an agent) and holds
//! each message boxed, in a linked queue (futures-channel's): an idle
//! queue is its shared state and an empty stub node, about 100 bytes, and
//! a message costs a node and its box while it is queued. A tokio mpsc
//! channel allocates its slots 32 at a time, in blocks sized by the
//! element type, and the first block comes with the channel: with
//! `Result<DispatcherMessage, Status>` inline that block was 13 KB for
//! every attached agent, boxed 512 bytes, and with the channel's own
//! state 800 bytes per agent, idle.
//!
//! The core queues a plain job's `Assign` as the job's shared record
//! ([`ToAgent::Assign`], [`AgentTx::send_to_agent`]); the proto is built
//! where the stream reads it, on the stream's task: the core thread, the
//! dispatcher's bottleneck, does not copy the spec, the id and the owner
//! at every start.

use std::collections::HashMap;

use futures_channel::mpsc;
use proto::v1::{DispatcherMessage, dispatcher_message};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::cluster::ToAgent;

/// What the stream carries: a message, or the status that ends it.
pub type Item = Result<DispatcherMessage, Status>;

/// The stream ended: its agent went away (or the stream was replaced).
#[derive(Debug, thiserror::Error)]
#[error("the agent's stream has ended")]
pub struct Closed;

/// What the queue holds: an item, or a cluster message with the trace
/// context its `Assign` carries, built into the item when it is read.
#[derive(Debug)]
enum Queued {
    Item(Item),
    Agent(ToAgent, Option<HashMap<String, String>>),
}

impl Queued {
    fn into_item(self) -> Item {
        match self {
            Queued::Item(item) => item,
            Queued::Agent(msg, carrier) => {
                let mut msg = msg.into_message();
                if let Some(carrier) = carrier
                    && let Some(dispatcher_message::Msg::Assign(a)) = msg.msg.as_mut()
                {
                    a.trace_context = carrier;
                }
                Ok(msg)
            }
        }
    }
}

/// The core's end of one agent's outbound queue.
#[derive(Clone, Debug)]
pub struct AgentTx(mpsc::UnboundedSender<Box<Queued>>);

/// The stream's end of the queue.
#[derive(Debug)]
pub struct AgentRx(mpsc::UnboundedReceiver<Box<Queued>>);

/// A new queue.
pub fn channel() -> (AgentTx, AgentRx) {
    let (tx, rx) = mpsc::unbounded();
    (AgentTx(tx), AgentRx(rx))
}

impl AgentTx {
    /// Queue `item` for the agent; [`Closed`] once its stream has ended.
    pub fn send(&self, item: Item) -> Result<(), Closed> {
        self.0
            .unbounded_send(Box::new(Queued::Item(item)))
            .map_err(|_| Closed)
    }

    /// Queue a cluster message; an `Assign` gets `trace_context` (when
    /// given) as it is built, on the stream's side.
    pub fn send_to_agent(
        &self,
        msg: ToAgent,
        trace_context: Option<HashMap<String, String>>,
    ) -> Result<(), Closed> {
        self.0
            .unbounded_send(Box::new(Queued::Agent(msg, trace_context)))
            .map_err(|_| Closed)
    }
}

impl AgentRx {
    /// The next queued item (None once every sender is gone).
    pub async fn recv(&mut self) -> Option<Item> {
        self.0.next().await.map(|b| b.into_item())
    }

    /// The queue as the stream's response body.
    pub fn into_stream(self) -> impl Stream<Item = Item> + Send + 'static {
        self.0.map(|b| b.into_item())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::{Registered, dispatcher_message};
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn messages_and_the_ending_status_arrive_in_order() {
        let (tx, rx) = channel();
        let hello = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Registered(Registered::default())),
        };
        tx.send(Ok(hello.clone())).unwrap();
        tx.send(Err(Status::aborted("replaced"))).unwrap();
        drop(tx);
        let got: Vec<Item> = rx.into_stream().collect().await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap(), &hello);
        assert_eq!(got[1].as_ref().unwrap_err().message(), "replaced");
    }

    /// A job's `Assign` queued as its record is built where it is read,
    /// with the trace context the core gave it; other messages keep
    /// theirs.
    #[tokio::test]
    async fn an_assign_is_built_from_its_record_with_its_trace_context() {
        use crate::cluster::JobKey;
        use crate::record::JobRecord;
        use proto::v1::{Assign, JobSpec};
        use std::sync::Arc;
        let spec = JobSpec {
            command: vec!["true".into()],
            cpus: 3,
            ..Default::default()
        };
        let Some(key) = JobKey::parse("j-7") else {
            panic!("a job key");
        };
        let job = Arc::new(JobRecord::new(
            key,
            Arc::new(spec.clone()),
            "bob".into(),
            0,
            1,
        ));
        let carrier: HashMap<String, String> = [("traceparent".into(), "00-ab".into())].into();
        let (tx, mut rx) = channel();
        tx.send_to_agent(ToAgent::Assign(job.clone()), Some(carrier.clone()))
            .unwrap();
        tx.send_to_agent(ToAgent::Assign(job), None).unwrap();
        let lease = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Lease(proto::v1::Lease {
                seq: 4,
                lease_ms: 9,
            })),
        };
        tx.send_to_agent(ToAgent::Msg(lease.clone()), Some(carrier.clone()))
            .unwrap();
        let want = Assign {
            job_id: "j-7".into(),
            attempt: 1,
            spec: Some(spec),
            owner: "bob".into(),
            trace_context: carrier,
        };
        let got = rx.recv().await.unwrap().unwrap();
        assert_eq!(got.msg, Some(dispatcher_message::Msg::Assign(want.clone())));
        let got = rx.recv().await.unwrap().unwrap();
        let untraced = Assign {
            trace_context: HashMap::new(),
            ..want
        };
        assert_eq!(got.msg, Some(dispatcher_message::Msg::Assign(untraced)));
        assert_eq!(rx.recv().await.unwrap().unwrap(), lease);
    }

    #[tokio::test]
    async fn sending_to_an_ended_stream_is_an_error() {
        let (tx, mut rx) = channel();
        tx.send(Err(Status::cancelled("x"))).unwrap();
        assert!(rx.recv().await.unwrap().is_err());
        drop(rx);
        assert!(tx.send(Err(Status::cancelled("y"))).is_err());
    }
}
