//! Finding the leader among several dispatcher replicas: the one place
//! where clients (agents, dispatchctl, tests) keep their list of
//! dispatcher URLs, follow a follower's `dispatch-leader` hint and rotate
//! on connection failures, and where the server builds that hint.
//!
//! A follower answers every RPC with UNAVAILABLE, the message "not the
//! leader; the leader is at URL" and the response metadata
//! `dispatch-leader: URL` ([`not_leader`]). A client holding an
//! [`Endpoints`] list calls [`Endpoints::failed`] with the error of a
//! failed call or connection: a hint moves it to the leader (added to the
//! list when it was not there), anything else to the next URL in order.

use std::future::Future;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::client_security::{ClientTls, SecurityError};
use tonic::{Code, Status};

/// Response metadata key carrying the leader's URL.
pub const LEADER_METADATA: &str = "dispatch-leader";

/// How long to wait for a TCP connection to a dispatcher.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 PING interval on dispatcher channels: a dispatcher that stops
/// answering (paused, cut off) is noticed within interval + timeout even
/// while the connection stays open at the TCP level.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a PING may go unanswered before the connection is dropped.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The status a follower answers with: UNAVAILABLE, naming the leader in
/// the message and in the `dispatch-leader` metadata when it is known.
pub fn not_leader(leader: Option<&str>) -> Status {
    match leader {
        Some(url) => {
            let mut status = Status::unavailable(format!("not the leader; the leader is at {url}"));
            if let Ok(v) = url.parse() {
                status.metadata_mut().insert(LEADER_METADATA, v);
            }
            status
        }
        None => Status::unavailable("not the leader; the leader is not known yet, retry"),
    }
}

/// The leader's URL named by a follower's answer, if any.
pub fn leader_hint(status: &Status) -> Option<String> {
    if status.code() != Code::Unavailable {
        return None;
    }
    let url = status
        .metadata()
        .get(LEADER_METADATA)?
        .to_str()
        .ok()?
        .trim();
    (!url.is_empty()).then(|| url.to_string())
}

