"""Request building and reply conversion, shared by the sync and the asyncio sessions."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Union, cast

import numpy as np

from ._proto import kvtier_pb2 as pb
from .geometry import Geometry
from .keys import KEY_BYTES, BlockKeys, KeysLike, Namespace, as_keys
from .pool import CpuPool
from .results import (
    BlocksMissing, ClearResult, DeviceEvent, DeviceEventsResult, LayerReady, LoadDone,
    LoadEvent, MatchResult, PinResult, PoolHandle, Removals, Stats, StoreResult, Tier, Timing,
)

#: A pool as requests name it: its handle, or its id.
PoolRef = Union[PoolHandle, int]
#: Slots: a sequence of ints or an integer numpy array.
SlotsLike = Union[Sequence[int], np.ndarray]
#: A pool's layout: per layer ``(k_buffer, k_offset, v_buffer, v_offset, slot_stride)``, or
#: with ``token_stride, head_stride`` after them for K and V that are not one
#: ``[token][head][dim]`` run per slot (0: packed), in bytes, and then the layer's KV cache
#: ``group`` for an engine with several block tables (docs/api.md, "Pool layouts and GPU
#: pools").
LayoutLike = Sequence[tuple[int, ...]]
#: In a load's ``group_slots``: the group keeps no block there (its layers are not written).
NO_SLOT = 0xFFFFFFFF
#: A GPU buffer: ``(ipc_handle, offset_bytes, size_bytes)``.
CudaBufferLike = tuple[bytes, int, int]
#: Memory of this process's own: a C-contiguous, writable numpy array (or anything with the
#: buffer protocol), or ``(address, size_bytes)`` (a torch CPU tensor's ``data_ptr()`` and
#: ``untyped_storage().nbytes()``).
ProcessBufferLike = Union[np.ndarray, memoryview, tuple[int, int]]


def pool_layout(layout: LayoutLike | None) -> pb.PoolLayout | None:
    """The proto of ``layout``; None for none (an empty layout is left out too)."""
    if not layout:
        return None
    layers = []
    for i, entry in enumerate(layout):
        if len(entry) not in (5, 7, 8):
            raise ValueError(f"layout[{i}] has {len(entry)} fields; expected (k_buffer, k_offset, v_buffer, "
                             "v_offset, slot_stride[, token_stride, head_stride[, group]])")
        kb, ko, vb, vo, st, ts, hs, group = (*entry, 0, 0, 0)[:8]  # the left-out fields 0
        layers.append(pb.LayerLayout(k_buffer=kb, k_offset=ko, v_buffer=vb, v_offset=vo, slot_stride=st,
                                     token_stride=ts, head_stride=hs, group=group))
    return pb.PoolLayout(layers=layers)


class PoolRegistration:
    """A RegisterPool request and what its handle is made of once the sidecar answers."""

    def __init__(self, request: pb.RegisterPoolRequest, namespace: Namespace, num_slots: int,
                 mapped: CpuPool | None, memory: tuple[Any, ...] = ()) -> None:
        self.request, self.namespace, self.num_slots, self.mapped = request, namespace, num_slots, mapped
        self.memory = memory

    def handle(self, r: pb.RegisterPoolResponse) -> PoolHandle:
        return PoolHandle(r.pool_id, self.request.session_id, self.namespace, self.num_slots,
                          int.from_bytes(r.namespace_fingerprint, "little"), self.mapped, self.memory)


def cpu_registration(session_id: int, session_geometry: Geometry, pool: CpuPool | str | os.PathLike[str],
                     model_id: str, tp_rank: int, tp_size: int, geometry: Geometry | None,
                     num_slots: int | None, layout: LayoutLike | None) -> PoolRegistration:
    """RegisterPool of a CPU pool: a :class:`CpuPool` (with its layout when it is block-major),
    or a file's path with its geometry (default: the session's), ``num_slots`` and, for memory
    without kvtier's pool header (an engine's own shared KV), its ``layout``."""
    if isinstance(pool, CpuPool):
        path, g, slots, mapped = str(pool.path), pool.geometry, pool.num_slots, pool
        if layout is None:
            layout = pool.layout
    else:
        if num_slots is None:
            raise ValueError("register_pool by path needs num_slots")
        path, g, slots, mapped = os.fspath(pool), geometry or session_geometry, num_slots, None
    req = pb.RegisterPoolRequest(session_id=session_id, model_id=model_id, geometry=g.to_proto(),
                                 num_slots=slots, tp_rank=tp_rank, tp_size=tp_size, shm_path=path,
                                 layout=pool_layout(layout))
    return PoolRegistration(req, Namespace(model_id, g, tp_rank, tp_size), slots, mapped)


def cuda_registration(session_id: int, geometry: Geometry, buffers: Sequence[CudaBufferLike],
                      layout: LayoutLike, model_id: str, num_slots: int, device_ordinal: int,
                      device_uuid: bytes, tp_rank: int, tp_size: int) -> PoolRegistration:
    """RegisterPool of GPU memory by CUDA IPC handles (an empty layout is left out: the
    sidecar then says a CUDA pool needs one)."""
    req = pb.RegisterPoolRequest(
        session_id=session_id, model_id=model_id, geometry=geometry.to_proto(), num_slots=num_slots,
        tp_rank=tp_rank, tp_size=tp_size,
        cuda=pb.CudaPool(
            device_ordinal=device_ordinal, device_uuid=device_uuid,
            buffers=[pb.CudaBuffer(ipc_handle=h, offset_bytes=o, size_bytes=n) for h, o, n in buffers],
        ),
        layout=pool_layout(layout),
    )
    return PoolRegistration(req, Namespace(model_id, geometry, tp_rank, tp_size), num_slots, None)


def process_buffer(i: int, buf: ProcessBufferLike) -> tuple[int, int]:
    """``(address, size_bytes)`` of a process-pool buffer (ValueError naming it if the sidecar
    could not write into it as one run)."""
    if isinstance(buf, tuple):
        if len(buf) != 2 or not all(isinstance(x, int) and x > 0 for x in buf):
            raise ValueError(f"buffers[{i}] = {buf!r}: expected (address, size_bytes), both positive")
        return buf
    a = np.asarray(buf)
    if not a.flags.c_contiguous:
        raise ValueError(f"buffers[{i}]: not C-contiguous (a process pool's buffer is one run of memory)")
    if not a.flags.writeable:
        raise ValueError(f"buffers[{i}]: read-only (loads write into a pool's buffers)")
    if a.nbytes == 0:
        raise ValueError(f"buffers[{i}]: empty")
    return a.ctypes.data, a.nbytes


def process_registration(session_id: int, geometry: Geometry, buffers: Sequence[ProcessBufferLike],
                         layout: LayoutLike | None, model_id: str, num_slots: int, tp_rank: int,
                         tp_size: int) -> PoolRegistration:
    """RegisterPool of memory of this process's own (the sidecar reaches it by this process's
    pid, which it reads off the Unix socket)."""
    spans = [process_buffer(i, b) for i, b in enumerate(buffers)]
    req = pb.RegisterPoolRequest(
        session_id=session_id, model_id=model_id, geometry=geometry.to_proto(), num_slots=num_slots,
        tp_rank=tp_rank, tp_size=tp_size,
        process=pb.ProcessMemory(buffers=[pb.ProcessBuffer(address=a, size_bytes=n) for a, n in spans]),
        layout=pool_layout(layout),
    )
    # The handle keeps the buffers alive while the pool is registered.
    return PoolRegistration(req, Namespace(model_id, geometry, tp_rank, tp_size), num_slots, None,
                            tuple(buffers))


#: The sidecar this process let in with PR_SET_PTRACER (0: none yet).
_ptracer = 0


def allow_sidecar(sidecar_pid: int) -> None:
    """Where Yama's ptrace_scope is 1, lets the sidecar (and only it) reach this process's memory
    (prctl(PR_SET_PTRACER)), once per sidecar; elsewhere nothing is changed (scope 0 needs no
    leave; 2 and 3 allow no leave: the registration then says so). A process has one such
    tracer: process pools on two sidecars at once need scope 0 or CAP_SYS_PTRACE. Raises
    OSError when the kernel refuses."""
    global _ptracer
    if sidecar_pid <= 0 or sidecar_pid == _ptracer:  # 0: a sidecar that does not say its pid
        return
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return
    import ctypes
    PR_SET_PTRACER = 0x59616D61
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(sidecar_pid), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_PTRACER, {sidecar_pid}): {os.strerror(e)}")
    _ptracer = sidecar_pid


def pool_id(pool: PoolRef) -> int:
    return pool.pool_id if isinstance(pool, PoolHandle) else int(pool)


def slot_list(slots: SlotsLike) -> list[int]:
    if isinstance(slots, np.ndarray):
        return slots.astype(np.int64, copy=False).tolist()  # type: ignore[no-any-return]
    return list(slots)


def timing(t: pb.TransferTiming) -> Timing:
    return Timing(t.queue_us, t.latency_us, t.span_us, t.active_us)


def match_request(session_id: int, pool: PoolRef, keys: KeysLike | None,
                  token_ids: Sequence[int] | np.ndarray | None, cache_salt: str) -> pb.MatchRequest:
    req = pb.MatchRequest(session_id=session_id, pool_id=pool_id(pool), cache_salt=cache_salt)
    # Both given is passed on: the sidecar answers INVALID_ARGUMENT naming it.
    if keys is not None:
        req.keys = as_keys(keys).packed
    if token_ids is not None:
        req.token_ids.extend(slot_list(token_ids))
    return req


def match_result(r: pb.MatchResponse) -> MatchResult:
    return MatchResult(
        tiers=[Tier(t) for t in r.tiers], device_slots=list(r.device_slots), keys=BlockKeys(r.keys),
        matched_tokens=r.matched_tokens, device_tokens=r.device_tokens, host_tokens=r.host_tokens,
        disk_tokens=r.disk_tokens, remote_tokens=r.remote_tokens,
    )


def group_slot_lists(group_slots: Sequence[SlotsLike]) -> list[pb.GroupSlots]:
    return [pb.GroupSlots(slots=slot_list(g)) for g in group_slots]


def load_request(session_id: int, pool: PoolRef, keys: KeysLike, slots: SlotsLike, cache_salt: str,
                 deadline_ms: int, layer_event_stride: int, done_only: bool,
                 group_slots: Sequence[SlotsLike] = ()) -> pb.LoadRequest:
    return pb.LoadRequest(
        session_id=session_id, pool_id=pool_id(pool), cache_salt=cache_salt, keys=as_keys(keys).packed,
        slots=slot_list(slots), deadline_ms=deadline_ms, layer_event_stride=layer_event_stride,
        done_only=done_only, group_slots=group_slot_lists(group_slots),
    )


def load_event(e: pb.LoadEvent) -> LoadEvent:
    which = e.WhichOneof("event")
    if which == "layer_ready":
        return LayerReady(e.layer_ready.layer)
    if which == "missing":
        return BlocksMissing(BlockKeys(e.missing.keys))
    if which == "done":
        d = e.done
        return LoadDone(d.loaded_blocks, d.disk_blocks, BlockKeys(d.missing), d.bytes, timing(d.timing),
                        d.remote_blocks)
    raise ValueError(f"a load event with no event set ({which!r})")


def store_request(session_id: int, pool: PoolRef, keys: KeysLike, slots: SlotsLike, parent: int | None,
                  cache_salt: str, durable: bool, group_slots: Sequence[SlotsLike] = (),
                  not_after: float | None = None) -> pb.StoreRequest:
    if not_after is not None and not (math.isfinite(not_after) and not_after > 0):
        raise ValueError(f"not_after = {not_after}: give a time.time() in seconds, or None")
    return pb.StoreRequest(
        session_id=session_id, pool_id=pool_id(pool), cache_salt=cache_salt, keys=as_keys(keys).packed,
        slots=slot_list(slots), parent=b"" if parent is None else parent.to_bytes(KEY_BYTES, "little"),
        durable=durable, group_slots=group_slot_lists(group_slots),
        # Rounded down, and a millisecond early (the float product may round up): the
        # sidecar's cut-off is never later than the caller's.
        not_after_unix_ms=0 if not_after is None else max(1, math.floor(not_after * 1000) - 1),
    )


def store_result(r: pb.StoreResponse) -> StoreResult:
    return StoreResult(
        r.stored_blocks, r.already_stored, BlockKeys(r.no_space), r.bytes, timing(r.timing),
        r.durable_blocks, BlockKeys(r.not_durable),
    )


def device_events_request(session_id: int, pool: PoolRef, events: Iterable[DeviceEvent]) -> pb.DeviceEventsRequest:
    return pb.DeviceEventsRequest(
        session_id=session_id, pool_id=pool_id(pool),
        events=[
            pb.DeviceEvent(kind=cast(Any, int(e.kind)),
                           key=b"" if e.kind == 3 else e.key.to_bytes(KEY_BYTES, "little"),
                           slot=e.slot)
            for e in events
        ],
    )


def device_events_result(r: pb.DeviceEventsResponse) -> DeviceEventsResult:
    return DeviceEventsResult(r.applied, r.device_blocks)


def pin_request(session_id: int, pool: PoolRef, keys: KeysLike, cache_salt: str, ttl_ms: int) -> pb.PinRequest:
    return pb.PinRequest(session_id=session_id, pool_id=pool_id(pool), cache_salt=cache_salt,
                         keys=as_keys(keys).packed, ttl_ms=ttl_ms)


def pin_result(r: pb.PinResponse) -> PinResult:
    return PinResult(r.pin_id, r.pinned_blocks, BlockKeys(r.missing))


def clear_request(session_id: int, pool: PoolRef | None, cache_salt: str, all: bool,
                  tier: Tier | int | None) -> pb.ClearRequest:
    return pb.ClearRequest(session_id=session_id, pool_id=0 if pool is None else pool_id(pool),
                           cache_salt=cache_salt, all=all, tier=cast(Any, int(tier or 0)))


def clear_result(r: pb.ClearResponse) -> ClearResult:
    return ClearResult(r.host_blocks, r.disk_blocks, r.kept_pinned, r.remote_blocks)


def stats(r: pb.StatsResponse) -> Stats:
    return Stats(r.sessions, r.pools, r.pinned_blocks, r.host_used_bytes, r.host_capacity_bytes,
                 r.disk_used_bytes, r.disk_capacity_bytes, r.json)


class RemovalLog:
    """The ``BlocksRemoved`` events a watching session heard, until taken (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: list[bytes] = []
        self._cleared = self._lost = False
        self._unnamed_at = 0.0

    def note(self, ev: pb.BlocksRemoved) -> None:
        with self._lock:
            self._keys.append(ev.keys)
            self._cleared |= ev.cleared
            self._lost |= ev.lost
            if ev.cleared or ev.lost:
                self._unnamed_at = time.monotonic()

    def take(self) -> Removals:
        with self._lock:
            packed, self._keys = b"".join(self._keys), []
            cleared, lost, self._cleared, self._lost = self._cleared, self._lost, False, False
            at = self._unnamed_at if cleared or lost else 0.0
        return Removals(BlockKeys(packed), cleared, lost, at)
