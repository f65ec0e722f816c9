//! Limits on what clients may send the dispatcher, outside the job spec
//! itself (spec fields are `spec.rs`): the largest gRPC message each
//! service decodes and encodes, and a per-client submission rate (a token
//! bucket per client, counted in specs). Each refusal is a gRPC status with
//! a message saying which limit and what to do.
//!
//! The services are built with their [`Limits`] (see
//! [`crate::server::serve_secured`]); each JobService owns its
//! [`SubmitLimiter`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::{Request, Status};

/// Largest request a client may send, by default (16 MiB: a SubmitJobs
/// batch of 10000 specs of 1.6 KB each).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;
/// Sustained submissions (specs) per second per client, by default.
pub const DEFAULT_SUBMIT_RATE: f64 = 2000.0;
/// Submissions (specs) a client may send at once, by default: two full
/// SubmitJobs batches.
pub const DEFAULT_SUBMIT_BURST: u32 = 20_000;
/// Responses may be this many times larger than requests (a ListJobs page
/// or an array's SubmitJob reply); clients (dispatchctl) accept 256 MiB.
const ENCODE_FACTOR: usize = 16;
/// The agents' stream carries registrations of large nodes with all their
/// jobs, and log data: it may carry this many times the client limit.
const AGENT_FACTOR: usize = 4;
/// Buckets kept before idle ones (full again) are forgotten.
const MAX_BUCKETS: usize = 10_000;

/// The limits of one dispatcher.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request message of the client services (JobService,
    /// NodeService, health, reflection).
    pub max_message_bytes: usize,
    /// Sustained submissions per second per client; 0 = no rate limit.
    pub submit_rate: f64,
    /// Submissions a client may send at once.
    pub submit_burst: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            submit_rate: DEFAULT_SUBMIT_RATE,
            submit_burst: DEFAULT_SUBMIT_BURST,
        }
    }
}

impl Limits {
    /// Largest request a client service decodes.
    pub fn client_decode(&self) -> usize {
        self.max_message_bytes
    }

    /// Largest response a client service encodes.
    pub fn client_encode(&self) -> usize {
        self.max_message_bytes.saturating_mul(ENCODE_FACTOR)
    }

    /// Largest message the agents' stream carries, either way.
    pub fn agent_message(&self) -> usize {
        self.max_message_bytes.saturating_mul(AGENT_FACTOR)
    }

    /// The per-client submission limiter these limits ask for.
    pub fn submit_limiter(&self) -> SubmitLimiter {
        SubmitLimiter::new(self.submit_rate, self.submit_burst)
    }
}

/// Who a request comes from, for per-client limits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ClientKey {
    /// The user of the bearer token the request carried.
    Identity(String),
    /// The peer's IP address (no authentication).
    Peer(IpAddr),
    /// Neither is known (in-process transports).
    Unknown,
}

impl std::fmt::Display for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientKey::Identity(id) => write!(f, "client {id}"),
            ClientKey::Peer(ip) => write!(f, "client {ip}"),
            ClientKey::Unknown => write!(f, "unidentified clients"),
        }
    }
}

/// The key a request is limited under: the authenticated identity of its
/// bearer token when there is one (`identity`, from `auth`), else its
/// peer's IP address. The one place that decides who a client is.
pub fn client_key<T>(req: &Request<T>, identity: &str) -> ClientKey {
    if !identity.is_empty() {
        return ClientKey::Identity(identity.to_string());
    }
    match req.remote_addr() {
        Some(addr) => ClientKey::Peer(addr.ip()),
        None => ClientKey::Unknown,
    }
}

/// A token bucket: `rate` tokens per second up to `burst`.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    tokens: f64,
    last: Instant,
}

/// Why a bucket refused.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refusal {
    /// Time until the request would be admitted.
    pub retry_after: Duration,
}

impl TokenBucket {
    /// A full bucket.
    pub fn full(burst: u32, now: Instant) -> Self {
        Self {
            tokens: burst as f64,
            last: now,
        }
    }

    /// Take `cost` tokens at `now`, refilled at `rate`/s up to `burst`. A
    /// cost larger than the burst is admitted only from a full bucket and
    /// leaves it in debt, so large batches pass at the same average rate
    /// instead of never.
    pub fn take(&mut self, cost: u32, rate: f64, burst: u32, now: Instant) -> Result<(), Refusal> {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + elapsed * rate).min(burst as f64);
        let need = (cost as f64).min(burst as f64);
        if self.tokens + 1e-9 >= need {
            self.tokens -= cost as f64;
            return Ok(());
        }
        let secs = (need - self.tokens) / rate;
        Err(Refusal {
            retry_after: Duration::from_secs_f64(secs.clamp(0.001, 86_400.0)),
        })
    }

    /// Whether the bucket is full at `now` (its client is idle).
    fn is_full(&self, rate: f64, burst: u32, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens + elapsed * rate >= burst as f64
    }
}

/// Per-client token buckets for submissions.
#[derive(Debug)]
pub struct SubmitLimiter {
    rate: f64,
    burst: u32,
    buckets: Mutex<HashMap<ClientKey, TokenBucket>>,
}