/// Splits a comma-separated list of URLs (`--dispatcher`, `--server`),
/// dropping blanks.
pub fn parse_list(raw: &str) -> Vec<String> {
    raw.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// A tonic endpoint for a dispatcher URL: TLS as `tls` says
/// ([`crate::client_security::endpoint`]) and the shared connection
/// settings (connect timeout, no Nagle, HTTP/2 keepalive).
pub fn endpoint(url: &str, tls: &ClientTls) -> Result<Endpoint, SecurityError> {
    Ok(crate::client_security::endpoint(url, tls)?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// What a client should do after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// A follower named the leader: go there at once.
    Redirected(String),
    /// Try the next URL (after a short pause when a whole round failed).
    Rotated {
        /// The URL to try.
        url: String,
        /// True when every URL has failed since the last success.
        round_done: bool,
    },
}

/// A client's list of dispatcher URLs and the one it is using.
#[derive(Debug, Clone)]
pub struct Endpoints {
    urls: Vec<String>,
    current: usize,
    failures: usize,
}

/// An empty endpoint list.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no dispatcher address given")]
pub struct NoEndpoints;

impl Endpoints {
    /// The URLs in the order to try them.
    pub fn new<I, S>(urls: I) -> Result<Self, NoEndpoints>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut list: Vec<String> = Vec::new();
        for u in urls {
            let u: String = u.into();
            for part in parse_list(&u) {
                let part = part.trim_end_matches('/').to_string();
                if !list.contains(&part) {
                    list.push(part);
                }
            }
        }
        if list.is_empty() {
            return Err(NoEndpoints);
        }
        Ok(Self {
            urls: list,
            current: 0,
            failures: 0,
        })
    }

    /// The URL to use now.
    pub fn current(&self) -> &str {
        &self.urls[self.current]
    }

    /// Every known URL.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The current URL worked (a call succeeded, a stream registered).
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// The current URL failed with `status` (None: the connection itself
    /// failed): follow the leader hint if there is one, else rotate.
    pub fn failed(&mut self, status: Option<&Status>) -> Next {
        if let Some(leader) = status.and_then(leader_hint) {
            let leader = leader.trim_end_matches('/').to_string();
            if leader != self.urls[self.current] {
                let i = match self.urls.iter().position(|u| *u == leader) {
                    Some(i) => i,
                    None => {
                        self.urls.push(leader.clone());
                        self.urls.len() - 1
                    }
                };
                self.current = i;
                // A hint is progress, but a stale hint must not loop
                // forever without pauses: it counts as half a failure.
                self.failures += 1;
                if self.failures <= 2 * self.urls.len() {
                    return Next::Redirected(leader);
                }
            }
        }
        self.failures += 1;
        self.current = (self.current + 1) % self.urls.len();
        let round_done = self.failures >= self.urls.len();
        if round_done {
            self.failures = 0;
        }
        Next::Rotated {
            url: self.urls[self.current].clone(),
            round_done,
        }
    }
}

/// True when a call's status means "try another dispatcher": UNAVAILABLE
/// (a follower, a dispatcher shutting down or stepping down, a broken
/// connection).
pub fn should_failover(status: &Status) -> bool {
    status.code() == Code::Unavailable
}

/// A channel to whichever dispatcher leads, re-found on failures: the
/// connection-and-retry loop every client shares.
pub struct LeaderChannel {
    endpoints: Endpoints,
    channel: Option<Channel>,
    tls: ClientTls,
    /// How long [`LeaderChannel::call`] keeps trying before it gives up.
    pub patience: Duration,
}

impl LeaderChannel {
    /// A client of `endpoints` that retries for up to `patience`, in
    /// plain text unless [`LeaderChannel::with_tls`].
    pub fn new(endpoints: Endpoints, patience: Duration) -> Self {
        Self {
            endpoints,
            channel: None,
            tls: ClientTls::default(),
            patience,
        }
    }

    /// Connect with these TLS settings (for `https://` URLs).
    pub fn with_tls(mut self, tls: ClientTls) -> Self {
        self.tls = tls;
        self
    }

    /// The URL in use.
    pub fn current(&self) -> &str {
        self.endpoints.current()
    }

    /// Run `f` on a channel to the current dispatcher; on UNAVAILABLE or a
    /// connection failure follow the hint or rotate and run it again,
    /// until it succeeds, fails otherwise, or `patience` runs out (then
    /// the last UNAVAILABLE is returned). `f` must be safe to repeat: a
    /// call that reached a leader which then failed may have taken effect.
    pub async fn call<T, F, Fut>(&mut self, mut f: F) -> Result<T, Status>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.patience;
        loop {
            let status = match self.connect().await {
                Ok(channel) => match f(channel).await {
                    Ok(v) => {
                        self.endpoints.succeeded();
                        return Ok(v);
                    }
                    Err(s) if should_failover(&s) => s,
                    Err(s) => return Err(s),
                },
                Err(s) => s,
            };
            self.channel = None;
            // A hint is followed at once (Endpoints bounds stale hints);
            // patience applies to rotations.
            if let Next::Rotated { round_done, .. } = self.endpoints.failed(Some(&status)) {
                if tokio::time::Instant::now() >= deadline {
                    return Err(status);
                }
                if round_done {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn connect(&mut self) -> Result<Channel, Status> {
        if let Some(c) = &self.channel {
            return Ok(c.clone());
        }
        let url = self.endpoints.current().to_string();
        let ep = endpoint(&url, &self.tls).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let channel = tokio::time::timeout(CONNECT_TIMEOUT, ep.connect())
            .await
            .map_err(|_| Status::unavailable(format!("connecting to {url}: timed out")))?
            .map_err(|e| Status::unavailable(format!("connecting to {url}: {e}")))?;
        self.channel = Some(channel.clone());
        Ok(channel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_leader_round_trips_the_hint() {
        let s = not_leader(Some("http://10.0.0.2:50051"));
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(
            s.message(),
            "not the leader; the leader is at http://10.0.0.2:50051"
        );
        assert_eq!(leader_hint(&s).as_deref(), Some("http://10.0.0.2:50051"));
        assert_eq!(leader_hint(&not_leader(None)), None);
        // A hint on another code is ignored.
        let mut other = Status::internal("x");
        other
            .metadata_mut()
            .insert(LEADER_METADATA, "http://a:1".parse().unwrap());
        assert_eq!(leader_hint(&other), None);
    }

    #[test]
    fn parses_lists_and_rejects_empty() {
        assert_eq!(
            parse_list(" http://a:1, ,http://b:2 "),
            vec!["http://a:1", "http://b:2"]
        );
        assert!(Endpoints::new(Vec::<String>::new()).is_err());
        assert!(Endpoints::new([" , "]).is_err());
        let e = Endpoints::new(["http://a:1,http://b:2", "http://a:1/"]).unwrap();
        assert_eq!(e.urls(), ["http://a:1", "http://b:2"]);
    }

    #[test]
    fn follows_hints_and_rotates_otherwise() {
        let mut e = Endpoints::new(["http://a:1", "http://b:2", "http://c:3"]).unwrap();
        assert_eq!(e.current(), "http://a:1");
        // Connection failure: next in order.
        assert_eq!(
            e.failed(None),
            Next::Rotated {
                url: "http://b:2".into(),
                round_done: false
            }
        );
        // A follower names c: go there directly.
        let hint = not_leader(Some("http://c:3"));
        assert_eq!(e.failed(Some(&hint)), Next::Redirected("http://c:3".into()));
        assert_eq!(e.current(), "http://c:3");
        e.succeeded();
        // An unknown leader is added to the list.
        let hint = not_leader(Some("http://d:4"));
        assert_eq!(e.failed(Some(&hint)), Next::Redirected("http://d:4".into()));
        assert_eq!(e.urls().len(), 4);
        // A hint naming the current URL (stale) rotates instead.
        let stale = not_leader(Some("http://d:4"));
        assert!(matches!(e.failed(Some(&stale)), Next::Rotated { .. }));
    }

    #[test]
    fn stale_hints_cannot_loop_without_rounds() {
        // a says b leads, b says a leads: the client must still see a
        // completed round (and pause) every few steps.
        let mut e = Endpoints::new(["http://a:1", "http://b:2"]).unwrap();
        let mut rounds = 0;
        for _ in 0..40 {
            let hint = if e.current() == "http://a:1" {
                not_leader(Some("http://b:2"))
            } else {
                not_leader(Some("http://a:1"))
            };
            if let Next::Rotated {
                round_done: true, ..
            } = e.failed(Some(&hint))
            {
                rounds += 1;
            }
        }
        assert!(rounds >= 4, "only {rounds} pauses in 40 stale redirects");
    }
}
