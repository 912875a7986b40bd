"""kvtier.integrations.vllm through vLLM's own classes, against a real `kvtier serve`.

The scheduler side is made by vLLM's real Scheduler from a VllmConfig whose kv_transfer_config
names the connector by module path (as `--kv-transfer-config` does); requests whose prefixes
were stored earlier come back with the matched token counts. The worker side gets per-layer KV
caches allocated by vLLM's own allocate_kv_cache (CPU, in two physical layouts) and moves them
bit-exact. The model is a tiny Llama config written to a temporary directory (no weights, no
tokenizer). Run by scripts/test_connectors.sh in its vLLM venv; not part of
`scripts/test_python.sh`.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sidecar import Sidecar, free_port, start_sidecar  # noqa: E402

import kvtier  # noqa: E402
from kvtier.session import wait_for  # noqa: E402
from kvtier.integrations.vllm import (  # noqa: E402
    NULL_BLOCK,
    KvtierConnector,
    KvtierConnectorMetadata,
    LoadSpec,
    SaveSpec,
    kv_geometry,
)

LAYERS, HEADS, DIM, BLOCK = 4, 2, 16, 16
NUM_BLOCKS = 64
EOS = 2
GEOMETRY = ("--set", f"model.layers={LAYERS}", "--set", f"model.kv_heads={HEADS}", "--set", f"model.head_dim={DIM}",
            "--set", "model.dtype=f16", "--set", f"model.block_tokens={BLOCK}")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), geometry=GEOMETRY, host_capacity="64MiB")
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("model")
    LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=HEADS, head_dim=DIM,
                max_position_embeddings=4096, eos_token_id=EOS).save_pretrained(d)
    return str(d)


def vllm_config(sidecar: Sidecar, model_dir: str, **extra: Any) -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=4096)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False,
                                         disable_hybrid_kv_cache_manager=True),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                                 enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"sidecar": sidecar.target, "model_name": "test/tiny-llama", **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(layout: KVCacheLayout = KVCacheLayout.LBNHC, heads: int = HEADS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=DIM, dtype=torch.float16)
    page = spec.page_size_bytes
    if layout.is_block_outermost:  # a block holds every layer's page
        tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=NAMES, layer_stride=page,
                               block_stride=page * LAYERS)
    else:
        tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=NAMES, layer_stride=page * NUM_BLOCKS,
                               block_stride=page)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])


def scheduler(config: VllmConfig, kcc: KVCacheConfig) -> Scheduler:
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    s = Scheduler(vllm_config=config, kv_cache_config=kcc, log_stats=True,
                  structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    s.published = []  # type: ignore[attr-defined]
    s.kv_event_publisher.publish = s.published.append  # type: ignore[method-assign]
    return s


_hashing = [False]


def request(rid: str, tokens: list[int], max_tokens: int = 1, cache_salt: str | None = None) -> Request:
    if not _hashing[0]:
        init_none_hash(sha256)
        _hashing[0] = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256), cache_salt=cache_salt)


def worker(config: VllmConfig, kcc: KVCacheConfig, layout: KVCacheLayout = KVCacheLayout.LBNHC,
           ) -> tuple[KvtierConnector, dict[str, torch.Tensor]]:
    caches = allocate_kv_cache(kcc, torch.device("cpu"), layout)
    w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
    w.register_kv_caches(caches)
    return w, caches


def matched_blocks(target: str, salt: str = "", *, token_ids: list[int] | None = None,
                   keys: kvtier.BlockKeys | None = None) -> int:
    """How many leading blocks of a prompt (or keys) kvtier holds, asked by another client."""
    with kvtier.connect(target, "checker") as other, kvtier.CpuPool.create(other.geometry, 1) as p1:
        h = other.register_pool(p1, "test/tiny-llama")
        if keys is not None:
            return other.match(h, keys, cache_salt=salt).matched_blocks
        return other.match(h, token_ids=token_ids, cache_salt=salt).matched_blocks


def plane_caches(path: Path) -> dict[str, torch.Tensor]:
    """Per layer vLLM's ``[2, block, token, head, dim]`` views of a new shared file ``path``."""
    raw = shm_bytes(path, 2 * LAYERS * NUM_BLOCKS * BLOCK * HEADS * DIM * 2)
    planes = raw.view(torch.float16).view(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    return {n: planes[i] for i, n in enumerate(NAMES)}


@contextmanager
def in_place_engine(config: VllmConfig, name: str, seed: int) -> Iterator[
        tuple[Scheduler, KvtierConnector, dict[str, torch.Tensor], torch.Generator, dict[int, torch.Tensor]]]:
    """:func:`engine` with the worker's KV (vLLM's ``[2, block, token, head, dim]`` per layer)
    in a shared file, registered in place; the file is removed after."""
    kcc = kv_cache_config()
    s = scheduler(config, kcc)
    path = Path("/dev/shm") / f"kvtier-test-{name}-{os.getpid()}"
    w = None
    try:
        caches = plane_caches(path)
        w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        w.register_kv_caches(caches)
        assert w._in_place
        yield s, w, caches, torch.Generator().manual_seed(seed), {}
    finally:
        if w is not None:
            w.shutdown()
        s.connector.shutdown()
        path.unlink(missing_ok=True)


@contextmanager
def engine(config: VllmConfig, seed: int) -> Iterator[tuple[Scheduler, KvtierConnector, dict[str, torch.Tensor],
                                                           torch.Generator, dict[int, torch.Tensor]]]:
    """A real Scheduler and a worker on private CPU KV (vLLM's LBNHC) with the connector, a
    seeded generator and the "model"'s written blocks; both connectors shut down after."""
    kcc = kv_cache_config()
    s = scheduler(config, kcc)
    w, caches = worker(config, kcc)
    try:
        yield s, w, caches, torch.Generator().manual_seed(seed), {}
    finally:
        w.shutdown()
        s.connector.shutdown()


def block_of(t: torch.Tensor, block: int) -> torch.Tensor:
    """One block of one layer's cache, a view: [H, N, K‖V] of the 4-D views, [K|V, N, H, D] of
    the older 5-D [2, blocks, token, head, dim] tensors."""
    return t[block] if t.dim() == 4 else t[:, block]


def kvtier_view(caches: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """One block of every layer as kvtier's (layer, K|V, token, head, dim), whatever the layout."""
    return torch.stack([
        block_of(t, block).unflatten(-1, (2, DIM)).permute(2, 1, 0, 3) if t.dim() == 4 else block_of(t, block)
        for t in (caches[n] for n in NAMES)
    ])


def assert_scheduled_loaded(out: Any, req_id: str, blocks: int, caches: dict[str, torch.Tensor],
                            stored_kv: list[torch.Tensor]) -> None:
    """``out`` schedules ``req_id`` first among its new requests with ``blocks`` whole blocks
    computed, and its first ``blocks`` blocks hold ``stored_kv`` bit-exact."""
    nr = out.scheduled_new_reqs[0]
    assert (nr.req_id, nr.num_computed_tokens) == (req_id, blocks * BLOCK)
    for i, blk in enumerate(nr.block_ids[0][:blocks]):
        assert torch.equal(kvtier_view(caches, blk).view(torch.int16), stored_kv[i].view(torch.int16)), i


def forward(w: KvtierConnector, caches: dict[str, torch.Tensor], out: Any, reap: bool = True) -> KVConnectorOutput:
    """What vLLM's model runner does around a forward: let preempted requests' stores finish,
    bind the metadata, start the loads, per layer wait for its load and save it; then wait for
    the saves (``reap``; else they may end in a later step, as in a real runner) and collect
    the worker's output (finished sends and background loads included, then the load errors,
    in vLLM's order)."""
    w.handle_preemptions(out.kv_connector_metadata)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)  # type: ignore[arg-type]
    for name in NAMES:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, caches[name], None)
    w.wait_for_save()
    if reap:
        w._reap(block=True)  # the step's stores (a real runner reports them in a later step)
    results = w.get_transfer_results(out.finished_req_ids)
    meta = w.build_connector_worker_meta()
    w.clear_connector_metadata()
    return KVConnectorOutput(finished_sending=results.finished_sending or None,
                             finished_recving=results.finished_recving or None, kv_connector_worker_meta=meta,
                             invalid_block_ids=w.get_block_ids_with_load_errors())


