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
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
