//! Job-spec validation: every field of a submitted `JobSpec` is checked
//! against its documented range before anything is created, and a refusal
//! names the field (`spec.cpus: ...`) so the user can fix it. Valid specs
//! are normalised (`cpus: 0` means 1) so the rest of the dispatcher never
//! sees a zero default.

use proto::v1::{Alignment, JobSpec, PlacementPolicy};
use sched::{Align, Policy};
use thiserror::Error;

/// Limits on spec sizes (hostile or mistaken input must not exhaust the
/// dispatcher).
#[derive(Clone, Debug)]
pub struct SpecLimits {
    /// Entries in `command`.
    pub max_command_entries: usize,
    /// Total bytes of `command`, `env` and `cwd`.
    pub max_spec_bytes: usize,
    /// Entries in `env` and in `node_selector`.
    pub max_map_entries: usize,
    /// Bytes of `name` and `group`.
    pub max_label_bytes: usize,
    /// CPUs of one job.
    pub max_cpus: u32,
    /// Elements of one array.
    pub max_array: u32,
    /// Retries of one job.
    pub max_retries: u32,
}

impl Default for SpecLimits {
    fn default() -> Self {
        Self {
            max_command_entries: 4096,
            max_spec_bytes: 1 << 20,
            max_map_entries: 4096,
            max_label_bytes: 256,
            max_cpus: 4096,
            max_array: 100_000,
            max_retries: 100,
        }
    }
}

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
    fn from(e: SpecError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

fn err(prefix: &str, field: &str, message: impl Into<String>) -> SpecError {
    SpecError {
        field: format!("{prefix}.{field}"),
        message: message.into(),
    }
}

/// Validate and normalise `spec`; `prefix` names it in errors (`spec`,
/// `specs[3]`).
pub fn validate(spec: &mut JobSpec, prefix: &str, limits: &SpecLimits) -> Result<(), SpecError> {
    if spec.name.len() > limits.max_label_bytes {
        return Err(err(
            prefix,
            "name",
            format!("longer than {} bytes", limits.max_label_bytes),
        ));
    }
    if spec.group.len() > limits.max_label_bytes {
        return Err(err(
            prefix,
            "group",
            format!("longer than {} bytes", limits.max_label_bytes),
        ));
    }
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
    if spec.command.len() > limits.max_command_entries {
        return Err(err(
            prefix,
            "command",
            format!(
                "{} entries, at most {}",
                spec.command.len(),
                limits.max_command_entries
            ),
        ));
    }
    for (i, arg) in spec.command.iter().enumerate() {
        if arg.contains('\0') {
            return Err(err(prefix, &format!("command[{i}]"), "contains a NUL byte"));
        }
    }
    if spec.env.len() > limits.max_map_entries {
        return Err(err(
            prefix,
            "env",
            format!(
                "{} entries, at most {}",
                spec.env.len(),
                limits.max_map_entries
            ),
        ));
    }
    for (k, v) in &spec.env {
        if k.is_empty() {
            return Err(err(prefix, "env", "a variable name is empty"));
        }
        if k.contains('=') || k.contains('\0') {
            return Err(err(
                prefix,
                &format!("env[{k:?}]"),
                "names may not contain '=' or NUL",
            ));
        }
        if v.contains('\0') {
            return Err(err(
                prefix,
                &format!("env[{k:?}]"),
                "value contains a NUL byte",
            ));
        }
    }
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
    if spec.node_selector.len() > limits.max_map_entries {
        return Err(err(prefix, "node_selector", "too many entries"));
    }
    for k in spec.node_selector.keys() {
        if k.is_empty() {
            return Err(err(prefix, "node_selector", "a label name is empty"));
        }
    }
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
    Ok(())
}

/// The engine's alignment for a (validated) spec.
pub fn align_of(spec: &JobSpec) -> Align {
    proto::engine::align(spec.alignment)
}

/// The engine's policy for a (validated) spec.
pub fn policy_of(spec: &JobSpec) -> Policy {
    proto::engine::policy(spec.policy)
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
        check(|s| s.command = vec!["x".repeat(2 << 20)], "spec.command");
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
}
