"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``): vLLM's KV blocks are stored in and
loaded from a kvtier sidecar.

vLLM loads it by its module path::

    kvtier serve --set model.layers=28 --set model.kv_heads=8 --set model.head_dim=128 \\
        --set model.dtype=bf16 --set model.block_tokens=16 &      # block = vLLM's block size
    vllm serve Qwen/Qwen3-8B --block-size 16 \\
        --kv-transfer-config '{"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"sidecar": "unix:///run/kvtier/kvtier.sock"}}'

Scheduler side (one per engine): :meth:`~KvtierConnector.get_num_new_matched_tokens` computes
the request's kvtier block keys from its token ids and cache salt (kvtier's own key function,
:mod:`kvtier.keys`, in the namespace model + geometry + TP rank/size) and asks the sidecar with
one ``Match``; the leading run found (capped so that at least the prompt's last token is
computed) is what vLLM loads instead of computing. :meth:`~KvtierConnector.update_state_after_alloc`
records the blocks vLLM allocated for it; :meth:`~KvtierConnector.build_connector_meta` turns
each step into loads (keys → vLLM block ids) and saves (every full block computed by the end
of the step and not yet in kvtier). The scheduler registers a one-slot pool only to name the
namespace in ``Match``.

Worker side (one per TP rank): :meth:`~KvtierConnector.register_kv_caches` takes vLLM's
per-layer KV tensors (CPU or CUDA). Where the sidecar can reach them, they are registered in
place (:mod:`kvtier.integrations.in_place`: CUDA memory by IPC handle, CPU memory in a shared
file by its path, private CPU memory — vLLM's own CPU KV — by address as a process pool that
the sidecar reads and writes with cross-memory attach) with the layout their strides give
(vLLM's older ``[2, blocks, token, head, dim]``, and every physical layout of vLLM ≥ 0.34's
``[B, H, N, K‖V]`` views, K and V interleaved per token and head), and blocks move with no copy
in Python: loads land in vLLM's blocks, stores read them. Otherwise (a sidecar without CUDA;
private CPU memory over TCP, or that the sidecar may not reach) they go
through a shared-memory staging pool (``staging_slots`` blocks) that torch copies blocks into
and out of. :meth:`~KvtierConnector.start_load_kv` opens
one ``Load`` per request (layer events); :meth:`~KvtierConnector.wait_for_layer_load` waits for
the layer's ``LayerReady`` (and copies that layer out of the staging slots);
:meth:`~KvtierConnector.save_kv_layer` (through staging) copies each layer of the step's saved
blocks into staging slots as vLLM writes it (CUDA KV: on a copy stream into the pinned pool,
while the next layers compute), and :meth:`~KvtierConnector.wait_for_save` sends one ``Store``
per saved run on a background thread (in place: straight from vLLM's blocks; through staging:
from the slots, freed when it returns).
In place, a finished request whose blocks were saved keeps them (``request_finished`` answers
True) until :meth:`~KvtierConnector.get_finished` reports its stores done, and
:meth:`~KvtierConnector.handle_preemptions` lets a preempted request's stores finish before
vLLM reuses its blocks (hybrid models differ: see below). Finished stores' keys go back to the scheduler (worker metadata) and
come out of :meth:`~KvtierConnector.take_events` as ``BlockStored`` events (medium ``KVTIER``).
Blocks it announced that leave kvtier come out as ``BlockRemoved`` (medium ``KVTIER``): as the
sidecar reports them (the scheduler's session watches removals), or when a later ``Match`` no
longer finds them.
Blocks a load could not bring (evicted since ``Match``) are reported by
:meth:`~KvtierConnector.get_block_ids_with_load_errors`, for vLLM to recompute them.

Hybrid models (vLLM's hybrid KV cache manager: sliding-window and full-attention layers, or
other attention kinds, in KV cache groups with a block table each; the connector is
``SupportsHMA``): a kvtier block still holds every layer of its tokens, in the model's layer
order. A block is saved in the step that computes it, while every group still holds it (a
block some group has already dropped is not saved, nor any before it); a load copies each
layer into its own group's block, and none into a group's null blocks (sliding-window layers
before their window). In place, each layer is registered in its group and every ``Load`` and
``Store`` names each block's slot in every group (``group_slots``; ``NO_SLOT`` for a group's
null block); as the window groups free blocks when the window moves on, unannounced, a step's
stores end before :meth:`~KvtierConnector.wait_for_save` returns (so before vLLM can write any
block again; within ``step_store_timeout_s`` all together, a store still queued then is skipped),
instead of the finished requests' blocks waiting for them. Through staging, a kvtier slot is one block of every layer,
copied from and to each group's blocks. Either way such models load in the background
(``load_async`` is implied: vLLM takes a hybrid model's failed load only per request,
``failed_recving``). Every group must be attention of one geometry; Mamba state and MLA
latents are refused by name.

Copies reorder each block between vLLM's per-layer views (``[block, head, token, K‖V]``, the
standardized ``[B, H, N, C]`` views of vLLM ≥ 0.34, any physical layout; or the older
``[2, block, token, head, dim]``) and kvtier's ``[layer][K|V][token][head][dim]``.

