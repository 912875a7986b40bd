//! Compiles proto/kvtier/v1/kvtier.proto with protox (pure Rust: no system protoc) into prost
//! messages and tonic client/server code, and keeps the descriptor set for server reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = root.join("kvtier/v1/kvtier.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("kvtier_descriptor.bin"), fds.encode_to_vec())?;
    // `bytes` fields as `bytes::Bytes`: decoding slices the receive buffer instead of copying.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .bytes(".")
        // Undecodable requests are INVALID_ARGUMENT, not tonic's INTERNAL (src/codec.rs).
        .codec_path("crate::codec::KvCodec")
        .compile_fds(fds)?;
    Ok(())
}
