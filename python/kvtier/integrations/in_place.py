"""An engine's KV registered with the sidecar where it lies, so loads land in the engine's
blocks and stores read them with no staging copy.

Each layer's K and V come as ``[blocks, token, head, dim]`` views of the engine's tensors; the
pool's layout (docs/api.md, "Pool layouts and GPU pools") is read from their strides: each
head's ``dim`` elements contiguous, K and V with the same strides, any order of blocks, tokens
and heads otherwise (vLLM's ``[2, blocks, token, head, dim]``, vLLM ≥ 0.34's ``[B, H, N, K‖V]``
views of its ``LBNHC``, ``LBHNC``, ``LHBNC`` ... layouts, with K and V interleaved per token and
head). Where the memory is:

- on a GPU: registered by CUDA IPC handle (one buffer per allocation the tensors live in); the
  sidecar opens it on the same device;
- on the CPU in a shared file mapping (``/proc/self/maps`` says which file, at which offset):
  registered by that file's path, which the sidecar maps too;
- in private CPU memory (an ordinary torch tensor): registered by address as a process pool
  (one buffer per allocation), which the sidecar reads and writes with cross-memory attach
  (docs/api.md, "Process pools"); where it cannot (a session over TCP, a sidecar that may not
  reach this process), :class:`NotInPlace` says why;
- strides kvtier cannot copy: :class:`NotInPlace` says why.

Where it raises :class:`NotInPlace`, the connectors copy through a staging pool instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import FailedPrecondition
from ..results import PoolHandle
from ..session import Session


class NotInPlace(Exception):
    """The engine's KV cannot be registered where it lies (the message says why)."""


class PrivateMemory(NotInPlace):
    """The engine's CPU KV is not in a shared file mapping (the message says where it is)."""


def _strides(x: torch.Tensor, what: str) -> tuple[int, int, int]:
    """``x``'s (block, token, head) strides in bytes (``[blocks, token, head, dim]``, each head's
    ``dim`` elements contiguous)."""
    if x.dim() != 4:
        raise NotInPlace(f"{what} is not a [blocks, token, head, dim] view (shape {tuple(x.shape)})")
    s = x.stride()
    if s[3] != 1 and x.shape[3] > 1:
        raise NotInPlace(f"{what} has strides {tuple(s)} (elements) over [blocks, token, head, dim] = "
                         f"{tuple(x.shape)}: a head's dim elements are not contiguous")
    if min(s[:3]) < 0:
        raise NotInPlace(f"{what} has a negative stride {tuple(s)}")
    e = x.element_size()
    return s[0] * e, s[1] * e, s[2] * e


def layer_layout(planes: Sequence[tuple[torch.Tensor, torch.Tensor]], place: _Place,
                 groups: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Per layer ``(k_buffer, k_offset, v_buffer, v_offset, slot_stride, token_stride,
    head_stride, group)`` in bytes, for K and V views ``[blocks, token, head, dim]``; ``place``
    names the buffer and offset of an address, ``groups`` each layer's KV cache group (all 0 if
    None). Whether the strides keep slots, tokens, heads, K and V apart (within a group) is the
    sidecar's check (``InvalidArgument`` naming the field)."""
    if groups is not None and len(groups) != len(planes):
        raise NotInPlace(f"{len(groups)} KV cache groups given for {len(planes)} layers")
    out = []
    for i, (k, v) in enumerate(planes):
        ks = _strides(k, f"layer {i}'s K")
        vs = _strides(v, f"layer {i}'s V")
        if ks != vs:
            raise NotInPlace(f"layer {i}: K's (block, token, head) strides {ks} != V's {vs} (bytes)")
        if ks[0] <= 0:
            raise NotInPlace(f"layer {i}: block stride {ks[0]}")
        kb, ko = place.locate(k)
        vb, vo = place.locate(v)
        out.append((kb, ko, vb, vo, *ks, groups[i] if groups is not None else 0))
    return out


class _Place:
    """Names the buffer (an index) and offset of a tensor's first byte."""

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        raise NotImplementedError


