//! Compiles the vendored etcd v3 API protos (proto/etcd/api) with protox
//! (pure Rust, no protoc): client code only.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/etcd/api/mvccpb/kv.proto",
        "proto/etcd/api/etcdserverpb/rpc.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
