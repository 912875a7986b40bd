"""The CPU device pool: a shared-memory file the engine creates and the sidecar maps.

Format v1 (docs/api.md, "The device pool file"), all little-endian: a 4096-byte header (magic
``KVTPOOL\\0``, u32 version 1, u32 header bytes 4096, layers, kv_heads, head_dim, dtype code,
block_tokens, slot count, zeros), then the KV as ``[layer][slot]`` block-layers, each laid out
``[K|V][token][head][dim]``; the file is exactly ``4096 + layers x slots x B`` bytes.

A *block-major* pool (``CpuPool.create(..., block_major=True)``) holds the KV as ``[slot][layer]``
block-layers instead, with no header: each block is one contiguous run, so copying whole blocks
into and out of it is one memcpy per run of slots. It is registered with its layout
(:attr:`CpuPool.layout`, sent by :meth:`kvtier.Session.register_pool`).

:class:`CpuPool` maps the file once; every array it hands out is a numpy *view* of that mapping
(writes go straight to the shared memory the sidecar copies from and into; nothing is copied).
"""

from __future__ import annotations

import mmap
import os
import struct
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np

from .geometry import Geometry, dtype_name

MAGIC = b"KVTPOOL\0"
VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8s8I")


def file_bytes(geometry: Geometry, num_slots: int) -> int:
    """Bytes of a pool file of ``num_slots`` slots of ``geometry``."""
    return HEADER_BYTES + geometry.layers * num_slots * geometry.block_layer_bytes


def encode_header(geometry: Geometry, num_slots: int) -> bytes:
    """The 4096-byte header of a pool of ``num_slots`` slots of ``geometry``."""
    g = geometry
    head = _HEADER.pack(
        MAGIC, VERSION, HEADER_BYTES, g.layers, g.kv_heads, g.head_dim, g.dtype_code,
        g.block_tokens, num_slots,
    )
    return head + bytes(HEADER_BYTES - len(head))


def decode_header(header: bytes) -> tuple[Geometry, int]:
    """The geometry and slot count of a pool header (ValueError naming what is wrong)."""
    if len(header) < _HEADER.size:
        raise ValueError(f"pool header of {len(header)} bytes: too short")
    magic, version, hbytes, layers, kv_heads, head_dim, dtype, block_tokens, slots = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"pool format version {version} (this client reads {VERSION})")
    if hbytes != HEADER_BYTES:
        raise ValueError(f"header bytes {hbytes} (expected {HEADER_BYTES})")
    return Geometry(layers, kv_heads, head_dim, dtype_name(dtype), block_tokens), slots