def compute(caches: dict[str, torch.Tensor], block_ids: list[int], gen: torch.Generator,
            written: dict[int, torch.Tensor]) -> None:
    """The "model" writes KV for blocks it computes (random, remembered per block)."""
    for b in block_ids:
        for n in NAMES:
            dst = block_of(caches[n], b)
            dst.copy_(torch.randn(dst.shape, generator=gen).to(torch.float16))
        written[b] = kvtier_view(caches, b).clone()


def step(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], gen: torch.Generator,
         written: dict[int, torch.Tensor], reap: bool = True) -> Any:
    out = s.schedule()
    # The model computes the scheduled tokens' blocks (the loaded ones are not computed).
    for r in out.scheduled_new_reqs:
        first = r.num_computed_tokens // BLOCK
        last = -(-(r.num_computed_tokens + out.num_scheduled_tokens[r.req_id]) // BLOCK)
        compute(caches, r.block_ids[0][first:last], gen, written)
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        ids = s.kv_cache_manager.get_block_ids(rid)[0]
        first = cached.num_computed_tokens[i] // BLOCK
        last = -(-(cached.num_computed_tokens[i] + out.num_scheduled_tokens[rid]) // BLOCK)
        compute(caches, ids[first:last], gen, written)
    kvo = forward(w, caches, out, reap)
    reqs = list(out.num_scheduled_tokens)
    # A token is sampled once a request's prompt is all computed (none for a prefill chunk);
    # schedule() has already advanced num_computed_tokens.
    done = {r: s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens for r in reqs}
    mro = ModelRunnerOutput(req_ids=reqs, sampled_token_ids=[[7] if done[r] else [] for r in reqs],
                            kv_connector_output=kvo)
    s.update_from_output(out, mro)
    return out


def reconnected(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], gen: torch.Generator,
                written: dict[int, torch.Tensor]) -> bool:
    """Steps the engine until both sides have their sessions open again. Each side reopens on
    a thread of its own and takes the new session at a later call: engine steps with no
    request in them are enough (the scheduler polls at build_connector_meta, the worker at
    start_load_kv)."""
    return wait_for(lambda: step(s, w, caches, gen, written) is not None
                    and not s.connector._session.closed and not w._session.closed, timeout=30)


def run_to_end(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], gen: torch.Generator,
               written: dict[int, torch.Tensor]) -> list[Any]:
    """Steps until the scheduler holds nothing, finished requests whose frees wait for the
    worker's stores included."""
    outs = []
    while s.has_requests():
        outs.append(step(s, w, caches, gen, written))
        assert len(outs) < 20
    return outs


def test_scheduler_matches_stored_prefixes_and_worker_loads_bit_exact(sidecar: Sidecar, model_dir: str) -> None:
    config = vllm_config(sidecar, model_dir, staging_slots=32)
    kcc = kv_cache_config()
    s = scheduler(config, kcc)
    assert isinstance(s.connector, KvtierConnector)
    w, caches = worker(config, kcc)
    gen = torch.Generator().manual_seed(0)
    try:
        # A: 5 whole blocks + 4 tokens, prefilled in two chunks (64-token budget); nothing stored yet.
        prompt = torch.randint(100, 30000, (5 * BLOCK + 4,), generator=gen).tolist()
        written: dict[int, torch.Tensor] = {}
        s.add_request(request("a", prompt))
        outs = run_to_end(s, w, caches, gen, written)
        assert outs[0].scheduled_new_reqs[0].num_computed_tokens == 0
        # Saved: blocks 0-3 after the first chunk, block 4 after the second (not the partial tail).
        saves = [sp for o in outs for sp in o.kv_connector_metadata.saves]
        assert [(sp.req_id, len(sp.block_ids), sp.first_block) for sp in saves] == [("a", 4, 0), ("a", 1, 4)]
        a_blocks = saves[0].block_ids + saves[1].block_ids
        stored_kv = [written[b] for b in a_blocks]
        # Its 5 whole blocks were saved (over two steps) and published as BlockStored events.
        events = [e for batch in s.published for e in batch.events if isinstance(e, BlockStored)]
        assert [e.medium for e in events] == ["KVTIER"] * 5
        keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK)).keys(prompt)
        assert [e.block_hashes[0] for e in events] == list(keys)
        assert events[1].parent_block_hash == keys[0] and events[0].token_ids == prompt[:BLOCK]

        # The device forgets: vLLM's prefix cache is reset and its blocks zeroed.
        assert s.reset_prefix_cache()
        for t in caches.values():
            t.zero_()

        # B shares A's 5 blocks: the scheduler schedules only the rest, the worker loads the 5.
        s.add_request(request("b", prompt[: 5 * BLOCK] + [11] * 10))
        out = step(s, w, caches, gen, written)
        nr = out.scheduled_new_reqs[0]
        assert nr.num_computed_tokens == 5 * BLOCK
        assert out.num_scheduled_tokens["b"] == 10
        assert not s.has_unfinished_requests(), "b finished in one step: its load was good (no recompute)"
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvtierConnectorMetadata) and len(meta.loads) == 1
        assert meta.loads[0].block_ids == nr.block_ids[0][:5]
        for i, b in enumerate(nr.block_ids[0][:5]):
            assert torch.equal(kvtier_view(caches, b).view(torch.int16), stored_kv[i].view(torch.int16)), i
        run_to_end(s, w, caches, gen, written)

        # C is exactly A's 5 blocks: the match is capped so that the last token is computed.
        s.reset_prefix_cache()
        s.add_request(request("c", prompt[: 5 * BLOCK]))
        out = step(s, w, caches, gen, written)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
        assert out.num_scheduled_tokens["c"] == BLOCK
        run_to_end(s, w, caches, gen, written)

        # Another cache salt matches nothing; a different first block matches nothing.
        s.reset_prefix_cache()
        s.add_request(request("d", prompt, cache_salt="tenant-2"))
        s.add_request(request("e", [5] + prompt[1:]))
        outs = run_to_end(s, w, caches, gen, written)
        assert {r.req_id: r.num_computed_tokens for o in outs for r in o.scheduled_new_reqs} == {"d": 0, "e": 0}

        # Blocks evicted between Match and Load are reported as load errors (vLLM recomputes).
        s.reset_prefix_cache()
        s.add_request(request("f", prompt[: 3 * BLOCK] + [12] * 5))
        out = s.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
        with kvtier.connect(sidecar.target, "clearer") as other:
            other.clear(all=True)
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)  # type: ignore[arg-type]
        for name in NAMES:
            w.wait_for_layer_load(name)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set(out.scheduled_new_reqs[0].block_ids[0][:3])
        w.flush()
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        s.connector.shutdown()


def store_then_load(a: KvtierConnector, a_caches: dict[str, torch.Tensor], src: list[int],
                    b: KvtierConnector, b_caches: dict[str, torch.Tensor], dst: list[int],
                    keys: kvtier.BlockKeys, salt: str) -> None:
    """Worker ``a`` saves its blocks ``src`` under ``keys``; worker ``b`` loads them into its
    blocks ``dst`` layer by layer, as vLLM's model runner drives them; the blocks match
    bit-exact."""
    a.bind_connector_metadata(KvtierConnectorMetadata(saves=[SaveSpec("x", keys.packed, src, None, salt)]))
    a.wait_for_save()
    a.flush()
    stored = a.build_connector_worker_meta()
    assert stored is not None and stored.stored == list(keys)
    b.bind_connector_metadata(KvtierConnectorMetadata(loads=[LoadSpec("y", keys.packed, dst, salt)]))
    b.start_load_kv(None)  # type: ignore[arg-type]
    for name in NAMES:
        b.wait_for_layer_load(name)
    b.wait_for_save()
    assert b.get_block_ids_with_load_errors() == set()
    for s_, d in zip(src, dst):
        assert torch.equal(kvtier_view(b_caches, d).view(torch.int16), kvtier_view(a_caches, s_).view(torch.int16)), d


