"""A session: the unit that owns pools, pins and transfers on the sidecar.

Opening one starts ``OpenSession``; a background thread keeps reading its stream (heartbeats)
so the session stays alive. When the stream ends — :meth:`Session.close`, or this process
exiting or dying — the sidecar releases the session's pins and unregisters its pools.

Batches are the fast path: every method takes a whole run of keys and slots in one request
(keys packed, 16 bytes each); a load streams one event per layer by default, fewer with
``layer_event_stride``, or just the final one with ``done_only`` (:meth:`Session.load_wait`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from . import _wire
from ._proto import kvtier_pb2 as pb
from ._wire import CudaBufferLike, LayoutLike, PoolRef, ProcessBufferLike, SlotsLike
from .errors import KvtierError, SessionClosed, from_rpc_error
from .geometry import Geometry
from .keys import BlockKeys, KeysLike
from .pool import CpuPool
from .results import (
    BlocksMissing, ClearResult, DeviceEvent, DeviceEventsResult, LoadDone, LoadEvent,
    MatchResult, PinResult, PoolHandle, Removals, Stats, StoreResult, Tier,
)

if TYPE_CHECKING:
    from .client import Client


class LoadStream(Iterator[LoadEvent]):
    """The events of one Load: :class:`~kvtier.results.BlocksMissing` (if any),
    :class:`~kvtier.results.LayerReady` per layer (as asked), then
    :class:`~kvtier.results.LoadDone`. Iterate it, or :meth:`wait` for the end.

    A failed load raises its typed exception from iteration. Leaving a ``with`` block (or
    :meth:`cancel`) before the end cancels the load; the sidecar releases its pins.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        #: The final event, once received.
        self.done: LoadDone | None = None
        #: Keys reported missing so far.
        self.missing = BlockKeys()

    def __iter__(self) -> LoadStream:
        return self

    def __next__(self) -> LoadEvent:
        if self.done is not None:
            raise StopIteration
        try:
            msg = next(self._call)
        except StopIteration:
            raise KvtierError("the load stream ended without LoadDone") from None
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        ev = _wire.load_event(msg)
        if isinstance(ev, BlocksMissing):
            self.missing = self.missing + ev.keys
        elif isinstance(ev, LoadDone):
            self.done = ev
        return ev

    def wait(self) -> LoadDone:
        """Reads the remaining events; returns the final one."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def cancel(self) -> None:
        """Cancels the load (no effect once it is done)."""
        self._call.cancel()

    def __enter__(self) -> LoadStream:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        if self.done is None:
            self.cancel()


class Session:
    """An open ``OpenSession`` stream and the requests made in it.

    Use :func:`kvtier.connect` (or :meth:`kvtier.Client.session`); close it with :meth:`close`
    or a ``with`` block. Methods are thread-safe (grpcio channels are).
    """

    def __init__(self, client: Client, client_name: str = "kvtier-python", *, owns_client: bool = False,
                 watch_removals: bool = False) -> None:
        self._client = client
        self._owns_client = owns_client
        self.client_name = client_name
        client.wait_ready()
        self._call = client.stub.OpenSession(
            pb.OpenSessionRequest(client_name=client_name, watch_removals=watch_removals), metadata=client.metadata)
        try:
            first = next(self._call)
        except StopIteration:
            raise SessionClosed("the sidecar ended the session stream before opening it") from None
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        if first.WhichOneof("event") != "opened":
            self._call.cancel()
            raise KvtierError(f"the session stream began with {first.WhichOneof('event')!r}, not opened")
        #: The session id every request names.
        self.id: int = first.opened.session_id
        #: The KV geometry this sidecar serves (pools must match it).
        self.geometry: Geometry = Geometry.from_proto(first.opened.geometry)
        #: The sidecar's process id (0 from a sidecar older than process pools).
        self.sidecar_pid: int = first.opened.sidecar_pid
        #: Unix milliseconds of the last heartbeat (0 before the first).
        self.last_heartbeat_ms = 0
        self._closing = False
        self._ended: KvtierError | None = None
        self._pools: dict[int, PoolHandle] = {}
        self._removals = _wire.RemovalLog()
        self._thread = threading.Thread(target=self._pump, name=f"kvtier-session-{self.id}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for ev in self._call:
                which = ev.WhichOneof("event")
                if which == "heartbeat":
                    self.last_heartbeat_ms = ev.heartbeat.unix_ms
                elif which == "removed":
                    self._removals.note(ev.removed)
            self._ended = SessionClosed(f"the sidecar ended session {self.id}")
        except grpc.RpcError as e:
            if not self._closing:
                self._ended = from_rpc_error(e)

    def take_removals(self) -> Removals:
        """The blocks that left kvtier since the last call (a session opened with
        ``watch_removals=True``; otherwise always empty)."""
        return self._removals.take()

    # --- lifetime --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the session was closed here or its stream ended."""
        return self._closing or self._ended is not None

    def _check(self) -> None:
        if self._closing:
            raise SessionClosed(f"session {self.id} is closed")
        if self._ended is not None:
            raise SessionClosed(f"session {self.id} ended: {self._ended}")

    def close(self, timeout: float = 10.0) -> None:
        """Ends the session stream; the sidecar releases its pins and unregisters its pools.
        Idempotent. Closes the connection too when the session owns it (:func:`kvtier.connect`)."""
        if not self._closing:
            self._closing = True
            self._call.cancel()
            self._thread.join(timeout)
            if self._owns_client:
                self._client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        self._check()
        return self._client.unary(method, request, timeout)

    # --- pools -----------------------------------------------------------------------------

    def register_pool(
        self,
        pool: CpuPool | str | os.PathLike[str],
        model_id: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        geometry: Geometry | None = None,
        num_slots: int | None = None,
        layout: LayoutLike | None = None,
    ) -> PoolHandle:
        """Registers a CPU pool (a :class:`~kvtier.pool.CpuPool`, or a pool file's path with its
        claimed ``geometry`` — default: the session's — and ``num_slots``) for ``model_id`` on
        tensor-parallel rank ``tp_rank`` of ``tp_size``. A shared-memory file without kvtier's
        pool header (an engine's own KV) needs its ``layout``: per layer ``(k_buffer, k_offset,
        v_buffer, v_offset, slot_stride)`` in bytes from the file's start (buffer 0), plus
        ``token_stride, head_stride`` where K and V are interleaved (vLLM ≥ 0.34)."""
        reg = _wire.cpu_registration(self.id, self.geometry, pool, model_id, tp_rank, tp_size, geometry,
                                     num_slots, layout)
        h = reg.handle(self._unary("RegisterPool", reg.request))
        self._pools[h.pool_id] = h
        return h

    def register_cuda_pool(
        self,
        buffers: Sequence[CudaBufferLike],
        layout: LayoutLike,
        model_id: str,
        *,
        num_slots: int,
        device_ordinal: int = 0,
        device_uuid: bytes = b"",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> PoolHandle:
        """Registers KV in GPU memory by CUDA IPC handle (docs/api.md, "Pool layouts and GPU
        pools"). ``buffers``: ``(ipc_handle, offset_bytes, size_bytes)`` per buffer — for a torch
        tensor ``s = t.untyped_storage()._share_cuda_()`` gives ``(s[1], s[3], s[2])``.
        ``layout``: per layer ``(k_buffer, k_offset, v_buffer, v_offset, slot_stride[,
        token_stride, head_stride])`` in bytes (vLLM, a ``[2, num_blocks, ...]`` tensor per layer
        ``l``: ``(l, 0, l, num_blocks * h, h)`` with ``h`` half a block-layer;
        :func:`kvtier.integrations.in_place.layer_layout` reads it from torch views). A sidecar without usable CUDA raises
        :class:`~kvtier.errors.FailedPrecondition` saying why; a layout or buffer that does not
        fit raises :class:`~kvtier.errors.InvalidArgument` naming the field."""
        reg = _wire.cuda_registration(self.id, self.geometry, buffers, layout, model_id, num_slots,
                                      device_ordinal, device_uuid, tp_rank, tp_size)
        h = reg.handle(self._unary("RegisterPool", reg.request))
        self._pools[h.pool_id] = h
        return h

    def register_process_pool(
        self,
        buffers: Sequence[ProcessBufferLike],
        model_id: str,
        *,
        num_slots: int,
        layout: LayoutLike | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> PoolHandle:
        """Registers KV in this process's own memory: no shared file, nothing to copy in or out.
        The sidecar writes loads straight into ``buffers`` and reads stores straight out of them
        (Linux cross-memory attach: ``process_vm_writev`` / ``process_vm_readv``), reaching this
        process by the pid at the other end of its Unix socket (a session over TCP raises
        :class:`~kvtier.errors.FailedPrecondition`).

        ``buffers``: C-contiguous writable numpy arrays, or ``(address, size_bytes)`` pairs (a
        torch CPU tensor: ``(t.data_ptr(), t.untyped_storage().nbytes())``); the handle keeps the
        arrays alive while the pool is registered, and ``(address, size)`` memory must be kept
        by the caller. ``layout``: as for :meth:`register_pool` (default: kvtier's
        ``[layer][slot]`` block-layers from the start of buffer 0;
        :func:`kvtier.pool.block_major_layout` gives ``[slot][layer]``).

        The sidecar needs ptrace-level access to this process: the same user (or
        CAP_SYS_PTRACE). Where Yama's ptrace_scope is 1 this call first allows the sidecar, and
        only it, with ``prctl(PR_SET_PTRACER)``; without access the sidecar raises
        :class:`~kvtier.errors.FailedPrecondition` saying what would allow it."""
        reg = _wire.process_registration(self.id, self.geometry, buffers, layout, model_id, num_slots,
                                         tp_rank, tp_size)
        _wire.allow_sidecar(self.sidecar_pid)
        h = reg.handle(self._unary("RegisterPool", reg.request))
        self._pools[h.pool_id] = h
        return h

    def unregister_pool(self, pool: PoolRef) -> None:
        """Unregisters a pool (transfers in flight on it finish first)."""
        pid = _wire.pool_id(pool)
        self._unary("UnregisterPool", pb.UnregisterPoolRequest(session_id=self.id, pool_id=pid))
        self._pools.pop(pid, None)

    # --- match / load / store --------------------------------------------------------------

    def match(
        self,
        pool: PoolRef,
        keys: KeysLike | None = None,
        *,
        token_ids: Sequence[int] | np.ndarray | None = None,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> MatchResult:
        """Where each leading block of a sequence is, by its ``keys`` or its ``token_ids``
        (whole blocks only). Pins nothing. ``timeout``: seconds to wait for the answer
        (default: the client's), else :class:`~kvtier.errors.DeadlineExceeded`."""
        return _wire.match_result(self._unary(
            "Match", _wire.match_request(self.id, pool, keys, token_ids, cache_salt), timeout))

    def load(
        self,
        pool: PoolRef,
        keys: KeysLike,
        slots: SlotsLike,
        *,
        cache_salt: str = "",
        deadline_ms: int = 0,
        layer_event_stride: int = 1,
        done_only: bool = False,
        group_slots: Sequence[SlotsLike] = (),
        timeout: float | None = None,
    ) -> LoadStream:
        """Copies the blocks ``keys`` (one sequence, in order) into device ``slots``, streaming
        events: ``LayerReady`` after every ``layer_event_stride``-th layer and the last (none
        with ``done_only``), ``BlocksMissing`` for blocks in no tier, then ``LoadDone``.

        ``deadline_ms`` is the sidecar's deadline (DeadlineExceeded, pins released); ``timeout``
        grpcio's deadline for the whole stream. A pool whose layout puts its layers in several
        KV cache groups takes a slot per block per group: ``slots`` for group 0,
        ``group_slots`` for groups 1, 2, ... (:data:`~kvtier.NO_SLOT` where a group keeps no
        block: its layers of that block are not written).
        """
        self._check()
        req = _wire.load_request(self.id, pool, keys, slots, cache_salt, deadline_ms,
                                 layer_event_stride, done_only, group_slots)
        return LoadStream(self._client.stub.Load(req, timeout=timeout, metadata=self._client.metadata))

    def load_wait(
        self,
        pool: PoolRef,
        keys: KeysLike,
        slots: SlotsLike,
        *,
        cache_salt: str = "",
        deadline_ms: int = 0,
        group_slots: Sequence[SlotsLike] = (),
        timeout: float | None = None,
    ) -> LoadDone:
        """Loads and waits for the whole load (``done_only``: two messages at most, whatever
        the layer count); returns :class:`~kvtier.results.LoadDone` (``missing`` lists the
        blocks not loaded)."""
        return self.load(pool, keys, slots, cache_salt=cache_salt, deadline_ms=deadline_ms,
                         done_only=True, group_slots=group_slots, timeout=timeout).wait()

    def store(
        self,
        pool: PoolRef,
        keys: KeysLike,
        slots: SlotsLike,
        *,
        parent: int | None = None,
        cache_salt: str = "",
        durable: bool = False,
        group_slots: Sequence[SlotsLike] = (),
        timeout: float | None = None,
        not_after: float | None = None,
    ) -> StoreResult:
        """Copies a contiguous run of one sequence's blocks (``keys`` in order, each in its
        device slot) into host memory; ``parent`` is the key of the block before the first
        (None when the run starts the sequence). Returns when the slots may be reused (with
        ``durable``: once the blocks are also on disk and synced). ``timeout``: seconds to wait
        (default: the client's), else :class:`~kvtier.errors.DeadlineExceeded` (the store may
        still complete on the sidecar, unless ``not_after`` is given). ``group_slots``: as in
        :meth:`load`, without ``NO_SLOT`` (a stored block holds every layer). ``not_after``
        (:func:`time.time` seconds; the sidecar's host's clock): the sidecar publishes nothing
        of the store unless its copies end by then, so a caller that writes the slots again
        once it stops waiting gives that moment (:class:`~kvtier.errors.DeadlineExceeded` when
        they did not)."""
        return _wire.store_result(self._unary(
            "Store",
            _wire.store_request(self.id, pool, keys, slots, parent, cache_salt, durable, group_slots, not_after),
            timeout))

    def device_events(self, pool: PoolRef, events: Iterable[DeviceEvent]) -> DeviceEventsResult:
        """Reports a batch of changes to what the pool's device holds (what Match reports as
        ``Tier.DEVICE``)."""
        return _wire.device_events_result(self._unary(
            "DeviceEvents", _wire.device_events_request(self.id, pool, events)))

    # --- pins, clear, stats ----------------------------------------------------------------

    def pin(self, pool: PoolRef, keys: KeysLike, *, cache_salt: str = "", ttl_ms: int = 0) -> PinResult:
        """Soft-pins blocks in host memory until :meth:`unpin`, ``ttl_ms`` (0: none) or the end
        of the session."""
        return _wire.pin_result(self._unary("Pin", _wire.pin_request(self.id, pool, keys, cache_salt, ttl_ms)))

    def unpin(self, pin: PinResult | int) -> int:
        """Releases a pin; returns how many blocks it released."""
        pid = pin.pin_id if isinstance(pin, PinResult) else int(pin)
        return int(self._unary("Unpin", pb.UnpinRequest(session_id=self.id, pin_id=pid)).released_blocks)

    def clear(
        self,
        pool: PoolRef | None = None,
        *,
        cache_salt: str = "",
        all: bool = False,
        tier: Tier | None = None,
    ) -> ClearResult:
        """Forgets the blocks of ``pool``'s namespace under ``cache_salt`` (or, with ``all``, of
        every namespace) in host memory and on disk, or only ``Tier.HOST`` / ``Tier.DISK`` /
        ``Tier.REMOTE`` (the fleet's shared tier is cleared only when named)."""
        return _wire.clear_result(self._unary("Clear", _wire.clear_request(self.id, pool, cache_salt, all, tier)))

    def stats(self) -> Stats:
        """The sidecar's counters."""
        return _wire.stats(self._unary("Stats", pb.StatsRequest()))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Session(id={self.id}, {self._client.target}, {state})"


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls ``predicate()`` until it is true or ``timeout`` passes; returns the last value
    (for effects the sidecar applies after a stream ends, such as a closed session's pins)."""
    end = time.monotonic() + timeout
    while True:
        v = predicate()
        if v or time.monotonic() >= end:
            return bool(v)
        time.sleep(interval)
