"""kvtier as an SGLang HiCache storage backend (the L3 tier behind SGLang's host KV pool).

SGLang loads it through its dynamic storage backend option::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "sidecar": "unix:///run/kvtier/kvtier.sock"}'

``interface_v1`` makes SGLang's cache controller call the page variants
(:meth:`KvtierHiCacheStorage.batch_get_v1` / :meth:`~KvtierHiCacheStorage.batch_set_v1`),
which move whole runs of pages per request. SGLang's host pool is ordinary process memory: over
the sidecar's Unix socket it is registered where it lies, as a process pool whose slots are the
host pool's pages (:mod:`kvtier.integrations.in_place`), so ``batch_set_v1`` is one ``Store``
straight from the host pages and ``batch_get_v1`` one ``Load`` straight into them, the sidecar
copying to and from SGLang's memory itself, with the layout reordering each page from SGLang's
(``layer_first`` ``[K|V][layer][token]…`` or ``page_first``) to kvtier's
``[layer][K|V][token][head][dim]``, so what one node stores another reads back the same way.
Where that cannot be done (a session over TCP, a sidecar that may not reach this process, pages
not aligned to whole host pages), and for the flat-page calls, pages go through a shared-memory
staging pool of ``staging_slots`` pages (default 128, SGLang's storage batch): host pool →
staging slots → one ``Store``; one ``Load`` → staging slots → host pool, reordered by torch.

Keys are SGLang's own page hashes (hex strings chaining the prefix), reduced to kvtier's
128-bit keys (their first 32 hex digits): kvtier accepts keys computed by the caller, and a
page's hash already names its whole prefix. The kvtier namespace is the model name, the
geometry and the tensor-parallel rank/size SGLang gives, so ranks and models never mix.

extra_config keys: ``sidecar`` (a target as :func:`kvtier.connect` takes; default the
sidecar's default socket), ``auth_token``, ``kv_path`` (``auto``, the default: the host pool in
place where possible, else staging; ``in_place``: fail where not possible; ``staging``),
``staging_slots``, ``cache_salt``, ``model_name``
(default SGLang's), ``client_name``, ``reconnect_interval_s`` (default 2: how often a session
the sidecar ended, by a restart, is tried again; SGLang computes meanwhile), ``store_timeout_s``
(default 60: the longest a store is waited for; it is the store's ``not_after`` too, so the
sidecar publishes nothing of one that timed out, and the staging slots are reused at once; only
a store that failed earlier without saying how it ended makes the backend give the staging
pool up and reopen the session with a new one; in place, such a store keeps the calling thread
until its ``not_after``, so SGLang does not reuse pages the sidecar may still read).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from ..errors import KvtierError
from ..geometry import Geometry
from ..keys import BlockKeys
from ..pool import CpuPool
from ..results import PoolHandle, StoreResult
from ..session import Session
from .in_place import NotInPlace, register_in_place
from .reopen import REOPEN_CONNECT_TIMEOUT_S, Reopener, discard_reopened, held_until
from .staging import add_staging_pool, open_session, open_staging

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def page_key(sglang_hash: str) -> int:
    """kvtier's 128-bit key of an SGLang page hash (its first 32 hex digits)."""
    if len(sglang_hash) < 32:
        raise ValueError(f"page hash {sglang_hash!r}: expected at least 32 hex digits")
    return int(sglang_hash[:32], 16)

logger = logging.getLogger(__name__)


