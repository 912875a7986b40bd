"""Block keys (docs/block-keys.md): the 128-bit key of a block and its whole prefix.

::

    fingerprint = xxh3_128(canonical namespace bytes)
    key[i]      = xxh3_128(fingerprint 16B LE || key[i-1] 16B LE (zeros for i = 0)
                           || tokens of block i as u32 LE)

Keys travel packed: N keys are one ``bytes`` of 16 x N little-endian bytes. :class:`BlockKeys`
keeps them that way (no per-key objects) and converts to ints or hex on demand.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Union, overload

import numpy as np
import xxhash

from .geometry import Geometry

KEY_BYTES = 16
_MAGIC = b"kvtier-ns-v1"


class BlockKeys(Sequence[int]):
    """An immutable run of block keys, stored packed (16 little-endian bytes each).

    Indexing gives a key as an ``int`` (the u128 value); slicing gives ``BlockKeys``;
    :attr:`packed` is the wire form.
    """

    __slots__ = ("_b",)

    def __init__(self, packed: bytes | bytearray | memoryview = b"") -> None:
        b = bytes(packed)
        if len(b) % KEY_BYTES:
            raise ValueError(f"packed keys of {len(b)} bytes: not a multiple of {KEY_BYTES}")
        self._b = b

    @classmethod
    def from_ints(cls, keys: Iterable[int]) -> BlockKeys:
        """Keys from their u128 values."""
        return cls(b"".join(int(k).to_bytes(KEY_BYTES, "little") for k in keys))

    @classmethod
    def from_hex(cls, keys: Iterable[str]) -> BlockKeys:
        """Keys from 32-digit hex strings (as printed by ``kvtier keys`` and the vectors)."""
        return cls.from_ints(int(h, 16) for h in keys)

    @property
    def packed(self) -> bytes:
        """The wire form: len(self) x 16 little-endian bytes."""
        return self._b

    def __len__(self) -> int:
        return len(self._b) // KEY_BYTES

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> BlockKeys: ...

    def __getitem__(self, i: int | slice) -> int | BlockKeys:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step == 1:
                return BlockKeys(self._b[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
            return BlockKeys.from_ints(self[j] for j in range(start, stop, step))
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"key index {i} out of range for {n} keys")
        return int.from_bytes(self._b[i * KEY_BYTES : (i + 1) * KEY_BYTES], "little")

    def __iter__(self) -> Iterator[int]:
        b = self._b
        for off in range(0, len(b), KEY_BYTES):
            yield int.from_bytes(b[off : off + KEY_BYTES], "little")

    def __add__(self, other: BlockKeys) -> BlockKeys:
        return BlockKeys(self._b + as_keys(other).packed)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockKeys):
            return self._b == other._b
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._b)

    def hex(self) -> list[str]:
        """Each key as 32 lowercase hex digits of its value."""
        return ["%032x" % k for k in self]

    def __repr__(self) -> str:
        h = self.hex()
        shown = ", ".join(h[:3]) + (", ..." if len(h) > 3 else "")
        return f"BlockKeys({len(self)}: [{shown}])"


#: What the API accepts as keys: BlockKeys, packed bytes, or a sequence of u128 ints.
KeysLike = Union[BlockKeys, bytes, bytearray, memoryview, Sequence[int]]


def as_keys(keys: KeysLike) -> BlockKeys:
    """``keys`` as :class:`BlockKeys` (packed bytes are taken as they are)."""
    if isinstance(keys, BlockKeys):
        return keys
    if isinstance(keys, (bytes, bytearray, memoryview)):
        return BlockKeys(keys)
    return BlockKeys.from_ints(keys)


def _put_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True)
class Namespace:
    """What keys are hashed in: model, geometry, tensor-parallel rank/size and cache salt.

    Blocks of different namespaces never match each other.
    """

    model_id: str
    geometry: Geometry
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""

    def canonical_bytes(self) -> bytes:
        """The canonical namespace encoding (docs/block-keys.md, "Canonical namespace bytes")."""
        g = self.geometry
        return (
            _MAGIC
            + _put_str(self.model_id)
            + struct.pack("<III", g.layers, g.kv_heads, g.head_dim)
            + _put_str(g.dtype)
            + struct.pack("<III", g.block_tokens, self.tp_rank, self.tp_size)
            + _put_str(self.cache_salt)
        )

    def fingerprint(self) -> int:
        """xxh3_128 of the canonical bytes, as the u128 value."""
        return xxhash.xxh3_128_intdigest(self.canonical_bytes())

    def with_salt(self, cache_salt: str) -> Namespace:
        """The same namespace under another cache salt."""
        return Namespace(self.model_id, self.geometry, self.tp_rank, self.tp_size, cache_salt)

    def keys(self, tokens: Sequence[int] | np.ndarray, parent: int | None = None) -> BlockKeys:
        """The keys of the whole blocks of ``tokens`` (a partial last block is not keyed)."""
        return block_keys(self.fingerprint(), tokens, self.geometry.block_tokens, parent)


def block_keys(
    fingerprint: int,
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    parent: int | None = None,
) -> BlockKeys:
    """The keys of the whole blocks of ``tokens`` under ``fingerprint``.

    ``parent`` is the key of the block before ``tokens[0]`` when the tokens continue a
    sequence (None or 0 when they start it). Token ids must fit in u32 (ValueError otherwise).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens = {block_tokens}: expected at least 1")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, not of shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise ValueError("token ids must be integers in 0..2^32-1")
    n = arr.size // block_tokens
    data = arr[: n * block_tokens].astype("<u4", copy=False).tobytes()
    fp = fingerprint.to_bytes(KEY_BYTES, "little")
    prev = (parent or 0).to_bytes(KEY_BYTES, "little")
    stride = 4 * block_tokens
    out = bytearray()
    h = xxhash.xxh3_128
    for i in range(n):
        prev = h(fp + prev + data[i * stride : (i + 1) * stride]).intdigest().to_bytes(KEY_BYTES, "little")
        out += prev
    return BlockKeys(bytes(out))