``kv_connector_extra_config`` keys: ``sidecar`` (a target as :func:`kvtier.connect` takes),
``auth_token``, ``kv_path`` (``auto``, the default: in place where possible, else staging;
``in_place``: fail where not possible; ``staging``), ``load_async`` (default false; true:
matched blocks load in the background while the request waits in vLLM's
``WAITING_FOR_REMOTE_KVS``, and the step's forward never waits for them;
:meth:`~KvtierConnector.get_finished` reports each load done, with the blocks it could not bring
as load errors. In place they land straight in vLLM's blocks; through staging they land in
staging slots taken when the load starts (blocks beyond the free slots are reported as load
errors, for vLLM to recompute) and are copied into vLLM's blocks by ``get_finished``),
``in_place_stores`` (``in_step``, the default: in place, a step's stores end before
:meth:`~KvtierConnector.wait_for_save` returns, and finished requests' blocks are freed at
once; ``async``: a dense model's stores run on while the next steps compute, the finished
requests' blocks kept until they end, but vLLM ≥ 0.34 applies a step's copy-on-write block
copies before it reports the requests it preempted, so such a copy into a preempted request's
block can race its store; hybrid models are always ``in_step``), ``step_store_timeout_s``
(default 5: the longest ``wait_for_save`` waits for a step's in-step stores, all together; the
sidecar publishes nothing of a store whose copies end later (its ``not_after``); after such a
step, saves in place pause for ``reconnect_interval_s``, doubling while steps keep running out
of time, up to 60 s, so a stalled sidecar holds the steps for a small share of the time),
``staging_slots`` (default 256),
``model_name`` (default vLLM's served model name),
``cache_salt`` (for requests without one), ``client_name``, ``reconnect_interval_s`` (default
2: when the sidecar ends a session, by a restart, each side reopens it in the background and
registers its pool again, one try per interval; vLLM computes meanwhile), ``match_timeout_s``
(default 1: the longest the scheduler waits for a ``Match``; after a failed one, requests are
computed without asking for ``reconnect_interval_s``), ``store_timeout_s`` (default 60: the
longest a background store is waited for). Every store carries the moment the connector stops
waiting for it as its ``not_after``: the sidecar publishes nothing of copies that end later,
even of a request it reads late (a sidecar stopped or starved meanwhile), so the staging slots
or vLLM's blocks of a store that timed out are free again at once; those of a store that failed
earlier without saying how it ended are kept until its ``not_after`` has passed.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger

from .. import NO_SLOT
from ..errors import DeadlineExceeded, KvtierError
from ..geometry import Geometry
from ..keys import BlockKeys
from ..pool import CpuPool
from ..results import BlocksMissing, LayerReady, LoadDone, PoolHandle
from ..session import LoadStream, Session
from .in_place import NotInPlace, register_in_place
from .reopen import REOPEN_CONNECT_TIMEOUT_S, Reopener, discard_reopened, held_until
from .staged_copies import NULL_BLOCK, BlockRun, StagedCopies, kv_planes
from .staging import add_staging_pool, open_session, open_staging

__all__ = ["NULL_BLOCK", "KvtierConnector", "KvtierConnectorMetadata", "KvtierWorkerMetadata", "LoadSpec",
           "SaveSpec", "kv_geometry"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _slot(block: int) -> int:
    """A vLLM block id as a kvtier slot of vLLM's KV registered in place: the null block (a
    group keeps no block there) is ``NO_SLOT``."""
    return NO_SLOT if block == NULL_BLOCK else block


_DTYPES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
MEDIUM = "KVTIER"
#: Announced keys the scheduler side remembers, to report them removed (~100 bytes each).
ANNOUNCED_KEYS = 1 << 20
#: Saved blocks whose store the scheduler side has not heard of yet (their BlockStored event's
#: parent and tokens, ~1 KiB each); beyond that the oldest are forgotten (a store that failed or
#: was skipped is never heard of; a very late one then goes unannounced).
BLOCK_INFO_KEYS = 1 << 16
#: The longest in-place saves pause after steps whose stores ran out of step_store_timeout_s.
SAVE_PAUSE_MAX_S = 60.0


@dataclass(frozen=True)
class KvLayers:
    """vLLM's attention layers as kvtier holds them: the ``geometry`` of one layer's block,
    the layers' ``names`` in the model's order (kvtier's layer i is ``names[i]``; loads
    arrive in this order, as the forward uses them) and each one's KV cache ``group`` (hybrid
    models, such as sliding-window and full-attention layers, have a group per kind, each with
    its own block table)."""

    geometry: Geometry
    names: list[str]
    groups: list[int]

    @property
    def num_groups(self) -> int:
        return max(self.groups) + 1


def _model_order(names: list[str]) -> list[str]:
    """``names`` sorted by the layer number in each (``model.layers.7.self_attn.attn``), or
    as given where a name has none or several."""
    numbers = [re.findall(r"\.(\d+)\.", f".{n}.") for n in names]
    if any(len(x) != 1 for x in numbers):
        return names
    return [n for _, n in sorted(zip((int(x[0]) for x in numbers), names))]


def kv_geometry(kv_cache_config: KVCacheConfig) -> KvLayers:
    """kvtier's view of vLLM's KV cache config: every KV cache group attention with K and V
    of one head size (what kvtier's block layout holds), all with one geometry (heads, head
    size, dtype, block size: a kvtier block holds every layer of its tokens). Anything else
    (Mamba state, MLA's packed latents, groups of different shapes) is refused by name."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("kvtier: vLLM's KV cache config has no KV cache group")
    geometry: Geometry | None = None
    group_of: dict[str, int] = {}
    for gi, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
            if not hasattr(spec, attr):
                raise ValueError(f"kvtier: KV cache group {gi} ({kind}) is not attention; kvtier holds attention KV")
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise ValueError(f"kvtier: K head size {spec.head_size} != V head size {spec.head_size_v}")
        if getattr(spec, "state_content_bytes", None) is not None or getattr(spec, "num_head_slots", None) is not None:
            raise ValueError(f"kvtier: packed KV cache spec {kind} is not supported")
        dtype = _DTYPES.get(spec.dtype)
        if dtype is None:
            raise ValueError(f"kvtier: KV cache dtype {spec.dtype} is not supported ({list(_DTYPES)})")
        g = Geometry(1, int(spec.num_kv_heads), int(spec.head_size), dtype, int(spec.block_size))
        if geometry is not None and g != geometry:
            raise ValueError(f"kvtier: KV cache group {gi} ({kind}) has {g}, group 0 {geometry}; a kvtier block "
                             "holds every layer of its tokens in one geometry")
        geometry = g
        group_of.update((name, gi) for name in group.layer_names)
    assert geometry is not None
    names = _model_order(list(group_of))
    return KvLayers(
        Geometry(len(names), geometry.kv_heads, geometry.head_dim, geometry.dtype, geometry.block_tokens),
        names, [group_of[n] for n in names])


# --- metadata ------------------------------------------------------------------------------


@dataclass
class LoadSpec:
    """Load ``keys`` (packed) into vLLM blocks ``block_ids``, one block each (and, for a
    hybrid model, ``group_block_ids``)."""

    req_id: str
    keys: bytes
    block_ids: list[int]
    cache_salt: str = ""
    #: The tokens of those blocks' whole prefix, for TP ranks other than 0 (their own keys).
    token_ids: list[int] | None = None
    first_block: int = 0
    #: Loaded in the background (``load_async``): the request waits in vLLM's
    #: ``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` reports it.
    asynchronous: bool = False
    #: The same blocks in KV cache groups 1, 2, ... (hybrid models; ``block_ids`` is group 0's),
    #: ``NULL_BLOCK`` where a group keeps none (its layers do not need that block).
    group_block_ids: list[list[int]] = field(default_factory=list)

    def by_group(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


@dataclass
class SaveSpec:
    """Store vLLM blocks ``block_ids`` under ``keys`` (packed), a contiguous run of one
    sequence whose block before is ``parent`` (None: the run starts it)."""

    req_id: str
    keys: bytes
    block_ids: list[int]
    parent: int | None = None
    cache_salt: str = ""
    token_ids: list[int] | None = None
    first_block: int = 0
    #: The same blocks in KV cache groups 1, 2, ... (hybrid models; never ``NULL_BLOCK``).
    group_block_ids: list[list[int]] = field(default_factory=list)

    def by_group(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side hands the workers for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: Finished requests whose blocks vLLM frees only once the worker reports their stores
    #: done (``get_finished``): stores read vLLM's blocks in place.
    delayed_frees: list[str] = field(default_factory=list)
    #: Requests preempted this step: their blocks are reused, so stores reading them finish
    #: first (``handle_preemptions``).
    preempted: list[str] = field(default_factory=list)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers report back: keys kvtier now holds (finished stores)."""

    stored: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.stored + [k for k in other.stored if k not in set(self.stored)])


# --- copies between vLLM's per-layer views and kvtier's block layout ------------------------


# --- the connector -------------------------------------------------------------------------


def _group_runs(block_ids: tuple[list[int], ...] | list[list[int]], first: int, last: int) -> list[list[int]]:
    """Blocks ``first..last`` of each KV cache group's block table, ``NULL_BLOCK`` where a
    group's table is shorter."""
    return [[*g[first:last], *[NULL_BLOCK] * (last - first - len(g[first:last]))] for g in block_ids]


def _flag(value: Any, name: str) -> bool:
    """A boolean ``kv_connector_extra_config`` value (JSON true/false, or the words)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"{name} = {value!r}: give true or false")


@dataclass
class _ReqState:
    request: Any
    #: Leading blocks kvtier holds (matched, loaded or planned to be saved).
    known_blocks: int = 0
    keys: BlockKeys = field(default_factory=BlockKeys)
    #: Whether a save of its blocks was scheduled (its free may wait for the store).
    saved: bool = False


@dataclass
class _Fetched:
    """What a background load brought: staging ``slots`` it holds (freed once copied out),
    the ``copy_slots`` → ``copy_blocks`` (per KV cache group) to copy into vLLM's blocks, the
    blocks that ``failed`` (group 0's ids)."""

    slots: list[int]
    failed: set[int]
    copy_slots: list[int] = field(default_factory=list)
    copy_blocks: list[list[int]] = field(default_factory=list)


@dataclass
class _StagedSave:
    """One of the step's saves through staging, planned at the step's first saved layer: its
    keys and parent in this rank's namespace, and the ``run`` of its leading blocks that got
    the staging slots free then (None when none was), copied in layer by layer as vLLM writes
    them (``save_kv_layer``; ``copied``: the layers in). The rest is copied by
    ``wait_for_save``, which stores them all."""

    spec: SaveSpec
    keys: BlockKeys
    parent: int | None
    run: BlockRun | None
    copied: set[int] = field(default_factory=set)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    keys: BlockKeys
    slots: list[int]
    stream: LoadStream | None
    ready_layer: int = -1
    copied: int = -1
    done: LoadDone | None = None
    missing: set[int] = field(default_factory=set)


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM v1 KV connector on a kvtier sidecar (see the module's documentation)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._target: str | None = extra.get("sidecar")
        self._auth_token: str | None = extra.get("auth_token")
        self._staging_slots = int(extra.get("staging_slots", 256))
        if self._staging_slots < 1:
            raise ValueError(f"staging_slots = {self._staging_slots}: give at least 1")
        self._kv_path = str(extra.get("kv_path", "auto"))
        if self._kv_path not in ("auto", "in_place", "staging"):
            raise ValueError(f"kv_path = {self._kv_path!r}: give auto, in_place or staging")
        self._load_async = _flag(extra.get("load_async", False), "load_async")
        self._in_place_stores = str(extra.get("in_place_stores", "in_step"))
        if self._in_place_stores not in ("in_step", "async"):
            raise ValueError(f"in_place_stores = {self._in_place_stores!r}: give in_step or async")
        self._reopener = Reopener(self._reopen, float(extra.get("reconnect_interval_s", 2.0)),
                                  f"vLLM {role.name.lower()}", retry_on=(NotInPlace,))
        self._match_timeout_s = float(extra.get("match_timeout_s", 1.0))
        if not self._match_timeout_s > 0:
            raise ValueError(f"match_timeout_s = {self._match_timeout_s}: give a positive number of seconds")
        #: No Match before this (monotonic seconds): set when one failed.
        self._match_again_at = 0.0
        self._store_timeout_s = float(extra.get("store_timeout_s", 60.0))
        if not self._store_timeout_s > 0:
            raise ValueError(f"store_timeout_s = {self._store_timeout_s}: give a positive number of seconds")
        self._step_store_timeout_s = float(extra.get("step_store_timeout_s", 5.0))
        if not self._step_store_timeout_s > 0:
            raise ValueError(f"step_store_timeout_s = {self._step_store_timeout_s}: give a positive number of seconds")
        #: In-place saves that end within the step are skipped before this (monotonic seconds):
        #: set when a step's stores ran out of time, for a pause that doubles while they do.
        self._save_again_at = 0.0
        self._save_pause_s = 0.0
        #: Stores of the current step that were skipped or timed out (on the store thread).
        self._late_stores = 0
        mc = vllm_config.model_config
        self._model = str(extra.get("model_name") or getattr(mc, "served_model_name", None) or mc.model)
        self._salt = str(extra.get("cache_salt", ""))
        layers = kv_geometry(kv_cache_config)
        self._geometry, self._layer_names, self._layer_groups = layers.geometry, layers.names, layers.groups
        self._num_groups = layers.num_groups
        if self._num_groups > 1 and not self._load_async:
            # vLLM takes a failed load of a hybrid model only as a failed background load
            # (block ids are not unique across groups).
            logger.info("kvtier: %d KV cache groups (a hybrid model): loads run in the background (load_async)",
                        self._num_groups)
            self._load_async = True
        self._block_size = self._geometry.block_tokens
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER and self._tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        name = extra.get("client_name") or f"vllm-{role.name.lower()}-tp{self._tp_rank}"
        self._session: Session | None = None
        self._pool: CpuPool | None = None
        self._handle: PoolHandle | None = None
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        #: Per request asked about: (blocks kvtier matched, tokens vLLM had computed locally).
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._block_info: OrderedDict[int, tuple[int | None, list[int]]] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        #: Keys announced as BlockStored and not since as BlockRemoved, with when (monotonic
        #: seconds; oldest first, at most ANNOUNCED_KEYS: beyond that the oldest are forgotten
        #: without an event).
        self._announced: OrderedDict[int, float] = OrderedDict()
        self._kv_cache_manager: KVCacheManager | None = None
        self._delayed_frees: list[str] = []
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        #: Copies through the staging pool (None in place).
        self._copies: StagedCopies | None = None
        #: This step's saves through staging (one per ``meta.saves``), planned for the metadata
        #: ``_planned_for``.
        self._planned: list[_StagedSave] = []
        self._planned_for: KVConnectorMetadata | None = None
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        self._free: deque[int] = deque()
        self._slot_lock = threading.Condition()
        self._active_loads: list[_ActiveLoad] = []
        self._load_errors: set[int] = set()
        #: Requests whose background load failed in part (hybrid models: reported whole).
        self._failed_recving: set[str] = set()
        #: Background loads (``load_async``) per request.
        self._async_loads: dict[str, Future[_Fetched]] = {}
        self._loader: ThreadPoolExecutor | None = None
        #: True when vLLM's own KV memory is the registered pool (slots are vLLM's block ids).
        self._in_place = False
        self._stores: deque[tuple[str, list[int], Future[list[int] | float]]] = deque()
        #: Stores that failed before their not_after without saying how they ended (the
        #: sidecar might still publish what it reads): (request, staging slots, not_after);
        #: the slots, or in place (``async``) the request's blocks, are kept from reuse until
        #: not_after has passed.
        self._unsure: list[tuple[str, list[int], float]] = []
        self._stores_of: dict[str, int] = {}   # stores in flight per request
        self._delayed: set[str] = set()        # finished requests whose free waits on stores
        self._stored_keys: list[int] = []
        self._executor: ThreadPoolExecutor | None = None
        self._client_name = name
        if role == KVConnectorRole.SCHEDULER:
            self._open(name, 1)

    @property
    def _stores_end_in_step(self) -> bool:
        """Whether in-place stores end before ``wait_for_save`` returns (``in_place_stores`` =
        ``in_step``; always for a hybrid model, whose window groups free blocks unannounced)."""
        return self._num_groups > 1 or self._in_place_stores == "in_step"

    # --- session and pools -----------------------------------------------------------------

    def _open(self, client_name: str, slots: int) -> None:
        self._session, self._pool, self._handle = open_staging(
            self._target, client_name, auth_token=self._auth_token, geometry=self._geometry, slots=slots,
            model=self._model, tp_rank=self._tp_rank, tp_size=self._tp_size, engine_kv="vLLM's KV cache",
            watch_removals=True,
        )

    def _ready(self) -> tuple[Session, PoolHandle]:
        if self._session is None or self._handle is None:
            raise KvtierError("kvtier: no session yet (register_kv_caches)")
        return self._session, self._handle

    def _session_ok(self) -> bool:
        """Whether the session is open. When it has ended (the sidecar restarted, or dropped
        it), it is reopened in the background with this side's pool registered again
        (:class:`~kvtier.integrations.reopen.Reopener`, one try per ``reconnect_interval_s``)
        and put in place by a later call: the engine's loop never waits for the sidecar. While
        it is down, vLLM computes requests, saves are skipped and loads fail (their blocks are
        recomputed)."""
        is_open, made = self._reopener.replacement(self._session)
        if made is None:
            return is_open
        session, pool, handle = made
        old, self._session, self._handle = self._session, session, handle
        old.close()
        if pool is not None:  # the scheduler's one-slot pool is made anew
            if self._pool is not None:
                self._pool.close()
            self._pool = pool
        if self._role == KVConnectorRole.SCHEDULER:
            # What the sidecar holds now is unknown: the blocks announced are reported removed
            # (a later store announces them again).
            self._announce_removed(list(self._announced))
        # Held stores of the old session stay held until their not_after (its transfers run to
        # their end with its pool mapped): _reap lets them go, as for any session.
        return True

    def _reopen(self) -> tuple[Session, CpuPool | None, PoolHandle]:
        """A new session with this side's pool registered as before (on the reconnect thread;
        reads the connector's registration, changes nothing): the scheduler's one-slot pool
        made anew; vLLM's KV in place, or the same staging pool."""
        if self._role == KVConnectorRole.SCHEDULER:
            return open_staging(
                self._target, self._client_name, auth_token=self._auth_token, geometry=self._geometry, slots=1,
                model=self._model, tp_rank=self._tp_rank, tp_size=self._tp_size, engine_kv="vLLM's KV cache",
                watch_removals=True, connect_timeout=REOPEN_CONNECT_TIMEOUT_S)
        session = open_session(self._target, self._client_name, auth_token=self._auth_token,
                               geometry=self._geometry, engine_kv="vLLM's KV cache",
                               connect_timeout=REOPEN_CONNECT_TIMEOUT_S)
        try:
            if self._in_place:
                handle = self._register_in_place(session)
            else:
                assert self._pool is not None
                handle = session.register_pool(self._pool, self._model, tp_rank=self._tp_rank, tp_size=self._tp_size)
        except BaseException:
            session.close()
            raise
        return session, None, handle

    def shutdown(self) -> None:
        """Waits for the stores in flight, closes the session (the sidecar unregisters the
        pool) and removes the pool file."""
        if self._executor is not None:
            self._reap(block=True)
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)  # a load in flight ends (done or failed) first
            self._loader = None
            for f in self._async_loads.values():
                self._give_slots(f.result().slots)
            self._async_loads.clear()
        for a in self._active_loads:
            if a.stream is not None:
                a.stream.cancel()
        self._active_loads = []
        self._reopener.shutdown(discard_reopened)
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._pool is not None:
            if self._copies is not None:
                self._copies.close()
                self._copies = None
            self._pool.close()
            self._pool = None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def _keys(self, st: _ReqState, blocks: int, salt: str) -> BlockKeys:
        """The request's first ``blocks`` block keys (extending the ones computed before)."""
        _, handle = self._ready()
        have = len(st.keys)
        if blocks > have:
            toks = list(st.request.all_token_ids[have * self._block_size : blocks * self._block_size])
            parent = st.keys[have - 1] if have else None
            st.keys = st.keys + handle.keys(toks, cache_salt=salt, parent=parent)
        return st.keys[:blocks]

    def _salt_of(self, request: Request) -> str:
        return str(getattr(request, "cache_salt", None) or self._salt)

    # ==========================================================================================
    # Scheduler side
    # ==========================================================================================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier holds beyond ``num_computed_tokens``: one ``Match`` by the request's
        block keys, the leading run found, capped to leave the last token to compute."""
        if not self._session_ok():
            self._matched[request.request_id] = (0, num_computed_tokens)
            return 0, False
        session, handle = self._ready()
        salt = self._salt_of(request)
        full = (request.num_tokens - 1) // self._block_size
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request)
            self._reqs[request.request_id] = st
        self._matched[request.request_id] = (0, num_computed_tokens)
        if full <= num_computed_tokens // self._block_size:
            return 0, False
        keys = self._keys(st, full, salt)
        if time.monotonic() < self._match_again_at:
            return 0, False
        try:
            m = session.match(handle, keys, cache_salt=salt, timeout=self._match_timeout_s)
        except KvtierError as e:
            # A sidecar that does not answer in time is not asked again for a while: the
            # scheduler's loop waits at most one timeout per reconnect interval.
            self._match_again_at = time.monotonic() + self._reopener.interval_s
            logger.warning("kvtier: match failed (%s); computing request %s, no match for %.1f s", e,
                           request.request_id, self._reopener.interval_s)
            return 0, False
        self._matched[request.request_id] = (m.matched_blocks, num_computed_tokens)
        # Announced, and no longer in kvtier (or past a block that is not).
        self._announce_removed([k for k in keys[m.matched_blocks :] if k in self._announced])
        external = max(0, m.matched_blocks * self._block_size - num_computed_tokens)
        return external, self._load_async and external > 0

    def may_load_async(self, request: Request) -> bool:
        """Whether a match may load in the background (``load_async``)."""
        return self._load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Records the request; with external tokens, a load of those blocks into the blocks
        vLLM allocated for them."""
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request)
            self._reqs[request.request_id] = st
        matched, local = self._matched.pop(request.request_id, (0, request.num_computed_tokens))
        st.known_blocks = matched
        if num_external_tokens <= 0:
            return
        # The blocks after those vLLM found in its own prefix cache.
        bs = self._block_size
        first = local // bs
        last = (local + num_external_tokens) // bs
        salt = self._salt_of(request)
        keys = self._keys(st, last, salt)
        ids = _group_runs(blocks.get_block_ids(), first, last)
        self._loads[request.request_id] = LoadSpec(
            request.request_id, keys[first:last].packed, ids[0], salt,
            list(request.all_token_ids[: last * bs]) if self._tp_size > 1 else None, first, self._load_async,
            ids[1:],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (recorded at allocation) and saves: every whole block computed by
        the end of the step that kvtier does not hold yet."""
        meta = KvtierConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        # Every step, not only when a request arrives: a session that ended is reopened in the
        # background meanwhile, so the next request's Match finds the sidecar again.
        self._session_ok()
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        bs = self._block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or req_id not in computed:
                continue
            end = computed[req_id] + n - len(spec.get(req_id, ()))
            full = min(end, st.request.num_tokens) // bs
            if full <= st.known_blocks:
                continue
            salt = self._salt_of(st.request)
            keys = self._keys(st, full, salt)
            first = st.known_blocks
            if self._kv_cache_manager is None:
                raise KvtierError("kvtier: no KV cache manager bound (bind_kv_cache_manager)")
            ids = _group_runs(self._kv_cache_manager.get_block_ids(req_id), first, full)
            # A block is stored whole: not those some group no longer keeps (sliding-window
            # layers drop blocks behind their window), nor any before them.
            held = next((i for i in range(full - first, 0, -1)
                         if any(g[i - 1] == NULL_BLOCK for g in ids)), 0)
            st.known_blocks = full
            if held == full - first:
                continue
            ids = [g[held:] for g in ids]
            first += held
            toks = st.request.all_token_ids
            for i in range(first, full):
                self._block_info[keys[i]] = (keys[i - 1] if i else None, list(toks[i * bs : (i + 1) * bs]))
            while len(self._block_info) > BLOCK_INFO_KEYS:
                self._block_info.popitem(last=False)  # O(1), unlike a dict's first key
            meta.saves.append(SaveSpec(
                req_id, keys[first:full].packed, ids[0], keys[first - 1] if first else None, salt,
                list(toks[: full * bs]) if self._tp_size > 1 else None, first, ids[1:],
            ))
            st.saved = True
        meta.delayed_frees, self._delayed_frees = self._delayed_frees, []
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' finished stores become ``BlockStored`` events (once per key until it is
        reported removed)."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvtierWorkerMetadata):
            return
        for key in wm.stored:
            info = self._block_info.pop(key, None)
            if info is None:
                continue
            parent, tokens = info
            if key in self._announced:  # stored again (vLLM computed it locally): no news
                continue
            self._announced[key] = time.monotonic()
            if len(self._announced) > ANNOUNCED_KEYS:
                self._announced.popitem(last=False)
            self._events.append(BlockStored(
                block_hashes=[key], parent_block_hash=parent, token_ids=tokens, block_size=self._block_size,
                lora_id=None, medium=MEDIUM, lora_name=None,
            ))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. A request whose blocks were saved keeps them until the workers
        report its stores done (``get_finished``) where a worker stores straight from them in
        the background (in place, ``in_place_stores`` = ``async``); otherwise every save copies
        out within the step that makes it (through staging, or in place stores that end in the
        step: the default, and always for a hybrid model), and the blocks are freed at once."""
        st = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if st is None or not st.saved or self._kv_path == "staging" or self._stores_end_in_step:
            return False, None  # the saves copied the blocks out within the step
        self._delayed_frees.append(request.request_id)
        return True, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` for hybrid models (vLLM's hybrid KV cache manager)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def take_events(self) -> list[KVCacheEvent]:
        """This step's KV events: ``BlockStored`` for finished stores, ``BlockRemoved`` for
        announced blocks kvtier dropped since (as the sidecar reports them, or found missing by
        a ``Match``)."""
        self._take_removals()
        events, self._events = self._events, []
        return events

    def _take_removals(self) -> None:
        """The sidecar's removals of announced blocks become one ``BlockRemoved``; a clear or a
        lag (unnamed removals) removes every block announced before it was heard (one
        announced after may have been stored before it and cleared: a later ``Match`` finds
        that)."""
        if self._session is None:
            return
        r = self._session.take_removals()
        gone = [k for k in r.keys if k in self._announced]
        if r.cleared or r.lost:
            named = set(gone)
            gone += [k for k, at in self._announced.items() if at <= r.unnamed_at and k not in named]
        self._announce_removed(gone)

    def _announce_removed(self, gone: list[int]) -> None:
        """One ``BlockRemoved`` for announced keys ``gone``, which are no longer announced."""
        if gone:
            for k in gone:
                del self._announced[k]
            self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM))

    # ==========================================================================================
    # Worker side
    # ==========================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes vLLM's per-layer KV tensors (CPU or CUDA) and registers them: where they lie
        when the sidecar can reach them, with the layout their strides give (``kv_path``
        ``auto`` or ``in_place``; :mod:`kvtier.integrations.in_place`), else a staging pool the
        blocks are copied through (``auto`` says why in the log; ``in_place`` raises)."""
        g = self._geometry
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: no KV cache for layers {missing}")
        caches = [kv_caches[n] for n in self._layer_names]  # several layers may share one tensor (hybrid)
        for name, t in zip(self._layer_names, caches):
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"kvtier: layer {name}'s KV cache is on {t.device}; kvtier moves CPU and CUDA tensors")
            if t.dtype != _TORCH_DTYPES[g.dtype]:
                raise ValueError(f"kvtier: layer {name}'s KV cache is {t.dtype}, expected {g.dtype}")
            ok4 = t.dim() == 4 and tuple(t.shape[1:]) == (g.kv_heads, g.block_tokens, 2 * g.head_dim)
            ok5 = t.dim() == 5 and t.shape[0] == 2 and tuple(t.shape[2:]) == (g.block_tokens, g.kv_heads, g.head_dim)
            if not (ok4 or ok5):
                raise ValueError(
                    f"kvtier: layer {name}'s KV cache has shape {tuple(t.shape)}; expected "
                    f"[blocks, {g.kv_heads}, {g.block_tokens}, {2 * g.head_dim}] or "
                    f"[2, blocks, {g.block_tokens}, {g.kv_heads}, {g.head_dim}]"
                )
        self._kv_caches = caches
        self._session = open_session(self._target, self._client_name, auth_token=self._auth_token, geometry=g,
                                     engine_kv="vLLM's KV cache")
        try:
            if self._kv_path != "staging":
                try:
                    self._handle = self._register_in_place(self._session)
                    self._in_place = True
                    logger.info("kvtier: vLLM's KV cache (%s) registered in place", caches[0].device)
                except (NotInPlace, KvtierError) as e:
                    if self._kv_path == "in_place":
                        raise KvtierError(f"kvtier: kv_path = in_place, but vLLM's KV cache cannot be registered "
                                          f"in place: {e}") from e
                    logger.info("kvtier: vLLM's KV cache is copied through a staging pool: %s", e)
            if not self._in_place:
                self._pool, self._handle = add_staging_pool(
                    self._session, slots=self._staging_slots, model=self._model, tp_rank=self._tp_rank,
                    tp_size=self._tp_size)
                staging = (
                    torch.from_numpy(self._pool.raw).view(_TORCH_DTYPES[g.dtype])
                    .view(g.layers, self._staging_slots, 2, g.block_tokens, g.kv_heads, g.head_dim)
                )
                self._copies = StagedCopies(staging, caches, self._layer_groups, g.head_dim)
                self._free = deque(range(self._staging_slots))
        except BaseException:
            self._session.close()
            self._session = None
            raise
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-store")
        if self._load_async:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")

    def _register_in_place(self, session: Session) -> PoolHandle:
        """vLLM's KV registered where it lies, each layer in its KV cache group."""
        return register_in_place(session, [kv_planes(t, self._geometry.head_dim) for t in self._kv_caches],
                                 self._model, tp_rank=self._tp_rank, tp_size=self._tp_size,
                                 groups=self._layer_groups)

    # --- staging slots ---------------------------------------------------------------------

    def _take_slots(self, n: int) -> list[int]:
        """Up to ``n`` free staging slots, waiting for stores in flight while none is free
        (on the engine's thread, which alone reaps stores). With none in flight, the ended
        ones are reaped and held slots whose store's ``not_after`` has passed come back; if
        still none is free, :class:`~kvtier.errors.KvtierError`."""
        with self._slot_lock:
            while not self._free and any(not f.done() for _, _, f in self._stores):
                self._slot_lock.wait(0.05)
        if not self._free:
            self._reap(block=False)  # stores that ended held give their slots back once due
        with self._slot_lock:
            if self._free:
                return [self._free.popleft() for _ in range(min(n, len(self._free)))]
        held = sum(len(slots) for _, slots, _ in self._unsure)
        raise KvtierError(f"kvtier: no free staging slot ({held} held for stores of unknown outcome "
                          "until their not_after)" if held else "kvtier: no free staging slot")

    def _give_slots(self, slots: list[int]) -> None:
        with self._slot_lock:
            self._free.extend(slots)
            self._slot_lock.notify_all()

    def _staged(self) -> StagedCopies:
        assert self._copies is not None, "staging copies without a staging pool"
        return self._copies

    def _worker_keys(self, keys: bytes, token_ids: list[int] | None, first: int, salt: str) -> BlockKeys:
        """A spec's keys in this rank's namespace (rank 0's are the scheduler's)."""
        k = BlockKeys(keys)
        if self._tp_rank == 0 or token_ids is None:
            return k
        _, handle = self._ready()
        return handle.keys(token_ids, cache_salt=salt)[first : first + len(k)]

    # --- loads -----------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts this step's loads: one ``Load`` (layer events) per request, straight into
        vLLM's blocks when its KV is registered in place, else into staging slots (blocks beyond
        the free staging slots are then loaded first, whole, in runs)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._session_ok()  # else the loads fail, and their blocks are recomputed
        session, handle = self._ready()
        self._finish_loads()
        self._reap(block=False)  # stores that ended give their slots back (held ones once due)
        loads: list[tuple[LoadSpec, BlockKeys]] = []
        for spec in meta.loads:
            keys = self._worker_keys(spec.keys, spec.token_ids, spec.first_block, spec.cache_salt)
            if spec.asynchronous and self._loader is not None:
                # In place straight into vLLM's blocks; else into the staging slots free now,
                # which get_finished copies into vLLM's blocks.
                slots: list[int] = []
                if not self._in_place:
                    with self._slot_lock:
                        slots = [self._free.popleft() for _ in range(min(len(spec.block_ids), len(self._free)))]
                self._async_loads[spec.req_id] = self._loader.submit(
                    self._load_blocks, session, handle, spec, keys, slots)
            else:
                loads.append((spec, keys))
        if self._in_place:
            for spec, keys in loads:
                a = _ActiveLoad(spec, keys, list(spec.block_ids), None)
                try:
                    a.stream = session.load(handle, keys, a.slots, cache_salt=spec.cache_salt)
                except KvtierError as e:
                    logger.warning("kvtier: load for %s failed: %s", spec.req_id, e)
                    self._load_errors.update(spec.block_ids)
                    continue
                self._active_loads.append(a)
            return
        jobs = [(spec, keys, list(spec.block_ids)) for spec, keys in loads]
        with self._slot_lock:
            room = len(self._free)

        def recompute(rest: list[tuple[LoadSpec, BlockKeys, list[int]]], e: KvtierError) -> None:
            logger.warning("kvtier: %s; %d loads are recomputed", e, len(rest))
            self._load_errors.update(b for _, _, blocks in rest for b in blocks)

        total = sum(len(b) for _, _, b in jobs)
        # Whatever does not fit the free slots is loaded now, whole, in runs.
        over = max(0, total - room)
        while over > 0 and jobs:
            spec, keys, blocks = jobs[0]
            k = min(over, len(blocks))
            done = 0
            while done < k:
                try:
                    slots = self._take_slots(k - done)
                except KvtierError as e:  # every slot is kept from reuse
                    recompute([(spec, keys, blocks[done:])] + jobs[1:], e)
                    return
                try:
                    self._load_sync(session, handle, spec, keys[done : done + len(slots)],
                                    blocks[done : done + len(slots)], slots)
                finally:
                    self._give_slots(slots)
                done += len(slots)
            over -= k
            if k == len(blocks):
                jobs.pop(0)
            else:
                jobs[0] = (spec, keys[k:], blocks[k:])
        for j, (spec, keys, blocks) in enumerate(jobs):
            try:
                slots = self._take_slots(len(blocks))
            except KvtierError as e:
                recompute(jobs[j:], e)
                return
            for i in range(len(slots), len(blocks), len(slots)):  # stores took slots meanwhile
                self._load_sync(session, handle, spec, keys[i : i + len(slots)], blocks[i : i + len(slots)],
                                slots[: len(blocks[i : i + len(slots)])])
            a = _ActiveLoad(LoadSpec(spec.req_id, keys[: len(slots)].packed, blocks[: len(slots)], spec.cache_salt),
                            keys[: len(slots)], slots, None)
            try:
                a.stream = session.load(handle, a.keys, slots, cache_salt=spec.cache_salt)
            except KvtierError as e:
                logger.warning("kvtier: load for %s failed: %s", spec.req_id, e)
                self._load_errors.update(a.spec.block_ids)
                self._give_slots(slots)
                continue
            self._active_loads.append(a)

    def _load_blocks(self, session: Session, handle: PoolHandle, spec: LoadSpec, keys: BlockKeys,
                     slots: list[int]) -> _Fetched:
        """A background load (``load_async``, on the loader thread): straight into vLLM's
        blocks in place (``slots`` empty), else into staging ``slots`` (the blocks past them
        fail)."""
        blocks = spec.block_ids
        into = slots if not self._in_place else [_slot(b) for b in blocks]
        # In place, a hybrid model's other groups' blocks (none where a group keeps none).
        groups = [[_slot(b) for b in g] for g in spec.group_block_ids] if self._in_place else []
        n = len(into)
        got = _Fetched(slots=slots, failed=set(blocks[n:]), copy_blocks=[[] for _ in range(self._num_groups)])
        try:
            done = session.load_wait(handle, keys[:n], into, cache_salt=spec.cache_salt,
                                     group_slots=groups) if n else None
        except Exception as e:  # noqa: BLE001 - whatever happened, the request must be reported
            # (a load that never reports leaves the request waiting in vLLM forever)
            logger.warning("kvtier: load for %s failed: %s", spec.req_id, e)
            got.failed.update(blocks)
            return got
        missing = set(done.missing) if done is not None else set()
        by_group = spec.by_group()
        for i, (k, s) in enumerate(zip(keys[:n], into)):
            if k in missing:
                got.failed.add(blocks[i])
            elif not self._in_place:
                got.copy_slots.append(s)
                for g, ids in zip(got.copy_blocks, by_group):
                    g.append(ids[i])
        return got

    def _load_sync(self, session: Session, handle: PoolHandle, spec: LoadSpec, keys: BlockKeys,
                   blocks: list[int], slots: list[int]) -> None:
        try:
            done = session.load_wait(handle, keys, slots, cache_salt=spec.cache_salt)
        except KvtierError as e:
            logger.warning("kvtier: load for %s failed: %s", spec.req_id, e)
            self._load_errors.update(blocks)
            return
        ok_slots, ok_blocks = self._split_missing(keys, blocks, slots, done)
        if ok_blocks:  # one KV cache group: hybrid models load in the background
            self._staged().copy_out(ok_slots, [ok_blocks], range(self._geometry.layers))

    def _split_missing(self, keys: BlockKeys, blocks: list[int], slots: list[int],
                       done: LoadDone) -> tuple[list[int], list[int]]:
        """The (slots, blocks) that were loaded; the others become load errors."""
        missing = set(done.missing)
        ok_s, ok_b = [], []
        for k, b, s in zip(keys, blocks, slots):
            if k in missing:
                self._load_errors.add(b)
            else:
                ok_s.append(s)
                ok_b.append(b)
        return ok_s, ok_b

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Waits for every active load's ``LayerReady`` of this layer (and, through a staging
        pool, copies the layer into vLLM's blocks)."""
        if not self._active_loads:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._advance_loads(layer)

    def _read_event(self, a: _ActiveLoad) -> bool:
        """Reads the next event of ``a``'s load into its state; False when its stream has no
        more (ended, or failed: then every block of it counts as missing)."""
        if a.stream is None:
            return False
        try:
            ev = next(a.stream)
        except StopIteration:
            a.stream = None
            return False
        except KvtierError as e:
            logger.warning("kvtier: load for %s failed: %s", a.spec.req_id, e)
            a.missing.update(a.keys)
            a.stream = None
            return False
        if isinstance(ev, LayerReady):
            a.ready_layer = ev.layer
        elif isinstance(ev, BlocksMissing):
            a.missing.update(ev.keys)
        elif isinstance(ev, LoadDone):
            a.done = ev
            a.missing.update(ev.missing)
            a.ready_layer = self._geometry.layers - 1
        return True

    def _advance_loads(self, layer: int) -> None:
        """Reads each active load's events up to ``layer``'s ``LayerReady`` and copies the
        layers that arrived into vLLM's blocks."""
        for a in self._active_loads:
            while a.done is None and a.ready_layer < layer and self._read_event(a):
                pass
            upto = min(layer, a.ready_layer)
            if upto > a.copied and not self._in_place:
                pairs = [(s, b) for k, s, b in zip(a.keys, a.slots, a.spec.block_ids) if k not in a.missing]
                if pairs:  # one KV cache group: hybrid models load in the background
                    self._staged().copy_out([s for s, _ in pairs], [[b for _, b in pairs]],
                                            range(a.copied + 1, upto + 1))
                a.copied = upto

    def _finish_loads(self) -> None:
        """Completes every active load (all layers), notes its missing blocks as load errors
        and frees its slots."""
        if not self._active_loads:
            return
        self._advance_loads(self._geometry.layers - 1)
        for a in self._active_loads:
            while a.done is None and self._read_event(a):  # the events after the last layer's
                pass
            if a.done is None:  # the stream ended without LoadDone, or failed
                a.missing.update(a.keys)
            self._load_errors.update(b for k, b in zip(a.keys, a.spec.block_ids) if k in a.missing)
            if not self._in_place:
                self._give_slots(a.slots)
        self._active_loads = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves -----------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Through staging: copies this layer of the step's saved blocks into their staging
        slots now, as vLLM has just written it (CUDA KV: on a copy stream that waits for the
        layer, so the next layers compute while it goes out); :meth:`wait_for_save` stores them
        once every layer is in. In place: nothing (stores read vLLM's blocks after the step)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or self._in_place:
            return
        for p in self._layer_saves():
            if p.run is not None and layer not in p.copied:
                self._staged().copy_layer_in(layer, p.run)
                p.copied.add(layer)

    def _save_keys(self, spec: SaveSpec) -> tuple[BlockKeys, int | None]:
        """A save's keys and parent in this rank's namespace (ranks other than 0 hash the
        prefix's tokens once for both)."""
        if self._tp_rank == 0 or spec.token_ids is None:
            return BlockKeys(spec.keys), spec.parent
        _, handle = self._ready()
        every = handle.keys(spec.token_ids, cache_salt=spec.cache_salt)
        first = spec.first_block
        return every[first : first + len(BlockKeys(spec.keys))], (every[first - 1] if first else None)

    def _layer_saves(self) -> list[_StagedSave]:
        """This step's saves through staging, planned at the step's first saved layer: each
        with the staging slots free then for its leading blocks (none is waited for)."""
        if self._in_place or not self.has_connector_metadata() or self._session is None or self._session.closed:
            return []
        meta = self._get_connector_metadata()
        if self._planned_for is meta:
            return self._planned
        assert isinstance(meta, KvtierConnectorMetadata)
        self._planned_for, self._planned = meta, []
        for spec in meta.saves:
            keys, parent = self._save_keys(spec)
            with self._slot_lock:
                slots = [self._free.popleft() for _ in range(min(len(keys), len(self._free)))]
            n = len(slots)
            run = self._staged().run([g[:n] for g in spec.by_group()], slots) if n else None
            self._planned.append(_StagedSave(spec, keys, parent, run))
        return self._planned

    def wait_for_save(self) -> None:
        """Finishes this step's loads, then queues one ``Store`` per saved run on a background
        thread: straight from vLLM's blocks when its KV is registered in place (after the
        step's GPU work is done; the request's blocks stay vLLM's until ``get_finished``
        reports it; the stores end before this returns unless ``in_place_stores`` = ``async``
        for a model of one KV cache group), else from the staging
        slots the blocks were copied into (per layer by :meth:`save_kv_layer`, the rest now;
        vLLM may reuse its blocks when this returns)."""
        self._finish_loads()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        if not self._session_ok():  # the sidecar is away: this step's saves are skipped
            if self._planned_for is meta:
                if any(p.run is not None for p in self._planned):
                    self._staged().done()  # copies into the slots (a copy stream) end first
                self._give_slots([x for p in self._planned if p.run is not None for x in p.run.slots])
            self._planned_for, self._planned = None, []
            return
        session, handle = self._ready()
        assert self._executor is not None
        if self._in_place:
            # vLLM may write a block freed meanwhile as soon as this step returns: a hybrid
            # model's window groups free blocks as the window moves on, unannounced, and vLLM
            # >= 0.34 applies the next step's copy-on-write block copies before it reports
            # preemptions. So the stores reading them end first (in_place_stores = in_step;
            # always for a hybrid model), all within step_store_timeout_s whatever their number.
            in_step = self._stores_end_in_step
            if in_step and meta.saves and time.monotonic() < self._save_again_at:
                return  # a sidecar that has not kept up lately: this step computes, unsaved
            computed: torch.cuda.Event | None = None
            if meta.saves and self._kv_caches[0].is_cuda:
                computed = torch.cuda.Event()
                computed.record()
            deadline = time.monotonic() + self._step_store_timeout_s if in_step else None
            self._late_stores = 0
            for spec in meta.saves:
                keys, parent = self._save_keys(spec)
                self._submit_store(spec.req_id, session, handle, keys, list(spec.block_ids), parent,
                                   spec.cache_salt, computed, spec.group_block_ids, deadline)
            self._reap(block=in_step)
            if in_step and meta.saves:
                self._pace_saves()
            return
        plan = self._layer_saves()
        for p in plan:  # layers vLLM did not save one by one
            for layer in range(self._geometry.layers):
                if p.run is not None and layer not in p.copied:
                    self._staged().copy_layer_in(layer, p.run)
        self._staged().done()
        self._planned_for, self._planned = None, []
        for p in plan:
            spec, keys, parent, done = p.spec, p.keys, p.parent, 0
            if p.run is not None:
                done = len(p.run.slots)
                self._submit_store(spec.req_id, session, handle, keys[:done], p.run.slots, parent, spec.cache_salt,
                                   None)
                parent = keys[done - 1]
            by_group = spec.by_group()
            while done < len(keys):
                try:
                    slots = self._take_slots(len(keys) - done)
                except KvtierError as e:  # every slot is kept from reuse (stores of unknown outcome)
                    logger.warning("kvtier: %s; %d blocks of %s not saved", e, len(keys) - done, spec.req_id)
                    break
                run_keys = keys[done : done + len(slots)]
                self._staged().copy_in([g[done : done + len(slots)] for g in by_group], slots)
                self._submit_store(spec.req_id, session, handle, run_keys, slots, parent, spec.cache_salt, None)
                parent = run_keys[-1]
                done += len(slots)
        self._reap(block=False)

    def _pace_saves(self) -> None:
        """After a step's in-step stores: where some ran out of ``step_store_timeout_s`` (a
        sidecar stopped, starved or stalled, which ends no session), in-place saves pause for
        ``reconnect_interval_s``, doubling while the stores keep running out (up to 60 s), so
        such a sidecar holds vLLM's steps for a small share of the time; a step whose stores
        all end in time resumes them."""
        if not self._late_stores:
            self._save_pause_s = 0.0
            return
        self._save_pause_s = min(max(2 * self._save_pause_s, self._reopener.interval_s), SAVE_PAUSE_MAX_S)
        self._save_again_at = time.monotonic() + self._save_pause_s
        logger.warning("kvtier: %d store(s) of a step did not end within step_store_timeout_s (%.1f s); "
                       "saves in place paused for %.1f s", self._late_stores, self._step_store_timeout_s,
                       self._save_pause_s)

    def _submit_store(self, req_id: str, session: Session, handle: PoolHandle, keys: BlockKeys, slots: list[int],
                      parent: int | None, salt: str, computed: torch.cuda.Event | None,
                      groups: list[list[int]] | None = None, deadline: float | None = None) -> None:
        assert self._executor is not None
        self._stores_of[req_id] = self._stores_of.get(req_id, 0) + 1
        self._stores.append((req_id, slots, self._executor.submit(
            self._store, session, handle, keys, slots, parent, salt, computed, groups or [], deadline)))

    def _store(self, session: Session, handle: PoolHandle, keys: BlockKeys, slots: list[int],
               parent: int | None, salt: str, computed: torch.cuda.Event | None,
               groups: list[list[int]], deadline: float | None) -> list[int] | float:
        """One Store (on the store thread): the keys kvtier took, or, when the call failed
        before its ``not_after`` without saying how it ended (a cancel, a dropped connection),
        that ``not_after`` (:func:`time.time`): until then the sidecar might still publish what
        it reads from the slots, so they stay out of use (:meth:`_reap`). Every store carries
        ``not_after`` = the moment this side stops waiting for it: the sidecar publishes
        nothing of copies that end later, even of a request it reads late, so a store that
        timed out leaves its slots free at once. ``groups``: in place, a hybrid model's blocks
        in KV cache groups 1, 2, ... ``deadline`` (``time.monotonic()``): the end of the step's
        time for its stores, which the step waits for; a store not sent by then is skipped (the
        blocks may be vLLM's again when it would run)."""
        kept: float | None = None  # the not_after until which the slots stay out of use
        try:
            if computed is not None:
                try:
                    computed.synchronize()  # the forward that wrote the blocks is done
                except Exception as e:  # noqa: BLE001 (logged, never raised into vLLM's step)
                    logger.warning("kvtier: store of %d blocks skipped: %r", len(keys), e)
                    return []
            timeout = self._store_timeout_s
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    self._late_stores += 1
                    logger.warning("kvtier: store of %d blocks skipped: the step's stores took step_store_timeout_s",
                                   len(keys))
                    return []
            not_after = time.time() + timeout
            try:
                r = session.store(handle, keys, slots, parent=parent, cache_salt=salt, group_slots=groups,
                                  timeout=timeout, not_after=not_after)
            except Exception as e:  # noqa: BLE001 (logged, never raised into vLLM's step)
                held = held_until(e, not_after)
                if deadline is not None and (held is not None or isinstance(e, DeadlineExceeded)):
                    self._late_stores += 1  # the step ran out of time for it, or waits it out
                logger.warning("kvtier: store of %d blocks failed: %s%s", len(keys), e,
                               f"; its {'blocks' if self._in_place else 'slots'} are kept from reuse for "
                               f"{not_after - time.time():.1f} s (its not_after)" if held is not None else "")
                if held is not None and deadline is not None:
                    # The step's blocks are vLLM's again once wait_for_save returns: nothing
                    # signals the end of a call cut off unanswered, only its not_after (at most
                    # step_store_timeout_s away), which the step waits out.
                    time.sleep(max(0.0, held - time.time()))
                    return []
                kept = held  # read by the finally below: these slots stay out of use
                return [] if held is None else held
            refused = set(r.no_space)
            return [k for k in keys if k not in refused]
        finally:
            if not self._in_place and kept is None:
                self._give_slots(slots)

    def _reap(self, block: bool, only: set[str] | None = None) -> None:
        """Collects finished stores (``block``: waits for them; ``only``: for those requests'
        stores, which then all finish), and lets go of what held stores kept once their
        ``not_after`` has passed."""
        if block:
            wait_all([f for r, _, f in self._stores if only is None or r in only])
        kept: deque[tuple[str, list[int], Future[list[int] | float]]] = deque()
        for req_id, slots, f in self._stores:
            if not f.done():
                kept.append((req_id, slots, f))
            elif isinstance(stored := f.result(), float):
                # Held until its not_after: in place the request keeps its blocks (still
                # counted in _stores_of: not reported), through staging the slots are kept.
                self._unsure.append((req_id if self._in_place else "", slots, stored))
                if not self._in_place:
                    self._store_ended(req_id)
            else:
                self._stored_keys.extend(stored)
                self._store_ended(req_id)
        self._stores = kept
        if self._unsure:
            self._release_unsure()

    def _store_ended(self, req_id: str) -> None:
        n = self._stores_of.get(req_id, 1) - 1
        if n:
            self._stores_of[req_id] = n
        else:
            self._stores_of.pop(req_id, None)

    def _release_unsure(self) -> None:
        """Held stores whose ``not_after`` has passed (nothing of them can be published any
        more) release their slots and requests. Not earlier, not even for a replaced session: a
        transfer of the old one runs to its end with its pool still mapped."""
        now = time.time()
        unsure, self._unsure = self._unsure, []
        for req_id, slots, until in unsure:
            if until > now:
                self._unsure.append((req_id, slots, until))
            elif self._in_place:
                self._store_ended(req_id)
            else:
                self._give_slots(slots)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Binds the step's metadata and notes its delayed frees at once: vLLM may ask
        ``get_finished`` before ``wait_for_save`` (deferred finalization)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvtierConnectorMetadata):
            self._delayed.update(connector_metadata.delayed_frees)

    def handle_preemptions(self, kv_connector_metadata: Any = None) -> None:
        """Before vLLM reuses a preempted request's blocks: its stores that read them in place
        finish first, and one held until its ``not_after`` (cut off early without an answer:
        the sidecar might still publish what it reads) is waited out, as vLLM cannot be asked
        to keep a preempted request's blocks."""
        if not self._in_place:
            return
        meta = kv_connector_metadata
        preempted = set(meta) if isinstance(meta, set) else set(getattr(meta, "preempted", None) or ())
        if not preempted:
            return
        self._reap(block=True, only=preempted)
        until = max((t for r, _, t in self._unsure if r in preempted), default=0.0)
        if until > time.time():
            logger.warning("kvtier: waiting %.1f s for a preempted request's store of unknown outcome (its not_after)",
                           until - time.time())
            time.sleep(max(0.0, until - time.time()))
            self._release_unsure()

    def flush(self) -> None:
        """Waits for every store and background load in flight (for tests and shutdown)."""
        self._reap(block=True)
        wait_all(list(self._async_loads.values()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Reaps the stores that finished; reports the finished requests whose blocks the
        scheduler kept for them (``delayed_frees``) once none of their stores is in flight, and
        the requests whose background loads ended (their failed blocks go to
        :meth:`get_block_ids_with_load_errors`, which vLLM asks next in the same pass)."""
        self._reap(block=False)
        sent = {r for r in self._delayed if r not in self._stores_of}
        self._delayed -= sent
        recving = {r for r, f in self._async_loads.items() if f.done()}
        for r in recving:
            got = self._async_loads.pop(r).result()
            if got.copy_slots:
                self._staged().copy_out(got.copy_slots, got.copy_blocks, range(self._geometry.layers))
            self._give_slots(got.slots)
            if self._num_groups == 1:
                self._load_errors.update(got.failed)
            elif got.failed:  # block ids are not unique across groups: the request fails whole
                self._failed_recving.add(r)
        return (sent or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the background loads of a hybrid model that failed in
        part (vLLM recomputes or fails those requests, by ``kv_load_failure_policy``)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The keys of the stores finished since the last step."""
        self._reap(block=False)
        if not self._stored_keys:
            return None
        meta, self._stored_keys = KvtierWorkerMetadata(self._stored_keys), []
        return meta