class KvtierHiCacheStorage(HiCacheStorage):
    """An SGLang ``HiCacheStorage`` on a kvtier sidecar (see the module's documentation).

    Constructed by SGLang's backend factory as ``KvtierHiCacheStorage(storage_config, kwargs)``;
    the session opens, and the staging pool and (``kv_path`` auto or in_place) the host pool
    itself are registered, when SGLang registers its host pool (:meth:`register_mem_pool_host`),
    which fixes the geometry.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self._target: str | None = extra.get("sidecar")
        self._auth_token: str | None = extra.get("auth_token")
        self._staging_slots = int(extra.get("staging_slots", 128))
        if self._staging_slots < 1:
            raise ValueError(f"staging_slots = {self._staging_slots}: give at least 1")
        self._kv_path = str(extra.get("kv_path", "auto"))
        if self._kv_path not in ("auto", "in_place", "staging"):
            raise ValueError(f"kv_path = {self._kv_path!r}: give auto, in_place or staging")
        #: The host pool registered in place (its pages are the slots); None through staging.
        self._direct: PoolHandle | None = None
        self._salt = str(extra.get("cache_salt", ""))
        self._model = str(extra.get("model_name") or storage_config.model_name or "sglang-model")
        self._client_name = str(extra.get("client_name", f"sglang-tp{storage_config.tp_rank}"))
        self._session: Session | None = None
        self._pool: CpuPool | None = None
        self._handle: PoolHandle | None = None
        # SGLang's prefetch and backup threads call in concurrently; the staging pool is one.
        self._lock = threading.Lock()
        self._session_lock = threading.Lock()  # guards the swap to a reopened session
        #: A store's outcome is unknown (it may still read the staging slots): the staging pool
        #: is given up, and the reopened session gets a new one.
        self._tainted = False
        self._reopener = Reopener(self._reopen, float(extra.get("reconnect_interval_s", 2.0)), "SGLang")
        self._store_timeout_s = float(extra.get("store_timeout_s", 60.0))
        if not self._store_timeout_s > 0:
            raise ValueError(f"store_timeout_s = {self._store_timeout_s}: give a positive number of seconds")
        self.mem_pool_host: Any = None

    # --- setup -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the kvtier session and registers a staging pool of the host pool's geometry
        (layers, KV heads, head dim, dtype, page size; the sidecar must serve that geometry) and,
        where it can, the host pool in place (``kv_path``)."""
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in ("layer_first", "page_first"):
            raise ValueError(f"kvtier: host pool layout {layout!r} is not supported (layer_first, page_first)")
        dtype = _DTYPES.get(mem_pool_host.dtype)
        if dtype is None:
            raise ValueError(f"kvtier: host pool dtype {mem_pool_host.dtype} is not supported ({list(_DTYPES)})")
        geometry = Geometry(
            int(mem_pool_host.layer_num), int(mem_pool_host.head_num), int(mem_pool_host.head_dim),
            dtype, int(mem_pool_host.page_size),
        )
        self._session, self._pool, self._handle = open_staging(
            self._target, self._client_name, auth_token=self._auth_token, geometry=geometry,
            slots=self._staging_slots, model=self._model, tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size, engine_kv="SGLang's host pool",
        )
        try:
            self._direct = self._register_direct(self._session)
        except BaseException:
            self.close()
            raise

    def _host_planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the host pool's K and V as ``[pages, page_size, head, dim]`` views (its
        whole pages)."""
        h = self.mem_pool_host
        p = h.page_size
        first = h.layout == "layer_first"  # [2, layers, tokens, heads, dim]; page_first [2, tokens, layers, ...]
        whole = h.kv_buffer.shape[2 if first else 1] // p * p
        planes = []
        for layer in range(h.layer_num):
            k, v = ((h.kv_buffer[0, layer, :whole], h.kv_buffer[1, layer, :whole]) if first
                    else (h.kv_buffer[0, :whole, layer], h.kv_buffer[1, :whole, layer]))
            planes.append((k.unflatten(0, (-1, p)), v.unflatten(0, (-1, p))))
        return planes

    def _register_direct(self, session: Session) -> PoolHandle | None:
        """The host pool registered in place in ``session`` (``kv_path`` auto or in_place), or
        None (staging)."""
        if self._kv_path == "staging":
            return None
        try:
            handle = register_in_place(session, self._host_planes(), self._model, tp_rank=self.config.tp_rank,
                                       tp_size=self.config.tp_size)
        except (NotInPlace, KvtierError) as e:
            if self._kv_path == "in_place":
                raise KvtierError(f"kvtier: kv_path = in_place, but SGLang's host pool cannot be registered in "
                                  f"place: {e}") from e
            logger.info("kvtier: SGLang's host pool is copied through a staging pool: %s", e)
            return None
        logger.info("kvtier: SGLang's host pool registered in place")
        return handle

    def close(self) -> None:
        """Closes the session (the sidecar unregisters the staging pool) and removes the pool file."""
        self._reopener.shutdown(discard_reopened)
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _ready(self) -> tuple[Session, CpuPool, PoolHandle]:
        if self._session is None or self._pool is None or self._handle is None:
            raise KvtierError("kvtier: no host pool registered yet (register_mem_pool_host)")
        return self._session, self._pool, self._handle

    def _session_ok(self) -> bool:
        """Whether the session is open. When it has ended (the sidecar restarted, or dropped
        it, or a store's outcome was unknown), it is reopened in the background with the
        staging pool registered again (a new one after an unknown store; one try per
        ``reconnect_interval_s``) and put in place by a later call; meanwhile no page is found,
        loaded or stored, and SGLang computes."""
        with self._session_lock:
            is_open, made = self._reopener.replacement(self._session)
            if made is None:
                return is_open
            session, pool, handle, direct = made
            with self._lock:  # no page copy uses the old pool any more
                old, self._session, self._handle, self._direct = self._session, session, handle, direct
                if pool is not None:
                    old_pool, self._pool, self._tainted = self._pool, pool, False
                    if old_pool is not None:
                        old_pool.close()
            old.close()
            return True

    def _reopen(self) -> tuple[Session, CpuPool | None, PoolHandle, PoolHandle | None]:
        """A new session with the staging pool registered again, or a new staging pool after a
        store of unknown outcome, and the host pool in place again (on the reopen thread)."""
        assert self._pool is not None
        session = open_session(self._target, self._client_name, auth_token=self._auth_token,
                               geometry=self._pool.geometry, engine_kv="SGLang's host pool",
                               connect_timeout=REOPEN_CONNECT_TIMEOUT_S)
        try:
            direct = self._register_direct(session)
            if self._tainted:
                pool, handle = add_staging_pool(session, slots=self._staging_slots, model=self._model,
                                                tp_rank=self.config.tp_rank, tp_size=self.config.tp_size)
                return session, pool, handle, direct
            return session, None, session.register_pool(self._pool, self._model, tp_rank=self.config.tp_rank,
                                                        tp_size=self.config.tp_size), direct
        except BaseException:
            session.close()
            raise

    def _store(self, session: Session, handle: PoolHandle, keys: BlockKeys, slots: list[int] | None = None,
               **kw: Any) -> StoreResult | None:
        """One Store from the staging slots ``0..len(keys)`` (or in place from host pages
        ``slots``), or None when it failed. It carries
        the moment this side stops waiting as its ``not_after``: the sidecar publishes nothing
        of copies that end later, even of a request it reads late, so the slots are free again
        once the call ends, a timeout included. Only a store that failed earlier without saying
        how it ended (a cancel, a dropped connection) may still be published from what the
        sidecar reads of the slots: the pool is given up (the session closed, a new pool made
        when it is reopened) rather than written again; in place, this thread waits for
        ``not_after`` before SGLang may reuse the host pages."""
        not_after = time.time() + self._store_timeout_s
        try:
            return session.store(handle, keys, range(len(keys)) if slots is None else slots, cache_salt=self._salt,
                                 timeout=self._store_timeout_s, not_after=not_after, **kw)
        except KvtierError as e:
            until = held_until(e, not_after)
            if until is not None and slots is not None:
                logger.warning("kvtier: a store's outcome is unknown (%s); its host pages are handed back at its "
                               "not_after, in %.1f s", e, until - time.time())
                # The sidecar publishes nothing of copies that end after not_after: a real deadline.
                time.sleep(max(0.0, until - time.time()))
            elif until is not None:
                logger.warning("kvtier: a store's outcome is unknown (%s); the staging pool is replaced", e)
                self._tainted = True
                session.close()
            else:
                logger.warning("kvtier: a store of %d pages failed: %s", len(keys), e)
            return None

    # --- page copies between SGLang's host pool and the staging slots ----------------------

    def _host_page(self, index: int) -> torch.Tensor:
        """Page at token index ``index`` of the host pool as ``(layer, K|V, token, head, dim)``
        (a strided view)."""
        host = self.mem_pool_host
        p = host.page_size
        if host.layout == "layer_first":  # kv_buffer [2, layers, tokens, heads, dim]
            return host.kv_buffer[:, :, index : index + p].permute(1, 0, 2, 3, 4)
        # page_first: kv_buffer [2, tokens, layers, heads, dim]
        return host.kv_buffer[:, index : index + p].permute(2, 0, 1, 3, 4)

    def _flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in SGLang's order for this layout (what ``get_data_page(flat=True)``
        gives and ``set_from_flat_data_page`` takes) as ``(layer, K|V, token, head, dim)``."""
        h = self.mem_pool_host
        if h.layout == "layer_first":
            return flat.view(2, h.layer_num, h.page_size, h.head_num, h.head_dim).permute(1, 0, 2, 3, 4)
        return flat.view(2, h.page_size, h.layer_num, h.head_num, h.head_dim).permute(2, 0, 1, 3, 4)

    def _slot(self, pool: CpuPool, slot: int) -> torch.Tensor:
        """Staging slot ``slot`` as a torch view ``(layer, K|V, token, head, dim)`` of the
        host pool's dtype (numpy holds bf16 as raw 16-bit words)."""
        arr = pool.kv[:, slot]
        t = torch.from_numpy(arr) if arr.dtype != np.uint16 else torch.from_numpy(arr.view(np.int16))
        return t.view(self.mem_pool_host.dtype)

    def _runs(self, keys: list[str]) -> Any:
        """``(start, run)``: ``keys`` in runs of at most ``staging_slots`` pages, one request each."""
        for start in range(0, len(keys), self._staging_slots):
            yield start, keys[start : start + self._staging_slots]

    def _load_leading(self, keys: list[str], host_slots: list[int] | None, put: Any) -> None:
        """Loads ``keys`` one run (one Load) at a time, in place into host pages ``host_slots``,
        or (None) into the staging slots, and calls ``put(i, slot)`` for each page ``i`` in
        order (``slot`` its staging slot as a torch view, None in place), stopping at the first
        page kvtier does not hold. The caller checked the session."""
        session, pool, handle = self._ready()
        direct = self._direct if host_slots is not None else None
        with contextlib.nullcontext() if direct is not None else self._lock:
            for start, run in self._runs(keys):
                slots = range(len(run)) if host_slots is None else host_slots[start : start + len(run)]
                try:
                    done = session.load_wait(direct or handle, BlockKeys.from_ints(page_key(k) for k in run), slots,
                                             cache_salt=self._salt)
                except KvtierError as e:
                    logger.warning("kvtier: a load of %d pages failed: %s", len(run), e)
                    return
                missing = set(done.missing)
                for j, k in enumerate(run):
                    if page_key(k) in missing:
                        return
                    put(start + j, None if direct is not None else self._slot(pool, j))

    def _store_leading(self, keys: list[str], host_slots: list[int] | None, parent: int | None, stage: Any,
                       out: list[bool]) -> None:
        """Stores ``keys`` (one sequence's run, after ``parent``) one run (one Store) at a time,
        in place from host pages ``host_slots``, or (None) from the staging slots, which
        ``stage(i, slot)`` fills with page ``i`` first; marks in ``out`` what kvtier took. The
        caller checked the session."""
        session, pool, handle = self._ready()
        direct = self._direct if host_slots is not None else None
        with contextlib.nullcontext() if direct is not None else self._lock:
            for start, run in self._runs(keys):
                if direct is None:
                    for j in range(len(run)):
                        stage(start + j, self._slot(pool, j))
                slots = None if host_slots is None else host_slots[start : start + len(run)]
                r = self._store(session, direct or handle, BlockKeys.from_ints(page_key(k) for k in run), slots,
                                parent=parent)
                if r is None:
                    return
                refused = set(r.no_space)
                for j, k in enumerate(run):
                    out[start + j] = page_key(k) not in refused
                parent = page_key(run[-1])

    # --- in place: the host pool's pages are the slots --------------------------------------

    def _in_place_slots(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """The host pages (slots of the in-place pool) of ``n`` pages at ``host_indices``, or None
        when the host pool is not in place or a page is not one whole aligned host page."""
        if self._direct is None or n == 0:
            return None
        p = self.mem_pool_host.page_size
        idx = host_indices[: n * p].to(torch.int64).view(n, p)
        first = idx[:, 0]
        if bool((first % p != 0).any()) or not bool((idx - first[:, None] == torch.arange(p)).all()):
            return None
        return (first // p).tolist()  # type: ignore[no-any-return]

    # --- the page interface (interface_v1) -------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` kvtier holds (host or disk); 0 while the sidecar
        is away."""
        if not keys or not self._session_ok():
            return 0
        session, _, handle = self._ready()
        try:
            m = session.match(handle, BlockKeys.from_ints(page_key(k) for k in keys), cache_salt=self._salt)
        except KvtierError:
            return 0
        return m.matched_blocks

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Loads pages ``keys`` into the host pool at ``host_indices`` (page_size indices per
        page); one Load per staging batch. A page that is missing, and every page after it,
        is False (SGLang uses the leading run). In place: one Load per ``staging_slots`` pages,
        straight into the host pages."""
        p = self.mem_pool_host.page_size
        out = [False] * len(keys)
        if not keys or not self._session_ok():
            return out

        def put(i: int, slot: torch.Tensor | None) -> None:
            if slot is not None:
                self._host_page(int(host_indices[i * p])).copy_(slot)
            out[i] = True

        self._load_leading(keys, self._in_place_slots(host_indices, len(keys)), put)
        return out

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys`` (one run of one
        sequence); one Store per staging batch. A page kvtier refused (no host room, queue
        full) is False; every page while the sidecar is away. In place: straight from the host
        pages."""
        p = self.mem_pool_host.page_size
        out = [False] * len(keys)
        if not keys or not self._session_ok():
            return out
        prefix = extra_info.prefix_keys if extra_info is not None and extra_info.prefix_keys else None
        parent = page_key(prefix[-1]) if prefix else None

        def stage(i: int, slot: torch.Tensor) -> None:
            slot.copy_(self._host_page(int(host_indices[i * p])))

        self._store_leading(keys, self._in_place_slots(host_indices, len(keys)), parent, stage, out)
        return out

    # --- the per-page interface (flat tensors), for SGLang's generic path ------------------

    def exists(self, key: str) -> bool:
        """Whether kvtier holds page ``key``."""
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Page ``key`` as a flat tensor in SGLang's flat page order for the host pool's layout (into ``target_location``
        when given), or None when kvtier does not hold it."""
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages ``keys`` as flat tensors (``target_locations``, or new ones); None from the
        first missing page on."""
        host = self.mem_pool_host
        out: list[torch.Tensor | None] = [None] * len(keys)

        def put(i: int, slot: torch.Tensor) -> None:
            dst = target_locations[i] if target_locations is not None else host.get_dummy_flat_data_page()
            self._flat_page(dst).copy_(slot)
            out[i] = dst

        if self._session_ok():
            self._load_leading(keys, None, put)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores one flat page (SGLang's flat page order) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Stores flat pages ``values`` under ``keys``; True when kvtier took every one."""
        if not self._session_ok():
            return False
        session, pool, handle = self._ready()
        with self._lock:
            for start, run in self._runs(keys):
                for j in range(len(run)):
                    self._slot(pool, j).copy_(self._flat_page(values[start + j]))
                r = self._store(session, handle, BlockKeys.from_ints(page_key(k) for k in run))
                if r is None:
                    return False
                if len(r.no_space) > 0:
                    return False
        return True

    def clear(self) -> None:
        """Forgets this model's pages (this namespace and salt) in every kvtier tier."""
        session, _, handle = self._ready()
        session.clear(handle, cache_salt=self._salt)

    def get_stats(self) -> Any:
        """The sidecar's counters (:class:`kvtier.Stats`)."""
        session, _, _ = self._ready()
        return session.stats()
