//! A small async etcd v3 client: the KV calls (range, put, delete, txn)
//! and the lease calls (grant, keep-alive, revoke, time-to-live) the
//! dispatcher's etcd store and leader election use, over tonic.
//!
//! The protocol types are generated at build time from the etcd API protos
//! vendored in `proto/etcd/api` (see their headers for the etcd version
//! and what was left out), compiled with protox, so building this crate
//! needs no `protoc`. The generated messages are re-exported as they are
//! ([`pb`]); a few constructors on them ([`Compare::mod_revision`],
//! [`RequestOp::put`], [`prefix_end`], ...) keep call sites short.
//! Every call returns a typed [`Error`].

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// The code generated from the vendored protos.
pub mod pb {
    /// `mvccpb`: the stored key-value record.
    pub mod mvccpb {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("mvccpb");
    }
    /// `etcdserverpb`: the KV and Lease services and their messages.
    pub mod etcdserverpb {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("etcdserverpb");
    }
}

use pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::etcdserverpb::kv_client::KvClient;
use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::request_op::Request;
pub use pb::etcdserverpb::{
    Compare, DeleteRangeRequest, DeleteRangeResponse, LeaseGrantRequest, LeaseGrantResponse,
    LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest, LeaseTimeToLiveRequest,
    LeaseTimeToLiveResponse, PutRequest, PutResponse, RangeRequest, RangeResponse, RequestOp,
    ResponseHeader, ResponseOp, TxnRequest, TxnResponse,
};
pub use pb::mvccpb::KeyValue;

/// What an etcd call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No endpoint was given to [`Client::connect`].
    #[error("no etcd endpoint given")]
    NoEndpoints,
    /// An endpoint is not a valid URI.
    #[error("invalid etcd endpoint {endpoint:?}: {source}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// Why it was refused.
        source: tonic::transport::Error,
    },
    /// No endpoint could be connected to.
    #[error("cannot connect to etcd at {endpoint}: {source}")]
    Connect {
        /// The last endpoint tried.
        endpoint: String,
        /// The transport error.
        source: tonic::transport::Error,
    },
    /// etcd (or the transport under the call) answered with an error.
    #[error("etcd {rpc}: {}: {}", .status.code(), .status.message())]
    Rpc {
        /// The call, e.g. `Txn`.
        rpc: &'static str,
        /// gRPC's status.
        status: tonic::Status,
    },
    /// etcd refused a lease grant (`LeaseGrantResponse.error`).
    #[error("etcd refused the lease grant: {0}")]
    LeaseGrant(String),
    /// The lease keep-alive stream ended.
    #[error("the lease keep-alive stream of lease {0:x} closed")]
    KeepAliveClosed(i64),
}

fn rpc(rpc: &'static str) -> impl FnOnce(tonic::Status) -> Error {
    move |status| Error::Rpc { rpc, status }
}

/// How [`Client::connect`] sets up its connections.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    connect_timeout: Option<Duration>,
    keep_alive: Option<(Duration, Duration)>,
    keep_alive_while_idle: bool,
    max_message_bytes: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: None,
            keep_alive: None,
            keep_alive_while_idle: false,
            max_message_bytes: 4 << 20,
        }
    }
}

impl ConnectOptions {
    /// The defaults: no connect timeout, no HTTP/2 keep-alive, 4 MiB
    /// messages (gRPC's default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives up on a connection attempt after `d`.
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = Some(d);
        self
    }

    /// HTTP/2 pings every `interval`; the connection is dropped when one
    /// is not answered within `timeout`.
    pub fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive = Some((interval, timeout));
        self
    }

    /// Pings also while no call is in flight.
    pub fn with_keep_alive_while_idle(mut self, on: bool) -> Self {
        self.keep_alive_while_idle = on;
        self
    }

    /// Largest message sent or accepted (a page of a range read).
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    fn endpoint(&self, url: &str) -> Result<Endpoint, Error> {
        let mut e =
            Endpoint::from_shared(url.to_string()).map_err(|source| Error::InvalidEndpoint {
                endpoint: url.to_string(),
                source,
            })?;
        if let Some(d) = self.connect_timeout {
            e = e.connect_timeout(d);
        }
        if let Some((interval, timeout)) = self.keep_alive {
            e = e
                .http2_keep_alive_interval(interval)
                .keep_alive_timeout(timeout);
        }
        Ok(e.keep_alive_while_idle(self.keep_alive_while_idle))
    }
}

/// A connection to an etcd cluster. Cheap to clone; clones share the
/// connection. Calls may run concurrently.
#[derive(Clone, Debug)]
pub struct Client {
    kv: KvClient<Channel>,
    lease: LeaseClient<Channel>,
}

