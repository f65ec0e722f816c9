//! W3C Trace Context propagation: the `traceparent` / `tracestate` pair
//! that carries a span across processes (gRPC metadata from clients, the
//! `Assign.trace_context` map from the dispatcher to an agent).

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The W3C Trace Context headers (`traceparent`, `tracestate`) naming the
/// span active in `cx`; empty when it has none.
pub fn inject(cx: &Context) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(cx, &mut carrier);
    }
    carrier
}

/// The remote span named by W3C Trace Context headers, as a parent
/// context; `None` when `traceparent` is missing or malformed.
pub fn extract(carrier: &HashMap<String, String>) -> Option<Context> {
    let cx = TraceContextPropagator::new().extract(carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn trace_context_round_trips_through_w3c_headers() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let cx = Context::new().with_remote_span_context(sc.clone());
        let carrier = inject(&cx);
        assert_eq!(
            carrier.get("traceparent").map(String::as_str),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let back = extract(&carrier).expect("a valid context");
        assert_eq!(back.span().span_context().trace_id(), sc.trace_id());
        assert_eq!(back.span().span_context().span_id(), sc.span_id());
        assert!(back.span().span_context().is_remote());
    }

    #[test]
    fn no_or_bad_traceparent_gives_no_parent() {
        assert!(inject(&Context::new()).is_empty());
        assert!(extract(&HashMap::new()).is_none());
        let bad: HashMap<String, String> = [(
            "traceparent".to_string(),
            "00-nothex-00f067aa0ba902b7-01".to_string(),
        )]
        .into();
        assert!(extract(&bad).is_none());
    }
}