def block_major_layout(geometry: Geometry) -> list[tuple[int, int, int, int, int]]:
    """The layout of blocks kept ``[slot][layer]`` in buffer 0 (each block one run, each
    block-layer ``[K|V][token][head][dim]``): per layer ``(k_buffer, k_offset, v_buffer,
    v_offset, slot_stride)`` in bytes. A block-major :class:`CpuPool` is laid out so; so is a
    ``(slots, block bytes)`` array registered with :meth:`kvtier.Session.register_process_pool`."""
    B, L = geometry.block_layer_bytes, geometry.layers
    return [(0, layer * B, 0, layer * B + B // 2, L * B) for layer in range(L)]


def default_path() -> Path:
    """A fresh file name under /dev/shm (or the temp dir where there is no /dev/shm)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"kvtier-pool-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class CpuPool:
    """A mapped pool file: ``num_slots`` slots of ``geometry``.

    ``kv`` is the whole KV as one array of shape ``(layers, slots, 2, block_tokens, kv_heads,
    head_dim)`` (index 0 of the third axis is K, 1 is V); :meth:`layer` and :meth:`block` are
    views into it. Element types are numpy's f4/f2 for f32/f16 and the raw bits (u2, u1) for
    bf16 and fp8. Close the pool (or use it as a context manager) when done; a pool made by
    :meth:`create` removes its file then unless ``keep_file`` was given.
    """

    def __init__(self, path: Path, geometry: Geometry, num_slots: int, mm: mmap.mmap, owner: bool,
                 block_major: bool = False) -> None:
        self.path = path
        self.geometry = geometry
        self.num_slots = num_slots
        self.block_major = block_major
        self._mmap: mmap.mmap | None = mm
        self._owner = owner
        g = geometry
        B = g.block_layer_bytes
        data = np.frombuffer(mm, dtype=np.uint8, offset=0 if block_major else HEADER_BYTES,
                             count=g.layers * num_slots * B)
        shape = (g.block_tokens, g.kv_heads, g.head_dim)
        if block_major:
            self.blocks: np.ndarray = data.reshape(num_slots, g.layers * B)
            """Block-major pools: the KV bytes as ``(slots, block bytes)``, each row one block
            (``[layer][K|V][token][head][dim]``), contiguous (a view)."""
            self.raw: np.ndarray = data.reshape(num_slots, g.layers, B).transpose(1, 0, 2)
            self.kv: np.ndarray = data.view(g.numpy_dtype).reshape(num_slots, g.layers, 2, *shape).transpose(
                1, 0, 2, 3, 4, 5)
            #: The layout the sidecar is given: per layer (k_buffer, k_offset, v_buffer,
            #: v_offset, slot_stride) in bytes; None for the header format.
            self.layout: list[tuple[int, ...]] | None = block_major_layout(g)
        else:
            self.raw = data.reshape(g.layers, num_slots, B)
            """The KV bytes as ``(layers, slots, block-layer bytes)`` uint8 (a view)."""
            self.kv = data.view(g.numpy_dtype).reshape(g.layers, num_slots, 2, *shape)
            """The KV as ``(layers, slots, K|V, token, head, dim)`` elements (a view)."""
            self.layout = None

    @classmethod
    def create(
        cls,
        geometry: Geometry,
        num_slots: int,
        path: str | os.PathLike[str] | None = None,
        *,
        keep_file: bool = False,
        prefault: bool = True,
        block_major: bool = False,
    ) -> CpuPool:
        """Creates the pool file (it must not exist; default: a fresh name under /dev/shm),
        sizes it, writes its header and maps it. ``block_major``: each block one contiguous
        run, no header (see the module's documentation).

        ``prefault`` allocates every page now (posix_fallocate), so that a full /dev/shm is an
        error here rather than a SIGBUS later. The file is removed on :meth:`close` unless
        ``keep_file``.
        """
        if not isinstance(num_slots, int) or not 0 < num_slots < 2**32:
            raise ValueError(f"num_slots = {num_slots!r}: expected 1..2^32-1")
        p = Path(path) if path is not None else default_path()
        size = file_bytes(geometry, num_slots) - (HEADER_BYTES if block_major else 0)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            if prefault:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: a file system without it
                        raise
            if not block_major:
                os.pwrite(fd, encode_header(geometry, num_slots), 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(p)
            raise
        os.close(fd)
        return cls(p, geometry, num_slots, mm, owner=not keep_file, block_major=block_major)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> CpuPool:
        """Maps an existing pool file (geometry and slot count from its header; block-major
        pools have none and are not opened this way); the file is left in place on close."""
        p = Path(path)
        fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
        try:
            geometry, slots = decode_header(os.pread(fd, HEADER_BYTES, 0))
            size = file_bytes(geometry, slots)
            have = os.fstat(fd).st_size
            if have != size:
                raise ValueError(f"{p}: {have} bytes, but its header says {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(p, geometry, slots, mm, owner=False)

    def layer(self, layer: int) -> np.ndarray:
        """Layer ``layer`` of every slot: ``(slots, 2, block_tokens, kv_heads, head_dim)``, a view."""
        return self.kv[layer]

    def block(self, slot: int, layer: int | None = None) -> np.ndarray:
        """Slot ``slot``: one layer ``(2, block_tokens, kv_heads, head_dim)``, or with
        ``layer`` None every layer ``(layers, 2, ...)`` (a strided view, still no copy)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range for {self.num_slots} slots")
        return self.kv[:, slot] if layer is None else self.kv[layer, slot]

    def offset(self, slot: int, layer: int) -> int:
        """Byte offset in the file of block-layer (``slot``, ``layer``)."""
        g = self.geometry
        if self.block_major:
            return (slot * g.layers + layer) * g.block_layer_bytes
        return HEADER_BYTES + (layer * self.num_slots + slot) * g.block_layer_bytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._mmap is None

    def close(self) -> None:
        """Unmaps the pool (and removes its file if this object created it).

        Views handed out before keep the mapping alive until they are dropped; the file is
        removed at once either way (the sidecar must have unregistered it, or it fails its
        next request on the pool with FAILED_PRECONDITION).
        """
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        del self.kv, self.raw
        if self.block_major:
            del self.blocks
        try:
            mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the last view does
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> CpuPool:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        major = ", block_major=True" if self.block_major else ""
        return f"CpuPool({str(self.path)!r}, {self.geometry}, num_slots={self.num_slots}{major})"