impl Client {
    /// Connects to `endpoints` (`http://host:port`). Fails at once when
    /// none of them answers; once connected, a broken connection is
    /// re-established by the next call. With several endpoints, calls are
    /// spread over those that are up.
    pub async fn connect<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
        opts: &ConnectOptions,
    ) -> Result<Self, Error> {
        let endpoints = endpoints
            .into_iter()
            .map(|e| opts.endpoint(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let channel = match endpoints.as_slice() {
            [] => return Err(Error::NoEndpoints),
            [one] => one.connect().await.map_err(|source| Error::Connect {
                endpoint: one.uri().to_string(),
                source,
            })?,
            many => {
                // Refuse to start when the whole cluster is unreachable,
                // as with one endpoint; then balance over all of them.
                let mut last = None;
                for e in many {
                    match e.connect().await {
                        Ok(_) => {
                            last = None;
                            break;
                        }
                        Err(source) => {
                            last = Some(Error::Connect {
                                endpoint: e.uri().to_string(),
                                source,
                            })
                        }
                    }
                }
                if let Some(err) = last {
                    return Err(err);
                }
                Channel::balance_list(endpoints.into_iter())
            }
        };
        let max = opts.max_message_bytes;
        Ok(Self {
            kv: KvClient::new(channel.clone())
                .max_decoding_message_size(max)
                .max_encoding_message_size(max),
            lease: LeaseClient::new(channel)
                .max_decoding_message_size(max)
                .max_encoding_message_size(max),
        })
    }

    /// `KV.Range`.
    pub async fn range(&self, req: RangeRequest) -> Result<RangeResponse, Error> {
        let mut kv = self.kv.clone();
        Ok(kv.range(req).await.map_err(rpc("Range"))?.into_inner())
    }

    /// `KV.Put` of one key, attached to `lease` unless it is 0.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<PutResponse, Error> {
        let mut kv = self.kv.clone();
        let req = PutRequest {
            key: key.into(),
            value: value.into(),
            lease,
            ..Default::default()
        };
        Ok(kv.put(req).await.map_err(rpc("Put"))?.into_inner())
    }

    /// `KV.DeleteRange`.
    pub async fn delete_range(
        &self,
        req: DeleteRangeRequest,
    ) -> Result<DeleteRangeResponse, Error> {
        let mut kv = self.kv.clone();
        Ok(kv
            .delete_range(req)
            .await
            .map_err(rpc("DeleteRange"))?
            .into_inner())
    }

    /// `KV.Txn`: all of `success` when every compare holds, else all of
    /// `failure`, atomically.
    pub async fn txn(&self, req: TxnRequest) -> Result<TxnResponse, Error> {
        let mut kv = self.kv.clone();
        Ok(kv.txn(req).await.map_err(rpc("Txn"))?.into_inner())
    }

    /// `Lease.LeaseGrant` of a lease with `ttl_secs` (etcd's minimum is
    /// 2 s; it may grant more).
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<LeaseGrantResponse, Error> {
        let mut lease = self.lease.clone();
        let resp = lease
            .lease_grant(LeaseGrantRequest {
                ttl: ttl_secs,
                id: 0,
            })
            .await
            .map_err(rpc("LeaseGrant"))?
            .into_inner();
        if resp.error.is_empty() {
            Ok(resp)
        } else {
            Err(Error::LeaseGrant(resp.error))
        }
    }

    /// `Lease.LeaseRevoke`: the lease ends and etcd deletes its keys.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), Error> {
        let mut lease = self.lease.clone();
        lease
            .lease_revoke(LeaseRevokeRequest { id })
            .await
            .map_err(rpc("LeaseRevoke"))?;
        Ok(())
    }

    /// `Lease.LeaseTimeToLive`: the lease's remaining TTL (-1 when it is
    /// gone), with its keys when `keys`.
    pub async fn lease_time_to_live(
        &self,
        id: i64,
        keys: bool,
    ) -> Result<LeaseTimeToLiveResponse, Error> {
        let mut lease = self.lease.clone();
        Ok(lease
            .lease_time_to_live(LeaseTimeToLiveRequest { id, keys })
            .await
            .map_err(rpc("LeaseTimeToLive"))?
            .into_inner())
    }

    /// Opens a `Lease.LeaseKeepAlive` stream for lease `id` and renews it
    /// once: the stream, to renew again with [`LeaseKeepAlive::renew`],
    /// and the first renewal's answer (TTL 0 or less: the lease is gone).
    pub async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<(LeaseKeepAlive, LeaseKeepAliveResponse), Error> {
        let (tx, rx) = mpsc::channel(4);
        // The request goes in before the call: etcd answers the call's
        // headers with its first response, so an empty stream would wait.
        tx.send(LeaseKeepAliveRequest { id })
            .await
            .map_err(|_| Error::KeepAliveClosed(id))?;
        let mut lease = self.lease.clone();
        let responses = lease
            .lease_keep_alive(ReceiverStream::new(rx))
            .await
            .map_err(rpc("LeaseKeepAlive"))?
            .into_inner();
        let mut stream = LeaseKeepAlive { id, tx, responses };
        let first = stream.next().await?;
        Ok((stream, first))
    }
}

/// An open keep-alive stream of one lease.
#[derive(Debug)]
pub struct LeaseKeepAlive {
    id: i64,
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
    responses: tonic::Streaming<LeaseKeepAliveResponse>,
}

