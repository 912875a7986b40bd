"""kvtier.integrations.sglang through SGLang's own classes, against a real `kvtier serve`.

The backend is made the way SGLang's cache controller makes it (StorageBackendFactory with the
`dynamic` backend and `interface_v1`), over SGLang's real host KV pools (MHATokenToKVPoolHost on
CPU, both layer_first and page_first), with SGLang's own page hashes. Run by
scripts/test_connectors.sh in its venv (sglang, torch); not part of `scripts/test_python.sh`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sidecar import Sidecar, start_sidecar  # noqa: E402

from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.session import wait_for  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 4, 2, 64, 16
GEOMETRY = ("--set", f"model.layers={LAYERS}", "--set", f"model.kv_heads={HEADS}", "--set", f"model.head_dim={DIM}",
            "--set", "model.dtype=bf16", "--set", f"model.block_tokens={PAGE}")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), geometry=GEOMETRY, host_capacity="64MiB")
    yield sc
    sc.stop()


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=512, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MHATokenToKVPoolHost(device, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")


def backend(sidecar: Sidecar, host: MHATokenToKVPoolHost, **extra: object) -> KvtierHiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=host.layout == "page_first", model_name="test/model",
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "sidecar": sidecar.target, **extra},
    )
    b = StorageBackendFactory.create_backend("dynamic", config, host)
    b.register_mem_pool_host(host)  # as HiCacheController does right after
    assert isinstance(b, KvtierHiCacheStorage)
    return b


def page(host: MHATokenToKVPoolHost, index: int) -> torch.Tensor:
    """One page as (layer, K|V, token, head, dim), whatever the layout."""
    if host.layout == "layer_first":
        return host.kv_buffer[:, :, index : index + PAGE].permute(1, 0, 2, 3, 4)
    return host.kv_buffer[:, index : index + PAGE].permute(2, 0, 1, 3, 4)


def hashes(tokens: list[int]) -> list[str]:
    out, last = [], None
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        last = get_hash_str(tokens[i : i + PAGE], last)
        out.append(last)
    return out


def indices(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


@pytest.mark.parametrize("kv_path", ["staging", "auto"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_set_exists_get_bit_exact(sidecar: Sidecar, layout: str, kv_path: str) -> None:
    """Pages stored and loaded through a staging pool or (auto) in place: SGLang's host pool
    registered where it lies, a process pool whose slots are its pages."""
    host = host_pool(layout)
    b = backend(sidecar, host, cache_salt=f"{layout}-{kv_path}", kv_path=kv_path)
    try:
        assert (b._direct is not None) == (kv_path == "auto")
        # Pages of their own: SGLang's page hashes (the keys) do not depend on the salt.
        gen = torch.Generator().manual_seed(1 if kv_path == "staging" else 11)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(torch.bfloat16))
        tokens = torch.randint(0, 50_000, (10 * PAGE,), generator=gen).tolist()
        keys = hashes(tokens)
        want = [page(host, i * PAGE).clone() for i in range(10)]
        staged = []  # staging slots the page calls touched: none in place
        slot_of = b._slot
        b._slot = lambda pool, j: staged.append(j) or slot_of(pool, j)  # type: ignore[method-assign]
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, indices(0, 10)) == [True] * 10
        assert b.batch_exists(keys) == 10
        assert b.batch_exists(keys[:3] + hashes([7] * PAGE) + keys[4:]) == 3, "a hole ends the prefix"
        host.kv_buffer.zero_()
        # Into other pages of the host pool.
        assert b.batch_get_v1(keys, indices(12, 10)) == [True] * 10
        for i in range(10):
            assert torch.equal(page(host, (12 + i) * PAGE).view(torch.int16), want[i].view(torch.int16)), i
        # A page kvtier does not hold ends the run.
        unknown = hashes([9] * PAGE)
        assert b.batch_get_v1(keys[:2] + unknown + keys[3:4], indices(0, 4)) == [True, True, False, False]
        assert (staged == []) == (kv_path == "auto"), "in place: no staging copy"
        # Pages not aligned to whole host pages go through staging (in place too).
        host.kv_buffer.zero_()
        assert b.batch_get_v1(keys[:2], indices(0, 2) + PAGE // 2) == [True, True]
        for i in range(2):
            assert torch.equal(page(host, i * PAGE + PAGE // 2).view(torch.int16), want[i].view(torch.int16)), i
        assert staged, "misaligned pages went through staging"
        assert b.exists(keys[0]) and not b.exists(unknown[0])
        b.clear()
        assert b.batch_exists(keys) == 0
    finally:
        b.close()


def test_pages_cross_layouts_and_flat_pages(sidecar: Sidecar) -> None:
    """What a layer_first node stores, a page_first node reads as the same K/V per layer and
    token; the flat-page calls (SGLang's generic path) agree with the page calls."""
    a_host, b_host = host_pool("layer_first"), host_pool("page_first")
    a, b = backend(sidecar, a_host, client_name="node-a"), backend(sidecar, b_host, client_name="node-b")
    try:
        gen = torch.Generator().manual_seed(2)
        a_host.kv_buffer.copy_(torch.randn(a_host.kv_buffer.shape, generator=gen).to(torch.bfloat16))
        keys = hashes(list(range(1000, 1000 + 6 * PAGE)))
        prefix = HiCacheStorageExtraInfo(prefix_keys=None)
        assert a.batch_set_v1(keys, indices(0, 6), prefix) == [True] * 6
        assert b.batch_get_v1(keys, indices(20, 6)) == [True] * 6
        for i in range(6):
            assert torch.equal(page(b_host, (20 + i) * PAGE).view(torch.int16),
                               page(a_host, i * PAGE).view(torch.int16)), i
        # Flat pages: set by b's generic path, read by a's page path and generic path.
        flat = [b_host.get_data_page((20 + i) * PAGE, flat=True).clone() for i in range(2)]
        other = hashes(list(range(5000, 5000 + 2 * PAGE)))
        assert b.batch_set(other, flat)
        got = a.batch_get(other)
        for i, g in enumerate(got):  # a's flat order (layer_first), put back as SGLang does
            assert g is not None
            a_host.set_from_flat_data_page((40 + i) * PAGE, g)
            assert torch.equal(page(a_host, (40 + i) * PAGE).view(torch.int16),
                               page(b_host, (20 + i) * PAGE).view(torch.int16))
        assert b.get(hashes([3] * PAGE)[0]) is None
        assert a.batch_get_v1(other, indices(30, 2)) == [True, True]
        for i in range(2):
            assert torch.equal(page(a_host, (30 + i) * PAGE).view(torch.int16),
                               page(b_host, (20 + i) * PAGE).view(torch.int16))
        stats = a.get_stats()
        assert stats is not None
    finally:
        a.close()
        b.close()


def test_a_geometry_the_sidecar_does_not_serve_is_refused(sidecar: Sidecar) -> None:
    device = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS * 2, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(device, 2.0, 0, PAGE, "layer_first", pin_memory=False, device="cpu")
    with pytest.raises(Exception, match="model.\\* settings"):
        backend(sidecar, host)


def assert_pages_round_trip(b: KvtierHiCacheStorage, host: MHATokenToKVPoolHost, keys: list[str]) -> None:
    """Host pages 0-3 stored under ``keys`` come back into pages 8-11 bit-exact."""
    want = [page(host, i * PAGE).clone() for i in range(4)]
    assert b.batch_set_v1(keys, indices(0, 4)) == [True] * 4
    assert b.batch_get_v1(keys, indices(8, 4)) == [True] * 4
    for i in range(4):
        assert torch.equal(page(host, (8 + i) * PAGE).view(torch.int16), want[i].view(torch.int16)), i


def test_a_restarted_sidecar_is_reconnected_and_sglang_computes_meanwhile(tmp_path: Path) -> None:
    """The sidecar killed under SGLang's cache controller: lookups find nothing and stores and
    loads fail page by page (SGLang computes), nothing raises; a new sidecar on the same
    socket: the backend reopens its session on its own thread, registers its staging pool
    and its host pool in place again, and pages move bit-exact again."""
    first = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
    host = host_pool("layer_first")
    b = backend(first, host, reconnect_interval_s=0.01)
    second: Sidecar | None = None
    try:
        gen = torch.Generator().manual_seed(3)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(torch.bfloat16))
        keys = hashes(torch.randint(0, 50_000, (4 * PAGE,), generator=gen).tolist())
        assert b.batch_set_v1(keys, indices(0, 4)) == [True] * 4
        first.process.kill()
        first.process.wait()
        assert wait_for(lambda: b._session is not None and b._session.closed)
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, indices(8, 4)) == [False] * 4
        assert b.batch_set_v1(keys, indices(0, 4)) == [False] * 4
        second = start_sidecar(tmp_path, geometry=GEOMETRY, host_capacity="64MiB")
        assert wait_for(b._session_ok, timeout=30)
        assert b.batch_exists(keys) == 0, "the new sidecar holds nothing yet"
        assert b._direct is not None, "the host pool in place again"
        assert_pages_round_trip(b, host, keys)
    finally:
        b.close()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.parametrize("kv_path", ["staging", "auto"])
