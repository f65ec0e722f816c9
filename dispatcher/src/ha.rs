//! High availability on etcd: the election among dispatcher replicas and
//! the leader's term. It drives this replica's [`Role`]; every RPC reads
//! it through a [`crate::gate::Gate`].
//!
//! Protocol (all keys under `--etcd-prefix` `P`):
//!
//! 1. A replica grants itself a lease of `--lease-ttl-secs` and keeps it
//!    alive every TTL/3; each confirmed renewal extends its
//!    [`LeaseClock`] by the TTL counted from when the renewal was *sent*,
//!    so the local view never outlives etcd's.
//! 2. It campaigns with one transaction: if `P/leader` does not exist,
//!    create it with the replica's `--advertise-url`, attached to its
//!    lease; otherwise read it. The winner's fence is (lease, the key's
//!    create revision).
//! 3. A follower ([`Role::Follower`]) answers every RPC with UNAVAILABLE
//!    naming the leader read from `P/leader`
//!    ([`proto::endpoints::not_leader`]) and campaigns again every
//!    [`CAMPAIGN_POLL`]. When the leader's lease expires etcd deletes the
//!    key and the next campaign wins.
//! 4. The leader ([`Role::Starting`], then [`Role::Leader`]) loads the
//!    state from etcd, restores the cluster and starts the core; every
//!    commit is fenced ([`crate::store::etcd`]).
//! 5. The term ends when the lease clock runs out (renewals failed for a
//!    TTL, or etcd answered that the lease is gone) or a commit is
//!    refused ([`StoreError::Fenced`]) or fails. The replica then answers
//!    as a follower at once, stops the core (in-flight calls and agent
//!    streams end with UNAVAILABLE; nothing is written: the store refuses
//!    every write once the clock is lost), revokes its old lease (so a
//!    live peer takes over without waiting for the TTL) and campaigns
//!    again with a fresh lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::{Client, Compare, CompareOp, ConnectOptions, RequestOp, TxnRequest};
use tokio::sync::watch;

use crate::cluster::Cluster;
use crate::core::{CoreExit, OnStoreFailure};
use crate::gate::Role;
use crate::observe::Observers;
use crate::store::etcd::{
    EtcdStore, Fence, LeaseClock, MAX_DECODE, OP_TIMEOUT, TxnLimits, attempt_timeout, transient,
};
use crate::store::{Snapshot, Store, StoreError};

/// How often a follower campaigns (and refreshes the leader's URL).
pub const CAMPAIGN_POLL: Duration = Duration::from_millis(300);

/// A replica's etcd settings.
#[derive(Clone, Debug)]
pub struct HaConfig {
    /// etcd client URLs.
    pub endpoints: Vec<String>,
    /// Key prefix, e.g. `/dispatch`.
    pub prefix: String,
    /// The URL clients and agents should use for this replica.
    pub advertise_url: String,
    /// The URL of this replica's web page (`--http-listen`), published
    /// with the advertise URL so followers can link to the leader's page.
    pub advertise_http_url: Option<String>,
    /// Lease TTL (etcd's minimum is 2 s).
    pub lease_ttl: Duration,
    /// Transaction limits of the etcd servers.
    pub limits: TxnLimits,
    /// The etcd servers' `--election-timeout`: a request with no answer
    /// for [`attempt_timeout`] of it is sent again (it waits on a member
    /// for a leader that died).
    pub election_timeout: Duration,
}

impl HaConfig {
    fn leader_key(&self) -> String {
        format!("{}/leader", self.prefix.trim_end_matches('/'))
    }
}

/// The value of the leader key: the leader's advertise URL and, when it
/// serves one, its web page URL.
///
/// Encoded as the bare advertise URL when there is no web URL (the format
/// of the first HA release, which every replica still reads), else as JSON
/// `{"url": ..., "http": ...}`; [`LeaderRecord::decode`] takes both.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaderRecord {
    /// The advertise URL (gRPC).
    pub url: String,
    /// The web page URL (`--advertise-http-url`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
}

