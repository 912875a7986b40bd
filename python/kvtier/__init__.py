"""kvtier: the Python client of the kvtier sidecar (a tiered KV-cache offload service).

::

    import kvtier
    with kvtier.connect("unix:///run/kvtier/kvtier.sock", "engine-0") as s:
        with kvtier.CpuPool.create(s.geometry, num_slots=64) as pool:
            h = s.register_pool(pool, "my-model")
            keys = h.keys(prompt_tokens)
            s.store(h, keys, slots)              # one batched request for the whole run
            m = s.match(h, token_ids=prompt_tokens)
            done = s.load_wait(h, keys, slots)   # or: for ev in s.load(...): ...

Modules: :mod:`kvtier.client` (connection), :mod:`kvtier.session` (the API),
:mod:`kvtier.aio` (the same on asyncio), :mod:`kvtier.pool` (the shared-memory pool file),
:mod:`kvtier.keys` (block keys), :mod:`kvtier.geometry`, :mod:`kvtier.results`,
:mod:`kvtier.errors`; generated stubs in ``kvtier._proto``.
"""

from .client import Client, connect, default_target
from .errors import (
    AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument, KvtierError,
    NotFound, OutOfRange, ResourceExhausted, SessionClosed, Unauthenticated, Unavailable,
    Unimplemented,
)
from .geometry import Geometry
from .keys import BlockKeys, Namespace, block_keys
from .pool import CpuPool
from .results import (
    BlocksMissing, ClearResult, DeviceEvent, DeviceEventKind, DeviceEventsResult, LayerReady,
    LoadDone, LoadEvent, MatchResult, PinResult, PoolHandle, Removals, Stats, StoreResult, Tier, Timing,
)
from ._wire import NO_SLOT
from .session import LoadStream, Session
from . import aio

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists", "BlockKeys", "BlocksMissing", "Cancelled", "DataLoss", "ClearResult", "Client", "CpuPool",
    "DeadlineExceeded", "DeviceEvent", "DeviceEventKind", "DeviceEventsResult",
    "FailedPrecondition", "Geometry", "Internal", "InvalidArgument", "KvtierError", "LayerReady",
    "LoadDone", "LoadEvent", "LoadStream", "MatchResult", "NO_SLOT", "Namespace", "NotFound", "OutOfRange",
    "PinResult", "PoolHandle", "Removals", "ResourceExhausted", "Session", "SessionClosed", "Stats",
    "StoreResult", "Tier", "Timing", "Unauthenticated", "Unavailable", "Unimplemented",
    "aio", "block_keys", "connect", "default_target",
]