def test_a_store_that_times_out_keeps_the_staging_pool_and_lands_nothing_late(sidecar: Sidecar, kv_path: str) -> None:
    """A store sent to a stopped sidecar times out, which is its not_after too: the sidecar
    publishes nothing of it even when it reads it once it runs again (from staging slots or,
    in place, from SGLang's host pages), so the backend keeps its session and staging pool
    (before not_after, it had to give the pool up); the pages are not in kvtier, and move
    bit-exact after."""
    host = host_pool("page_first")
    b = backend(sidecar, host, store_timeout_s=0.5, reconnect_interval_s=0.05, cache_salt=f"timeout-{kv_path}",
                kv_path=kv_path)
    try:
        gen = torch.Generator().manual_seed(4 if kv_path == "staging" else 44)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(torch.bfloat16))
        keys = hashes(torch.randint(0, 50_000, (4 * PAGE,), generator=gen).tolist())
        old_pool, old_session = b._pool, b._session
        sidecar.pause()
        try:
            assert b.batch_set_v1(keys, indices(0, 4)) == [False] * 4
        finally:
            sidecar.resume()
        assert b._pool is old_pool and b._session is old_session and not b._tainted, "nothing given up"
        # Sent after the late store on the same channel, so read after it too: once this one
        # is stored, the late one has been refused or landed.
        other = hashes(torch.randint(50_000, 100_000, (4 * PAGE,), generator=gen).tolist())
        assert b.batch_set_v1(other, indices(4, 4)) == [True] * 4
        assert b.batch_exists(keys) == 0, "nothing landed late"
        assert_pages_round_trip(b, host, keys)
    finally:
        b.close()