impl LeaderRecord {
    /// The leader key's value.
    pub fn encode(&self) -> String {
        match &self.http {
            None => self.url.clone(),
            Some(_) => serde_json::to_string(self).unwrap_or_else(|_| self.url.clone()),
        }
    }

    /// Reads a leader key's value (either form); None when it is neither
    /// a URL nor the JSON form.
    pub fn decode(value: &str) -> Option<Self> {
        let value = value.trim();
        if value.starts_with('{') {
            return serde_json::from_str::<Self>(value)
                .ok()
                .filter(|r| !r.url.is_empty());
        }
        (!value.is_empty()).then(|| Self {
            url: value.to_string(),
            http: None,
        })
    }
}

/// Connects to etcd, retrying until it answers or `stop` turns true.
async fn connect(cfg: &HaConfig, stop: &mut watch::Receiver<bool>) -> Option<Client> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
        .with_keep_alive_while_idle(true)
        .with_max_message_bytes(MAX_DECODE);
    let mut backoff = Duration::from_millis(100);
    loop {
        match tokio::time::timeout(OP_TIMEOUT, Client::connect(&cfg.endpoints, &opts)).await {
            Ok(Ok(c)) => return Some(c),
            Ok(Err(err)) => tracing::warn!(%err, "connecting to etcd; retrying in {backoff:?}"),
            Err(_) => tracing::warn!("connecting to etcd timed out; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            return None;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// A lease and the task renewing it.
struct Lease {
    id: i64,
    clock: Arc<LeaseClock>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Lease {
    /// A new lease of `ttl`; the grant waits at most `wait` (an
    /// unanswered grant that etcd applies anyway expires unused).
    async fn grant(client: &Client, ttl: Duration, wait: Duration) -> Result<Self, String> {
        let sent = Instant::now();
        let resp = tokio::time::timeout(wait, client.lease_grant(ttl.as_secs() as i64))
            .await
            .map_err(|_| "lease grant timed out".to_string())?
            .map_err(|e| format!("lease grant: {e}"))?;
        let granted = Duration::from_secs(resp.ttl.max(0) as u64);
        let clock = Arc::new(LeaseClock::new(sent, granted));
        let keeper = tokio::spawn(keep_alive(client.clone(), resp.id, ttl, clock.clone()));
        Ok(Self {
            id: resp.id,
            clock,
            keeper,
        })
    }

    /// Gives the lease up: no more writes under it, and etcd deletes the
    /// keys attached to it (the leader key) so a peer can win at once.
    async fn give_up(self, client: &Client) {
        self.clock.lose();
        self.keeper.abort();
        // Again until it answers: after an etcd member died the client
        // keeps handing it requests for a while, and an unrevoked lease
        // holds the leader key for a whole TTL, so no replica could win
        // before it expires (found by tests/faults_etcd.rs). Revoking
        // twice is harmless.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            match tokio::time::timeout_at(deadline, client.lease_revoke(self.id)).await {
                Ok(Ok(_)) => tracing::info!(lease = format!("{:x}", self.id), "lease revoked"),
                Ok(Err(err)) if err.to_string().contains("lease not found") => {}
                Ok(Err(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Ok(Err(err)) => tracing::info!(%err, "revoking the old lease failed; it expires"),
                Err(_) => tracing::info!("revoking the old lease timed out; it expires"),
            }
            return;
        }
    }
}

/// Renews `lease` every TTL/3 until the clock is lost.
async fn keep_alive(client: Client, lease: i64, ttl: Duration, clock: Arc<LeaseClock>) {
    let period = ttl / 3;
    let mut stream: Option<etcd::LeaseKeepAlive> = None;
    loop {
        if !clock.valid() {
            clock.lose();
            return;
        }
        let sent = Instant::now();
        let renewed = tokio::time::timeout(period, async {
            match stream.as_mut() {
                Some(open) => open.renew().await,
                None => {
                    let (open, first) = client.lease_keep_alive(lease).await?;
                    stream = Some(open);
                    Ok(first)
                }
            }
        })
        .await;
        match renewed {
            Ok(Ok(resp)) if resp.ttl > 0 => {
                clock.extend(sent, Duration::from_secs(resp.ttl as u64));
            }
            Ok(Ok(_)) => {
                tracing::warn!(lease = format!("{lease:x}"), "etcd says the lease expired");
                clock.lose();
                return;
            }
            Ok(Err(_)) | Err(_) => {
                // The stream broke (etcd restarted, connection lost) or the
                // renewal is late: open a new one next time.
                stream = None;
            }
        }
        tokio::time::sleep(period.saturating_sub(sent.elapsed())).await;
    }
}

/// One campaign: `Ok(Some(create_revision))` when this replica now holds
/// the leader key, `Ok(None)` with the current leader written to `leader`.
async fn campaign(
    client: &Client,
    cfg: &HaConfig,
    lease: i64,
    leader: &mut Option<LeaderRecord>,
) -> Result<Option<i64>, String> {
    let key = cfg.leader_key();
    let record = LeaderRecord {
        url: cfg.advertise_url.clone(),
        http: cfg.advertise_http_url.clone(),
    }
    .encode();
    let txn = TxnRequest {
        compare: vec![Compare::create_revision(key.as_str(), CompareOp::Equal, 0)],
        success: vec![RequestOp::put(key.as_str(), record.as_str(), lease)],
        failure: vec![RequestOp::get(key.as_str())],
    };
    // A campaign is safe to repeat (one that applied is recognised by its
    // lease): it is sent again at once while it fails on the way (a dead
    // member the client still tries), and waits no longer than a request
    // held by a member whose leader died: the next one, CAMPAIGN_POLL
    // later, finds a new leader.
    let send = async {
        loop {
            match client.txn(txn.clone()).await {
                Err(e) if transient(&e) => tokio::time::sleep(Duration::from_millis(10)).await,
                r => return r,
            }
        }
    };
    let resp = tokio::time::timeout(attempt_timeout(cfg.election_timeout), send)
        .await
        .map_err(|_| "campaign timed out".to_string())?
        .map_err(|e| format!("campaign: {e}"))?;
    if resp.succeeded {
        return Ok(Some(etcd::revision(resp.header.as_ref())));
    }
    for op in &resp.responses {
        if let Some(get) = op.as_range()
            && let Some(kv) = get.kvs.first()
        {
            if kv.lease == lease {
                // Ours already (an earlier campaign's answer was lost).
                return Ok(Some(kv.create_revision));
            }
            *leader = std::str::from_utf8(&kv.value)
                .ok()
                .and_then(LeaderRecord::decode);
        }
    }
    Ok(None)
}

/// How a term ended.
enum TermEnd {
    Stop,
    LeaseLost,
    Core(CoreExit),
}

/// Runs the replica until `stop` turns true: campaign, lead, step down,
/// campaign again. `build` makes the cluster from a loaded snapshot (the
/// caller's configuration and restore grace); each term's core reports to
/// `observers`, which learn when a term starts and ends.
pub async fn run(
    cfg: HaConfig,
    build: impl Fn(Snapshot) -> Cluster,
    observers: Observers,
    role: watch::Sender<Role>,
    mut stop: watch::Receiver<bool>,
) {
    let setup = CoreSetup { build, observers };
    // Not leading yet: export no cluster gauges until elected.
    setup.observers.leading(false);
    let Some(client) = connect(&cfg, &mut stop).await else {
        return;
    };
    let mut leader: Option<LeaderRecord> = None;
    let mut lease: Option<Lease> = None;
    while !*stop.borrow() {
        // Follower: campaign until elected.
        let held = match lease.take() {
            Some(l) if l.clock.valid() => l,
            old => {
                if let Some(old) = old {
                    old.give_up(&client).await;
                }
                match Lease::grant(
                    &client,
                    cfg.lease_ttl,
                    attempt_timeout(cfg.election_timeout),
                )
                .await
                {
                    Ok(l) => l,
                    Err(err) => {
                        tracing::warn!(%err, "cannot get a lease; retrying");
                        pause(&mut stop, CAMPAIGN_POLL).await;
                        continue;
                    }
                }
            }
        };
        let won = match campaign(&client, &cfg, held.id, &mut leader).await {
            Ok(won) => won,
            Err(err) => {
                tracing::warn!(%err, "campaign failed; retrying");
                None
            }
        };
        let Some(create_revision) = won else {
            let url = leader.as_ref().map(|l| l.url.clone());
            let http = leader.as_ref().and_then(|l| l.http.clone());
            role.send_if_modified(|r| match r {
                Role::Follower {
                    leader: l,
                    leader_http: h,
                } if *l == url && *h == http => false,
                _ => {
                    *r = Role::Follower {
                        leader: url,
                        leader_http: http,
                    };
                    true
                }
            });
            lease = Some(held);
            pause(&mut stop, CAMPAIGN_POLL).await;
            continue;
        };
        tracing::info!(
            url = %cfg.advertise_url,
            lease = format!("{:x}", held.id),
            create_revision,
            "elected leader"
        );
        let end = lead(
            &client,
            &cfg,
            &setup,
            &role,
            &mut stop,
            &held,
            create_revision,
        )
        .await;
        let _ = role.send(Role::Follower {
            leader: None,
            leader_http: None,
        });
        // The core has stopped: what it published for the web page and
        // the cluster gauges is stale from now on (`dispatch_leader` 0).
        setup.observers.leading(false);
        match &end {
            TermEnd::Stop => tracing::info!("leader stopping"),
            TermEnd::LeaseLost => {
                tracing::warn!("stepped down: the leader lease was lost; nothing more is written")
            }
            TermEnd::Core(CoreExit::StoreFailed(StoreError::Fenced(why))) => {
                tracing::warn!(%why, "stepped down: fenced, a write was refused")
            }
            TermEnd::Core(exit) => tracing::warn!(?exit, "stepped down: the core stopped"),
        }
        leader = None;
        held.give_up(&client).await;
    }
}

async fn pause(stop: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.changed() => {}
    }
}

/// What each term builds its core from: the cluster, made from the loaded
/// state, and the observers the core reports to.
struct CoreSetup<B> {
    build: B,
    observers: Observers,
}

/// One term as leader; returns when it ends, with the core stopped.
async fn lead(
    client: &Client,
    cfg: &HaConfig,
    setup: &CoreSetup<impl Fn(Snapshot) -> Cluster>,
    role: &watch::Sender<Role>,
    stop: &mut watch::Receiver<bool>,
    lease: &Lease,
    create_revision: i64,
) -> TermEnd {
    let _ = role.send(Role::Starting);
    let fence = Fence {
        leader_key: cfg.leader_key(),
        lease: lease.id,
        create_revision,
        clock: lease.clock.clone(),
    };
    let store = EtcdStore::new(
        client,
        tokio::runtime::Handle::current(),
        &cfg.prefix,
        fence,
        cfg.limits,
    )
    .with_attempt_timeout(attempt_timeout(cfg.election_timeout));
    let loaded = tokio::task::spawn_blocking(move || {
        let snap = store.load();
        (store, snap)
    })
    .await;
    let (store, snapshot) = match loaded {
        Ok((store, Ok(snap))) => (store, snap),
        Ok((_, Err(err))) => return TermEnd::Core(CoreExit::StoreFailed(err)),
        Err(err) => {
            return TermEnd::Core(CoreExit::StoreFailed(StoreError::Backend(format!(
                "loading the state: {err}"
            ))));
        }
    };
    let jobs = snapshot.jobs.len();
    let cluster = (setup.build)(snapshot);
    let (core, thread) = crate::core::spawn(
        cluster,
        Box::new(store),
        OnStoreFailure::Stop,
        setup.observers.clone(),
    );
    let mut joined = tokio::task::spawn_blocking(move || thread.join());
    let _ = role.send(Role::Leader(core.clone()));
    setup.observers.leading(true);
    tracing::info!(jobs, "leading: state loaded, placing");
    let mut check = tokio::time::interval(Duration::from_millis(50));
    let end = loop {
        tokio::select! {
            r = &mut joined => {
                let exit = match r {
                    Ok(Ok(exit)) => exit,
                    _ => CoreExit::StoreFailed(StoreError::Backend("the core thread panicked".into())),
                };
                return TermEnd::Core(exit);
            }
            _ = check.tick() => {
                if !lease.clock.valid() {
                    break TermEnd::LeaseLost;
                }
            }
            _ = stop.changed() => {
                if *stop.borrow() {
                    break TermEnd::Stop;
                }
            }
        }
    };
    // Stop answering as leader first, then stop the core: from here every
    // commit is refused (the clock is lost), so the core writes nothing.
    let _ = role.send(Role::Follower {
        leader: None,
        leader_http: None,
    });
    lease.clock.lose();
    core.send(crate::core::Command::Shutdown);
    let _ = joined.await;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keepalive loop against a real etcd: a kept lease outlives
    /// several TTLs both in etcd and in the local clock (this fails if
    /// renewal is broken: the clock runs out after one TTL); once renewal
    /// stops, the clock runs out no later than etcd's lease. Time passing
    /// is what is tested here, so the test waits for it (polling etcd).
    /// etcd reports a lease's remaining time in whole seconds, rounded
    /// down (0 for the last second), and -1 once it is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renewal_keeps_the_lease_and_the_clock_never_outlives_etcd() {
        let dir = tempfile::tempdir().unwrap();
        let etcd = e2e::Etcd::start(dir.path()).unwrap();
        let client = Client::connect([etcd.url.as_str()], &ConnectOptions::new())
            .await
            .unwrap();
        let ttl = Duration::from_secs(3);
        let lease = Lease::grant(&client, ttl, Duration::from_secs(30))
            .await
            .unwrap();
        let granted = Instant::now();
        let etcd_ttl = |id| {
            let client = client.clone();
            async move { client.lease_time_to_live(id, false).await.unwrap().ttl }
        };
        // Two TTLs, checked all along: never lost, etcd's lease alive.
        while granted.elapsed() < ttl * 2 {
            assert!(
                lease.clock.valid(),
                "the lease clock ran out after {:?} with renewal running",
                granted.elapsed()
            );
            assert!(
                etcd_ttl(lease.id).await >= 0,
                "etcd expired a renewed lease"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Renewal stops: the clock runs out, and while it still says
        // valid, etcd still holds the lease.
        lease.keeper.abort();
        let stopped = Instant::now();
        while lease.clock.valid() {
            assert!(
                etcd_ttl(lease.id).await >= 0,
                "the local clock outlived etcd's lease"
            );
            assert!(stopped.elapsed() < ttl * 3, "the clock never ran out");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[test]
    fn leader_records_read_both_forms() {
        let bare = LeaderRecord {
            url: "http://10.0.0.7:50051".into(),
            http: None,
        };
        // Without a web URL the value stays the bare URL older replicas wrote.
        assert_eq!(bare.encode(), "http://10.0.0.7:50051");
        assert_eq!(LeaderRecord::decode("http://10.0.0.7:50051"), Some(bare));
        let full = LeaderRecord {
            url: "https://d1:50051".into(),
            http: Some("http://d1:9100".into()),
        };
        assert_eq!(
            full.encode(),
            r#"{"url":"https://d1:50051","http":"http://d1:9100"}"#
        );
        assert_eq!(LeaderRecord::decode(&full.encode()), Some(full));
        assert_eq!(LeaderRecord::decode(""), None);
        assert_eq!(LeaderRecord::decode("{not json"), None);
        assert_eq!(LeaderRecord::decode(r#"{"url":""}"#), None);
    }
}