@pytest.mark.parametrize("kv_path", ["staging", "auto"])
@pytest.mark.parametrize("layouts", [(KVCacheLayout.LBNHC, KVCacheLayout.BLNHC), (KVCacheLayout.BLNHC, KVCacheLayout.LBHNC)])
def test_worker_moves_blocks_bit_exact_across_layouts_and_staging_runs(
        sidecar: Sidecar, model_dir: str, layouts: tuple[KVCacheLayout, KVCacheLayout], kv_path: str) -> None:
    """Worker A (one physical layout) stores 10 blocks, through a 4-slot staging pool or (auto)
    in place: vLLM's private CPU KV as a process pool the sidecar reads and writes itself;
    worker B (another layout) loads them into other block ids, bit-exact; the 5-D
    [2, blocks, token, head, dim] tensors of older vLLM read the same."""
    salt = f"layouts-{layouts[0].name}-{kv_path}"
    config = vllm_config(sidecar, model_dir, kv_path=kv_path, staging_slots=4, cache_salt=salt)
    kcc = kv_cache_config()
    a, a_caches = worker(config, kcc, layouts[0])
    b, b_caches = worker(config, kcc, layouts[1])
    try:
        assert a._in_place == b._in_place == (kv_path == "auto")
        assert (a._pool is None) == (kv_path == "auto")
        gen = torch.Generator().manual_seed(1)
        for t in a_caches.values():
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.float16))
        tokens = torch.randint(0, 30000, (10 * BLOCK,), generator=gen).tolist()
        keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK), cache_salt=salt).keys(tokens)
        src, dst = list(range(3, 13)), list(range(40, 50))
        store_then_load(a, a_caches, src, b, b_caches, dst, keys, salt)
        # Older vLLM's [2, blocks, token, head, dim] per layer.
        old = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.float16) for n in NAMES}
        c = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        c.register_kv_caches(old)
        try:
            c.bind_connector_metadata(KvtierConnectorMetadata(loads=[LoadSpec("z", keys.packed, dst, salt)]))
            c.start_load_kv(None)  # type: ignore[arg-type]
            c.wait_for_save()
            for i, n in enumerate(NAMES):
                for s_, d in zip(src, dst):
                    want = kvtier_view(a_caches, s_)[i]  # (K|V, token, head, dim)
                    assert torch.equal(old[n][:, d].view(torch.int16), want.view(torch.int16))
        finally:
            c.shutdown()
    finally:
        a.shutdown()
        b.shutdown()



def test_saved_layers_are_staged_as_vllm_writes_them(sidecar: Sidecar, model_dir: str) -> None:
    """Through staging, save_kv_layer copies each layer of the step's saved blocks into the
    staging slots free at the step's first layer, as vLLM writes the layer; blocks past those
    slots are copied at wait_for_save. Shown by what is stored: blocks changed after their
    layers were saved keep what the layers held then, the rest what they hold at the end."""
    salt = "per-layer"
    config = vllm_config(sidecar, model_dir, kv_path="staging", staging_slots=4, cache_salt=salt)
    kcc = kv_cache_config()
    a, a_caches = worker(config, kcc)
    b, b_caches = worker(config, kcc)
    try:
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 30000, (10 * BLOCK,), generator=gen).tolist()
        keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK),
                                cache_salt=salt).keys(tokens)
        src, dst = list(range(3, 13)), list(range(40, 50))
        a.bind_connector_metadata(KvtierConnectorMetadata(saves=[SaveSpec("x", keys.packed, src, None, salt)]))
        for name in NAMES:  # the forward writes each layer, then saves it
            for blk in src:
                t = block_of(a_caches[name], blk)
                t.copy_(torch.randn(t.shape, generator=gen).to(torch.float16))
            a.save_kv_layer(name, a_caches[name], None)
        at_save = {blk: kvtier_view(a_caches, blk).clone() for blk in src}
        for name in NAMES:  # changed after every layer was saved
            for blk in src:
                block_of(a_caches[name], blk).fill_(1.0)
        a.wait_for_save()
        a.flush()
        b.bind_connector_metadata(KvtierConnectorMetadata(loads=[LoadSpec("y", keys.packed, dst, salt)]))
        b.start_load_kv(None)  # type: ignore[arg-type]
        b.wait_for_save()
        assert b.get_block_ids_with_load_errors() == set()
        for i, (s_, d) in enumerate(zip(src, dst)):
            want = at_save[s_] if i < 4 else kvtier_view(a_caches, s_)
            assert torch.equal(kvtier_view(b_caches, d).view(torch.int16), want.view(torch.int16)), i
        assert len(a._free) == 4, "every staging slot came back"
    finally:
        a.shutdown()
        b.shutdown()

def test_blocks_kvtier_no_longer_holds_are_published_as_removed(sidecar: Sidecar, model_dir: str) -> None:
    """Blocks announced as BlockStored that a later request's Match no longer finds (here: the
    sidecar cleared by another client) are published once as BlockRemoved (medium KVTIER), and
    as BlockStored again when the request's recompute saves them."""
    with engine(vllm_config(sidecar, model_dir, cache_salt="removed"), 4) as (s, w, caches, gen, written):
        prompt = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
        keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK),
                                cache_salt="removed").keys(prompt)
        s.add_request(request("a", prompt))
        run_to_end(s, w, caches, gen, written)
        with kvtier.connect(sidecar.target, "clearer") as other:
            other.clear(all=True)
        assert s.reset_prefix_cache()
        s.add_request(request("b", prompt))
        run_to_end(s, w, caches, gen, written)
        # Found again (vLLM's own prefix cache has them too; the save that follows is no news).
        s.add_request(request("c", prompt[: 2 * BLOCK] + [3] * 5))
        run_to_end(s, w, caches, gen, written)
        events = [(type(e).__name__, e.block_hashes, e.medium) for batch in s.published for e in batch.events
                  if isinstance(e, (BlockStored, BlockRemoved))]
        stored = [("BlockStored", [k], "KVTIER") for k in keys]
        assert events == stored + [("BlockRemoved", list(keys), "KVTIER")] + stored


def test_blocks_the_sidecar_evicts_are_published_as_removed(model_dir: str, tmp_path: Path) -> None:
    """With a sidecar of 16 blocks, 8 requests of 3 blocks each: the sidecar pushes the blocks
    it evicts, and the scheduler side publishes each announced one as BlockRemoved (medium
    KVTIER) without any request asking for it again; a clear removes every announced block."""
    small = start_sidecar(tmp_path / "small", geometry=GEOMETRY, host_capacity="128KiB")
    try:
        with engine(vllm_config(small, model_dir, cache_salt="evicted"), 6) as (s, w, caches, gen, written):
            for i in range(8):
                s.add_request(request(f"r{i}", torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()))
                run_to_end(s, w, caches, gen, written)
            stored = [k for batch in s.published for e in batch.events if isinstance(e, BlockStored)
                      for k in e.block_hashes]
            assert len(stored) == 24
            # Published by the steps (the scheduler takes the connector's events), or still to come.
            removed = [k for batch in s.published for e in batch.events if isinstance(e, BlockRemoved)
                       for k in e.block_hashes]
            deadline = time.monotonic() + 10
            while len(removed) < 8 and time.monotonic() < deadline:  # at least 24 - 16 left
                removed += [k for e in s.connector.take_events() if isinstance(e, BlockRemoved) for k in e.block_hashes]
                time.sleep(0.02)
            assert len(removed) >= 8 and set(removed) <= set(stored) and len(set(removed)) == len(removed)
            with kvtier.connect(small.target, "clearer") as other:
                other.clear(all=True)
            rest: list[int] = []
            while not rest and time.monotonic() < deadline:
                rest = [k for e in s.connector.take_events() if isinstance(e, BlockRemoved) for k in e.block_hashes]
                time.sleep(0.02)
            assert sorted(removed + rest) == sorted(stored)
    finally:
        small.stop()


def test_a_geometry_the_sidecar_does_not_serve_is_refused(sidecar: Sidecar, model_dir: str) -> None:
    config = vllm_config(sidecar, model_dir)
    with pytest.raises(Exception, match="model.\\* settings"):
        KvtierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(heads=HEADS * 2))


