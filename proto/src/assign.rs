//! `dispatch.v1.Assign`, declared here instead of generated: its spec is
//! shared ([`SharedSpec`], an `Arc<JobSpec>`), so that the dispatcher
//! sends a job's spec without copying it. The dispatcher keeps each job's
//! spec behind an `Arc` in the job's record; a generated `Assign` owns its
//! `JobSpec`, and every start copied the spec (its command, its
//! environment map) into the message, encoded it, then freed the copy.
//! Under `loadgen` that copy's allocations, frees and clones were ~4% of
//! the dispatcher's samples, on its gRPC workers; its accepted rate did
//! not change beyond the noise (`loadgen`'s spec is small; the copy grows
//! with the spec; docs/BENCHMARKS.md, session 33). The wire format is the `.proto`'s
//! (`build.rs` maps the type here with `extern_path`; the tests check
//! the encoding against a generated-style declaration and the fields
//! against the compiled descriptor).

use std::ops::Deref;
use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType};

use crate::v1::JobSpec;

/// Run this job (attempt) on the node. CPUs are chosen by the agent's own
/// scheduler, within the job's alignment. (`agent.proto`'s `Assign`.)
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Assign {
    #[prost(string, tag = "1")]
    pub job_id: ::prost::alloc::string::String,
    #[prost(uint32, tag = "2")]
    pub attempt: u32,
    /// The job's spec, shared with whoever else holds it (the
    /// dispatcher's job record); a decoded one is the message's own.
    #[prost(message, optional, tag = "3")]
    pub spec: ::core::option::Option<SharedSpec>,
    /// The job's trace context in W3C Trace Context form (keys
    /// `traceparent` and, when present, `tracestate`), naming the
    /// dispatcher's span of the job's run on this node; empty when the
    /// dispatcher does not trace. The agent's spans for the job
    /// (`job.start`, `job.run`) are its children. It travels in the
    /// message, not in gRPC metadata, because the Attach stream is
    /// long-lived: its metadata is sent once, for all jobs.
    #[prost(map = "string, string", tag = "4")]
    pub trace_context:
        ::std::collections::HashMap<::prost::alloc::string::String, ::prost::alloc::string::String>,
    /// The job's owner (Job.owner): the agent runs the job as the local
    /// uid its user map gives this owner.
    #[prost(string, tag = "5")]
    pub owner: ::prost::alloc::string::String,
}

/// A `JobSpec` behind an `Arc`, encoded and decoded as the `JobSpec`
/// itself. Reads go through `Deref`; [`SharedSpec::into_inner`] gives the
/// spec (without a copy when nothing else holds it, as after decoding).
#[derive(Clone, PartialEq, Default, Debug)]
pub struct SharedSpec(pub Arc<JobSpec>);

impl SharedSpec {
    /// The spec, copied only if another holder shares it.
    pub fn into_inner(self) -> JobSpec {
        Arc::unwrap_or_clone(self.0)
    }

    /// The spec to change: this message's own, copied first if another
    /// holder shares it.
    pub fn make_mut(&mut self) -> &mut JobSpec {
        Arc::make_mut(&mut self.0)
    }
}

impl Deref for SharedSpec {
    type Target = JobSpec;

    fn deref(&self) -> &JobSpec {
        &self.0
    }
}

impl From<JobSpec> for SharedSpec {
    fn from(spec: JobSpec) -> Self {
        Self(Arc::new(spec))
    }
}

impl From<Arc<JobSpec>> for SharedSpec {
    fn from(spec: Arc<JobSpec>) -> Self {
        Self(spec)
    }
}

impl prost::Message for SharedSpec {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.0.encode_raw(buf)
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // A decoded spec is this message's alone: no copy.
        Arc::make_mut(&mut self.0).merge_field(tag, wire_type, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
    }

    fn clear(&mut self) {
        Arc::make_mut(&mut self.0).clear()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;
    use prost::Message;
    use prost_types::field_descriptor_proto::{Label, Type};

    use super::*;
    use crate::v1::{DispatcherMessage, dispatcher_message};

    /// `Assign` as prost generates it from `agent.proto` (a spec of its
    /// own): the reference for the wire format.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Generated {
        #[prost(string, tag = "1")]
        job_id: String,
        #[prost(uint32, tag = "2")]
        attempt: u32,
        #[prost(message, optional, tag = "3")]
        spec: Option<JobSpec>,
        #[prost(map = "string, string", tag = "4")]
        trace_context: HashMap<String, String>,
        #[prost(string, tag = "5")]
        owner: String,
    }

