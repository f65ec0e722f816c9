//! Job-spec validation, all of it: [`check_submission`] is the one check a
//! submission passes before anything is created (the call's size, each
//! spec's fields, its waker, the store's record limit, what the call
//! creates as a whole). Every field of a submitted `JobSpec` is checked
//! against its documented range, and a refusal names the field
//! (`spec.cpus: ...`) so the user can fix it. Valid specs are normalised
//! (`cpus: 0` means 1) so the rest of the dispatcher never sees a zero
//! default.

use proto::v1::{Alignment, GangRetry, JobSpec, PlacementPolicy, Within};
use sched::{Align, Policy};
use thiserror::Error;

/// Limits on spec sizes (hostile or mistaken input must not exhaust the
/// dispatcher, its store or the agents). Each refusal names the field and
/// the limit, e.g. `spec.env: 1025 entries, at most 1024`.
#[derive(Clone, Debug)]
pub struct SpecLimits {
    /// Entries in `command`.
    pub max_command_entries: usize,
    /// Bytes of one `command` entry, and of one `env` value (Linux's
    /// MAX_ARG_STRLEN: the kernel refuses longer ones at exec).
    pub max_arg_bytes: usize,
    /// Total bytes of `command`, `env` and `cwd`.
    pub max_spec_bytes: usize,
    /// Entries in `env`.
    pub max_env_entries: usize,
    /// Entries in `node_selector`.
    pub max_selector_entries: usize,
    /// Bytes of `name`, `group`, an `env` name, a `node_selector` key or
    /// value.
    pub max_label_bytes: usize,
    /// Bytes of `cwd` (PATH_MAX).
    pub max_path_bytes: usize,
    /// Bytes of `waker` (a job id).
    pub max_id_bytes: usize,
    /// CPUs of one job.
    pub max_cpus: u32,
    /// Elements of one array, and jobs created by one call.
    pub max_array: u32,
    /// Retries of one job.
    pub max_retries: u32,
    /// Members of one gang (`nodes`).
    pub max_gang_nodes: u32,
    /// A preferred gang's wait before it relaxes (`relax_after_ms`).
    pub max_relax_after_ms: u64,
    /// Specs in one SubmitJobs call.
    pub max_batch_specs: usize,
    /// Bytes of the jobs one call creates: each spec's encoded size times
    /// its array elements, summed (every element keeps its own copy).
    pub max_call_bytes: u64,
    /// Encoded bytes of one spec the store can hold in a record (the etcd
    /// store's limit; None: no limit).
    pub max_stored_spec_bytes: Option<usize>,
}

impl Default for SpecLimits {
    fn default() -> Self {
        Self {
            max_command_entries: 4096,
            max_arg_bytes: 128 << 10,
            max_spec_bytes: 1 << 20,
            max_env_entries: 1024,
            max_selector_entries: 64,
            max_label_bytes: 256,
            max_path_bytes: 4096,
            max_id_bytes: 64,
            max_cpus: 4096,
            max_array: 100_000,
            max_retries: 100,
            max_gang_nodes: 1024,
            max_relax_after_ms: 7 * 24 * 3600 * 1000,
            max_batch_specs: 10_000,
            max_call_bytes: 64 << 20,
            max_stored_spec_bytes: None,
        }
    }
}

/// GPUs of one job (the largest GPU servers have 16; 64 leaves room).
pub const MAX_GPUS: u32 = 64;