def test_kv_caches_on_other_devices_are_refused(sidecar: Sidecar, model_dir: str) -> None:
    config = vllm_config(sidecar, model_dir)
    w = KvtierConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    meta = {n: torch.empty(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.float16, device="meta") for n in NAMES}
    with pytest.raises(ValueError, match="on meta; kvtier moves CPU and CUDA tensors"):
        w.register_kv_caches(meta)
    w.shutdown()


def shm_bytes(path: Path, nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes of a new shared mapping of ``path`` (what an engine that keeps
    its KV in shared memory has)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def test_kv_in_shared_memory_moves_in_place_and_frees_wait_for_stores(
        sidecar: Sidecar, model_dir: str, tmp_path: Path) -> None:
    """vLLM's [2, blocks, token, head, dim] KV in a shared file is registered where it lies (no
    staging pool): the real Scheduler keeps a finished request's blocks until the worker
    reports its stores done, a preempted request's stores finish before handle_preemptions
    returns (in_place_stores = async: by default they end within the step, so none is in
    flight then), and a later request loads the blocks straight into vLLM's blocks, bit-exact."""
    salt = "in-place"
    config = vllm_config(sidecar, model_dir, kv_path="in_place", cache_salt=salt, in_place_stores="async")
    kcc = kv_cache_config()
    s = scheduler(config, kcc)
    raw = shm_bytes(Path("/dev/shm") / f"kvtier-test-vllm-{os.getpid()}", 2 * LAYERS * NUM_BLOCKS * BLOCK * HEADS * DIM * 2)
    try:
        planes = raw.view(torch.float16).view(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, DIM)
        caches = {n: planes[i] for i, n in enumerate(NAMES)}
        w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        w.register_kv_caches(caches)
        gen = torch.Generator().manual_seed(3)
        try:
            assert w._in_place and w._pool is None, "registered in place, no staging pool"
            written: dict[int, torch.Tensor] = {}

            prompt = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
            s.add_request(request("a", prompt))
            out = step(s, w, caches, gen, written)
            saves = out.kv_connector_metadata.saves
            assert [(sp.req_id, len(sp.block_ids)) for sp in saves] == [("a", 3)]
            a_blocks = saves[0].block_ids
            stored_kv = [written[b] for b in a_blocks]
            # "a" is finished but its blocks wait for the worker: the next step's metadata names
            # it, the worker reports its stores done, and only then does vLLM forget it.
            assert not s.has_unfinished_requests() and "a" in s.requests
            out = step(s, w, caches, gen, written)
            assert out.kv_connector_metadata.delayed_frees == ["a"]
            assert "a" not in s.requests and not s.has_requests()

            # Preemption: a store in flight on a preempted request's blocks is done when
            # handle_preemptions returns. The store thread is held behind a gate that opens
            # only some time after handle_preemptions is called, so a handle_preemptions that
            # did not wait would return before the store ran.
            keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK),
                                    cache_salt=salt).keys(list(range(500, 500 + 2 * BLOCK)))
            gate = threading.Event()
            assert w._executor is not None
            w._executor.submit(gate.wait)
            w.bind_connector_metadata(KvtierConnectorMetadata(saves=[SaveSpec("p", keys.packed, [20, 21], None, salt)]))
            w.wait_for_save()
            w.clear_connector_metadata()
            with kvtier.connect(sidecar.target, "checker") as other, kvtier.CpuPool.create(other.geometry, 1) as p1:
                h = other.register_pool(p1, "test/tiny-llama")
                assert other.match(h, keys, cache_salt=salt).matched_blocks == 0, "held behind the gate"
                opener = threading.Timer(0.3, gate.set)
                opener.start()
                w.handle_preemptions(KvtierConnectorMetadata(preempted=["p"]))
                assert other.match(h, keys, cache_salt=salt).matched_blocks == 2
                opener.join()

            # The device forgets; "b" shares a's 3 blocks and loads them into vLLM's blocks.
            assert s.reset_prefix_cache()
            raw.zero_()
            s.add_request(request("b", prompt[: 3 * BLOCK] + [11] * 5))
            out = step(s, w, caches, gen, written)
            assert_scheduled_loaded(out, "b", 3, caches, stored_kv)
            while s.has_requests():
                step(s, w, caches, gen, written)
        finally:
            w.shutdown()
            s.connector.shutdown()
    finally:
        os.unlink(Path("/dev/shm") / f"kvtier-test-vllm-{os.getpid()}")


def store_prefix(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], gen: torch.Generator,
                 written: dict[int, torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Request "a" (3 blocks and 4 tokens) computed and saved to kvtier, then vLLM's prefix
    cache reset: a's prompt and the KV of its 3 blocks."""
    prompt = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
    s.add_request(request("a", prompt))
    out = step(s, w, caches, gen, written)
    stored_kv = [written[b] for b in out.kv_connector_metadata.saves[0].block_ids]
    run_to_end(s, w, caches, gen, written)
    assert s.reset_prefix_cache()
    return prompt, stored_kv


def assert_stores_and_loads(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor],
                            gen: torch.Generator, written: dict[int, torch.Tensor]) -> None:
    """A prefix stored now (:func:`store_prefix`) is scheduled as loaded for a request that
    shares it, into zeroed KV, bit-exact."""
    prompt, stored_kv = store_prefix(s, w, caches, gen, written)
    for t in caches.values():
        t.zero_()
    s.add_request(request("d", prompt[: 3 * BLOCK] + [11] * 5))
    out = step(s, w, caches, gen, written)
    assert_scheduled_loaded(out, "d", 3, caches, stored_kv)
    run_to_end(s, w, caches, gen, written)


