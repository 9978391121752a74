"""Calls payments.v1.Payments/CreatePayment with Python's grpcio and its own retry policy.

Each key is sent by several threads at once (concurrent duplicates), over one channel whose
service config retries UNAVAILABLE and ABORTED (honouring idem's grpc-retry-pushback-ms).
Prints one JSON document: per key, what each copy got. Run by the gRPC tests
(crates/idem-grpc-tests) with the venv of scripts/grpc_python.sh.

    python grpc_python.py --target 127.0.0.1:50051 --proto crates/idem-grpc-tests/proto/payments.proto \
        --keys 20 --copies 4 [--script flaky] [--tls-ca ca.pem --authority localhost]
"""

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc

SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "payments.v1.Payments"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"],
            },
        }
    ]
}


def stubs(proto):
    """Generates the messages and stubs of `proto` into a temporary folder and imports them."""
    out = tempfile.mkdtemp(prefix="idem-grpc-py-")
    folder, name = os.path.split(os.path.abspath(proto))
    status = protoc.main(
        ["grpc_tools.protoc", f"-I{folder}", f"--python_out={out}", f"--grpc_python_out={out}", name]
    )
    if status != 0:
        sys.exit(f"protoc failed on {proto}")
    sys.path.insert(0, out)
    base = name[: -len(".proto")]
    return __import__(f"{base}_pb2"), __import__(f"{base}_pb2_grpc")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--proto", required=True)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--script", default="")
    parser.add_argument("--prefix", default="py-key")
    parser.add_argument("--account", default="acct_python")
    parser.add_argument("--tls-ca")
    parser.add_argument("--authority")
    args = parser.parse_args()

    pb2, pb2_grpc = stubs(args.proto)
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ]
    if args.authority:
        options.append(("grpc.ssl_target_name_override", args.authority))
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.secure_channel(args.target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.target, options=options)
    stub = pb2_grpc.PaymentsStub(channel)

    def call(key, amount):
        request = pb2.CreatePaymentRequest(amount=amount, currency="EUR", script=args.script)
        metadata = [("idempotency-key", key), ("authorization", f"Bearer {args.account}")]
        try:
            payment, rpc = stub.CreatePayment.with_call(request, metadata=metadata, timeout=60)
            replayed = dict(rpc.initial_metadata()).get("idempotent-replayed") == "true"
            return {"code": "OK", "id": payment.id, "replayed": replayed}
        except grpc.RpcError as e:
            return {"code": e.code().name, "message": e.details()}

    keys = [f"{args.prefix}-{n:04d}" for n in range(args.keys)]
    results = {key: [] for key in keys}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(keys) * args.copies) as pool:
        futures = {
            pool.submit(call, key, 100 + n): key
            for n, key in enumerate(keys)
            for _ in range(args.copies)
        }
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]].append(future.result())
    channel.close()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