/// A refused field.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{field}: {message}")]
pub struct SpecError {
    /// The field's path, e.g. `spec.cpus` or `specs[3].env["A=B"]`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl From<SpecError> for tonic::Status {
    /// Cold and out of line, as [`err`]: `?` inlines it on every check.
    #[cold]
    #[inline(never)]
    fn from(e: SpecError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// A spec's error. Cold and out of line: every check's error branch
/// (with its message's formatting) then leaves the checks' code, which
/// runs for every job, for the end of the function.
#[cold]
#[inline(never)]
fn err(prefix: &str, field: &str, message: impl Into<String>) -> SpecError {
    SpecError {
        field: format!("{prefix}.{field}"),
        message: message.into(),
    }
}

/// `field` has `n` entries where at most `max` are allowed. Inline (a
/// compare at each of validation's checks, where a call passed four
/// arguments); the error is built out of line.
#[inline]
fn too_many(prefix: &str, field: &str, n: usize, max: usize) -> Result<(), SpecError> {
    if n > max {
        return Err(too_many_error(prefix, field, n, max));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn too_many_error(prefix: &str, field: &str, n: usize, max: usize) -> SpecError {
    err(prefix, field, format!("{n} entries, at most {max}"))
}

/// `field` is `n` bytes long where at most `max` are allowed (inline, as
/// [`too_many`]).
#[inline]
fn too_long(prefix: &str, field: &str, n: usize, max: usize) -> Result<(), SpecError> {
    if n > max {
        return Err(too_long_error(prefix, field, n, max));
    }
    Ok(())
}

/// As [`too_long`] for a field whose path is built only on error (a
/// key of a map, see [`key_path`]).
#[inline]
fn too_long_at(
    prefix: &str,
    field: impl FnOnce() -> String,
    n: usize,
    max: usize,
) -> Result<(), SpecError> {
    if n > max {
        return Err(too_long_error(prefix, &field(), n, max));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn too_long_error(prefix: &str, field: &str, n: usize, max: usize) -> SpecError {
    err(prefix, field, format!("{n} bytes, at most {max}"))
}

/// A short, printable form of a user-supplied key for a field path.
fn key_path(field: &str, key: &str) -> String {
    const SHOWN: usize = 32;
    if key.len() <= SHOWN {
        return format!("{field}[{key:?}]");
    }
    let mut end = SHOWN;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{field}[{:?}...]", &key[..end])
}

fn call_error(message: String) -> SpecError {
    SpecError {
        field: "specs".into(),
        message,
    }
}

/// The first spec whose encoding is longer than `max` bytes (the etcd
/// store's limit), when one's bound is (see [`check_submission`]). Cold
/// and out of line, as [`err`].
#[cold]
#[inline(never)]
fn check_encoded_len(
    specs: &[JobSpec],
    max: usize,
    prefix: impl Fn(usize) -> String,
) -> Result<(), SpecError> {
    let too_large = specs
        .iter()
        .enumerate()
        .filter(|(_, s)| encoded_len_bound(s) > max)
        .map(|(i, s)| (i, prost::Message::encoded_len(s)))
        .find(|&(_, n)| n > max);
    match too_large {
        Some((i, n)) => Err(SpecError {
            field: prefix(i),
            message: format!("{n} bytes encoded, at most {max} with the etcd store"),
        }),
        None => Ok(()),
    }
}

/// Check a call's number of specs, before any spec is validated.
pub fn check_batch(specs: &[JobSpec], limits: &SpecLimits) -> Result<(), SpecError> {
    if specs.is_empty() {
        return Err(call_error("empty".into()));
    }
    if specs.len() > limits.max_batch_specs {
        return Err(call_error(format!(
            "{} specs in one call, at most {} per call",
            specs.len(),
            limits.max_batch_specs
        )));
    }
    Ok(())
}

/// The jobs a spec creates: its array elements, or its gang members, or
/// itself.
pub fn jobs_of(spec: &JobSpec) -> u32 {
    spec.array_count.max(spec.nodes).max(1)
}

/// An upper bound of a spec's encoded size (`prost::Message::encoded_len`),
/// read from its strings' lengths and its entries' counts without
/// encoding anything: the exact size cost ~290 instructions per submit,
/// and it is computed only when this bound passes a limit, so every
/// refusal and its message stay those of the exact size. In prost's
/// encoding a field is a tag (2 bytes at most below field number 2,048),
/// then a varint (10 bytes at most: a scalar, or a length before the
/// bytes); a map entry is such a field holding a key field and a value
/// field. Every field is named here, so a field added to `JobSpec` does
/// not compile until it is counted.
pub fn encoded_len_bound(spec: &JobSpec) -> usize {
    /// A tag and a varint.
    const FIELD: usize = 2 + 10;
    let JobSpec {
        name,
        command,
        env,
        cwd,
        cpus: _,
        memory_bytes: _,
        alignment: _,
        policy: _,
        node_selector,
        latency_nice: _,
        nice: _,
        waker,
        group,
        retries: _,
        timeout_ms: _,
        array_count: _,
        nodes: _,
        within: _,
        within_preferred: _,
        relax_after_ms: _,
        gang_retry: _,
        gpus: _,
    } = spec;
    const SCALARS: usize = 15;
    let map = |m: &std::collections::HashMap<String, String>| {
        m.iter()
            .map(|(k, v)| 3 * FIELD + k.len() + v.len())
            .sum::<usize>()
    };
    SCALARS * FIELD
        + [name, cwd, waker, group]
            .iter()
            .map(|s| FIELD + s.len())
            .sum::<usize>()
        + command.iter().map(|s| FIELD + s.len()).sum::<usize>()
        + map(env)
        + map(node_selector)
}

/// Check what a call of valid specs would create as a whole: its jobs
/// (array elements and gang members count one each) and their bytes (every element keeps
/// its own copy of the spec).
pub fn check_call(specs: &[JobSpec], limits: &SpecLimits) -> Result<(), SpecError> {
    check_batch(specs, limits)?;
    check_call_jobs(specs, limits)
}

/// [`check_call`] of specs whose number [`check_batch`] passed
/// (`check_submission` checks it first, before validating them).
fn check_call_jobs(specs: &[JobSpec], limits: &SpecLimits) -> Result<(), SpecError> {
    let field = call_error;
    let jobs: u64 = specs.iter().map(|s| jobs_of(s) as u64).sum();
    if jobs > limits.max_array as u64 {
        return Err(field(format!(
            "{jobs} jobs in one call, at most {}",
            limits.max_array
        )));
    }
    let total = |len: fn(&JobSpec) -> usize| -> u64 {
        specs
            .iter()
            .map(|s| len(s) as u64 * jobs_of(s) as u64)
            .sum()
    };
    // The exact size only when the bound passes the limit.
    if total(encoded_len_bound) > limits.max_call_bytes {
        let bytes = total(prost::Message::encoded_len);
        if bytes > limits.max_call_bytes {
            return Err(field(format!(
                "the jobs of this call total {bytes} bytes (each spec's size times its array \
                 elements), at most {}: submit smaller specs or fewer elements per call",
                limits.max_call_bytes
            )));
        }
    }
    Ok(())
}

/// Validate and normalise a whole submission; nothing may be created
/// unless this passes. `batch` says the specs came as a list (errors name
/// `specs[i]`, else `spec`); `known_job` says whether a waker id names a
/// job.
pub fn check_submission(
    specs: &mut [JobSpec],
    batch: bool,
    limits: &SpecLimits,
    known_job: impl Fn(&str) -> bool,
) -> Result<(), SpecError> {
    let prefix = |i: usize| {
        if batch {
            format!("specs[{i}]")
        } else {
            "spec".to_string()
        }
    };
    if let Some(max) = limits.max_stored_spec_bytes
        // A spec whose bound fits fits (`encoded_len_bound`).
        && specs.iter().any(|s| encoded_len_bound(s) > max)
    {
        check_encoded_len(specs, max, prefix)?;
    }
    check_batch(specs, limits)?;
    for (i, spec) in specs.iter_mut().enumerate() {
        // The field path is formatted only for an error: a refused spec
        // is validated again under its name (validation is idempotent).
        if validate(spec, "", limits).is_err() {
            validate(spec, &prefix(i), limits)?;
        }
        if !spec.waker.is_empty() && !known_job(&spec.waker) {
            return Err(err(&prefix(i), "waker", format!("no job {:?}", spec.waker)));
        }
    }
    check_call_jobs(specs, limits)
}

/// Validate and normalise `spec`; `prefix` names it in errors (`spec`,
/// `specs[3]`).
pub fn validate(spec: &mut JobSpec, prefix: &str, limits: &SpecLimits) -> Result<(), SpecError> {
    too_long(prefix, "name", spec.name.len(), limits.max_label_bytes)?;
    too_long(prefix, "group", spec.group.len(), limits.max_label_bytes)?;
    if spec.command.is_empty() {
        return Err(err(
            prefix,
            "command",
            "required: the program and its arguments",
        ));
    }
    if spec.command[0].is_empty() {
        return Err(err(prefix, "command[0]", "the program name is empty"));
    }
    too_many(
        prefix,
        "command",
        spec.command.len(),
        limits.max_command_entries,
    )?;
    for (i, arg) in spec.command.iter().enumerate() {
        if arg.len() > limits.max_arg_bytes || arg.contains('\0') {
            let field = format!("command[{i}]");
            too_long(prefix, &field, arg.len(), limits.max_arg_bytes)?;
            return Err(err(prefix, &field, "contains a NUL byte"));
        }
    }
    too_many(prefix, "env", spec.env.len(), limits.max_env_entries)?;
    for (k, v) in &spec.env {
        if k.is_empty() {
            return Err(err(prefix, "env", "a variable name is empty"));
        }
        // The field's path is written only for an error: formatting it
        // for every variable of every job was ~1,500 instructions a job.
        let field = || key_path("env", k);
        too_long_at(prefix, field, k.len(), limits.max_label_bytes)?;
        if k.contains('=') || k.contains('\0') {
            return Err(err(prefix, &field(), "names may not contain '=' or NUL"));
        }
        too_long_at(prefix, field, v.len(), limits.max_arg_bytes)?;
        if v.contains('\0') {
            return Err(err(prefix, &field(), "value contains a NUL byte"));
        }
    }
    too_long(prefix, "cwd", spec.cwd.len(), limits.max_path_bytes)?;
    if spec.cwd.contains('\0') {
        return Err(err(prefix, "cwd", "contains a NUL byte"));
    }
    if !spec.cwd.is_empty() && !spec.cwd.starts_with('/') {
        return Err(err(prefix, "cwd", "must be an absolute path"));
    }
    let bytes: usize = spec.command.iter().map(String::len).sum::<usize>()
        + spec
            .env
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
        + spec.cwd.len();
    if bytes > limits.max_spec_bytes {
        return Err(err(
            prefix,
            "command",
            format!(
                "command, env and cwd total {bytes} bytes, at most {}",
                limits.max_spec_bytes
            ),
        ));
    }
    if spec.cpus == 0 {
        spec.cpus = 1;
    }
    if spec.cpus > limits.max_cpus {
        return Err(err(
            prefix,
            "cpus",
            format!(
                "{} is more than the largest allowed ({})",
                spec.cpus, limits.max_cpus
            ),
        ));
    }
    if spec.gpus > MAX_GPUS {
        return Err(err(
            prefix,
            "gpus",
            format!(
                "{} is more than the largest allowed ({MAX_GPUS})",
                spec.gpus
            ),
        ));
    }
    if Alignment::try_from(spec.alignment).is_err() {
        return Err(err(
            prefix,
            "alignment",
            format!("unknown value {}", spec.alignment),
        ));
    }
    if PlacementPolicy::try_from(spec.policy).is_err() {
        return Err(err(
            prefix,
            "policy",
            format!("unknown value {}", spec.policy),
        ));
    }
    too_many(
        prefix,
        "node_selector",
        spec.node_selector.len(),
        limits.max_selector_entries,
    )?;
    for (k, v) in &spec.node_selector {
        if k.is_empty() {
            return Err(err(prefix, "node_selector", "a label name is empty"));
        }
        let field = || key_path("node_selector", k);
        too_long_at(prefix, field, k.len(), limits.max_label_bytes)?;
        too_long_at(prefix, field, v.len(), limits.max_label_bytes)?;
    }
    too_long(prefix, "waker", spec.waker.len(), limits.max_id_bytes)?;
    if !(-20..=19).contains(&spec.latency_nice) {
        return Err(err(
            prefix,
            "latency_nice",
            format!("{} is outside -20..19", spec.latency_nice),
        ));
    }
    if !(-20..=19).contains(&spec.nice) {
        return Err(err(
            prefix,
            "nice",
            format!("{} is outside -20..19", spec.nice),
        ));
    }
    if spec.retries > limits.max_retries {
        return Err(err(
            prefix,
            "retries",
            format!("{} is more than {}", spec.retries, limits.max_retries),
        ));
    }
    if spec.array_count > limits.max_array {
        return Err(err(
            prefix,
            "array_count",
            format!("{} is more than {}", spec.array_count, limits.max_array),
        ));
    }
    if spec.timeout_ms > 366 * 24 * 3600 * 1000 {
        return Err(err(prefix, "timeout_ms", "more than a year"));
    }
    validate_gang(spec, prefix, limits)
}

/// The gang fields: `nodes` within its limit and not with an array; the
/// others only for a gang, each with what it depends on.
#[inline]
fn validate_gang(spec: &mut JobSpec, prefix: &str, limits: &SpecLimits) -> Result<(), SpecError> {
    if spec.nodes > limits.max_gang_nodes {
        return Err(err(
            prefix,
            "nodes",
            format!("{} is more than {}", spec.nodes, limits.max_gang_nodes),
        ));
    }
    let within = Within::try_from(spec.within)
        .map_err(|_| err(prefix, "within", format!("unknown value {}", spec.within)))?;
    if GangRetry::try_from(spec.gang_retry).is_err() {
        return Err(err(
            prefix,
            "gang_retry",
            format!("unknown value {}", spec.gang_retry),
        ));
    }
    let gang = spec.nodes > 1;
    if gang && spec.array_count > 1 {
        return Err(err(
            prefix,
            "nodes",
            "a gang (nodes > 1) cannot also be an array (array_count > 1)",
        ));
    }
    let only_gangs = |field: &str| err(prefix, field, "only for gangs (nodes > 1)");
    if !gang {
        if within != Within::Unspecified {
            return Err(only_gangs("within"));
        }
        if spec.within_preferred {
            return Err(only_gangs("within_preferred"));
        }
        if spec.gang_retry != GangRetry::Unspecified as i32 {
            return Err(only_gangs("gang_retry"));
        }
        if spec.relax_after_ms != 0 {
            return Err(only_gangs("relax_after_ms"));
        }
        return Ok(());
    }
    if spec.within_preferred && matches!(within, Within::Unspecified | Within::Any) {
        return Err(err(
            prefix,
            "within_preferred",
            "needs within RACK or ZONE (ANY holds every gang already)",
        ));
    }
    if spec.relax_after_ms != 0 && !spec.within_preferred {
        return Err(err(
            prefix,
            "relax_after_ms",
            "only with within_preferred (a required level never relaxes)",
        ));
    }
    if spec.relax_after_ms > limits.max_relax_after_ms {
        return Err(err(
            prefix,
            "relax_after_ms",
            format!(
                "{} is more than {} (7 days)",
                spec.relax_after_ms, limits.max_relax_after_ms
            ),
        ));
    }
    if spec.within_preferred && spec.relax_after_ms == 0 {
        spec.relax_after_ms = DEFAULT_RELAX_AFTER_MS;
    }
    Ok(())
}

/// A preferred gang's wait before it relaxes when the spec says 0: Slurm's
/// default `max_switch_wait` (300 s).
pub const DEFAULT_RELAX_AFTER_MS: u64 = 300_000;

/// The engine's level for a (validated) gang spec's `within`: a rack is
/// the cluster's LLC level, a zone its NUMA level.
pub fn within_of(spec: &JobSpec) -> Align {
    match Within::try_from(spec.within) {
        Ok(Within::Rack) => Align::Llc,
        Ok(Within::Zone) => Align::Numa,
        _ => Align::Any,
    }
}

/// The gang's retry policy of a (validated) spec: true for replace-member.
pub fn replaces_members(spec: &JobSpec) -> bool {
    spec.gang_retry == GangRetry::ReplaceMember as i32
}

/// The engine's alignment for a (validated) spec.
pub fn align_of(spec: &JobSpec) -> Align {
    engine_proto::align(spec.alignment)
}

/// The engine's policy for a (validated) spec.
pub fn policy_of(spec: &JobSpec) -> Policy {
    engine_proto::policy(spec.policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_spec() -> JobSpec {
        JobSpec {
            command: vec!["true".into()],
            ..Default::default()
        }
    }

    fn check(mutate: impl FnOnce(&mut JobSpec), field: &str) {
        let mut s = ok_spec();
        mutate(&mut s);
        let e = validate(&mut s, "spec", &SpecLimits::default()).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        let status: tonic::Status = e.into();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().starts_with(field));
    }

    proptest::proptest! {
        /// The bound is never below the exact encoded size (oracle:
        /// prost's `encoded_len`), for specs with every scalar at any
        /// value (negative ones take 10 bytes), long strings (two-byte
        /// lengths) and map entries.
        #[test]
        fn the_size_bound_is_never_below_the_size(
            ints in proptest::array::uniform8(proptest::prelude::any::<u64>()),
            small in proptest::array::uniform8(proptest::prelude::any::<i32>()),
            flag in proptest::prelude::any::<bool>(),
            strings in proptest::collection::vec("[a-z]{0,200}", 4),
            command in proptest::collection::vec("[a-z]{0,150}", 0..4),
            env in proptest::collection::hash_map("[a-z]{0,140}", "[a-z]{0,140}", 0..3),
            selector in proptest::collection::hash_map("[a-z]{0,3}", "[a-z]{0,3}", 0..3),
        ) {
            let spec = JobSpec {
                name: strings[0].clone(),
                command,
                env,
                cwd: strings[1].clone(),
                cpus: small[0] as u32,
                memory_bytes: ints[0],
                alignment: small[1],
                policy: small[2],
                node_selector: selector,
                latency_nice: small[3],
                nice: small[4],
                waker: strings[2].clone(),
                group: strings[3].clone(),
                retries: small[5] as u32,
                timeout_ms: ints[1],
                array_count: small[6] as u32,
                nodes: small[7] as u32,
                within: ints[2] as i32,
                within_preferred: flag,
                relax_after_ms: ints[3],
                gang_retry: ints[4] as i32,
                gpus: ints[5] as u32,
            };
            let exact = prost::Message::encoded_len(&spec);
            proptest::prop_assert!(encoded_len_bound(&spec) >= exact, "{} < {}", encoded_len_bound(&spec), exact);
        }
    }

    /// At the limits, the bound changes no answer: a call just at the
    /// call limit passes and one byte over is refused with the exact size.
    #[test]
    fn call_size_refusals_use_the_exact_size() {
        let spec = ok_spec();
        let one = prost::Message::encoded_len(&spec) as u64;
        let limits = |max_call_bytes| SpecLimits {
            max_call_bytes,
            ..SpecLimits::default()
        };
        assert!(check_call(std::slice::from_ref(&spec), &limits(one)).is_ok());
        let e = check_call(&[spec], &limits(one - 1)).unwrap_err();
        assert!(e.message.contains(&format!("total {one} bytes")), "{e}");
    }

    #[test]
    fn every_field_is_checked() {
        check(|s| s.command.clear(), "spec.command");
        check(|s| s.command[0] = String::new(), "spec.command[0]");
        check(|s| s.command.push("a\0b".into()), "spec.command[1]");
        check(|s| s.command = vec!["x".into(); 5000], "spec.command");
        check(|s| s.name = "n".repeat(300), "spec.name");
        check(|s| s.group = "g".repeat(300), "spec.group");
        check(
            |s| {
                s.env.insert(String::new(), "v".into());
            },
            "spec.env",
        );
        check(
            |s| {
                s.env.insert("A=B".into(), "v".into());
            },
            "spec.env[\"A=B\"]",
        );
        check(|s| s.cwd = "relative".into(), "spec.cwd");
        check(|s| s.cpus = 5000, "spec.cpus");
        check(|s| s.gpus = 65, "spec.gpus");
        check(|s| s.alignment = 99, "spec.alignment");
        check(|s| s.policy = 7, "spec.policy");
        check(
            |s| {
                s.node_selector.insert(String::new(), "x".into());
            },
            "spec.node_selector",
        );
        check(|s| s.latency_nice = -21, "spec.latency_nice");
        check(|s| s.latency_nice = 20, "spec.latency_nice");
        check(|s| s.nice = 20, "spec.nice");
        check(|s| s.retries = 101, "spec.retries");
        check(|s| s.array_count = 100_001, "spec.array_count");
        check(|s| s.timeout_ms = u64::MAX, "spec.timeout_ms");
        check(|s| s.nodes = 1025, "spec.nodes");
        check(
            |s| {
                s.nodes = 2;
                s.array_count = 3;
            },
            "spec.nodes",
        );
        let gang = |s: &mut JobSpec| s.nodes = 4;
        check(|s| s.within = Within::Rack as i32, "spec.within");
        check(
            |s| {
                gang(s);
                s.within = 9;
            },
            "spec.within",
        );
        check(|s| s.within_preferred = true, "spec.within_preferred");
        check(
            |s| {
                gang(s);
                s.within_preferred = true;
            },
            "spec.within_preferred",
        );
        check(
            |s| s.gang_retry = GangRetry::ReplaceMember as i32,
            "spec.gang_retry",
        );
        check(
            |s| {
                gang(s);
                s.gang_retry = 5;
            },
            "spec.gang_retry",
        );
        check(|s| s.relax_after_ms = 10, "spec.relax_after_ms");
        check(
            |s| {
                gang(s);
                s.within = Within::Rack as i32;
                s.relax_after_ms = 10;
            },
            "spec.relax_after_ms",
        );
        check(
            |s| {
                gang(s);
                s.within = Within::Zone as i32;
                s.within_preferred = true;
                s.relax_after_ms = 8 * 24 * 3600 * 1000;
            },
            "spec.relax_after_ms",
        );
        check(|s| s.command = vec!["x".repeat(2 << 20)], "spec.command[0]");
    }

    /// Every size limit, with the message naming the size and the limit.
    #[test]
    fn every_size_limit_is_refused_by_name() {
        let sized = |mutate: &dyn Fn(&mut JobSpec), field: &str, message: &str| {
            let mut s = ok_spec();
            mutate(&mut s);
            let e = validate(&mut s, "spec", &SpecLimits::default()).unwrap_err();
            assert_eq!((e.field.as_str(), e.message.as_str()), (field, message));
        };
        let big = |n: usize| "x".repeat(n);
        sized(
            &|s| s.name = big(257),
            "spec.name",
            "257 bytes, at most 256",
        );
        sized(
            &|s| s.group = big(300),
            "spec.group",
            "300 bytes, at most 256",
        );
        sized(
            &|s| s.command = vec!["x".into(); 4097],
            "spec.command",
            "4097 entries, at most 4096",
        );
        sized(
            &|s| s.command.push(big(128 * 1024 + 1)),
            "spec.command[1]",
            "131073 bytes, at most 131072",
        );
        sized(
            &|s| s.command = vec![big(100 * 1024); 11],
            "spec.command",
            "command, env and cwd total 1126400 bytes, at most 1048576",
        );
        sized(
            &|s| {
                for i in 0..1025 {
                    s.env.insert(format!("V{i}"), String::new());
                }
            },
            "spec.env",
            "1025 entries, at most 1024",
        );
        sized(
            &|s| {
                s.env.insert(big(257), String::new());
            },
            &format!("spec.env[{:?}...]", big(32)),
            "257 bytes, at most 256",
        );
        sized(
            &|s| {
                s.env.insert("HUGE".into(), big(128 * 1024 + 1));
            },
            "spec.env[\"HUGE\"]",
            "131073 bytes, at most 131072",
        );
        sized(
            &|s| s.cwd = format!("/{}", big(4096)),
            "spec.cwd",
            "4097 bytes, at most 4096",
        );
        sized(
            &|s| {
                for i in 0..65 {
                    s.node_selector.insert(format!("l{i}"), "v".into());
                }
            },
            "spec.node_selector",
            "65 entries, at most 64",
        );
        sized(
            &|s| {
                s.node_selector.insert(big(257), "v".into());
            },
            &format!("spec.node_selector[{:?}...]", big(32)),
            "257 bytes, at most 256",
        );
        sized(
            &|s| {
                s.node_selector.insert("rack".into(), big(257));
            },
            "spec.node_selector[\"rack\"]",
            "257 bytes, at most 256",
        );
        sized(
            &|s| s.waker = format!("j-{}", "1".repeat(63)),
            "spec.waker",
            "65 bytes, at most 64",
        );
        // Sizes at the limit pass.
        let mut s = ok_spec();
        s.name = big(256);
        s.command.push(big(128 * 1024));
        s.cwd = format!("/{}", big(4095));
        for i in 0..1024 {
            s.env.insert(format!("V{i}"), String::new());
        }
        for i in 0..64 {
            s.node_selector.insert(format!("l{i}"), big(256));
        }
        validate(&mut s, "spec", &SpecLimits::default()).unwrap();
    }

    /// A multi-byte key is cut on a character boundary in the field path.
    #[test]
    fn long_keys_are_cut_on_char_boundaries() {
        let mut s = ok_spec();
        s.env.insert("é".repeat(200), String::new());
        let e = validate(&mut s, "spec", &SpecLimits::default()).unwrap_err();
        assert_eq!(e.field, format!("spec.env[{:?}...]", "é".repeat(16)));
    }

    #[test]
    fn calls_are_checked_as_a_whole() {
        let limits = SpecLimits::default();
        let call = |specs: Vec<JobSpec>| check_call(&specs, &limits).map_err(|e| e.to_string());
        assert_eq!(call(vec![]).unwrap_err(), "specs: empty");
        assert_eq!(
            call(vec![ok_spec(); 10_001]).unwrap_err(),
            "specs: 10001 specs in one call, at most 10000 per call"
        );
        call(vec![ok_spec(); 10_000]).unwrap();
        let array = |n: u32, arg: usize| JobSpec {
            array_count: n,
            command: vec!["x".repeat(arg)],
            ..Default::default()
        };
        assert_eq!(
            call(vec![array(60_000, 1), array(60_000, 1)]).unwrap_err(),
            "specs: 120000 jobs in one call, at most 100000"
        );
        // 1000 elements of a 100 KB spec: 100 MB of jobs.
        let e = call(vec![array(1000, 100_000)]).unwrap_err();
        assert!(
            e.starts_with("specs: the jobs of this call total 1000"),
            "{e}"
        );
        call(vec![array(100, 100_000)]).unwrap();
    }

    /// A valid gang passes; a preferred one without a wait gets Slurm's
    /// default; its members count as jobs of the call.
    #[test]
    fn gangs_are_normalised_and_counted() {
        let mut s = JobSpec {
            nodes: 3,
            within: Within::Rack as i32,
            within_preferred: true,
            gang_retry: GangRetry::ReplaceMember as i32,
            ..ok_spec()
        };
        validate(&mut s, "spec", &SpecLimits::default()).unwrap();
        assert_eq!(s.relax_after_ms, DEFAULT_RELAX_AFTER_MS);
        assert_eq!((within_of(&s), replaces_members(&s)), (Align::Llc, true));
        assert_eq!(jobs_of(&s), 3);
        let limits = SpecLimits {
            max_array: 5,
            ..Default::default()
        };
        let e = check_call(&[s.clone(), s], &limits).unwrap_err();
        assert!(e.message.starts_with("6 jobs in one call"), "{e}");
    }

    #[test]
    fn defaults_are_normalised() {
        let mut s = ok_spec();
        validate(&mut s, "spec", &SpecLimits::default()).unwrap();
        assert_eq!(s.cpus, 1);
        assert_eq!(align_of(&s), Align::Any);
        assert_eq!(policy_of(&s), Policy::Spread);
        s.alignment = Alignment::Llc as i32;
        s.policy = PlacementPolicy::Pack as i32;
        assert_eq!(align_of(&s), Align::Llc);
        assert_eq!(policy_of(&s), Policy::Pack);
    }

    #[test]
    fn a_submission_is_checked_in_one_pass_naming_the_spec() {
        let limits = SpecLimits {
            max_stored_spec_bytes: Some(100),
            ..SpecLimits::default()
        };
        let known = |id: &str| id == "j-1";
        let run = |mut specs: Vec<JobSpec>, batch: bool| {
            check_submission(&mut specs, batch, &limits, known).map(|()| specs)
        };
        let big = JobSpec {
            command: vec!["x".repeat(200)],
            ..Default::default()
        };
        let e = run(vec![ok_spec(), big.clone()], true).unwrap_err();
        assert_eq!(e.field, "specs[1]");
        assert!(e.message.ends_with("with the etcd store"), "{e}");
        let e = run(vec![big], false).unwrap_err();
        assert_eq!(e.field, "spec");
        let waking = |w: &str| JobSpec {
            waker: w.into(),
            ..ok_spec()
        };
        let e = run(vec![ok_spec(), waking("j-2")], true).unwrap_err();
        assert_eq!(e.to_string(), "specs[1].waker: no job \"j-2\"");
        assert_eq!(run(vec![], true).unwrap_err().field, "specs");
        // Valid specs come back normalised.
        let ok = run(vec![waking("j-1")], false).unwrap();
        assert_eq!(ok[0].cpus, 1);
    }
}