def test_background_loads_keep_the_request_waiting_and_never_block_the_forward(
        sidecar: Sidecar, model_dir: str) -> None:
    """load_async = true (in place, vLLM's KV in a shared file): a request whose prefix kvtier
    holds waits in the real Scheduler's WAITING_FOR_REMOTE_KVS while its load runs (held
    behind a gate here, and steps go on meanwhile), is scheduled with the loaded tokens once
    get_finished reports it, with the blocks bit-exact, also after a local prefix-cache hit on
    its first block; a request aborted while loading keeps its blocks until the load ends;
    blocks evicted before the load are reported in the pass that reports the load, and
    recomputed."""
    salt = "async"
    config = vllm_config(sidecar, model_dir, kv_path="in_place", load_async=True, cache_salt=salt)
    kcc = kv_cache_config()
    s = scheduler(config, kcc)
    path = Path("/dev/shm") / f"kvtier-test-vllm-async-{os.getpid()}"
    raw = shm_bytes(path, 2 * LAYERS * NUM_BLOCKS * BLOCK * HEADS * DIM * 2)
    planes = raw.view(torch.float16).view(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    caches = {n: planes[i] for i, n in enumerate(NAMES)}
    w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
    gen = torch.Generator().manual_seed(8)
    written: dict[int, torch.Tensor] = {}
    free_blocks = s.kv_cache_manager.block_pool.get_num_free_blocks
    try:
        w.register_kv_caches(caches)
        assert w._in_place and w._loader is not None
        prompt, stored_kv = store_prefix(s, w, caches, gen, written)
        raw.zero_()
        idle = free_blocks()

        def gated() -> threading.Event:
            gate = threading.Event()
            assert w._loader is not None
            w._loader.submit(gate.wait)
            return gate

        # "p" shares a's first block only; its load is held: the request waits, steps go on.
        gate = gated()
        s.add_request(request("p", prompt[:BLOCK] + [9] * 3))
        out = step(s, w, caches, gen, written)
        assert out.scheduled_new_reqs == [] and s.requests["p"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert [(ld.req_id, ld.asynchronous, len(ld.block_ids)) for ld in out.kv_connector_metadata.loads] == [("p", True, 1)]
        out = step(s, w, caches, gen, written)
        assert out.scheduled_new_reqs == [] and s.requests["p"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        gate.set()
        w.flush()
        step(s, w, caches, gen, written)  # get_finished reports p
        out = step(s, w, caches, gen, written)
        assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("p", BLOCK)]
        run_to_end(s, w, caches, gen, written)

        # "b": block 0 from vLLM's own prefix cache (p's), blocks 1 and 2 loaded by kvtier.
        s.add_request(request("b", prompt[: 3 * BLOCK] + [11] * 5))
        out = step(s, w, caches, gen, written)
        assert [(ld.req_id, ld.first_block, len(ld.block_ids)) for ld in out.kv_connector_metadata.loads] == [("b", 1, 2)]
        w.flush()
        step(s, w, caches, gen, written)
        out = step(s, w, caches, gen, written)
        assert_scheduled_loaded(out, "b", 3, caches, stored_kv)
        run_to_end(s, w, caches, gen, written)

        # Aborted while loading: vLLM keeps the blocks until the load is reported.
        assert s.reset_prefix_cache()
        gate = gated()
        s.add_request(request("c", prompt[: 3 * BLOCK] + [12] * 5))
        step(s, w, caches, gen, written)
        assert s.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
        assert free_blocks() < idle
        gate.set()
        w.flush()
        step(s, w, caches, gen, written)
        assert free_blocks() == idle and not s.has_requests()

        # Evicted between Match and Load: the load ends with missing blocks, reported in the
        # same pass as the load, and the request is recomputed from the start.
        assert s.reset_prefix_cache()
        gate = gated()
        s.add_request(request("d", prompt[: 3 * BLOCK] + [13] * 5))
        step(s, w, caches, gen, written)
        with kvtier.connect(sidecar.target, "clearer") as other:
            other.clear(all=True)
        gate.set()
        w.flush()
        step(s, w, caches, gen, written)  # get_finished reports d, then its 3 failed blocks
        assert s.requests["d"].num_computed_tokens == 0
        outs = run_to_end(s, w, caches, gen, written)
        assert [(r.req_id, r.num_computed_tokens) for o in outs for r in o.scheduled_new_reqs] == [("d", 0)]
    finally:
        w.shutdown()
        s.connector.shutdown()
        path.unlink(missing_ok=True)


def test_background_loads_through_staging_copy_out_when_reported(sidecar: Sidecar, model_dir: str) -> None:
    """load_async = true with vLLM's KV in private memory (staging, 2 slots): the load takes
    the free staging slots when it starts, get_finished copies them into vLLM's blocks, and the
    block past the slots is a load error that vLLM recomputes; the slots come back."""
    salt = "async-staged"
    config = vllm_config(sidecar, model_dir, kv_path="staging", load_async=True, staging_slots=2, cache_salt=salt)
    with engine(config, 12) as (s, w, caches, gen, written):
        assert not w._in_place and w._loader is not None
        prompt, stored_kv = store_prefix(s, w, caches, gen, written)
        for t in caches.values():
            t.zero_()
        s.add_request(request("b", prompt[: 3 * BLOCK] + [11] * 5))
        out = step(s, w, caches, gen, written)
        assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        w.flush()
        step(s, w, caches, gen, written)  # reported: 2 blocks copied out, the third failed
        assert len(w._free) == 2
        out = step(s, w, caches, gen, written)
        assert_scheduled_loaded(out, "b", 2, caches, stored_kv)
        run_to_end(s, w, caches, gen, written)


def shm_caches(layout: KVCacheLayout, path: Path) -> dict[str, torch.Tensor]:
    """Per layer ``[B, H, N, K‖V]`` views of one shared-file allocation laid out physically as
    ``layout`` names it (its letters outermost first), as vLLM 0.34 views its KV cache."""
    sizes = {"L": LAYERS, "B": NUM_BLOCKS, "H": HEADS, "N": BLOCK, "C": 2 * DIM}
    nbytes = LAYERS * NUM_BLOCKS * HEADS * BLOCK * 2 * DIM * 2
    phys = shm_bytes(path, nbytes).view(torch.float16).view(*(sizes[c] for c in layout.name))
    logical = phys.permute(*(layout.name.index(c) for c in "LBHNC"))
    return {n: logical[i] for i, n in enumerate(NAMES)}


@contextmanager
def held_in_place(sidecar: Sidecar, model_dir: str, salt: str, hold_s: float, hybrid: bool = False,
                  **extra: Any) -> Iterator[tuple[Scheduler, KvtierConnector, dict[str, torch.Tensor], list[Any]]]:
    """A real Scheduler and a worker whose KV lies in a shared file, registered in place, its
    store thread held for ``hold_s`` seconds from the first ``wait_for_save``. ``hybrid``: two KV cache groups, each
    sliding-window layer over the same memory as a full-attention layer (vLLM's hybrid KV cache
    manager gives a block to one group at a time); else vLLM's ``[2, block, token, head, dim]``
    per layer. Yields them and, per ``wait_for_save``, (whether the step saved, stores of the
    worker still pending when it returned)."""
    config = vllm_config(sidecar, model_dir, kv_path="in_place", cache_salt=salt, **extra)
    if hybrid:
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        kcc = hybrid_kv_cache_config(window_tokens=2 * BLOCK)
    else:
        kcc = kv_cache_config()
    s = scheduler(config, kcc)
    path = Path("/dev/shm") / f"kvtier-test-vllm-held-{os.getpid()}"
    w, gate = None, threading.Event()
    try:
        if hybrid:
            # [B, H, N, K‖V] per layer; layers 2i (window) and 2i + 1 (full) share one tensor.
            raw = shm_bytes(path, LAYERS // 2 * NUM_BLOCKS * HEADS * BLOCK * 2 * DIM * 2)
            shared = raw.view(torch.float16).view(LAYERS // 2, NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
            caches = {n: shared[i // 2] for i, n in enumerate(NAMES)}
        else:
            caches = plane_caches(path)
        w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        w.register_kv_caches(caches)
        assert w._in_place and w._pool is None, "in place, no staging pool"
        assert w._executor is not None
        w._executor.submit(gate.wait)
        saved, seen = w.wait_for_save, []

        def wait_for_save() -> None:
            saves = bool(w._get_connector_metadata().saves) if w.has_connector_metadata() else False
            if not seen:  # held from the first step on, however long the setup took
                threading.Timer(hold_s, gate.set).start()
            saved()
            seen.append((saves, sum(not f.done() for _, _, f in w._stores)))

        w.wait_for_save = wait_for_save  # type: ignore[method-assign]
        yield s, w, caches, seen
    finally:
        gate.set()
        if w is not None:
            w.shutdown()
        s.connector.shutdown()
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["in_step", "async"])
def test_in_place_stores_end_within_the_step_unless_async(sidecar: Sidecar, model_dir: str, mode: str) -> None:
    """Dense KV in place: by default a step's stores end before wait_for_save returns (vLLM ≥
    0.34 copies blocks for the next step before it reports preemptions), checked with the store
    thread held; with in_place_stores = async they run on after it, the finished request's
    blocks kept for them. A value that is neither is refused by name."""
    with held_in_place(sidecar, model_dir, f"in-place-{mode}", 0.5, in_place_stores=mode) as (s, w, caches, seen):
        gen, written = torch.Generator().manual_seed(4), {}
        s.add_request(request("a", torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()))
        for _ in range(20):
            if not s.has_requests():
                break
            step(s, w, caches, gen, written, reap=False)
        assert seen[0][0], seen
        assert (seen[0][1] == 0) == (mode == "in_step"), seen
    with pytest.raises(ValueError, match="in_place_stores = 'later': give in_step or async"):
        KvtierConnector(vllm_config(sidecar, model_dir, in_place_stores="later"), KVConnectorRole.WORKER,
                        kv_cache_config())


@pytest.mark.parametrize("layouts", [(KVCacheLayout.LBNHC, KVCacheLayout.BLHNC),
                                     (KVCacheLayout.BLNHC, KVCacheLayout.LBHNC),
                                     (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC)])
def test_vllm_034_layouts_in_shared_memory_move_in_place(
        sidecar: Sidecar, model_dir: str, layouts: tuple[KVCacheLayout, KVCacheLayout]) -> None:
    """Every physical layout of vLLM ≥ 0.34 (K and V interleaved per token and head; layers,
    blocks or heads outermost) in a shared file is registered where it lies (kv_path = in_place,
    no staging pool): worker A stores 6 blocks, worker B (the other layout) loads them into
    other block ids, bit-exact. Where vLLM's own allocate_kv_cache builds the layout, its views
    have the same strides as these."""
    salt = f"in-place-{layouts[0].name}"
    config = vllm_config(sidecar, model_dir, kv_path="in_place", cache_salt=salt)
    paths = [Path("/dev/shm") / f"kvtier-test-vllm-{layout.name}-{os.getpid()}" for layout in layouts]
    workers: list[KvtierConnector] = []
    try:
        views = []
        for layout, path in zip(layouts, paths):
            kcc = kv_cache_config(layout)
            caches = shm_caches(layout, path)
            if layout.name not in ("LHBNC", "BHLNC"):  # vLLM 0.34 allocates these only for HNC specs
                theirs = allocate_kv_cache(kcc, torch.device("cpu"), layout)
                assert {n: t.stride() for n, t in theirs.items()} == {n: t.stride() for n, t in caches.items()}
            w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
            workers.append(w)
            w.register_kv_caches(caches)
            assert w._in_place and w._pool is None, f"{layout.name} registered in place"
            views.append(caches)
        a, b = workers
        gen = torch.Generator().manual_seed(5)
        for t in views[0].values():
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.float16))
        keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK),
                                cache_salt=salt).keys(torch.randint(0, 30000, (6 * BLOCK,), generator=gen).tolist())
        src, dst = [7, 3, 60, 0, 31, 12], [1, 2, 63, 40, 41, 5]
        store_then_load(a, views[0], src, b, views[1], dst, keys, salt)
        # Only the loaded blocks were written.
        untouched = [blk for blk in range(NUM_BLOCKS) if blk not in dst]
        assert all(not kvtier_view(views[1], blk).any() for blk in untouched)
    finally:
        for w in workers:
            w.shutdown()
        for path in paths:
            path.unlink(missing_ok=True)


def test_kv_that_cannot_move_in_place_says_why(sidecar: Sidecar, model_dir: str) -> None:
    """kv_path = in_place takes private memory (a process pool) but refuses strides the sidecar
    cannot copy, naming the reason; kv_path = auto copies those through a staging pool."""
    kcc = kv_cache_config()
    w = KvtierConnector(vllm_config(sidecar, model_dir, kv_path="in_place"), KVConnectorRole.WORKER, kcc)
    private = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.float16) for n in NAMES}
    w.register_kv_caches(private)
    assert w._in_place and w._pool is None, "private memory: in place, as a process pool"
    w.shutdown()
    path = Path("/dev/shm") / f"kvtier-test-vllm-odd-{os.getpid()}"
    try:
        # [2, blocks, token, head, dim] viewed with dim reversed: a head's elements go backwards.
        raw = shm_bytes(path, 2 * LAYERS * NUM_BLOCKS * BLOCK * HEADS * DIM * 2).view(torch.float16)
        planes = raw.view(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, DIM)
        odd = {n: planes[i].as_strided(planes[i].shape, (NUM_BLOCKS * BLOCK * HEADS * DIM, BLOCK * HEADS * DIM,
                                                         HEADS * DIM, 1, HEADS)) for i, n in enumerate(NAMES)}
        w = KvtierConnector(vllm_config(sidecar, model_dir, kv_path="in_place"), KVConnectorRole.WORKER, kcc)
        with pytest.raises(kvtier.KvtierError, match="a head's dim elements are not contiguous"):
            w.register_kv_caches(odd)
        w.shutdown()
        w = KvtierConnector(vllm_config(sidecar, model_dir), KVConnectorRole.WORKER, kcc)
        w.register_kv_caches(odd)
        assert not w._in_place and w._pool is not None
        w.shutdown()
    finally:
        path.unlink(missing_ok=True)


