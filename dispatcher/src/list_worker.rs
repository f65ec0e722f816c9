//! ListNodes answered off the core thread: the core copies the nodes once
//! per batch for the calls that list every node
//! ([`Cluster::node_copies`](crate::cluster::Cluster::node_copies)), and a
//! page's nodes for each paged call
//! ([`Cluster::node_copies_page`](crate::cluster::Cluster::node_copies_page)),
//! and hands each call's copy and reply to one worker thread, which builds
//! the views ([`views`]) and answers. Every listing handed over is
//! answered, in order; the thread starts with the first listing and ends
//! when the core drops the worker and the last listing is answered. If the
//! thread cannot be started, or is gone, the views are built where the
//! listing is handed over (the core): slower, never unanswered.

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;

use proto::v1::ListNodesResponse;
use tokio::sync::oneshot;
use tonic::Status;

use crate::cluster::listing::{NodeCopy, views};

/// A listing's reply.
pub type ListReply = oneshot::Sender<Result<ListNodesResponse, Status>>;

/// The nodes' copies, the next page's token, and where to answer.
type Listing = (Arc<Vec<NodeCopy>>, String, ListReply);

/// The answer to one listing.
fn answer((copies, next_page_token, reply): Listing) {
    let _ = reply.send(Ok(ListNodesResponse {
        nodes: views(copies),
        next_page_token,
    }));
}

/// The worker thread's queue, started on first use.
#[derive(Default)]
pub struct ListWorker {
    tx: Option<std_mpsc::Sender<Listing>>,
    /// The thread could not be started: build on the caller.
    failed: bool,
}

/// Where to hand one listing.
pub struct ListSender(Option<std_mpsc::Sender<Listing>>);

impl ListWorker {
    /// A sender to the worker thread, starting it the first time.
    pub fn sender(&mut self) -> ListSender {
        if self.tx.is_none() && !self.failed {
            let (tx, rx) = std_mpsc::channel::<Listing>();
            let spawned = std::thread::Builder::new()
                .name("dispatcher-list".into())
                .spawn(move || {
                    for listing in rx {
                        answer(listing);
                    }
                });
            match spawned {
                Ok(_) => self.tx = Some(tx),
                Err(err) => {
                    tracing::warn!(
                        "ListNodes worker thread not started ({err}): views are built on the core"
                    );
                    self.failed = true;
                }
            }
        }
        ListSender(self.tx.clone())
    }
}

impl ListSender {
    /// Answer `reply` with the views of `copies` and the next page's
    /// token, on the worker thread.
    pub fn send(self, copies: Arc<Vec<NodeCopy>>, next_page_token: String, reply: ListReply) {
        let listing = (copies, next_page_token, reply);
        let unsent = match self.0 {
            Some(tx) => tx.send(listing).err().map(|e| e.0),
            None => Some(listing),
        };
        if let Some(listing) = unsent {
            answer(listing);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every listing handed over is answered, on the thread or, when
    /// there is none, by the caller.
    #[tokio::test]
    async fn every_listing_is_answered() {
        let mut worker = ListWorker::default();
        let mut answers = Vec::new();
        for _ in 0..3 {
            let (reply, answer) = oneshot::channel();
            worker
                .sender()
                .send(Arc::new(Vec::new()), "next".into(), reply);
            answers.push(answer);
        }
        let (reply, answer) = oneshot::channel();
        ListSender(None).send(Arc::new(Vec::new()), "next".into(), reply);
        answers.push(answer);
        drop(worker);
        for a in answers {
            let listing = a.await.unwrap().unwrap();
            assert!(listing.nodes.is_empty());
            assert_eq!(listing.next_page_token, "next");
        }
    }
}
