//! Generates the `payments.v1` messages and server of the tonic example, from the proto the gRPC
//! tests use too (needs `protoc`: Debian's `protobuf-compiler`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::compile_protos("../crates/idem-grpc-tests/proto/payments.proto")?;
    Ok(())
}