def test_private_kv_over_tcp_goes_through_staging(model_dir: str, tmp_path: Path) -> None:
    """Over TCP the sidecar cannot tell which process is at the other end, so vLLM's private CPU
    KV cannot be a process pool: kv_path = in_place says so, auto copies through staging."""
    port = free_port()
    sc = start_sidecar(tmp_path, "--tcp", f"127.0.0.1:{port}", geometry=GEOMETRY, host_capacity="64MiB")
    kcc = kv_cache_config()
    try:
        config = vllm_config(sc, model_dir, kv_path="in_place")
        config.kv_transfer_config.kv_connector_extra_config["sidecar"] = f"http://127.0.0.1:{port}"
        w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        private = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.float16) for n in NAMES}
        with pytest.raises(kvtier.KvtierError, match="not in a file mapping.*process pool.*Unix socket"):
            w.register_kv_caches(private)
        w.shutdown()
        config.kv_transfer_config.kv_connector_extra_config["kv_path"] = "auto"
        w = KvtierConnector(config, KVConnectorRole.WORKER, kcc)
        w.register_kv_caches(private)
        assert not w._in_place and w._pool is not None
        w.shutdown()
    finally:
        sc.stop()


# --- hybrid models: a KV cache group per attention kind ------------------------------------

FULL_NAMES, WINDOW_NAMES = NAMES[1::2], NAMES[0::2]


def hybrid_kv_cache_config(window_tokens: int) -> KVCacheConfig:
    """vLLM's hybrid KV cache: odd layers full attention (group 0), even layers a sliding
    window (group 1), each group with its own block table over one pool of blocks."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16,
                               sliding_window=window_tokens)
    page = full.page_size_bytes
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * LAYERS, layers=NAMES, layer_stride=page * NUM_BLOCKS,
                           block_stride=page)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(FULL_NAMES, full), KVCacheGroupSpec(WINDOW_NAMES, window)])


def prefix_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """What the "model" writes for the last block of ``tokens`` in ``layer``: a function of the
    whole prefix and the layer, so any block's right content is known anywhere."""
    gen = torch.Generator().manual_seed(hash((tuple(tokens), layer)) % (1 << 31))
    return torch.randn((HEADS, BLOCK, 2 * DIM), generator=gen).to(torch.float16)


