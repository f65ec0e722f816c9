//! A job's key ([`JobKey`], the one place that reads and writes job
//! ids) and its record as the job table keeps it ([`JobRecord`]), shared
//! by the job table (`cluster::jobs`) and the store, which encodes it.
//! The record is not the proto `Job` but its fields in compact form, from which the proto is
//! built only when a reader asks (GetJob, ListJobs, a watcher's event,
//! the web page); the stores write its encoding straight from the record
//! ([`JobRecord::encode_proto`]), the same bytes without the copy.
//!
//! What is compact (the proto `Job` with its `JobSpec` is 600 bytes
//! inline plus its strings, and an array's elements each carried a copy
//! of the spec):
//! - the spec is shared (`Arc`) by an array's or a gang's elements, and
//!   moved into the record at submit, never copied;
//! - the ids `id`, `array_id` and `gang_id` and the indexes are derived
//!   from the job's [`JobKey`] and whether it is an array element or a
//!   gang member (the only ids the dispatcher hands out);
//! - the owner is shared by the jobs of one submission;
//! - the reported CPUs and GPUs are boxed slices;
//! - `pending_reason` is not kept: it is computed when a job is read
//!   (`cluster::pending`), never stored.
//!
//! Invariant: `JobRecord::from_proto(j).to_proto() == j` for every `Job`
//! the dispatcher writes (ids from its key, no `pending_reason`), so every
//! answer and every stored byte is what the proto record gave
//! (`tests::a_record_gives_back_the_proto_job`).

use std::fmt;
use std::sync::Arc;

use proto::v1::{Assign, DispatcherMessage, Job, JobSpec, SharedSpec, dispatcher_message};

/// A job's id as an ordered key: `j-12` is `(12, 0)`, element 3 of array
/// `j-12` (`j-12.3`) is `(12, 4)`. The only place that reads or writes the
/// id format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobKey {
    number: u64,
    /// 0 for a plain job; array index + 1 for an array element.
    element: u32,
}

impl JobKey {
    /// A plain job.
    pub fn single(number: u64) -> Self {
        Self { number, element: 0 }
    }

    /// Element `index` of array `number`.
    pub fn element(number: u64, index: u32) -> Self {
        Self {
            number,
            element: index.saturating_add(1),
        }
    }

    /// Parse `j-12` / `j-12.3`.
    pub fn parse(id: &str) -> Option<Self> {
        let rest = id.strip_prefix("j-")?;
        // A plain id of up to 19 decimal digits (every plain id the
        // dispatcher hands out below 10^19): read here, where the general
        // path below (a search for `.`, then `str::parse`, which also
        // takes a leading `+`) cost ~180 instructions of each status.
        if !rest.is_empty()
            && rest.len() <= 19
            && let Some(n) = rest.bytes().try_fold(0u64, |n, b| {
                b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
            })
        {
            return Some(Self::single(n));
        }
        Self::parse_rest(rest)
    }

    /// [`JobKey::parse`] of the id without its `j-`, in general.
    fn parse_rest(rest: &str) -> Option<Self> {
        match rest.split_once('.') {
            None => Some(Self::single(rest.parse().ok()?)),
            Some((n, i)) => Some(Self {
                number: n.parse().ok()?,
                element: i.parse::<u32>().ok()?.checked_add(1)?,
            }),
        }
    }

    /// The job number (an array's elements share it).
    pub fn number(self) -> u64 {
        self.number
    }

    /// The element's index in its array or gang (0 for a plain job).
    pub fn index(self) -> u32 {
        self.element.saturating_sub(1)
    }

    /// True for a plain job id (which may name an array).
    pub fn is_single(self) -> bool {
        self.element == 0
    }

    /// The array id `j-N` of an element (itself for a plain job).
    pub fn array(self) -> Self {
        Self::single(self.number)
    }

    /// The key range of the elements of array `self`.
    pub fn elements(self) -> std::ops::Range<JobKey> {
        Self::element(self.number, 0)..Self::single(self.number + 1)
    }
}

