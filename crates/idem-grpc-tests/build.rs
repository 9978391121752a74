//! Generates the `payments.v1` messages, server and client (needs `protoc`: Debian's
//! `protobuf-compiler`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::compile_protos("proto/payments.proto")?;
    Ok(())
}
