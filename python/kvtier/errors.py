"""gRPC status codes as typed exceptions, each carrying the sidecar's message.

Every error the sidecar returns is raised as a subclass of :class:`KvtierError`; ``code`` is
the ``grpc.StatusCode`` and ``message`` the server's text (which names the offending value).
docs/api.md, "Errors", says when each is returned.
"""

from __future__ import annotations

import grpc


class KvtierError(Exception):
    """An error answered by the sidecar (or by gRPC on its way there)."""

    #: The status code this class stands for (None: the base class, for codes without a class).
    grpc_code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.grpc_code

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "ERROR"
        return f"{name}: {self.message}"


class InvalidArgument(KvtierError):
    """A malformed request: wrong key length, keys and slots of different lengths, an empty or
    oversized batch, a slot out of range or duplicated, keys and token ids together, tp_size 0,
    a shm_path that is no regular file, a message that does not decode."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(KvtierError):
    """A message over the sidecar's size limit (refused before it is read)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class NotFound(KvtierError):
    """An unknown session, pool or pin; a pool file that does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvtierError):
    """A pool of another geometry, or whose file disagrees with its claim or changed after
    registration; a durable store without a disk tier that is written."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvtierError):
    """A transfer queue is full: the request was dropped (retry later)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(KvtierError):
    """A load missed its deadline (its pins are released), or a client-side timeout."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(KvtierError):
    """The sidecar is shutting down, or cannot be reached."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(KvtierError):
    """A TCP request without the bearer token."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class Unimplemented(KvtierError):
    """A method this server does not have."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvtierError):
    """An I/O error inside the sidecar (never the client's mistake)."""

    grpc_code = grpc.StatusCode.INTERNAL


class AlreadyExists(KvtierError):
    """Something the request creates exists already."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class DataLoss(KvtierError):
    """Unrecoverable data loss or corruption inside the sidecar."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class Cancelled(KvtierError):
    """The call was cancelled (by this client, e.g. a session or load closed early)."""

    grpc_code = grpc.StatusCode.CANCELLED


class SessionClosed(KvtierError):
    """A request on a session that was closed, or whose stream the sidecar ended."""


_BY_CODE: dict[grpc.StatusCode, type[KvtierError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        OutOfRange,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Unauthenticated,
        Unimplemented,
        Internal,
        AlreadyExists,
        DataLoss,
        Cancelled,
    )
    if cls.grpc_code is not None
}


def error_class(code: grpc.StatusCode) -> type[KvtierError]:
    """The exception class of a status code (:class:`KvtierError` for codes without one)."""
    return _BY_CODE.get(code, KvtierError)


def from_rpc_error(err: grpc.RpcError) -> KvtierError:
    """The typed exception for a failed grpcio call (sync or grpc.aio)."""
    code = err.code() if hasattr(err, "code") else None  # type: ignore[attr-defined]
    details = err.details() if hasattr(err, "details") else None  # type: ignore[attr-defined]
    if code is None:
        return KvtierError(str(err))
    return error_class(code)(details or "", code)