def hybrid_step(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], reap: bool = True) -> Any:
    """A step where the "model" writes every scheduled block of every group's layers (its
    own block table each; none into a group's null blocks)."""
    out = s.schedule()
    for rid, n in out.num_scheduled_tokens.items():
        req = s.requests[rid]
        start = req.num_computed_tokens - n  # schedule() has advanced it
        tokens = list(req.all_token_ids)
        for g, names in enumerate((FULL_NAMES, WINDOW_NAMES)):
            ids = s.kv_cache_manager.get_block_ids(rid)[g]
            for i in range(start // BLOCK, -(-(start + n) // BLOCK)):
                if ids[i] != NULL_BLOCK:
                    for name in names:
                        caches[name][ids[i]] = prefix_kv(tokens[: (i + 1) * BLOCK], NAMES.index(name))
    kvo = forward(w, caches, out, reap)
    reqs = list(out.num_scheduled_tokens)
    done = {r: s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens for r in reqs}
    s.update_from_output(out, ModelRunnerOutput(req_ids=reqs, sampled_token_ids=[[7] if done[r] else [] for r in reqs],
                                                kv_connector_output=kvo))
    return out


def hybrid_round_trip(s: Scheduler, w: KvtierConnector, caches: dict[str, torch.Tensor], salt: str, target: str,
                      reap: bool = True) -> None:
    """A hybrid model's request runs to its end (every block stored with every layer, while
    all groups still hold it); after the prefix cache is reset and the KV zeroed, a request
    with the same prefix loads in the background into each group's own blocks, none into the
    window group's null blocks, bit-exact. ``reap``: as :func:`forward`."""
    gen = torch.Generator().manual_seed(21)
    prompt = torch.randint(100, 30000, (6 * BLOCK + 4,), generator=gen).tolist()
    s.add_request(request("a", prompt))
    outs = []
    while s.has_requests():
        outs.append(hybrid_step(s, w, caches, reap))
        assert len(outs) < 20
    w.flush()
    saves = [sp for o in outs for sp in o.kv_connector_metadata.saves]
    assert [(len(sp.block_ids), sp.first_block) for sp in saves] == [(4, 0), (2, 4)]
    assert all(len(sp.group_block_ids) == 1 and NULL_BLOCK not in sp.group_block_ids[0] for sp in saves)
    assert matched_blocks(target, salt, token_ids=prompt) == 6

    assert s.reset_prefix_cache()
    for t in caches.values():
        t.zero_()
    s.add_request(request("b", prompt[: 6 * BLOCK] + [11] * 10))
    out = hybrid_step(s, w, caches, reap)
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    load = out.kv_connector_metadata.loads[0]
    assert len(load.block_ids) == 6 and NULL_BLOCK not in load.block_ids
    assert NULL_BLOCK in load.group_block_ids[0], "the window group keeps no block before its window"
    w.flush()
    # The step after the load ended reports it, and the one after that schedules b: the load
    # may have ended within the step that started it (reported there), or only since.
    for _ in range(2):
        out = hybrid_step(s, w, caches, reap)
        if out.scheduled_new_reqs:
            break
    nr = out.scheduled_new_reqs[0]
    assert (nr.req_id, nr.num_computed_tokens) == ("b", 6 * BLOCK)
    copied = 0
    for g, names in enumerate((FULL_NAMES, WINDOW_NAMES)):
        for i, b in enumerate(nr.block_ids[g][:6]):
            if b == NULL_BLOCK:
                continue
            for name in names:
                want = prefix_kv(prompt[: (i + 1) * BLOCK], NAMES.index(name))
                assert torch.equal(caches[name][b].view(torch.int16), want.view(torch.int16)), (name, i)
                copied += 1
    assert copied == 6 * len(FULL_NAMES) + sum(b != NULL_BLOCK for b in load.group_block_ids[0]) * len(WINDOW_NAMES)
    while s.has_requests():
        hybrid_step(s, w, caches, reap)


def test_hybrid_models_store_whole_blocks_and_load_each_groups_own(sidecar: Sidecar, model_dir: str) -> None:
    """vLLM's hybrid KV cache manager (full-attention and sliding-window groups, a block table
    each) on private CPU KV, through staging: every block is stored with every layer while all
    groups still hold it; a later request loads in the background (how vLLM takes a hybrid
    model's failed load) into each group's own blocks, none into the window group's null
    blocks before its window, and decodes from exactly what was computed."""
    config = vllm_config(sidecar, model_dir, kv_path="staging", staging_slots=32, cache_salt="hybrid")
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    kcc = hybrid_kv_cache_config(window_tokens=2 * BLOCK)
    s = scheduler(config, kcc)
    w, caches = worker(config, kcc)
    try:
        assert len(s.kv_cache_config.kv_cache_groups) == 2 and w._num_groups == 2
        assert not w._in_place and w._loader is not None, "staged, loads in the background"
        hybrid_round_trip(s, w, caches, "hybrid", sidecar.target)
    finally:
        w.shutdown()
        s.connector.shutdown()


def test_hybrid_models_in_shared_memory_move_in_place(sidecar: Sidecar, model_dir: str) -> None:
    """A hybrid model's KV in a shared file registers in place with each layer's KV cache
    group (no staging pool): stores read, and background loads write, each group's own blocks
    straight in vLLM's memory, none into the window group's null blocks; with the store thread
    held, a step's stores still end before its wait_for_save returns (vLLM may write a freed
    window block in the next step before it calls start_load_kv)."""
    salt = "hybrid-in-place"
    with held_in_place(sidecar, model_dir, salt, 0.5, hybrid=True) as (s, w, caches, seen):
        hybrid_round_trip(s, w, caches, salt, sidecar.target, reap=False)
        assert any(saves for saves, _ in seen) and not any(n for _, n in seen), seen


def test_hybrid_in_place_stores_share_one_deadline_per_step(sidecar: Sidecar, model_dir: str) -> None:
    """A hybrid model's in-place stores of a step share step_store_timeout_s: with the store thread
    held past it, wait_for_save returns once the thread is free and the store still queued is
    skipped, not sent late (vLLM may have written its blocks by then): nothing of that step's
    run is stored, so the prefix matches nothing."""
    salt = "hybrid-deadline"
    with held_in_place(sidecar, model_dir, salt, 1.0, hybrid=True, step_store_timeout_s=0.2) as (s, w, caches, seen):
        prompt = torch.randint(100, 30000, (6 * BLOCK + 4,), generator=torch.Generator().manual_seed(8)).tolist()
        s.add_request(request("a", prompt))
        for _ in range(20):
            if not s.has_requests():
                break
            hybrid_step(s, w, caches, reap=False)
        w.flush()
        assert seen[0] == (True, 0), seen
        assert matched_blocks(sidecar.target, salt, token_ids=prompt) == 0


def test_hybrid_layers_keep_the_models_order_and_other_shapes_are_refused_by_name() -> None:
    layers = kv_geometry(hybrid_kv_cache_config(window_tokens=2 * BLOCK))
    assert (layers.names, layers.groups, layers.geometry.layers) == (NAMES, [1, 0, 1, 0], LAYERS)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)
    wider = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2 * HEADS, head_size=DIM, dtype=torch.float16,
                              sliding_window=2 * BLOCK)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(FULL_NAMES, full), KVCacheGroupSpec(WINDOW_NAMES, wider)])
    with pytest.raises(ValueError, match=r"KV cache group 1 \(SlidingWindowSpec\) has .*kv_heads=4"):
        kv_geometry(kcc)



def test_a_restarted_sidecar_is_reconnected_and_vllm_computes_meanwhile(model_dir: str, tmp_path: Path) -> None:
    """The sidecar killed under a running engine: vLLM keeps serving (nothing matched, saves
    skipped); a new sidecar on the same socket: both sides reopen their sessions and register
    their pools again, the blocks announced before are published as removed, and prefixes
    stored from then on load bit-exact."""
    first = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    config = vllm_config(first, model_dir, staging_slots=8, reconnect_interval_s=0.01)
    second: Sidecar | None = None
    try:
        with engine(config, 31) as (s, w, caches, gen, written):
            prompt, _ = store_prefix(s, w, caches, gen, written)
            first.process.kill()
            first.process.wait()
            assert wait_for(lambda: w._session.closed and s.connector._session.closed)
            s.add_request(request("b", prompt + [9] * 3))
            outs = run_to_end(s, w, caches, gen, written)
            assert outs[0].scheduled_new_reqs[0].num_computed_tokens == 0, "computed while the sidecar is away"
            assert not any(o.kv_connector_metadata.loads for o in outs)

            second = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
            assert reconnected(s, w, caches, gen, written)
            s.reset_prefix_cache()
            s.add_request(request("e", [1] * 4))
            run_to_end(s, w, caches, gen, written)  # a step publishes the scheduler's events
            removed = [h for batch in s.published for e in batch.events if isinstance(e, BlockRemoved)
                       for h in e.block_hashes]
            keys = kvtier.Namespace("test/tiny-llama", kvtier.Geometry(LAYERS, HEADS, DIM, "f16", BLOCK)).keys(prompt)
            assert set(keys) <= set(removed), "the blocks announced before the restart are published as removed"
            assert_stores_and_loads(s, w, caches, gen, written)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_hung_sidecar_holds_the_scheduler_for_one_match_timeout(model_dir: str, tmp_path: Path) -> None:
    """The sidecar stopped (SIGSTOP: alive, answering nothing): the scheduler asks one Match,
    with match_timeout_s as its deadline (not the client's 60 s), and none for the second
    request (Match rests for reconnect_interval_s after a failed one); both requests are
    computed; once the sidecar runs again, requests match and load as before."""
    sc = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    config = vllm_config(sc, model_dir, staging_slots=8, match_timeout_s=0.5, reconnect_interval_s=0.5)
    try:
        with engine(config, 41) as (s, w, caches, gen, written):
            prompt, _ = store_prefix(s, w, caches, gen, written)
            session = s.connector._session
            asked: list[float | None] = []

            def match(*args: Any, **kwargs: Any) -> Any:  # the real Match, its deadlines noted
                asked.append(kwargs.get("timeout"))
                return type(session).match(session, *args, **kwargs)

            session.match = match  # type: ignore[method-assign]
            sc.pause()
            try:
                s.add_request(request("b", prompt[: 3 * BLOCK] + [5] * 3))
                s.add_request(request("c", [6] + prompt[1 : 3 * BLOCK] + [6] * 3))  # not b's blocks
                out = s.schedule()
            finally:
                sc.resume()
            assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {"b": 0, "c": 0}
            assert asked == [0.5], "one Match, with match_timeout_s as its deadline; none for c"
            kvo = forward(w, caches, out)
            reqs = list(out.num_scheduled_tokens)
            s.update_from_output(out, ModelRunnerOutput(req_ids=reqs, sampled_token_ids=[[7] for _ in reqs],
                                                        kv_connector_output=kvo))
            run_to_end(s, w, caches, gen, written)
            assert wait_for(lambda: time.monotonic() >= s.connector._match_again_at)
            s.reset_prefix_cache()
            assert_stores_and_loads(s, w, caches, gen, written)
    finally:
        sc.stop()


