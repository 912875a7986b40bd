"""A real grpcio client with default channels against a real `kvtier serve`.

grpcio sends the percent-encoded socket path as `:authority` over a Unix socket; the sidecar
must serve it anyway (issue 15). Checks Health, KvTier.Stats and an undecodable request
(INVALID_ARGUMENT) over `unix:/abs`, `unix:///abs` and TCP loopback. Usage: python3 scripts/grpcio_interop.py [path/to/kvtier]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(target: str) -> None:
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.v1.KvTier"), timeout=10
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING, status
        # StatsRequest has no fields: its encoding is empty.
        stats = ch.unary_unary(
            "/kvtier.v1.KvTier/Stats",
            request_serializer=lambda _: b"",
            response_deserializer=lambda b: b,
        )(None, timeout=10)
        assert len(stats) > 0, "an empty Stats reply"
        # Bytes that are not a MatchRequest: the client's mistake, INVALID_ARGUMENT.
        try:
            ch.unary_unary(
                "/kvtier.v1.KvTier/Match",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )(b"\x08\xff", timeout=10)
            raise AssertionError("an undecodable request was answered")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    print(f"grpcio default channel OK: {target}")


def main() -> int:
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/kvtier"
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "kvtier.sock")
        port = free_port()
        proc = subprocess.Popen(
            [binary, "serve", "--socket", sock, "--tcp", f"127.0.0.1:{port}", "--metrics", "off",
             "--host-capacity", "64MiB", "--set", "model.layers=1"],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 60
            for line in proc.stderr:
                if "kvtier: serving" in line:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("kvtier serve did not start")
            else:
                raise SystemExit("kvtier serve exited before serving")
            for target in (f"unix:{sock}", f"unix://{sock}", f"127.0.0.1:{port}"):
                check(target)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
