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

use futures_channel::mpsc;
use proto::v1::DispatcherMessage;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

/// What the stream carries: a message, or the status that ends it.
pub type Item = Result<DispatcherMessage, Status>;

/// The stream ended: its agent went away (or the stream was replaced).
#[derive(Debug, thiserror::Error)]
#[error("the agent's stream has ended")]
pub struct Closed;

/// The core's end of one agent's outbound queue.
#[derive(Clone, Debug)]
pub struct AgentTx(mpsc::UnboundedSender<Box<Item>>);

/// The stream's end of the queue.
#[derive(Debug)]
pub struct AgentRx(mpsc::UnboundedReceiver<Box<Item>>);

/// A new queue.
pub fn channel() -> (AgentTx, AgentRx) {
    let (tx, rx) = mpsc::unbounded();
    (AgentTx(tx), AgentRx(rx))
}

impl AgentTx {
    /// Queue `item` for the agent; [`Closed`] once its stream has ended.
    pub fn send(&self, item: Item) -> Result<(), Closed> {
        self.0.unbounded_send(Box::new(item)).map_err(|_| Closed)
    }
}

impl AgentRx {
    /// The next queued item (None once every sender is gone).
    pub async fn recv(&mut self) -> Option<Item> {
        self.0.next().await.map(|b| *b)
    }

    /// The queue as the stream's response body.
    pub fn into_stream(self) -> impl Stream<Item = Item> + Send + 'static {
        self.0.map(|b| *b)
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

    #[tokio::test]
    async fn sending_to_an_ended_stream_is_an_error() {
        let (tx, mut rx) = channel();
        tx.send(Err(Status::cancelled("x"))).unwrap();
        assert!(rx.recv().await.unwrap().is_err());
        drop(rx);
        assert!(tx.send(Err(Status::cancelled("y"))).is_err());
    }
}
