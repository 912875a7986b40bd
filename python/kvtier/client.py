"""The connection to a sidecar: target forms, channel options, credentials, error mapping.

:func:`connect` is the usual entry point: it opens a :class:`~kvtier.session.Session` that
owns its connection. A :class:`Client` can also serve several sessions, and ``Stats`` without
one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from . import _wire
from ._proto import kvtier_pb2 as pb
from ._proto import kvtier_pb2_grpc as pb_grpc
from .errors import Unavailable, from_rpc_error
from .results import Stats

if TYPE_CHECKING:
    from .session import Session

#: Replies kvtier's own client accepts (a Match reply of a full batch is ~1.4 MiB at defaults).
MAX_RECEIVE_BYTES = 128 * 1024 * 1024


def default_target() -> str:
    """The socket ``kvtier serve`` listens on by default: ``$XDG_RUNTIME_DIR/kvtier.sock``,
    else ``/tmp/kvtier-<uid>.sock``."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(run, "kvtier.sock") if run else f"/tmp/kvtier-{os.getuid()}.sock"
    return "unix:" + path


def resolve_target(target: str | os.PathLike[str] | None) -> tuple[str, bool]:
    """A target as grpcio names it, and whether it uses TLS.

    Accepts the forms of docs/api.md: ``unix:///abs``, ``unix:/abs``, ``unix:rel``, a bare path,
    ``http://host:port``, ``https://host:port``, ``dns:…``, ``ipv4:…``, ``ipv6:…``, ``host:port``.
    """
    if target is None:
        return default_target(), False
    t = os.fspath(target)
    if t.startswith("https://"):
        return t[len("https://"):].rstrip("/"), True
    if t.startswith("http://"):
        return t[len("http://"):].rstrip("/"), False
    if t.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")):
        return t, False
    if t.startswith(("/", "./", "../")) or os.path.exists(t):
        return "unix:" + os.path.abspath(t), False
    return t, False


@dataclass(frozen=True)
class ChannelConfig:
    """How to open a channel to a target (shared by :class:`Client` and the asyncio client)."""

    target: str
    options: list[tuple[str, Any]]
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]


def channel_config(
    target: str | os.PathLike[str] | None,
    auth_token: str | None,
    tls_ca: bytes | str | os.PathLike[str] | None,
    tls_server_name: str | None,
    options: Sequence[tuple[str, Any]],
) -> ChannelConfig:
    """The grpcio target, options, TLS credentials and call metadata for these settings."""
    resolved, secure = resolve_target(target)
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", -1),
    ]
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    opts.extend(options)
    creds = None
    if secure:
        ca = tls_ca
        if ca is not None and not isinstance(ca, bytes):
            with open(ca, "rb") as f:
                ca = f.read()
        creds = grpc.ssl_channel_credentials(ca)
    elif tls_ca is not None or tls_server_name is not None:
        raise ValueError(f"TLS settings for a plaintext target {resolved!r}")
    metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
    return ChannelConfig(resolved, opts, creds, metadata)


class Client:
    """A gRPC channel to one sidecar.

    ``timeout`` bounds every unary call (seconds; None for none); ``connect_timeout`` how long
    opening a session waits for the sidecar to accept. ``auth_token`` is sent as ``authorization:
    Bearer …`` (TCP listeners off loopback); ``tls_ca`` (PEM bytes or a path) and
    ``tls_server_name`` configure an ``https://`` target.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        auth_token: str | None = None,
        tls_ca: bytes | str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 60.0,
        connect_timeout: float = 10.0,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        cfg = channel_config(target, auth_token, tls_ca, tls_server_name, options)
        self.target = cfg.target
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.metadata = cfg.metadata
        if cfg.credentials is not None:
            self.channel = grpc.secure_channel(cfg.target, cfg.credentials, cfg.options)
        else:
            self.channel = grpc.insecure_channel(cfg.target, cfg.options)
        self.stub = pb_grpc.KvTierStub(self.channel)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the channel connects (:class:`~kvtier.errors.Unavailable` past ``timeout``)."""
        t = self.connect_timeout if timeout is None else timeout
        try:
            grpc.channel_ready_future(self.channel).result(timeout=t)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"no sidecar accepted a connection at {self.target} within {t} s") from None

    def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Calls unary method ``method`` (e.g. ``"Match"``), mapping a failed status to its
        exception."""
        try:
            return getattr(self.stub, method)(
                request, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def stats(self) -> Stats:
        """The sidecar's counters (no session needed)."""
        return _wire.stats(self.unary("Stats", pb.StatsRequest()))

    def session(self, client_name: str = "kvtier-python", *, watch_removals: bool = False) -> Session:
        """Opens a session on this connection (closing it leaves the connection open);
        ``watch_removals``: collect the blocks that leave kvtier (:meth:`Session.take_removals`)."""
        from .session import Session

        return Session(self, client_name, watch_removals=watch_removals)

    def close(self) -> None:
        """Closes the channel (sessions on it end)."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def connect(target: str | os.PathLike[str] | None = None, client_name: str = "kvtier-python", *,
            watch_removals: bool = False, **kwargs: Any) -> Session:
    """Connects to the sidecar at ``target`` (default: :func:`default_target`) and opens a
    session that owns the connection (closing the session closes it); ``watch_removals``:
    collect the blocks that leave kvtier (:meth:`Session.take_removals`). ``kwargs`` go to
    :class:`Client`."""
    from .session import Session

    client = Client(target, **kwargs)
    try:
        return Session(client, client_name, owns_client=True, watch_removals=watch_removals)
    except BaseException:
        client.close()
        raise
