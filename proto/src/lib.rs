//! `dispatch-proto`: the public gRPC API of the dispatcher
//! (`proto/dispatch/v1/*.proto`, documented field by field there) and the
//! Rust code tonic/prost generate from it, plus [`client_security`]: the
//! clients' TLS and bearer-token setup; [`endpoints`]: finding the leading
//! dispatcher among replicas; [`pending`]: the names of the pending
//! reasons' kinds; [`codec`]: the generated services' codec (prost's,
//! with small first buffers); [`assign`]: `Assign`, declared by hand so
//! that its spec is shared; [`reply`]: the submit replies, declared by
//! hand so that a server can send its jobs already encoded. It does not depend on the engine (`sched`):
//! conversions to and from the engine's types are `dispatch-engine-proto`'s,
//! so clients such as `dispatchctl` never compile the engine.

pub mod assign;
pub mod client_security;
pub mod codec;
pub mod endpoints;
pub mod peer;
pub mod pending;
pub mod reply;

/// Package `dispatch.v1`: messages, clients and servers.
#[allow(clippy::large_enum_variant)] // generated oneofs; boxing would change the API
pub mod v1 {
    tonic::include_proto!("dispatch.v1");
    pub use crate::assign::{Assign, SharedSpec};
    pub use crate::reply::{EncodedJobs, SubmitJobResponse, SubmitJobsResponse};
}

/// The encoded `FileDescriptorSet` of `dispatch.v1`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/dispatch_v1_descriptor.bin"));