class _StoragePlace(_Place):
    """One buffer per allocation (torch storage) the tensors live in."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[int, torch.UntypedStorage]] = {}

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        st = t.untyped_storage()
        base = st.data_ptr()
        if base not in self.storages:
            self.storages[base] = (len(self.storages), st)
        return self.storages[base][0], t.data_ptr() - base

    def in_order(self) -> list[torch.UntypedStorage]:
        return [st for _, st in sorted(self.storages.values(), key=lambda e: e[0])]


class _CudaPlace(_StoragePlace):
    """One buffer per CUDA allocation, by IPC handle."""

    def buffers(self) -> list[tuple[bytes, int, int]]:
        """``(ipc_handle, offset_bytes, size_bytes)`` per buffer, in index order."""
        out = []
        for st in self.in_order():
            # (device, handle, storage size, storage offset in its allocation, ...)
            share = st._share_cuda_()
            out.append((bytes(share[1]), int(share[3]), int(share[2])))
        return out


class _ProcessPlace(_StoragePlace):
    """One buffer per CPU allocation, by address in this process."""

    def buffers(self) -> list[tuple[int, int]]:
        """``(address, size_bytes)`` per buffer, in index order."""
        return [(st.data_ptr(), st.nbytes()) for st in self.in_order()]


def shared_mapping(addr: int, nbytes: int, maps: str = "/proc/self/maps") -> tuple[str, int]:
    """The file a shared mapping holds ``[addr, addr + nbytes)`` from, and the file offset of
    ``addr``; :class:`NotInPlace` where that memory is private, anonymous or split."""
    with open(maps) as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= addr < hi:
                continue
            path = parts[5].strip() if len(parts) == 6 else ""
            if not path.startswith("/") or path.endswith("(deleted)"):
                raise PrivateMemory(f"the KV at {addr:#x} is not in a file mapping ({path or 'anonymous memory'})")
            if parts[1][3] != "s":
                raise PrivateMemory(f"the KV at {addr:#x} is a private mapping of {path}: the sidecar would not see it")
            if addr + nbytes > hi:
                raise NotInPlace(f"the KV at {addr:#x} runs past its mapping of {path}")
            return path, int(parts[2], 16) + addr - lo
    raise NotInPlace(f"the KV at {addr:#x} is in no mapping")


class _FilePlace(_Place):
    """One buffer: the shared file every tensor lies in."""

    def __init__(self) -> None:
        self.path: str | None = None

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        st = t.untyped_storage()
        path, base = shared_mapping(st.data_ptr(), st.nbytes())
        if self.path is None:
            self.path = path
        elif path != self.path:
            raise NotInPlace(f"the KV lies in two files ({self.path}, {path}); a CPU pool is one file")
        return 0, base + t.data_ptr() - st.data_ptr()


def _device_uuid(device: torch.device) -> bytes:
    text = str(torch.cuda.get_device_properties(device).uuid).replace("GPU-", "").replace("-", "")
    return bytes.fromhex(text) if len(text) == 32 else b""


def register_in_place(session: Session, planes: Sequence[tuple[torch.Tensor, torch.Tensor]], model_id: str, *,
                      tp_rank: int = 0, tp_size: int = 1, groups: Sequence[int] | None = None) -> PoolHandle:
    """Registers the engine's KV where it lies: per layer its K and V as ``[blocks, token,
    head, dim]`` views (every layer the same number of blocks, which are the pool's slots),
    and with ``groups`` each layer's KV cache group (an engine with a block table per group,
    whose layers of different groups may lie over the same memory; loads and stores then
    name a slot per group). Raises :class:`NotInPlace` where that cannot be done, and the
    sidecar's error (e.g. :class:`~kvtier.errors.FailedPrecondition` from a sidecar without
    CUDA) where it refuses. CPU KV in a shared file registers by the file's path; CPU KV in
    private memory as a process pool (:meth:`~kvtier.Session.register_process_pool`), and
    :class:`NotInPlace` says why where the sidecar cannot reach it."""
    if not planes:
        raise NotInPlace("no layers")
    device = planes[0][0].device
    blocks = planes[0][0].shape[0]
    for i, (k, v) in enumerate(planes):
        for x in (k, v):
            if x.device != device or x.shape[0] != blocks:
                raise NotInPlace(f"layer {i}: {x.shape[0]} blocks on {x.device}, layer 0 {blocks} on {device}")
    if device.type == "cuda":
        cuda = _CudaPlace()
        layout = layer_layout(planes, cuda, groups)
        return session.register_cuda_pool(
            cuda.buffers(), layout, model_id, num_slots=blocks, device_ordinal=device.index or 0,
            device_uuid=_device_uuid(device), tp_rank=tp_rank, tp_size=tp_size)
    if device.type == "cpu":
        file = _FilePlace()
        try:
            layout = layer_layout(planes, file, groups)
        except PrivateMemory as private:
            memory = _ProcessPlace()
            layout = layer_layout(planes, memory, groups)
            try:
                return session.register_process_pool(memory.buffers(), model_id, num_slots=blocks, layout=layout,
                                                     tp_rank=tp_rank, tp_size=tp_size)
            except FailedPrecondition as e:
                raise NotInPlace(f"{private}, and the sidecar cannot reach it as a process pool: {e.message}") from e
        assert file.path is not None
        return session.register_pool(file.path, model_id, num_slots=blocks, layout=layout, tp_rank=tp_rank,
                                     tp_size=tp_size)
    raise NotInPlace(f"the KV is on {device}")
