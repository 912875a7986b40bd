"""The KV geometry a sidecar serves and a pool holds (``kvtier.v1.KvGeometry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ._proto import kvtier_pb2 as pb

#: Canonical dtype names (docs/block-keys.md) -> (proto ``Dtype`` number, bytes per element).
DTYPES: dict[str, tuple[int, int]] = {
    "f32": (pb.DTYPE_F32, 4),
    "f16": (pb.DTYPE_F16, 2),
    "bf16": (pb.DTYPE_BF16, 2),
    "fp8_e4m3": (pb.DTYPE_FP8_E4M3, 1),
    "fp8_e5m2": (pb.DTYPE_FP8_E5M2, 1),
}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}

#: The numpy dtype of a pool's elements. numpy has no bf16 or fp8: those are views of the raw
#: bits (uint16 / uint8), which copy bit-exactly.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "fp8_e4m3": np.dtype("u1"),
    "fp8_e5m2": np.dtype("u1"),
}


@dataclass(frozen=True)
class Geometry:
    """Shape of the KV of one block: ``layers`` x [K|V] x ``block_tokens`` x ``kv_heads`` x
    ``head_dim`` elements of ``dtype`` (a canonical name: f32, f16, bf16, fp8_e4m3, fp8_e5m2).

    ``kv_heads`` is the count on this tensor-parallel rank.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 < v < 2**32:
                raise ValueError(f"{name} = {v!r}: expected an integer in 1..2^32-1")

    @property
    def dtype_code(self) -> int:
        """The proto ``Dtype`` number (also the pool header's dtype code)."""
        return DTYPES[self.dtype][0]

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype][1]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The element type of the pool's numpy views (raw bits for bf16 and fp8)."""
        return NUMPY_DTYPES[self.dtype]

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block in one layer: 2 x block_tokens x kv_heads x head_dim x dtype bytes."""
        return 2 * self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        return self.layers * self.block_layer_bytes

    def to_proto(self) -> pb.KvGeometry:
        """This geometry as the wire message."""
        return pb.KvGeometry(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=cast(Any, self.dtype_code),
            block_tokens=self.block_tokens,
        )

    @classmethod
    def from_proto(cls, g: pb.KvGeometry) -> Geometry:
        """The geometry a ``KvGeometry`` message describes."""
        return cls(g.layers, g.kv_heads, g.head_dim, dtype_name(g.dtype), g.block_tokens)


def dtype_name(code: int) -> str:
    """The canonical name of a proto ``Dtype`` number (ValueError for an unknown one)."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise ValueError(f"unknown dtype code {code}") from None
