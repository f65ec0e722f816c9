//! `dispatch.v1.SubmitJobResponse` and `SubmitJobsResponse`, declared
//! here instead of generated: besides the decoded `jobs`, a reply can
//! carry jobs already encoded ([`EncodedJobs`]), so that the dispatcher
//! answers a submit by encoding its job records directly. A generated
//! reply owns its `Job`s: every submit copied each job's spec (its
//! command, its environment) and strings out of the dispatcher's shared
//! record into a `Job`, encoded it, then freed the copy, on the gRPC
//! workers: about a third of their samples under `loadgen`. The wire
//! format is the `.proto`'s (`build.rs` maps the types here with
//! `extern_path`; the tests check the encoding against a generated-style
//! declaration and the fields against the compiled descriptor).

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};

use crate::v1::Job;

/// The `jobs` field's entries (field 1, length-delimited `Job`s), already
/// encoded, in the order they were pushed.
#[derive(Clone, PartialEq, Eq, Default, Debug)]
pub struct EncodedJobs {
    bytes: Vec<u8>,
    count: usize,
}

impl EncodedJobs {
    /// Append one job: `encode` appends the `Job`'s encoding (its fields,
    /// without a length) to the buffer it is given; its key and length
    /// are put in front of it here.
    pub fn push(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        encoding::encode_key(JOBS_TAG, WireType::LengthDelimited, &mut self.bytes);
        let body = self.bytes.len();
        encode(&mut self.bytes);
        prefix_length(&mut self.bytes, body);
        self.count += 1;
    }

    /// How many jobs were pushed.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether none was pushed.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Their bytes on the wire.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Put the length of `buf[body..]` in front of it, as a varint: a body
/// written first, its length known only then (the body moves by the
/// prefix's bytes). prost's `message::encode` computes the length first,
/// a whole extra pass over the message; the dispatcher's store encodes
/// its records this way too.
pub fn prefix_length(buf: &mut Vec<u8>, body: usize) {
    let len = buf.len() - body;
    let n = encoding::encoded_len_varint(len as u64);
    buf.resize(body + len + n, 0);
    buf.copy_within(body..body + len, body + n);
    encoding::encode_varint(len as u64, &mut &mut buf[body..body + n]);
}

/// The tag of both replies' `repeated Job jobs = 1`.
const JOBS_TAG: u32 = 1;

macro_rules! jobs_reply {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// On the wire, `jobs` then `encoded`: a reply that uses both
        /// decodes as one list in that order. A decoded reply has all of
        /// its jobs in `jobs` (so two replies with the same jobs in
        /// different fields are not `==`).
        #[derive(Clone, PartialEq, Default, Debug)]
        pub struct $name {
            /// The jobs as messages (all of them, in a decoded reply).
            pub jobs: Vec<Job>,
            /// More jobs, already encoded (a server's reply built from
            /// its records); empty in a decoded reply.
            pub encoded: EncodedJobs,
        }

        impl prost::Message for $name {
            fn encode_raw(&self, buf: &mut impl BufMut) {
                for job in &self.jobs {
                    encoding::message::encode(JOBS_TAG, job, buf);
                }
                buf.put_slice(&self.encoded.bytes);
            }

            fn merge_field(
                &mut self,
                tag: u32,
                wire_type: WireType,
                buf: &mut impl Buf,
                ctx: DecodeContext,
            ) -> Result<(), prost::DecodeError> {
                if tag == JOBS_TAG {
                    encoding::message::merge_repeated(wire_type, &mut self.jobs, buf, ctx)
                        .map_err(|mut e| {
                            e.push(stringify!($name), "jobs");
                            e
                        })
                } else {
                    encoding::skip_field(wire_type, tag, buf, ctx)
                }
            }

            fn encoded_len(&self) -> usize {
                encoding::message::encoded_len_repeated(JOBS_TAG, &self.jobs)
                    + self.encoded.bytes.len()
            }

            fn clear(&mut self) {
                self.jobs.clear();
                self.encoded = EncodedJobs::default();
            }
        }
    };
}

jobs_reply! {
    /// The job SubmitJob created (or, for an array, its elements in index
    /// order). (`jobs.proto`'s `SubmitJobResponse`.)
    SubmitJobResponse
}