impl SubmitLimiter {
    /// A limiter admitting `rate` specs per second per client, `burst` at
    /// once; a rate of 0 admits everything.
    pub fn new(rate: f64, burst: u32) -> Self {
        Self {
            rate,
            burst: burst.max(1),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Admit `specs` submissions from `key` at `now`, or refuse with
    /// RESOURCE_EXHAUSTED saying the rate and when to retry (also in the
    /// standard `grpc-retry-pushback-ms` trailer).
    pub fn admit(&self, key: &ClientKey, specs: usize, now: Instant) -> Result<(), Status> {
        if self.rate <= 0.0 || !self.rate.is_finite() {
            return Ok(());
        }
        let cost = u32::try_from(specs).unwrap_or(u32::MAX);
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(key) {
            buckets.retain(|_, b| !b.is_full(self.rate, self.burst, now));
        }
        let bucket = buckets
            .entry(key.clone())
            .or_insert_with(|| TokenBucket::full(self.burst, now));
        match bucket.take(cost, self.rate, self.burst, now) {
            Ok(()) => Ok(()),
            Err(refusal) => {
                let ms = refusal.retry_after.as_millis().max(1);
                let mut status = Status::resource_exhausted(format!(
                    "submission rate limit: {key} may submit {} specs per second, bursts of {}; \
                     this call of {specs} spec(s) was refused and created nothing: retry in {:.3}s",
                    self.rate,
                    self.burst,
                    refusal.retry_after.as_secs_f64()
                ));
                if let Ok(v) = ms.to_string().parse() {
                    status.metadata_mut().insert("grpc-retry-pushback-ms", v);
                }
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_bucket_admits_its_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::full(5, t0);
        for _ in 0..5 {
            b.take(1, 2.0, 5, t0).unwrap();
        }
        let refused = b.take(1, 2.0, 5, t0).unwrap_err();
        assert!((refused.retry_after.as_secs_f64() - 0.5).abs() < 1e-6);
        // Half a second later one token (rate 2/s) is back, not two.
        b.take(1, 2.0, 5, t0 + secs(0.5)).unwrap();
        assert!(b.take(1, 2.0, 5, t0 + secs(0.5)).is_err());
        // Long idle refills to the burst, never beyond.
        let later = t0 + secs(100.0);
        for _ in 0..5 {
            b.take(1, 2.0, 5, later).unwrap();
        }
        assert!(b.take(1, 2.0, 5, later).is_err());
    }

    #[test]
    fn a_batch_larger_than_the_burst_passes_from_a_full_bucket_into_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::full(10, t0);
        b.take(25, 10.0, 10, t0).unwrap();
        // 15 in debt: one more needs 1.6 s of refill.
        let r = b.take(1, 10.0, 10, t0).unwrap_err();
        assert!((r.retry_after.as_secs_f64() - 1.6).abs() < 1e-6, "{r:?}");
        // The next large batch waits for a full bucket again: 2.5 s.
        let r = b.take(25, 10.0, 10, t0).unwrap_err();
        assert!((r.retry_after.as_secs_f64() - 2.5).abs() < 1e-6, "{r:?}");
        b.take(25, 10.0, 10, t0 + secs(2.5)).unwrap();
    }

    #[test]
    fn clients_have_their_own_buckets_and_refusals_say_when_to_retry() {
        let l = SubmitLimiter::new(1.0, 3);
        let now = Instant::now();
        let a = ClientKey::Peer("10.0.0.1".parse().unwrap());
        let b = ClientKey::Identity("alice".into());
        l.admit(&a, 3, now).unwrap();
        l.admit(&b, 3, now).unwrap();
        let e = l.admit(&a, 1, now).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("client 10.0.0.1"), "{}", e.message());
        assert!(
            e.message().contains("1 specs per second"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("retry in 1.000s"), "{}", e.message());
        assert_eq!(
            e.metadata()
                .get("grpc-retry-pushback-ms")
                .and_then(|v| v.to_str().ok()),
            Some("1000")
        );
        assert!(l.admit(&b, 1, now).is_err());
        l.admit(&a, 1, now + secs(1.0)).unwrap();
    }

    #[test]
    fn rate_zero_is_off() {
        let l = SubmitLimiter::new(0.0, 1);
        let now = Instant::now();
        for _ in 0..1000 {
            l.admit(&ClientKey::Unknown, 10_000, now).unwrap();
        }
    }

    #[test]
    fn idle_buckets_are_forgotten_when_there_are_too_many() {
        let l = SubmitLimiter::new(1000.0, 10);
        let now = Instant::now();
        for i in 0..MAX_BUCKETS as u32 {
            let ip = IpAddr::from(i.to_be_bytes());
            l.admit(&ClientKey::Peer(ip), 1, now).unwrap();
        }
        // A second later every bucket is full again: a new client prunes them.
        l.admit(&ClientKey::Unknown, 1, now + secs(1.0)).unwrap();
        assert_eq!(l.buckets.lock().unwrap().len(), 1);
    }

    #[test]
    fn the_key_is_the_identity_else_the_peer() {
        let req = Request::new(());
        assert_eq!(client_key(&req, ""), ClientKey::Unknown);
        assert_eq!(client_key(&req, "bob"), ClientKey::Identity("bob".into()));
    }

    #[test]
    fn message_limits_follow_the_flag() {
        let l = Limits {
            max_message_bytes: 1 << 20,
            ..Limits::default()
        };
        assert_eq!(l.client_decode(), 1 << 20);
        assert_eq!(l.client_encode(), 16 << 20);
        assert_eq!(l.agent_message(), 4 << 20);
    }
}
