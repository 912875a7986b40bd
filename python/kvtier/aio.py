"""The API on asyncio (grpc.aio): :func:`connect` -> :class:`AsyncSession`, whose methods are
coroutines and whose :meth:`AsyncSession.load` is an async iterator of layer events.

::

    async with await kvtier.aio.connect(target, "engine-0") as s:
        h = await s.register_pool(pool, "my-model")
        async for ev in s.load(h, keys, slots, layer_event_stride=4):
            ...

Same requests, results and exceptions as :mod:`kvtier.session`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc.aio
import numpy as np

from . import _wire
from ._proto import kvtier_pb2 as pb
from ._proto import kvtier_pb2_grpc as pb_grpc
from ._wire import CudaBufferLike, LayoutLike, PoolRef, ProcessBufferLike, SlotsLike
from .client import channel_config
from .errors import KvtierError, SessionClosed, Unavailable, from_rpc_error
from .geometry import Geometry
from .keys import BlockKeys, KeysLike
from .pool import CpuPool
from .results import (
    BlocksMissing, ClearResult, DeviceEvent, DeviceEventsResult, LoadDone, LoadEvent,
    MatchResult, PinResult, PoolHandle, Removals, Stats, StoreResult, Tier,
)


class AsyncClient:
    """A grpc.aio channel to one sidecar (arguments as :class:`kvtier.Client`). Create it
    inside a running event loop."""

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
            self.channel = grpc.aio.secure_channel(cfg.target, cfg.credentials, cfg.options)
        else:
            self.channel = grpc.aio.insecure_channel(cfg.target, cfg.options)
        self.stub = pb_grpc.KvTierStub(self.channel)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the channel connects (:class:`~kvtier.errors.Unavailable` past ``timeout``)."""
        t = self.connect_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self.channel.channel_ready(), t)
        except asyncio.TimeoutError:
            raise Unavailable(f"no sidecar accepted a connection at {self.target} within {t} s") from None

    async def unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Calls unary method ``method``, mapping a failed status to its exception."""
        try:
            return await getattr(self.stub, method)(
                request, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    async def stats(self) -> Stats:
        """The sidecar's counters (no session needed)."""
        return _wire.stats(await self.unary("Stats", pb.StatsRequest()))

    async def session(self, client_name: str = "kvtier-python") -> AsyncSession:
        """Opens a session on this connection."""
        return await AsyncSession.open(self, client_name)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


class AsyncLoadStream(AsyncIterator[LoadEvent]):
    """The events of one Load, as an async iterator (see :class:`kvtier.LoadStream`)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.done: LoadDone | None = None
        self.missing = BlockKeys()

    def __aiter__(self) -> AsyncLoadStream:
        return self

    async def __anext__(self) -> LoadEvent:
        if self.done is not None:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        if msg is grpc.aio.EOF:
            raise KvtierError("the load stream ended without LoadDone")
        ev = _wire.load_event(msg)
        if isinstance(ev, BlocksMissing):
            self.missing = self.missing + ev.keys
        elif isinstance(ev, LoadDone):
            self.done = ev
        return ev

    async def wait(self) -> LoadDone:
        """Reads the remaining events; returns the final one."""
        async for _ in self:
            pass
        assert self.done is not None
        return self.done

    def cancel(self) -> None:
        """Cancels the load (no effect once it is done)."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncLoadStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        if self.done is None:
            self.cancel()


