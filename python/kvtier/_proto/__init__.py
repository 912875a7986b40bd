"""Generated gRPC stubs of proto/kvtier/v1/kvtier.proto (scripts/gen_python_stubs.sh; do not edit).

``kvtier_pb2`` holds the messages, ``kvtier_pb2_grpc`` the ``KvTierStub``; the high-level API in
:mod:`kvtier.session` and :mod:`kvtier.aio` wraps them.
"""
