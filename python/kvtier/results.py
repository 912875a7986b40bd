"""Typed results and events of the API: what the wire messages carry, keys unpacked into
:class:`~kvtier.keys.BlockKeys`, enums as Python enums."""

from __future__ import annotations

import enum
import json as _json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .geometry import Geometry
from .keys import BlockKeys, Namespace
from .pool import CpuPool


class Tier(enum.IntEnum):
    """Where a block is (the proto's ``Tier``)."""

    UNSPECIFIED = 0
    DEVICE = 1
    HOST = 2
    DISK = 3
    #: A Redis Cluster the whole fleet shares (when the sidecar has ``[remote]``).
    REMOTE = 4


@dataclass(frozen=True)
class Timing:
    """When a transfer's copies ran, in microseconds: from the request's arrival to the first
    copy (``queue_us``) and to the last (``latency_us``); first copy start to last copy end
    (``span_us``); the copies' own durations summed (``active_us``)."""

    queue_us: int = 0
    latency_us: int = 0
    span_us: int = 0
    active_us: int = 0


@dataclass(frozen=True)
class PoolHandle:
    """A pool registered in a session. ``namespace`` has an empty cache salt;
    :meth:`keys` hashes tokens in this pool's namespace under any salt."""

    pool_id: int
    session_id: int
    namespace: Namespace
    num_slots: int
    #: The namespace fingerprint the sidecar computed (empty cache salt), as the u128 value.
    fingerprint: int
    #: The mapped pool, when registered from a :class:`CpuPool`.
    pool: Optional[CpuPool] = field(default=None, compare=False, repr=False)
    #: A process pool's buffers, kept alive while the handle is.
    memory: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    @property
    def geometry(self) -> Geometry:
        return self.namespace.geometry

    def keys(self, tokens: Any, cache_salt: str = "", parent: int | None = None) -> BlockKeys:
        """Block keys of ``tokens``' whole blocks in this pool's namespace under ``cache_salt``
        (computed here; the same keys the sidecar computes from token ids)."""
        return self.namespace.with_salt(cache_salt).keys(tokens, parent)


@dataclass(frozen=True)
class MatchResult:
    """Where each leading block of a sequence is; the first block in no tier ends the lists."""

    #: The tier of each matched leading block.
    tiers: list[Tier]
    #: Per matched block: its slot in this pool when on the DEVICE tier, else 0.
    device_slots: list[int]
    #: The matched blocks' keys when the request gave token ids (empty for a request by keys).
    keys: BlockKeys
    matched_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    #: In the remote tier only.
    remote_tokens: int = 0

    @property
    def matched_blocks(self) -> int:
        """How many leading blocks matched (in any tier)."""
        return len(self.tiers)


@dataclass(frozen=True)
class LayerReady:
    """Every loadable block's layers ``0..=layer`` are in their slots."""

    layer: int


@dataclass(frozen=True)
class Removals:
    """Blocks that left kvtier (its host and disk tiers) since the last
    :meth:`~kvtier.Session.take_removals`, for a session opened with ``watch_removals``.
    ``cleared`` (a clear) or ``lost`` (the session fell behind) mean unnamed blocks left too:
    treat every block as possibly removed."""

    keys: BlockKeys
    cleared: bool = False
    lost: bool = False
    #: ``time.monotonic()`` when the last clear or lag was heard (blocks stored after it were
    #: not cleared by it); 0 without one.
    unnamed_at: float = 0.0

    def __bool__(self) -> bool:
        return bool(len(self.keys)) or self.cleared or self.lost


@dataclass(frozen=True)
class BlocksMissing:
    """Blocks whose slots will not be written (in no tier, or failed verification on disk):
    recompute them."""

    keys: BlockKeys


@dataclass(frozen=True)
class LoadDone:
    """The last event of a load."""

    loaded_blocks: int
    #: Of those, read from disk first.
    disk_blocks: int
    #: Keys of the blocks not loaded.
    missing: BlockKeys
    bytes: int
    timing: Timing
    #: Of the loaded blocks, fetched from the remote tier first.
    remote_blocks: int = 0


#: One event of a load stream.
LoadEvent = Union[LayerReady, BlocksMissing, LoadDone]


@dataclass(frozen=True)
class StoreResult:
    """A Store's reply: the slots may be reused."""

    stored_blocks: int
    already_stored: int
    #: Keys dropped for lack of host memory.
    no_space: BlockKeys
    bytes: int
    timing: Timing
    #: A durable store: blocks now on disk and synced, and the keys of those that are not.
    durable_blocks: int
    not_durable: BlockKeys


class DeviceEventKind(enum.IntEnum):
    """What a :class:`DeviceEvent` reports (the proto's ``DeviceEvent.Kind``)."""

    STORED = 1
    REMOVED = 2
    CLEARED = 3


@dataclass(frozen=True)
class DeviceEvent:
    """A change of what the engine's device pool holds; build with :meth:`stored`,
    :meth:`removed`, :meth:`cleared`."""

    kind: DeviceEventKind
    key: int = 0
    slot: int = 0

    @classmethod
    def stored(cls, key: int, slot: int) -> DeviceEvent:
        """The device now holds ``key`` in ``slot``."""
        return cls(DeviceEventKind.STORED, key, slot)

    @classmethod
    def removed(cls, key: int) -> DeviceEvent:
        """The device no longer holds ``key``."""
        return cls(DeviceEventKind.REMOVED, key)

    @classmethod
    def cleared(cls) -> DeviceEvent:
        """The device holds nothing any more."""
        return cls(DeviceEventKind.CLEARED)


@dataclass(frozen=True)
class DeviceEventsResult:
    applied: int
    #: Blocks this pool's device holds now.
    device_blocks: int


@dataclass(frozen=True)
class PinResult:
    pin_id: int
    pinned_blocks: int
    #: Keys not in host memory (not pinned).
    missing: BlockKeys


@dataclass(frozen=True)
class ClearResult:
    host_blocks: int
    disk_blocks: int
    #: Pinned blocks kept.
    kept_pinned: int
    #: Removed from the remote tier (only a clear of ``Tier.REMOTE`` touches it).
    remote_blocks: int = 0


@dataclass(frozen=True)
class Stats:
    """The sidecar's counters; :attr:`snapshot` is the full JSON snapshot, parsed."""

    sessions: int
    pools: int
    pinned_blocks: int
    host_used_bytes: int
    host_capacity_bytes: int
    disk_used_bytes: int
    disk_capacity_bytes: int
    json: str = field(repr=False)

    @property
    def snapshot(self) -> dict[str, Any]:
        return _json.loads(self.json)  # type: ignore[no-any-return]