class AsyncSession:
    """A session on asyncio: :meth:`open` (or :func:`connect`) it, ``await close()`` it (or
    ``async with``). A task reads the session stream's heartbeats meanwhile."""

    def __init__(self) -> None:  # use AsyncSession.open
        self.id = 0
        self.geometry: Geometry
        self.client_name = ""
        self.last_heartbeat_ms = 0
        self._client: AsyncClient
        self._owns_client = False
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._ended: KvtierError | None = None
        self._removals = _wire.RemovalLog()

    @classmethod
    async def open(cls, client: AsyncClient, client_name: str = "kvtier-python", *,
                   owns_client: bool = False, watch_removals: bool = False) -> AsyncSession:
        """Opens a session on ``client`` (closing it closes the client when ``owns_client``;
        ``watch_removals``: collect the blocks that leave kvtier, :meth:`take_removals`)."""
        self = cls()
        self._client, self._owns_client, self.client_name = client, owns_client, client_name
        await client.wait_ready()
        self._call = client.stub.OpenSession(
            pb.OpenSessionRequest(client_name=client_name, watch_removals=watch_removals), metadata=client.metadata)
        try:
            first = await self._call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        if first is grpc.aio.EOF:
            raise SessionClosed("the sidecar ended the session stream before opening it")
        if first.WhichOneof("event") != "opened":
            self._call.cancel()
            raise KvtierError(f"the session stream began with {first.WhichOneof('event')!r}, not opened")
        self.id = first.opened.session_id
        self.geometry = Geometry.from_proto(first.opened.geometry)
        self.sidecar_pid = first.opened.sidecar_pid
        self._task = asyncio.get_running_loop().create_task(self._pump())
        return self

    async def _pump(self) -> None:
        try:
            while True:
                ev = await self._call.read()
                if ev is grpc.aio.EOF:
                    self._ended = SessionClosed(f"the sidecar ended session {self.id}")
                    return
                which = ev.WhichOneof("event")
                if which == "heartbeat":
                    self.last_heartbeat_ms = ev.heartbeat.unix_ms
                elif which == "removed":
                    self._removals.note(ev.removed)
        except asyncio.CancelledError:
            pass
        except grpc.RpcError as e:
            if not self._closing:
                self._ended = from_rpc_error(e)

    def take_removals(self) -> Removals:
        """The blocks that left kvtier since the last call (opened with ``watch_removals``;
        otherwise always empty)."""
        return self._removals.take()

    @property
    def closed(self) -> bool:
        return self._closing or self._ended is not None

    def _check(self) -> None:
        if self._closing:
            raise SessionClosed(f"session {self.id} is closed")
        if self._ended is not None:
            raise SessionClosed(f"session {self.id} ended: {self._ended}")

    async def close(self) -> None:
        """Ends the session stream (the sidecar releases its pins and pools). Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._call.cancel()
        if self._task is not None:
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def _unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self._check()
        return await self._client.unary(method, request, timeout)

    async def register_pool(self, pool: CpuPool | str | os.PathLike[str], model_id: str, *, tp_rank: int = 0,
                            tp_size: int = 1, geometry: Geometry | None = None,
                            num_slots: int | None = None, layout: LayoutLike | None = None) -> PoolHandle:
        """See :meth:`kvtier.Session.register_pool`."""
        reg = _wire.cpu_registration(self.id, self.geometry, pool, model_id, tp_rank, tp_size, geometry,
                                     num_slots, layout)
        return reg.handle(await self._unary("RegisterPool", reg.request))

    async def register_cuda_pool(self, buffers: Sequence[CudaBufferLike], layout: LayoutLike, model_id: str, *,
                                 num_slots: int, device_ordinal: int = 0, device_uuid: bytes = b"",
                                 tp_rank: int = 0, tp_size: int = 1) -> PoolHandle:
        """See :meth:`kvtier.Session.register_cuda_pool`."""
        reg = _wire.cuda_registration(self.id, self.geometry, buffers, layout, model_id, num_slots,
                                      device_ordinal, device_uuid, tp_rank, tp_size)
        return reg.handle(await self._unary("RegisterPool", reg.request))

    async def register_process_pool(self, buffers: Sequence[ProcessBufferLike], model_id: str, *, num_slots: int,
                                    layout: LayoutLike | None = None, tp_rank: int = 0,
                                    tp_size: int = 1) -> PoolHandle:
        """See :meth:`kvtier.Session.register_process_pool`."""
        reg = _wire.process_registration(self.id, self.geometry, buffers, layout, model_id, num_slots,
                                         tp_rank, tp_size)
        _wire.allow_sidecar(self.sidecar_pid)
        return reg.handle(await self._unary("RegisterPool", reg.request))

    async def unregister_pool(self, pool: PoolRef) -> None:
        await self._unary("UnregisterPool", pb.UnregisterPoolRequest(session_id=self.id, pool_id=_wire.pool_id(pool)))

    async def match(self, pool: PoolRef, keys: KeysLike | None = None, *,
                    token_ids: Sequence[int] | np.ndarray | None = None, cache_salt: str = "",
                    timeout: float | None = None) -> MatchResult:
        """See :meth:`kvtier.Session.match`."""
        return _wire.match_result(await self._unary(
            "Match", _wire.match_request(self.id, pool, keys, token_ids, cache_salt), timeout))

    def load(self, pool: PoolRef, keys: KeysLike, slots: SlotsLike, *, cache_salt: str = "",
             deadline_ms: int = 0, layer_event_stride: int = 1, done_only: bool = False,
             group_slots: Sequence[SlotsLike] = (), timeout: float | None = None) -> AsyncLoadStream:
        """See :meth:`kvtier.Session.load`; iterate the result with ``async for``."""
        self._check()
        req = _wire.load_request(self.id, pool, keys, slots, cache_salt, deadline_ms,
                                 layer_event_stride, done_only, group_slots)
        return AsyncLoadStream(self._client.stub.Load(req, timeout=timeout, metadata=self._client.metadata))

    async def load_wait(self, pool: PoolRef, keys: KeysLike, slots: SlotsLike, *, cache_salt: str = "",
                        deadline_ms: int = 0, group_slots: Sequence[SlotsLike] = (),
                        timeout: float | None = None) -> LoadDone:
        """See :meth:`kvtier.Session.load_wait` (``done_only``)."""
        return await self.load(pool, keys, slots, cache_salt=cache_salt, deadline_ms=deadline_ms,
                               done_only=True, group_slots=group_slots, timeout=timeout).wait()

    async def store(self, pool: PoolRef, keys: KeysLike, slots: SlotsLike, *, parent: int | None = None,
                    cache_salt: str = "", durable: bool = False, group_slots: Sequence[SlotsLike] = (),
                    timeout: float | None = None, not_after: float | None = None) -> StoreResult:
        """See :meth:`kvtier.Session.store`."""
        return _wire.store_result(await self._unary(
            "Store",
            _wire.store_request(self.id, pool, keys, slots, parent, cache_salt, durable, group_slots, not_after),
            timeout))

    async def device_events(self, pool: PoolRef, events: Iterable[DeviceEvent]) -> DeviceEventsResult:
        return _wire.device_events_result(await self._unary(
            "DeviceEvents", _wire.device_events_request(self.id, pool, events)))

    async def pin(self, pool: PoolRef, keys: KeysLike, *, cache_salt: str = "", ttl_ms: int = 0) -> PinResult:
        return _wire.pin_result(await self._unary("Pin", _wire.pin_request(self.id, pool, keys, cache_salt, ttl_ms)))

    async def unpin(self, pin: PinResult | int) -> int:
        pid = pin.pin_id if isinstance(pin, PinResult) else int(pin)
        r = await self._unary("Unpin", pb.UnpinRequest(session_id=self.id, pin_id=pid))
        return int(r.released_blocks)

    async def clear(self, pool: PoolRef | None = None, *, cache_salt: str = "", all: bool = False,
                    tier: Tier | None = None) -> ClearResult:
        return _wire.clear_result(await self._unary("Clear", _wire.clear_request(self.id, pool, cache_salt, all, tier)))

    async def stats(self) -> Stats:
        return _wire.stats(await self._unary("Stats", pb.StatsRequest()))


async def connect(target: str | os.PathLike[str] | None = None, client_name: str = "kvtier-python", *,
                  watch_removals: bool = False, **kwargs: Any) -> AsyncSession:
    """Connects and opens a session that owns its connection (``watch_removals`` as
    :meth:`AsyncSession.open` takes it; ``kwargs`` go to :class:`AsyncClient`)."""
    client = AsyncClient(target, **kwargs)
    try:
        return await AsyncSession.open(client, client_name, owns_client=True, watch_removals=watch_removals)
    except BaseException:
        await client.close()
        raise