/// Room for the longest id: `j-`, a `u64`, `.`, a `u32`.
const ID_MAX: usize = 2 + 20 + 1 + 10;

impl JobKey {
    /// The id text (`j-N`, `j-N.i`), written backwards into `buf`: the
    /// id is written for every `Assign` and every record encoded, and
    /// the formatting machinery (`write!` of two integers into a growing
    /// `String`) cost ~450 instructions of the ~30k of a placement.
    fn id_text(self, buf: &mut [u8; ID_MAX]) -> &str {
        // Right to left: the element's index and `.`, the number, `j-`.
        fn digits(buf: &mut [u8; ID_MAX], mut end: usize, mut v: u64) -> usize {
            loop {
                end -= 1;
                buf[end] = b'0' + (v % 10) as u8;
                v /= 10;
                if v == 0 {
                    return end;
                }
            }
        }
        let mut at = ID_MAX;
        if self.element != 0 {
            at = digits(buf, at, u64::from(self.element - 1)) - 1;
            buf[at] = b'.';
        }
        at = digits(buf, at, self.number) - 2;
        buf[at..at + 2].copy_from_slice(b"j-");
        std::str::from_utf8(&buf[at..]).unwrap_or_default()
    }
}

impl fmt::Display for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id_text(&mut [0; ID_MAX]))
    }
}

/// A job's display text (`Job.reason`), shared by the jobs that show the
/// same one: the elements of an array that no node matches each held its
/// own copy of the same ~80 bytes. An `Arc<str>`; none for the empty text.
#[derive(Clone, Default)]
pub struct Text(Option<Arc<str>>);

impl Text {
    /// The text.
    #[inline]
    pub fn as_str(&self) -> &str {
        self.0.as_deref().unwrap_or("")
    }

    /// True when both are one allocation (shared).
    pub fn is_shared_with(&self, other: &Text) -> bool {
        match (&self.0, &other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Self((!s.is_empty()).then(|| Arc::from(s)))
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self((!s.is_empty()).then(|| Arc::from(s)))
    }
}

impl From<Box<str>> for Text {
    fn from(s: Box<str>) -> Self {
        Self((!s.is_empty()).then(|| Arc::from(s)))
    }
}

impl std::ops::Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Text {}

impl PartialEq<str> for Text {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Text {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A node's name as the job table, the effects and the registry carry
/// it: one allocation per node, made when it registers, shared by every
/// job phase, record, agent message and move that names the node (a
/// `String` copy per placement, start and message was four allocations
/// and frees per job). A shared [`Text`]; none for the empty name (no
/// node). Compares, orders and hashes as its text, so it keys maps looked
/// up by `&str`.
///
/// A name the node registry handed out also carries the node's registry
/// slot ([`NodeName::slot`]; set only by `Nodes::insert`, and a node is
/// never removed, so the slot names that node for the registry's life):
/// the job table's per-node index reaches the node's jobs by it without
/// hashing the name. A name made from text (an agent's message, the
/// store) has none.
#[derive(Clone)]
pub struct NodeName(Text, u32);

/// [`NodeName`]'s slot when it has none.
const NO_SLOT: u32 = u32::MAX;

impl Default for NodeName {
    fn default() -> Self {
        Self(Text::default(), NO_SLOT)
    }
}

impl NodeName {
    /// The name.
    #[inline]
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The registry slot of the node it names, when the registry made it.
    #[inline]
    pub fn slot(&self) -> Option<u32> {
        (self.1 != NO_SLOT).then_some(self.1)
    }