jobs_reply! {
    /// The jobs SubmitJobs created, in the order of the specs (an array's
    /// elements in index order). (`jobs.proto`'s `SubmitJobsResponse`.)
    SubmitJobsResponse
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost::Message;
    use prost_types::field_descriptor_proto::{Label, Type};

    use super::*;
    use crate::v1::{JobSpec, JobState};

    /// The replies as prost generates them from `jobs.proto`: the
    /// reference for the wire format.
    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Generated {
        #[prost(message, repeated, tag = "1")]
        jobs: Vec<Job>,
    }

    fn job_strategy() -> impl Strategy<Value = Job> {
        (
            "[a-z0-9-]{0,10}",
            proptest::option::of((proptest::collection::vec("[a-z/ -]{0,200}", 0..4), 0u32..64)),
            0i32..9,
            "[a-z0-9-]{0,8}",
            0i64..i64::MAX,
        )
            .prop_map(|(id, spec, state, node, submit_time_ms)| Job {
                id,
                spec: spec.map(|(command, cpus)| JobSpec {
                    command,
                    cpus,
                    ..Default::default()
                }),
                state,
                node,
                submit_time_ms,
                ..Default::default()
            })
    }

    proptest! {
        /// A reply encodes as the generated one with the same jobs, byte
        /// for byte, whichever of its fields holds each job (`jobs` first,
        /// then `encoded`), and each decodes what the other encodes.
        #[test]
        fn the_replies_are_the_protos(
            jobs in proptest::collection::vec(job_strategy(), 0..6),
            split in 0usize..7,
        ) {
            let split = split.min(jobs.len());
            let generated = Generated { jobs: jobs.clone() };
            let mut ours = SubmitJobsResponse {
                jobs: jobs[..split].to_vec(),
                ..Default::default()
            };
            for job in &jobs[split..] {
                ours.encoded.push(|buf| job.encode_raw(buf));
            }
            prop_assert_eq!(ours.encoded.len(), jobs.len() - split);
            prop_assert_eq!(ours.encoded_len(), generated.encoded_len());
            prop_assert_eq!(ours.encode_to_vec(), generated.encode_to_vec());
            let back = SubmitJobsResponse::decode(&ours.encode_to_vec()[..]).unwrap();
            prop_assert_eq!(&back.jobs, &jobs);
            prop_assert!(back.encoded.is_empty());
            let there = Generated::decode(&ours.encode_to_vec()[..]).unwrap();
            prop_assert_eq!(there, generated.clone());
            // The single submit's reply is the same message.
            let mut one = SubmitJobResponse::default();
            for job in &jobs {
                one.encoded.push(|buf| job.encode_raw(buf));
            }
            prop_assert_eq!(one.encode_to_vec(), generated.encode_to_vec());
        }
    }

    /// A job longer than 127 bytes takes a two-byte length: the body
    /// moves past it whole.
    #[test]
    fn a_long_job_gets_a_longer_length() {
        let job = Job {
            id: "j-1".into(),
            state: JobState::Pending as i32,
            reason: "x".repeat(300),
            ..Default::default()
        };
        let mut reply = SubmitJobResponse::default();
        reply.encoded.push(|buf| job.encode_raw(buf));
        reply.encoded.push(|buf| job.encode_raw(buf));
        let back = SubmitJobResponse::decode(&reply.encode_to_vec()[..]).unwrap();
        assert_eq!(back.jobs, [job.clone(), job]);
        reply.clear();
        assert_eq!(reply, SubmitJobResponse::default());
    }

    /// The `.proto`'s replies have exactly the field declared here: a
    /// field added there fails this test until it is added here.
    #[test]
    fn the_declared_fields_are_the_protos() {
        let fds = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).unwrap();
        for name in ["SubmitJobResponse", "SubmitJobsResponse"] {
            let reply = fds
                .file
                .iter()
                .filter(|f| f.package() == "dispatch.v1")
                .flat_map(|f| &f.message_type)
                .find(|m| m.name() == name)
                .unwrap_or_else(|| panic!("dispatch.v1.{name} in the descriptor"));
            let fields: Vec<(i32, &str, Type, Label, &str)> = reply
                .field
                .iter()
                .map(|f| (f.number(), f.name(), f.r#type(), f.label(), f.type_name()))
                .collect();
            assert_eq!(
                fields,
                [(
                    1,
                    "jobs",
                    Type::Message,
                    Label::Repeated,
                    ".dispatch.v1.Job"
                )],
                "{name}"
            );
        }
    }
}
