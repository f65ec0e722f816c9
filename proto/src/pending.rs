//! Names of the pending reasons' kinds for people and scripts: the
//! `.proto` enum's own names without their prefix, lower case
//! (`PENDING_REASON_KIND_QUEUED_BEHIND` is `queued_behind`), so the
//! dispatcher's web page and dispatchctl show the same words and the
//! `.proto` stays their one source.

use crate::v1::{PendingReason, PendingReasonKind};

const PREFIX: &str = "PENDING_REASON_KIND_";

/// The short name of a kind's wire value: `queued_behind`; `unknown` for
/// a value this build does not know (a newer dispatcher's kind).
pub fn kind_name(kind: i32) -> String {
    match PendingReasonKind::try_from(kind) {
        Ok(k) => k
            .as_str_name()
            .strip_prefix(PREFIX)
            .unwrap_or(k.as_str_name())
            .to_ascii_lowercase(),
        Err(_) => "unknown".to_string(),
    }
}

/// A reason in one line: `queued_behind: waiting behind 2 jobs ...`.
pub fn one_line(r: &PendingReason) -> String {
    format!("{}: {}", kind_name(r.kind), r.message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_proto_enum() {
        assert_eq!(
            kind_name(PendingReasonKind::QueuedBehind as i32),
            "queued_behind"
        );
        assert_eq!(
            kind_name(PendingReasonKind::NoMatchCpus as i32),
            "no_match_cpus"
        );
        assert_eq!(
            kind_name(PendingReasonKind::Unspecified as i32),
            "unspecified"
        );
        assert_eq!(kind_name(9999), "unknown");
        // Every known value has a distinct name without the prefix.
        let names: std::collections::BTreeSet<String> = (0..64)
            .filter(|&v| PendingReasonKind::try_from(v).is_ok())
            .map(kind_name)
            .collect();
        assert!(names.len() >= 18, "{names:?}");
        assert!(
            names.iter().all(|n| !n.contains("pending_reason")),
            "{names:?}"
        );
    }
}