    /// The same name, for the registry slot `slot` (`Nodes::insert`).
    pub(crate) fn in_slot(mut self, slot: u32) -> Self {
        debug_assert!(slot != NO_SLOT, "a slot beyond u32");
        self.1 = slot;
        self
    }
}

impl<T: Into<Text>> From<T> for NodeName {
    fn from(s: T) -> Self {
        Self(s.into(), NO_SLOT)
    }
}

impl From<&String> for Text {
    fn from(s: &String) -> Self {
        Self::from(s.as_str())
    }
}

impl std::ops::Deref for NodeName {
    type Target = str;
    #[inline]
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for NodeName {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for NodeName {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for NodeName {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        // One node's names are one allocation: equal at once.
        self.0.is_shared_with(&other.0) || self.0 == other.0
    }
}

impl Eq for NodeName {}

impl std::hash::Hash for NodeName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl PartialOrd for NodeName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for NodeName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl PartialEq<str> for NodeName {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for NodeName {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for NodeName {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<NodeName> for str {
    fn eq(&self, other: &NodeName) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<NodeName> for &str {
    fn eq(&self, other: &NodeName) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<NodeName> for String {
    fn eq(&self, other: &NodeName) -> bool {
        self.as_str() == other.as_str()
    }
}

impl fmt::Debug for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a job is a member of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Member {
    /// A plain job (`j-N`).
    Plain,
    /// An element of array `j-N` (`j-N.i`).
    Array,
    /// A member of gang `j-N` (`j-N.i`).
    Gang,
}

/// A job as the table keeps it. Fields named as the proto's mean what
/// they mean there.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    key: JobKey,
    member: Member,
    /// Whether a cancel was requested while it was on a node.
    pub cancel_requested: bool,
    /// `JobState` as i32.
    pub state: i32,
    /// What was asked, shared by an array's or a gang's elements.
    pub spec: Option<Arc<JobSpec>>,
    /// The node it is on (empty: none).
    pub node: NodeName,
    /// Display text (see `cluster::jobs`), shared by the jobs showing
    /// the same.
    pub reason: Text,
    /// The submitting user, shared by the jobs of one submission.
    pub owner: Arc<str>,
    /// CPUs the agent reported.
    pub cpus: Box<[u32]>,
    /// GPUs the agent reported.
    pub gpus: Box<[u32]>,
    /// Exit code.
    pub exit_code: i32,
    /// Signal that ended it (0: none).
    pub signal: i32,
    /// Attempt number (1 = first).
    pub attempt: u32,
    /// The gang's size (0 for a job that is not a gang member).
    pub gang_size: u32,
    /// Submit time (Unix ms).
    pub submit_time_ms: i64,
    /// Start time (0: not started).
    pub start_time_ms: i64,
    /// End time (0: not ended).
    pub end_time_ms: i64,
}

impl JobRecord {
    /// A new job's record: attempt 1, no state yet (the table sets it).
    /// `gang_size` > 0 makes an element a gang member, else an element
    /// of `key` is an array element.
    pub fn new(
        key: JobKey,
        spec: Arc<JobSpec>,
        owner: Arc<str>,
        gang_size: u32,
        submit_time_ms: i64,
    ) -> Self {
        let member = match (key.is_single(), gang_size > 0) {
            (true, _) => Member::Plain,
            (false, true) => Member::Gang,
            (false, false) => Member::Array,
        };
        Self {
            key,
            member,
            cancel_requested: false,
            state: 0,
            spec: Some(spec),
            node: NodeName::default(),
            reason: Text::default(),
            owner,
            cpus: Box::default(),
            gpus: Box::default(),
            exit_code: 0,
            signal: 0,
            attempt: 1,
            gang_size: if member == Member::Gang { gang_size } else { 0 },
            submit_time_ms,
            start_time_ms: 0,
            end_time_ms: 0,
        }
    }

    /// The record of a stored job (None: its id is not a job id). The
    /// array and gang fields are taken from its key: a gang member is one
    /// with a `gang_id`, an array element one with an `array_id`.
    pub fn from_proto(job: Job) -> Option<Self> {
        let key = JobKey::parse(&job.id)?;
        let member = if key.is_single() {
            Member::Plain
        } else if !job.gang_id.is_empty() {
            Member::Gang
        } else {
            Member::Array
        };
        Some(Self {
            key,
            member,
            cancel_requested: job.cancel_requested,
            state: job.state,
            spec: job.spec.map(Arc::new),
            node: NodeName::from(job.node),
            reason: Text::from(job.reason),
            owner: Arc::from(job.owner),
            cpus: job.cpus.into_boxed_slice(),
            gpus: job.gpus.into_boxed_slice(),
            exit_code: job.exit_code,
            signal: job.signal,
            attempt: job.attempt,
            gang_size: job.gang_size,
            submit_time_ms: job.submit_time_ms,
            start_time_ms: job.start_time_ms,
            end_time_ms: job.end_time_ms,
        })
    }

    /// The proto record (a copy: the spec, the strings).
    pub fn to_proto(&self) -> Job {
        let element = |m| self.member == m;
        let index = self.index();
        Job {
            id: self.key.to_string(),
            spec: self.spec.as_deref().cloned(),
            array_id: self.array_id(),
            array_index: if element(Member::Array) { index } else { 0 },
            gang_id: self.gang_id(),
            gang_index: if element(Member::Gang) { index } else { 0 },
            ..self.state_proto()
        }
    }

    /// The encoding of [`JobRecord::to_proto`], byte for byte (prost
    /// writes a message's fields in tag order, skipping those at their
    /// default), appended to `buf` without building the proto: the
    /// store's thread encodes every job at each of its transitions, and
    /// the proto's copy of the spec and the strings, then its drop, cost
    /// it more than the encoding (`tests::the_direct_encoding_is_the_protos`).
    pub fn encode_proto(&self, buf: &mut Vec<u8>) {
        self.encode_proto_parts(true, true, buf)
    }

    /// [`JobRecord::encode_proto`] without its id (field 1) when `id` is
    /// false, without its spec (field 2) when `spec` is false: the
    /// embedded store keys a plain job by its number, and may keep its
    /// spec apart.
    pub fn encode_proto_parts(&self, id: bool, spec: bool, buf: &mut Vec<u8>) {
        use prost::encoding::{self, WireType, encode_key, encode_varint};
        fn text(tag: u32, s: &str, buf: &mut Vec<u8>) {
            if !s.is_empty() {
                encode_key(tag, WireType::LengthDelimited, buf);
                encode_varint(s.len() as u64, buf);
                buf.extend_from_slice(s.as_bytes());
            }
        }
        fn int32(tag: u32, v: i32, buf: &mut Vec<u8>) {
            if v != 0 {
                encoding::int32::encode(tag, &v, buf);
            }
        }
        fn uint32(tag: u32, v: u32, buf: &mut Vec<u8>) {
            if v != 0 {
                encoding::uint32::encode(tag, &v, buf);
            }
        }
        fn int64(tag: u32, v: i64, buf: &mut Vec<u8>) {
            if v != 0 {
                encoding::int64::encode(tag, &v, buf);
            }
        }
        fn packed(tag: u32, v: &[u32], buf: &mut Vec<u8>) {
            if !v.is_empty() {
                encoding::uint32::encode_packed(tag, v, buf);
            }
        }
        let element = |m| self.member == m;
        if id {
            text(1, self.key.id_text(&mut [0; ID_MAX]), buf);
        }
        if let Some(spec) = self.spec.as_deref().filter(|_| spec) {
            // As `encoding::message::encode`, without its `encoded_len`:
            // that walks the whole spec (its maps included) once more
            // for the length prefix, ~9% of the store's thread under
            // load. The body is written first and its length put in
            // front of it (the body moves by the prefix's 1-3 bytes).
            encode_key(2, WireType::LengthDelimited, buf);
            let body = buf.len();
            prost::Message::encode_raw(spec, buf);
            prefix_length(buf, body);
        }
        int32(3, self.state, buf);
        text(4, self.node.as_str(), buf);
        packed(5, &self.cpus, buf);
        int32(6, self.exit_code, buf);
        int32(7, self.signal, buf);
        text(8, self.reason.as_str(), buf);
        uint32(9, self.attempt, buf);
        int64(10, self.submit_time_ms, buf);
        int64(11, self.start_time_ms, buf);
        int64(12, self.end_time_ms, buf);
        let mut array_buf = [0; ID_MAX];
        let array_key = self.key.array();
        let array = array_key.id_text(&mut array_buf);
        if element(Member::Array) {
            text(13, array, buf);
            uint32(14, self.index(), buf);
        }
        text(15, &self.owner, buf);
        if self.cancel_requested {
            encoding::bool::encode(20, &true, buf);
        }
        if element(Member::Gang) {
            text(30, array, buf);
            uint32(31, self.index(), buf);
        }
        uint32(32, self.gang_size, buf);
        packed(33, &self.gpus, buf);
    }

    /// The proto fields a job's key and its array or gang do not give
    /// back: its state, placement, times and owner; no ids, no index, no
    /// spec.
    fn state_proto(&self) -> Job {
        Job {
            state: self.state,
            node: self.node.to_string(),
            cpus: self.cpus.to_vec(),
            exit_code: self.exit_code,
            signal: self.signal,
            reason: self.reason.as_str().to_owned(),
            attempt: self.attempt,
            submit_time_ms: self.submit_time_ms,
            start_time_ms: self.start_time_ms,
            end_time_ms: self.end_time_ms,
            owner: self.owner.to_string(),
            cancel_requested: self.cancel_requested,
            gang_size: self.gang_size,
            gpus: self.gpus.to_vec(),
            ..Default::default()
        }
    }

    /// An array's element or a gang's member (its spec is its array's
    /// or gang's, shared by the others).
    pub fn is_element(&self) -> bool {
        self.member != Member::Plain
    }

    /// The proto record of an element without what its key and its
    /// array give back ([`JobRecord::element_from_stored`]): no ids, no
    /// index, no spec. The embedded store keeps an element so, with the
    /// spec once per array. None for a plain job, and for a member whose
    /// gang size does not tell it apart (a gang member has one, an array
    /// element none: the only ones the dispatcher writes).
    pub fn element_proto(&self) -> Option<Job> {
        if !self.is_element() || self.is_gang() != (self.gang_size > 0) {
            return None;
        }
        Some(self.state_proto())
    }

    /// The proto record of element `key` stored as
    /// [`JobRecord::element_proto`] gave it, with its array's `spec`: a
    /// gang member is one with a gang size (an array element has none).
    /// None: `key` is not an element's.
    pub fn element_from_stored(key: JobKey, mut job: Job, spec: JobSpec) -> Option<Job> {
        if key.is_single() {
            return None;
        }
        let array = key.array().to_string();
        if job.gang_size > 0 {
            job.gang_id = array;
            job.gang_index = key.index();
        } else {
            job.array_id = array;
            job.array_index = key.index();
        }
        job.id = key.to_string();
        job.spec = Some(spec);
        Some(job)
    }

    /// Its key.
    pub fn key(&self) -> JobKey {
        self.key
    }

    /// Its id (`j-12`, `j-12.3`).
    pub fn id(&self) -> String {
        self.key.id_text(&mut [0; ID_MAX]).to_string()
    }

    /// The `Assign` of its current attempt: its id, attempt, spec (the
    /// record's, shared) and owner. The trace context is filled in by whoever sends it (the
    /// core, from the job's telemetry; the cluster does no tracing).
    pub fn assign(&self) -> DispatcherMessage {
        DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Assign(Assign {
                job_id: self.id(),
                attempt: self.attempt,
                // Shared with the record, not copied.
                spec: self.spec.clone().map(SharedSpec),
                owner: self.owner.to_string(),
                ..Default::default()
            })),
        }
    }

    /// The spec (None only for a stored job without one).
    pub fn spec(&self) -> Option<&JobSpec> {
        self.spec.as_deref()
    }

    /// A gang member.
    pub fn is_gang(&self) -> bool {
        self.member == Member::Gang
    }

    /// The gang's id (empty: not a gang member).
    pub fn gang_id(&self) -> String {
        match self.member {
            Member::Gang => self.key.array().to_string(),
            _ => String::new(),
        }
    }

    /// The array's id (empty: not an array element).
    pub fn array_id(&self) -> String {
        match self.member {
            Member::Array => self.key.array().to_string(),
            _ => String::new(),
        }
    }

    /// Its index in its array or gang (0 for a plain job).
    pub fn index(&self) -> u32 {
        self.key.index()
    }
}

/// Put the length of `buf[body..]` in front of it, as a varint (the
/// proto crate's, which its submit replies use too).
pub(crate) use proto::reply::prefix_length;

/// SUCCEEDED, FAILED, CANCELLED or LOST: a state a job never leaves.
pub(crate) fn is_terminal_state(state: i32) -> bool {
    use proto::v1::JobState;
    matches!(
        JobState::try_from(state),
        Ok(JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Lost)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// A node name compares, orders and hashes as its text (so a map
        /// keyed by names is looked up by `&str`), whether two names share
        /// one allocation or not; the empty name is no allocation.
        #[test]
        fn node_names_behave_as_their_text(a in "[ab]{0,3}", b in "[ab]{0,3}") {
            use std::hash::BuildHasher;
            let (na, nb) = (NodeName::from(a.as_str()), NodeName::from(b.clone()));
            let shared = na.clone();
            prop_assert_eq!(na == nb, a == b);
            prop_assert_eq!(na.cmp(&nb), a.cmp(&b));
            prop_assert!(shared == na);
            prop_assert_eq!(na.as_str(), a.as_str());
            prop_assert_eq!(na.is_empty(), a.is_empty());
            prop_assert_eq!(na.0.0.is_none(), a.is_empty());
            let h = std::hash::RandomState::new();
            prop_assert_eq!(h.hash_one(&na), h.hash_one(a.as_str()));
            let map: HashMap<NodeName, u32> = [(na.clone(), 1)].into_iter().collect();
            prop_assert_eq!(map.get(b.as_str()).copied(), (a == b).then_some(1));
        }

        /// The id text is what `write!` gave (`j-N`, `j-N.i`), and
        /// parses back to its key.
        #[test]
        fn an_id_is_written_as_before(number in any::<u64>(), element in any::<u32>()) {
            for key in [JobKey::single(number), JobKey { number, element }] {
                let old = match key.element {
                    0 => format!("j-{}", key.number),
                    e => format!("j-{}.{}", key.number, e - 1),
                };
                prop_assert_eq!(key.to_string(), old.clone());
                let mut buf = [0; ID_MAX];
                prop_assert_eq!(key.id_text(&mut buf), old.as_str());
                prop_assert_eq!(JobKey::parse(&old), Some(key));
            }
        }
    }

    fn spec() -> impl Strategy<Value = JobSpec> {
        (
            "[a-z]{0,6}",
            prop::collection::vec("[a-z0-9]{0,4}", 0..3),
            0u32..64,
            any::<u64>(),
            0u32..5,
            prop::option::of(("[a-z]{1,3}", "[a-z]{0,3}")),
            "[a-z]{0,4}",
            any::<u64>(),
            // Specs whose encoding's length takes one, two and three
            // bytes of varint (the direct encoding writes it after the
            // body).
            prop::collection::hash_map("[A-Z]{1,4}", "[a-z]{0,300}", 0..3),
            prop::option::weighted(0.1, 16_000usize..17_000),
        )
            .prop_map(
                |(
                    name,
                    mut command,
                    cpus,
                    memory_bytes,
                    gpus,
                    sel,
                    group,
                    timeout_ms,
                    env,
                    big,
                )| {
                    command.extend(big.map(|n| "x".repeat(n)));
                    JobSpec {
                        name,
                        command,
                        cpus,
                        memory_bytes,
                        gpus,
                        node_selector: sel.into_iter().collect::<HashMap<_, _>>(),
                        group,
                        timeout_ms,
                        env,
                        ..Default::default()
                    }
                },
            )
    }

    /// A job as the dispatcher writes it: the previous record's fields
    /// as `submit_as` and the lifecycle set them (ids from the key, an
    /// array's or gang's fields from its number and index).
    fn written_job() -> impl Strategy<Value = Job> {
        let facts = (
            0i32..8,
            "[a-z0-9-]{0,8}",
            prop::collection::vec(any::<u32>(), 0..4),
            any::<i32>(),
            any::<i32>(),
            ".{0,20}",
            any::<u32>(),
            (any::<i64>(), any::<i64>(), any::<i64>()),
            "[a-z]{0,5}",
            any::<bool>(),
            prop::collection::vec(any::<u32>(), 0..3),
        );
        (
            1u64..1000,
            0u8..3,
            0u32..50,
            2u32..9,
            prop::option::of(spec()),
            facts,
        )
            .prop_map(|(n, kind, i, size, spec, f)| {
                let (state, node, cpus, exit_code, signal, reason, attempt, t, owner, cr, gpus) = f;
                let (key, array, gang) = match kind {
                    0 => (JobKey::single(n), false, false),
                    1 => (JobKey::element(n, i), true, false),
                    _ => (JobKey::element(n, i % size), false, true),
                };
                Job {
                    id: key.to_string(),
                    spec,
                    state,
                    node,
                    cpus,
                    exit_code,
                    signal,
                    reason,
                    attempt,
                    submit_time_ms: t.0,
                    start_time_ms: t.1,
                    end_time_ms: t.2,
                    array_id: if array {
                        key.array().to_string()
                    } else {
                        String::new()
                    },
                    array_index: if array { i } else { 0 },
                    owner,
                    cancel_requested: cr,
                    gang_id: if gang {
                        key.array().to_string()
                    } else {
                        String::new()
                    },
                    gang_index: if gang { i % size } else { 0 },
                    gang_size: if gang { size } else { 0 },
                    pending_reason: None,
                    gpus,
                }
            })
    }

    /// The record `submit_as` built before this one (the oracle): the
    /// proto `Job` of a new job, element `index` of a gang of `gang`
    /// members or of an array when `index` is set.
    fn submitted_before(
        key: JobKey,
        index: Option<u32>,
        gang: Option<u32>,
        spec: &JobSpec,
        owner: &str,
        now: i64,
    ) -> Job {
        let is_gang = gang.is_some();
        Job {
            id: key.to_string(),
            spec: Some(spec.clone()),
            attempt: 1,
            submit_time_ms: now,
            array_id: match index {
                Some(_) if !is_gang => key.array().to_string(),
                _ => String::new(),
            },
            array_index: if is_gang { 0 } else { index.unwrap_or(0) },
            gang_id: if is_gang {
                key.array().to_string()
            } else {
                String::new()
            },
            gang_index: if is_gang { index.unwrap_or(0) } else { 0 },
            gang_size: gang.unwrap_or(0),
            owner: owner.to_string(),
            ..Default::default()
        }
    }

    proptest! {
        #[test]
        fn job_keys_round_trip_and_order_like_their_numbers(
            a in 0u64..1000, i in prop::option::of(0u32..100),
            b in 0u64..1000, j in prop::option::of(0u32..100),
        ) {
            let key = |n, i: Option<u32>| i.map_or(JobKey::single(n), |i| JobKey::element(n, i));
            let (x, y) = (key(a, i), key(b, j));
            prop_assert_eq!(JobKey::parse(&x.to_string()), Some(x));
            // Oracle: order by number, then the plain id before elements
            // by index.
            let rank = |n: u64, i: Option<u32>| (n, i.map_or(0, |i| i as u64 + 1));
            prop_assert_eq!(x.cmp(&y), rank(a, i).cmp(&rank(b, j)));
            prop_assert_eq!(x.array().elements().contains(&x), i.is_some());
        }
    }

    proptest! {
        /// The fast path of a plain id reads what the general parse
        /// reads (oracle: `parse_rest`, the parse before the fast path),
        /// for ids near the format: digits, `+`, `.`, letters, up to
        /// u64's and u32's limits and past them.
        #[test]
        fn the_fast_parse_reads_what_the_general_one_does(
            rest in "[0-9+.a]{0,22}|[0-9]{18,21}|1844674407370955161[0-9]",
        ) {
            let id = format!("j-{rest}");
            prop_assert_eq!(JobKey::parse(&id), JobKey::parse_rest(&rest), "{}", id);
        }
    }

    #[test]
    fn bad_ids_do_not_parse() {
        for id in ["", "j-", "x-1", "j-1.", "j-a", "j-1.x", "j-1.4294967295"] {
            assert_eq!(JobKey::parse(id), None, "{id}");
        }
    }

    proptest! {
        /// A new job's record gives the proto the previous code built at
        /// submit, for a plain job, an array's element and a gang member.
        #[test]
        fn a_new_record_is_the_job_submit_built(
            n in 1u64..1000, kind in 0u8..3, i in 0u32..20, size in 2u32..9,
            spec in spec(), owner in "[a-z]{0,4}", now in any::<i64>(),
        ) {
            let (key, index, gang) = match kind {
                0 => (JobKey::single(n), None, None),
                1 => (JobKey::element(n, i), Some(i), None),
                _ => (JobKey::element(n, i % size), Some(i % size), Some(size)),
            };
            let record = JobRecord::new(
                key,
                Arc::new(spec.clone()),
                Arc::from(owner.as_str()),
                gang.unwrap_or(0),
                now,
            );
            prop_assert_eq!(
                record.to_proto(),
                submitted_before(key, index, gang, &spec, &owner, now)
            );
        }

        /// Any job the dispatcher writes goes through the record and
        /// back unchanged, to the byte of its encoding.
        #[test]
        fn a_record_gives_back_the_proto_job(job in written_job()) {
            let record = JobRecord::from_proto(job.clone()).unwrap();
            let back = record.to_proto();
            prop_assert_eq!(
                prost::Message::encode_to_vec(&back),
                prost::Message::encode_to_vec(&job)
            );
            prop_assert_eq!(&back, &job);
            prop_assert_eq!(record.id(), job.id.clone());
            prop_assert_eq!(record.is_gang(), !job.gang_id.is_empty());
        }

        /// The direct encoding is the proto's, to the byte, for any job
        /// the dispatcher writes, and decodes back to it.
        #[test]
        fn the_direct_encoding_is_the_protos(job in written_job()) {
            let record = JobRecord::from_proto(job.clone()).unwrap();
            let mut direct = vec![7];
            record.encode_proto(&mut direct);
            prop_assert_eq!(direct[0], 7, "appended");
            let proto = prost::Message::encode_to_vec(&record.to_proto());
            prop_assert_eq!(&direct[1..], proto.as_slice());
            prop_assert_eq!(<Job as prost::Message>::decode(&direct[1..]).unwrap(), job);
        }

        /// Without its id or its spec, the encoding is the proto's
        /// without them (as the embedded store keeps a plain job).
        #[test]
        fn an_encoding_without_parts_is_the_protos_without_them(
            job in written_job(),
            id in any::<bool>(),
            spec in any::<bool>(),
        ) {
            let record = JobRecord::from_proto(job).unwrap();
            let mut direct = vec![7];
            record.encode_proto_parts(id, spec, &mut direct);
            let mut want = record.to_proto();
            if !id {
                want.id.clear();
            }
            if !spec {
                want.spec = None;
            }
            let want = prost::Message::encode_to_vec(&want);
            prop_assert_eq!(&direct[1..], want.as_slice());
        }

        /// An element written as the embedded store keeps it (no ids, no
        /// spec) comes back whole with its key and its array's spec; a
        /// job that could not come back so is not written so.
        #[test]
        fn an_element_comes_back_from_its_stored_form(job in written_job(), spec in spec()) {
            let job = Job { spec: Some(spec.clone()), ..job };
            let record = JobRecord::from_proto(job.clone()).unwrap();
            let key = record.key();
            match record.element_proto() {
                Some(stored) => {
                    let bytes = prost::Message::encode_to_vec(&stored);
                    let stored: Job = prost::Message::decode(bytes.as_slice()).unwrap();
                    prop_assert!(stored.id.is_empty() && stored.spec.is_none());
                    prop_assert_eq!(JobRecord::element_from_stored(key, stored, spec), Some(job));
                }
                None => prop_assert!(key.is_single() || job.gang_id.is_empty() != (job.gang_size == 0)),
            }
        }
    }
}