    fn spec_strategy() -> impl Strategy<Value = Option<JobSpec>> {
        proptest::option::of(
            (
                proptest::collection::vec("[a-z/ -]{0,12}", 0..4),
                0u32..64,
                proptest::collection::hash_map("[A-Z_]{1,6}", "[ -~]{0,10}", 0..3),
                -20i32..20,
            )
                .prop_map(|(command, cpus, env, latency_nice)| JobSpec {
                    command,
                    cpus,
                    env,
                    latency_nice,
                    ..Default::default()
                }),
        )
    }

    proptest! {
        /// The shared spec's `Assign` encodes as the generated one, byte
        /// for byte, and each decodes what the other encodes.
        #[test]
        fn the_shared_specs_assign_is_the_protos(
            job_id in "[a-z0-9.-]{0,12}",
            attempt in 0u32..5,
            spec in spec_strategy(),
            trace_context in proptest::collection::hash_map("[a-z]{1,8}", "[ -~]{0,16}", 0..2),
            owner in "[a-z]{0,8}",
        ) {
            let generated = Generated {
                job_id: job_id.clone(),
                attempt,
                spec: spec.clone(),
                trace_context: trace_context.clone(),
                owner: owner.clone(),
            };
            let ours = Assign {
                job_id,
                attempt,
                spec: spec.map(SharedSpec::from),
                trace_context,
                owner,
            };
            prop_assert_eq!(ours.encoded_len(), generated.encoded_len());
            // At most one trace-context entry: a map's encoding follows
            // its iteration order, which two maps need not share.
            prop_assert_eq!(ours.encode_to_vec(), generated.encode_to_vec());
            let back = Assign::decode(&generated.encode_to_vec()[..]).unwrap();
            prop_assert_eq!(&back, &ours);
            let there = Generated::decode(&ours.encode_to_vec()[..]).unwrap();
            prop_assert_eq!(there, generated);
            // In the stream's message too.
            let msg = DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Assign(ours)),
            };
            prop_assert_eq!(DispatcherMessage::decode(&msg.encode_to_vec()[..]).unwrap(), msg);
        }
    }

    /// Encoding a shared spec does not copy it, and decoding gives a spec
    /// no one else holds.
    #[test]
    fn the_spec_is_shared_not_copied() {
        let spec = Arc::new(JobSpec {
            command: vec!["true".into()],
            cpus: 2,
            ..Default::default()
        });
        let a = Assign {
            job_id: "j-1".into(),
            spec: Some(SharedSpec(spec.clone())),
            ..Default::default()
        };
        assert!(Arc::ptr_eq(&a.spec.as_ref().unwrap().0, &spec));
        let back = Assign::decode(&a.encode_to_vec()[..]).unwrap();
        let decoded = back.spec.unwrap();
        assert_eq!(Arc::strong_count(&decoded.0), 1);
        assert_eq!(decoded.into_inner(), *spec);
    }

    /// The `.proto`'s `Assign` has exactly the fields declared here: a
    /// field added there fails this test until it is added here.
    #[test]
    fn the_declared_fields_are_the_protos() {
        let fds = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).unwrap();
        let assign = fds
            .file
            .iter()
            .filter(|f| f.package() == "dispatch.v1")
            .flat_map(|f| &f.message_type)
            .find(|m| m.name() == "Assign")
            .expect("dispatch.v1.Assign in the descriptor");
        let fields: Vec<(i32, &str, Type, Label)> = assign
            .field
            .iter()
            .map(|f| (f.number(), f.name(), f.r#type(), f.label()))
            .collect();
        assert_eq!(
            fields,
            [
                (1, "job_id", Type::String, Label::Optional),
                (2, "attempt", Type::Uint32, Label::Optional),
                (3, "spec", Type::Message, Label::Optional),
                (4, "trace_context", Type::Message, Label::Repeated),
                (5, "owner", Type::String, Label::Optional),
            ]
        );
        let spec = &assign.field[2];
        assert_eq!(spec.type_name(), ".dispatch.v1.JobSpec");
    }
}