@pytest.mark.parametrize("kv", ["staging", "in_place_async"])
def test_a_store_that_times_out_frees_what_it_read_and_lands_nothing_late(
        model_dir: str, tmp_path: Path, kv: str) -> None:
    """A background store sent to a stopped sidecar (SIGSTOP: the session does not end) times
    out (store_timeout_s), which is its not_after too: the sidecar publishes nothing of it even
    when it reads it once it runs again, so what it read is free at once: its staging slots, or
    in place (in_place_stores = async) the finished request's blocks vLLM kept for it (before
    not_after, both stayed out of use until the session was replaced). Prefixes store and load
    bit-exact once the sidecar runs."""
    sc = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    extra: dict[str, Any] = {"kv_path": "staging", "staging_slots": 8} if kv == "staging" else {"kv_path": "in_place",
                                                                          "in_place_stores": "async"}
    config = vllm_config(sc, model_dir, match_timeout_s=0.3, store_timeout_s=0.5, reconnect_interval_s=0.05,
                         **extra)
    try:
        with (engine(config, 51) if kv == "staging" else in_place_engine(config, "timeout", 51)) as (
                s, w, caches, gen, written):
            prompt = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
            sc.pause()
            try:
                s.add_request(request("a", prompt))
                run_to_end(s, w, caches, gen, written)
                w.flush()  # its 3 blocks' store times out
                assert "a" not in s.requests and not w._unsure and not w._stores_of
                assert kv != "staging" or len(w._free) == 8, "the slots are free again"
            finally:
                sc.resume()
            assert_stores_and_loads(s, w, caches, gen, written)
            assert matched_blocks(sc.target, token_ids=prompt) == 0, "nothing of a landed late"
    finally:
        sc.stop()


def test_a_store_cut_off_early_holds_its_slots_until_its_not_after(model_dir: str, tmp_path: Path) -> None:
    """A store cut off before its not_after without an answer (its session closed while the
    request waited in a stopped sidecar's socket, as a session replaced meanwhile is) may still
    be carried out when the sidecar runs: its staging slots stay out of use until not_after,
    even once a new session is open, while saves make do with the slot left; then they are free
    again and prefixes store and load bit-exact."""
    sc = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    config = vllm_config(sc, model_dir, kv_path="staging", staging_slots=4, store_timeout_s=8.0,
                         match_timeout_s=0.3, reconnect_interval_s=0.05)
    try:
        with engine(config, 81) as (s, w, caches, gen, written):
            sc.pause()
            try:
                s.add_request(request("a", torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()))
                while s.has_requests():  # a's store waits in the stopped sidecar's socket
                    step(s, w, caches, gen, written, reap=False)
                assert w._session is not None
                w._session.close()  # its channel too: the store is cancelled at once
                w.flush()
                assert len(w._unsure) == 1 and len(w._free) == 1, "a's 3 slots held"
            finally:
                sc.resume()
            assert reconnected(s, w, caches, gen, written)
            s.add_request(request("b", torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()))
            run_to_end(s, w, caches, gen, written)  # b's blocks saved through the one slot left
            assert len(w._unsure) == 1 and len(w._free) == 1, "held across the new session"
            time.sleep(max(0.0, w._unsure[0][2] - time.time()))  # not_after passes
            w._reap(block=False)
            assert not w._unsure and len(w._free) == 4, "free once not_after has passed"
            assert_stores_and_loads(s, w, caches, gen, written)
    finally:
        sc.stop()


def test_in_place_async_a_preempted_requests_held_store_is_waited_out(model_dir: str, tmp_path: Path) -> None:
    """In place with in_place_stores = async, a store cut off early without an answer (its
    session closed under a stopped sidecar) is held until its not_after; vLLM reuses a
    preempted request's blocks at once, so handle_preemptions waits that out first."""
    sc = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    config = vllm_config(sc, model_dir, kv_path="in_place", in_place_stores="async", store_timeout_s=2.0,
                         match_timeout_s=0.3, reconnect_interval_s=0.05)
    try:
        with in_place_engine(config, "preempted-held", 91) as (s, w, caches, gen, written):
            sc.pause()
            try:
                s.add_request(request("a", torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()))
                step(s, w, caches, gen, written, reap=False)  # a computed, its store sent
                assert w._session is not None and w._stores
                w._session.close()  # its channel too: the store is cancelled at once
                assert wait_for(lambda: all(f.done() for _, _, f in w._stores), timeout=30)
                w._reap(block=False)
                (req, _, until), = w._unsure
                assert req == "a" and until > time.time(), "held"
                w.handle_preemptions(KvtierConnectorMetadata(preempted=["a"]))
                assert time.time() >= until and not w._unsure, "waited out before vLLM reuses a's blocks"
            finally:
                sc.resume()
    finally:
        sc.stop()


def test_in_place_a_stalled_sidecar_holds_few_steps_and_keeps_no_blocks(model_dir: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In place, stores ending in the step (the default): under a stopped sidecar (SIGSTOP: its
    session does not end), the step's store gives up after step_store_timeout_s, the finished
    request's blocks are freed at once (the store's not_after: nothing of it is published, even
    once the sidecar reads it),
    and saves pause for reconnect_interval_s, so the next steps do not wait; once the sidecar
    runs again and the pause is over, saves resume and load bit-exact. What the scheduler keeps
    for the BlockStored events of saves it never hears of is bounded."""
    monkeypatch.setattr("kvtier.integrations.vllm.BLOCK_INFO_KEYS", 4)
    sc = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    config = vllm_config(sc, model_dir, kv_path="in_place", match_timeout_s=0.3, step_store_timeout_s=0.3,
                         reconnect_interval_s=1.0)
    try:
        with in_place_engine(config, "stalled", 71) as (s, w, caches, gen, written):
            sent: list[str] = []  # the requests of the stores the worker sends
            submit = w._submit_store

            def submit_store(req_id: str, *args: Any, **kwargs: Any) -> None:
                sent.append(req_id)
                submit(req_id, *args, **kwargs)

            w._submit_store = submit_store  # type: ignore[method-assign]
            start = time.monotonic()
            sc.pause()
            prompt_a = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
            try:
                s.add_request(request("a", prompt_a))
                run_to_end(s, w, caches, gen, written)
                assert "a" not in s.requests, "freed at once"
                assert not w._unsure and not w._stores_of and not w._delayed
                assert sent == ["a"], "one store, for a's first step"
                assert w._save_pause_s == 1.0 and w._save_again_at >= start + 1.0, "saves paused"
            finally:
                sc.resume()
            # Within the pause: computed and not saved (nothing waits for the sidecar). The
            # pause is held open while b runs, however slow the host.
            paused_until, w._save_again_at = w._save_again_at, math.inf
            prompt_b = torch.randint(100, 30000, (3 * BLOCK + 4,), generator=gen).tolist()
            s.add_request(request("b", prompt_b))
            run_to_end(s, w, caches, gen, written)
            assert sent == ["a"], "no store sent for b: no step of it waits for the sidecar"
            w._save_again_at = paused_until
            time.sleep(max(0.0, paused_until - time.monotonic()))  # the pause runs out
            assert_stores_and_loads(s, w, caches, gen, written)
            assert w._save_pause_s == 0.0, "a step whose stores ended in time resets the pause"
            assert matched_blocks(sc.target, token_ids=prompt_b) == 0, "b was not saved"
            # a's store, read by the sidecar only once it ran again, stored nothing (its
            # not_after had passed): vLLM may have written those blocks by then.
            assert matched_blocks(sc.target, token_ids=prompt_a) == 0, "nothing of a landed late"
            # The saves never heard of (a's, b's) are not remembered without bound.
            assert len(s.connector._block_info) <= 4
    finally:
        sc.stop()