impl LeaseKeepAlive {
    /// The lease this stream renews.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Renews the lease once and waits for etcd's answer (TTL 0 or less:
    /// the lease is gone).
    pub async fn renew(&mut self) -> Result<LeaseKeepAliveResponse, Error> {
        self.tx
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| Error::KeepAliveClosed(self.id))?;
        self.next().await
    }

    async fn next(&mut self) -> Result<LeaseKeepAliveResponse, Error> {
        self.responses
            .message()
            .await
            .map_err(rpc("LeaseKeepAlive"))?
            .ok_or(Error::KeepAliveClosed(self.id))
    }
}

/// The end of the key range holding every key that starts with `prefix`
/// (etcd's `GetPrefixRangeEnd`): the prefix with its last byte below 0xff
/// incremented and what follows it dropped; `[0]` (every key from
/// `prefix` on) when there is no such byte.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

impl Compare {
    fn on(key: impl Into<Vec<u8>>, target: CompareTarget, result: CompareResult) -> Self {
        Self {
            result: result as i32,
            target: target as i32,
            key: key.into(),
            ..Default::default()
        }
    }

    /// `key`'s create revision compared with `revision` (0: absent).
    pub fn create_revision(key: impl Into<Vec<u8>>, result: CompareResult, revision: i64) -> Self {
        Self {
            target_union: Some(TargetUnion::CreateRevision(revision)),
            ..Self::on(key, CompareTarget::Create, result)
        }
    }

    /// `key`'s mod revision (of its last write) compared with `revision`
    /// (0: absent).
    pub fn mod_revision(key: impl Into<Vec<u8>>, result: CompareResult, revision: i64) -> Self {
        Self {
            target_union: Some(TargetUnion::ModRevision(revision)),
            ..Self::on(key, CompareTarget::Mod, result)
        }
    }

    /// `key`'s lease compared with `lease` (0: no lease).
    pub fn lease(key: impl Into<Vec<u8>>, result: CompareResult, lease: i64) -> Self {
        Self {
            target_union: Some(TargetUnion::Lease(lease)),
            ..Self::on(key, CompareTarget::Lease, result)
        }
    }
}

pub use pb::etcdserverpb::compare::CompareResult as CompareOp;

impl RequestOp {
    /// Puts `value` at `key`, attached to `lease` unless it is 0.
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> Self {
        Self {
            request: Some(Request::RequestPut(PutRequest {
                key: key.into(),
                value: value.into(),
                lease,
                ..Default::default()
            })),
        }
    }

    /// Deletes `key`.
    pub fn delete(key: impl Into<Vec<u8>>) -> Self {
        Self {
            request: Some(Request::RequestDeleteRange(DeleteRangeRequest {
                key: key.into(),
                ..Default::default()
            })),
        }
    }

    /// Deletes every key starting with `prefix`.
    pub fn delete_prefix(prefix: impl Into<Vec<u8>>) -> Self {
        let key = prefix.into();
        Self {
            request: Some(Request::RequestDeleteRange(DeleteRangeRequest {
                range_end: prefix_end(&key),
                key,
                ..Default::default()
            })),
        }
    }

    /// Reads `key`.
    pub fn get(key: impl Into<Vec<u8>>) -> Self {
        Self {
            request: Some(Request::RequestRange(RangeRequest {
                key: key.into(),
                ..Default::default()
            })),
        }
    }
}

impl ResponseOp {
    /// The answer to a [`RequestOp::get`], if this is one.
    pub fn as_range(&self) -> Option<&RangeResponse> {
        match &self.response {
            Some(pb::etcdserverpb::response_op::Response::ResponseRange(r)) => Some(r),
            _ => None,
        }
    }
}

/// The store revision a response header reports (0 without a header).
pub fn revision(header: Option<&ResponseHeader>) -> i64 {
    header.map_or(0, |h| h.revision)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every key `k`: `k` starts with `prefix` iff `prefix <= k < end`
    /// (the oracle is `starts_with`).
    fn check_prefix_range(prefix: &[u8], key: &[u8]) -> bool {
        let end = prefix_end(prefix);
        let in_range = key >= prefix && (end == [0] || key < end.as_slice());
        in_range == key.starts_with(prefix)
    }

    #[test]
    fn prefix_ends_like_etcd() {
        assert_eq!(prefix_end(b"/t/"), b"/t0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    proptest! {
        #[test]
        fn a_prefix_range_holds_exactly_the_keys_with_the_prefix(
            prefix in proptest::collection::vec(prop_oneof![Just(0xffu8), Just(0u8), any::<u8>()], 0..4),
            key in proptest::collection::vec(prop_oneof![Just(0xffu8), Just(0u8), any::<u8>()], 0..6),
        ) {
            // Keys that extend the prefix must be covered too.
            let mut extended = prefix.clone();
            extended.extend_from_slice(&key);
            prop_assert!(check_prefix_range(&prefix, &key));
            prop_assert!(check_prefix_range(&prefix, &extended));
        }
    }
}
