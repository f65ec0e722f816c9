//! Compiles proto/dispatch/v1/*.proto with protox (pure Rust, no protoc)
//! and writes the file descriptor set used by gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/dispatch/v1/common.proto",
        "proto/dispatch/v1/jobs.proto",
        "proto/dispatch/v1/nodes.proto",
        "proto/dispatch/v1/agent.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("dispatch_v1_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    // prost's codec with small first buffers (src/codec.rs): an agent's
    // stream keeps its codec buffers for the agent's life.
    // `Assign` is declared by hand (src/assign.rs): its spec is shared,
    // so that the dispatcher does not copy a job's spec to send it.
    tonic_prost_build::configure()
        .codec_path("crate::codec::SmallBuffers")
        // An agent's Register (280 bytes, the largest of its messages,
        // sent once per session) is boxed: the oneof, and the
        // dispatcher's commands that carry it, are sized by the others.
        .boxed(".dispatch.v1.AgentMessage.msg.register")
        .extern_path(".dispatch.v1.Assign", "crate::assign::Assign")
        // The submit replies are too (src/reply.rs): a server's may carry
        // its jobs already encoded, from its records.
        .extern_path(
            ".dispatch.v1.SubmitJobResponse",
            "crate::reply::SubmitJobResponse",
        )
        .extern_path(
            ".dispatch.v1.SubmitJobsResponse",
            "crate::reply::SubmitJobsResponse",
        )
        .compile_fds(fds)?;
    Ok(())
}
