"""The kvtier Python client (python/kvtier) against real `kvtier serve` processes.

Each sidecar runs on a Unix socket in a temporary directory with a small host tier and is
stopped by PID at the end of the module (tests/sidecar.py). Nothing is mocked: every
assertion is on what a real sidecar answered, or on bytes in a real shared-memory pool.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import grpc
import numpy as np

import kvtier

from kvtier import errors
from kvtier.pool import HEADER_BYTES, decode_header
from kvtier.session import wait_for
from sidecar import BIG_GEOMETRY_FLAGS, Sidecar, free_port, start_sidecar

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "crates" / "kvtier-core" / "vectors" / "block_keys_v1.json"
GEOMETRY = kvtier.Geometry(layers=4, kv_heads=2, head_dim=16, dtype="f16", block_tokens=4)
MAX_BATCH = 64
TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """The small-geometry sidecar; a batch limit of 64 blocks (so a 4 MiB message limit)."""
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), "--set", f"server.max_batch_blocks={MAX_BATCH}")
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def big_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, int]]:
    """A sidecar whose loads take milliseconds (256 KiB blocks, one load thread), whose store
    queue admits 1 MiB in flight, with a TCP listener on loopback that requires a token."""
    d = tmp_path_factory.mktemp("big")
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    sc = start_sidecar(
        d, "--set", "transfer.load_threads=1", "--set", "transfer.store_inflight_limit=1MiB",
        "--tcp", f"127.0.0.1:{port}", "--auth-token-file", str(token_file),
        host_capacity="160MiB", geometry=BIG_GEOMETRY_FLAGS,
    )
    yield sc, port
    sc.stop()


@pytest.fixture
def session(sidecar: Sidecar) -> Iterator[kvtier.Session]:
    with kvtier.connect(sidecar.target, "pytest") as s:
        yield s


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[kvtier.CpuPool]:
    with kvtier.CpuPool.create(GEOMETRY, 32, tmp_path / "pool") as p:
        yield p


def fill(pool: kvtier.CpuPool, slots: range, seed: int) -> np.ndarray:
    """Random bytes into `slots` of every layer; returns a copy of what was written."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(pool.geometry.layers, len(slots), pool.geometry.block_layer_bytes),
                        dtype=np.uint8)
    pool.raw[:, slots.start:slots.stop] = data
    return data


# --- keys, stubs, pool file -----------------------------------------------------------------


def test_key_vectors() -> None:
    vectors = json.loads(VECTORS.read_text(encoding="utf-8"))
    assert len(vectors["cases"]) >= 8
    for case in vectors["cases"]:
        n = case["namespace"]
        ns = kvtier.Namespace(n["model_id"], kvtier.Geometry(**n["geometry"]), n["tp_rank"], n["tp_size"],
                              n["cache_salt"])
        assert ns.canonical_bytes().hex() == case["namespace_canonical_hex"], case["name"]
        assert "%032x" % ns.fingerprint() == case["fingerprint"], case["name"]
        keys = ns.keys(case["tokens"])
        assert keys.hex() == case["keys"], case["name"]
        assert keys == kvtier.BlockKeys.from_hex(case["keys"])
        bt = n["geometry"]["block_tokens"]
        if len(keys) >= 2:  # continuing a sequence from its parent gives the same keys
            assert ns.keys(case["tokens"][bt:], parent=keys[0]) == keys[1:]
            assert ns.keys(np.asarray(case["tokens"], dtype=np.uint32)) == keys
    with pytest.raises(ValueError):
        kvtier.block_keys(1, [-1, 2, 3, 4], 4)
    with pytest.raises(ValueError):
        kvtier.BlockKeys(b"\x00" * 17)


def test_stubs_match_proto() -> None:
    r = subprocess.run([str(REPO / "scripts" / "gen_python_stubs.sh"), "--check"], capture_output=True,
                       text=True, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout + r.stderr


def test_pool_file_format(tmp_path: Path) -> None:
    # docs/api.md's sample: 48 layers, 4 KV heads of 128, bf16, 64-token blocks, 1024 slots.
    g = kvtier.Geometry(48, 4, 128, "bf16", 64)
    with kvtier.CpuPool.create(g, 1024, tmp_path / "sample", prefault=False) as p:
        assert p.path.stat().st_size == 6_442_455_040
        with open(p.path, "rb") as f:
            head = f.read(HEADER_BYTES)
        assert head[:40].hex(" ") == (
            "4b 56 54 50 4f 4f 4c 00 01 00 00 00 00 10 00 00 30 00 00 00 04 00 00 00 80 00 00 00 "
            "03 00 00 00 40 00 00 00 00 04 00 00")
        assert head[40:] == bytes(HEADER_BYTES - 40)
        assert decode_header(head) == (g, 1024)
    assert not (tmp_path / "sample").exists()  # the creator removes its file on close


def test_pool_views_are_the_file(pool: kvtier.CpuPool) -> None:
    g = pool.geometry
    assert pool.kv.shape == (g.layers, 32, 2, g.block_tokens, g.kv_heads, g.head_dim)
    assert pool.kv.dtype == np.float16
    blk = pool.block(5, layer=2)
    assert np.shares_memory(blk, pool.raw) and np.shares_memory(pool.layer(3), pool.kv)
    blk[1, 2, 1, 7] = 1.5  # V, token 2, head 1, dim 7 of (slot 5, layer 2)
    off = pool.offset(5, 2) + ((1 * g.block_tokens + 2) * g.kv_heads + 1) * g.head_dim * 2 + 7 * 2
    with open(pool.path, "rb") as f:
        f.seek(off)
        assert np.frombuffer(f.read(2), "<f2")[0] == 1.5
    assert pool.block(5)[2, 1, 2, 1, 7] == 1.5  # all layers of a slot: a strided view
    with kvtier.CpuPool.open(pool.path) as again:  # a second mapping sees the same bytes
        assert again.geometry == g and again.num_slots == 32
        assert again.kv[2, 5, 1, 2, 1, 7] == 1.5
    assert pool.path.exists()  # open() leaves the file to its creator


# --- the API against a sidecar --------------------------------------------------------------


def test_store_zero_match_load_bit_exact(session: kvtier.Session, pool: kvtier.CpuPool) -> None:
    assert session.geometry == GEOMETRY
    h = session.register_pool(pool, "store-load")
    assert h.fingerprint == h.namespace.fingerprint()  # the sidecar's namespace is ours
    tokens = list(range(1000, 1000 + 8 * 4 + 3))  # 8 whole blocks and a partial tail
    keys = h.keys(tokens)
    assert len(keys) == 8
    want = fill(pool, range(0, 8), seed=1)
    st = session.store(h, keys, range(8))  # one request for the whole run
    assert (st.stored_blocks, st.already_stored, len(st.no_space)) == (8, 0, 0)
    assert st.bytes == 8 * GEOMETRY.block_bytes
    assert session.store(h, keys[4:], range(4, 8), parent=keys[3]).already_stored == 4
    pool.raw[:] = 0

    by_keys = session.match(h, keys)
    assert by_keys.tiers == [kvtier.Tier.HOST] * 8 and by_keys.matched_tokens == 32
    assert by_keys.host_tokens == 32 and len(by_keys.keys) == 0
    by_tokens = session.match(h, token_ids=tokens)  # the partial tail is ignored
    assert by_tokens.keys == keys and by_tokens.matched_blocks == 8
    other = session.match(h, token_ids=tokens, cache_salt="tenant-b")  # another salt: nothing
    assert other.matched_blocks == 0 and other.matched_tokens == 0
    prefix = session.match(h, token_ids=tokens[:8] + [7] * 8)  # diverges after two blocks
    assert prefix.matched_blocks == 2

    # Into other slots, every layer event as it comes.
    slots = np.arange(16, 24)
    events = list(session.load(h, keys, slots))
    assert events[:-1] == [kvtier.LayerReady(layer) for layer in range(GEOMETRY.layers)]
    done = events[-1]
    assert isinstance(done, kvtier.LoadDone) and done.loaded_blocks == 8 and len(done.missing) == 0
    assert done.bytes == 8 * GEOMETRY.block_bytes
    assert np.array_equal(pool.raw[:, 16:24], want)
    assert not pool.raw[:, :16].any() and not pool.raw[:, 24:].any()


def test_load_event_options_and_missing(session: kvtier.Session, pool: kvtier.CpuPool) -> None:
    h = session.register_pool(pool, "events")
    keys = h.keys(list(range(4 * 4)))
    want = fill(pool, range(0, 4), seed=2)
    session.store(h, keys, range(4))
    strided = list(session.load(h, keys, range(4, 8), layer_event_stride=3))
    assert [type(e) for e in strided] == [kvtier.LayerReady, kvtier.LayerReady, kvtier.LoadDone]
    assert [e.layer for e in strided[:2]] == [2, 3]  # layers N-1, 2N-1, ... and always the last
    assert list(session.load(h, keys, range(8, 12), done_only=True))[0].loaded_blocks == 4  # only LoadDone

    unknown = kvtier.BlockKeys.from_ints([12345, 67890])
    stream = session.load(h, keys + unknown, range(12, 18), done_only=True)
    evs = list(stream)
    assert isinstance(evs[0], kvtier.BlocksMissing) and evs[0].keys == unknown
    assert stream.done is not None and stream.done.loaded_blocks == 4 and stream.done.missing == unknown
    assert stream.missing == unknown
    done = session.load_wait(h, keys, range(20, 24))
    assert done.loaded_blocks == 4
    for first in (4, 8, 12, 20):
        assert np.array_equal(pool.raw[:, first:first + 4], want)


def test_device_events_pin_clear(session: kvtier.Session, pool: kvtier.CpuPool) -> None:
    h = session.register_pool(pool, "device")
    keys = h.keys(list(range(3 * 4)))
    session.store(h, keys, range(3))
    r = session.device_events(h, [kvtier.DeviceEvent.stored(keys[0], 7), kvtier.DeviceEvent.stored(keys[1], 9)])
    assert (r.applied, r.device_blocks) == (2, 2)
    m = session.match(h, keys)
    assert m.tiers == [kvtier.Tier.DEVICE, kvtier.Tier.DEVICE, kvtier.Tier.HOST]
    assert m.device_slots[:2] == [7, 9] and m.device_tokens == 8
    assert session.device_events(h, [kvtier.DeviceEvent.removed(keys[1])]).device_blocks == 1
    assert session.device_events(h, [kvtier.DeviceEvent.cleared()]).device_blocks == 0

    p = session.pin(h, keys + kvtier.BlockKeys.from_ints([99]))
    assert p.pinned_blocks == 3 and list(p.missing) == [99]
    assert session.stats().pinned_blocks >= 3
    c = session.clear(h)
    assert c.kept_pinned == 3 and c.host_blocks == 0
    assert session.unpin(p) == 3
    c = session.clear(h, tier=kvtier.Tier.HOST)
    assert c.host_blocks == 3
    assert session.match(h, keys).matched_blocks == 0


def test_session_close_releases_pins(sidecar: Sidecar, tmp_path: Path) -> None:
    client = kvtier.Client(sidecar.target)
    base = client.stats()
    with kvtier.CpuPool.create(GEOMETRY, 8, tmp_path / "p") as p:
        s = kvtier.connect(sidecar.target, "pinner")
        h = s.register_pool(p, "pins")
        keys = h.keys(list(range(5 * 4)))
        s.store(h, keys, range(5))
        assert s.pin(h, keys).pinned_blocks == 5
        st = client.stats()
        assert st.pinned_blocks == base.pinned_blocks + 5
        assert (st.sessions, st.pools) == (base.sessions + 1, base.pools + 1)
        s.close()
        s.close()  # idempotent
        with pytest.raises(kvtier.SessionClosed):
            s.match(h, keys)
        # The sidecar applies the end of the stream as it notices it.
        assert wait_for(lambda: client.stats().pinned_blocks == base.pinned_blocks)
        st = client.stats()
        assert (st.sessions, st.pools) == (base.sessions, base.pools)
    client.close()


def test_asyncio_session(sidecar: Sidecar, pool: kvtier.CpuPool) -> None:
    async def run() -> None:
        async with await kvtier.aio.connect(sidecar.target, "asyncio") as s:
            h = await s.register_pool(pool, "aio")
            keys = h.keys(list(range(6 * 4)))
            want = fill(pool, range(0, 6), seed=3)
            assert (await s.store(h, keys, range(6))).stored_blocks == 6
            assert (await s.match(h, token_ids=list(range(6 * 4)))).keys == keys
            events = [ev async for ev in s.load(h, keys, range(10, 16), layer_event_stride=2)]
            assert [getattr(e, "layer", None) for e in events] == [1, 3, None]
            assert isinstance(events[-1], kvtier.LoadDone) and events[-1].loaded_blocks == 6
            assert (await s.load_wait(h, keys, range(20, 26))).loaded_blocks == 6
            assert np.array_equal(pool.raw[:, 10:16], want) and np.array_equal(pool.raw[:, 20:26], want)
            p = await s.pin(h, keys)
            assert await s.unpin(p) == 6
            with pytest.raises(kvtier.NotFound):
                await s.unpin(p)
            assert (await s.stats()).sessions >= 1
    asyncio.run(run())


# --- errors ---------------------------------------------------------------------------------


def test_invalid_argument_out_of_range_not_found_failed_precondition(
    session: kvtier.Session, pool: kvtier.CpuPool, tmp_path: Path
) -> None:
    h = session.register_pool(pool, "errors")
    keys = h.keys(list(range(8)))
    with pytest.raises(kvtier.InvalidArgument) as e:
        session.store(h, keys, [0])  # 2 keys, 1 slot
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message
    with pytest.raises(kvtier.InvalidArgument):
        session.match(h, keys, token_ids=list(range(8)))  # keys and token ids together
    with pytest.raises(kvtier.InvalidArgument):
        session.load(h, keys, [0, 99]).wait()  # slot out of range
    with pytest.raises(kvtier.InvalidArgument):
        session.store(h, keys, [3, 3])  # duplicate slot
    with pytest.raises(kvtier.InvalidArgument):
        session.register_pool(pool, "errors", tp_size=0)
    with pytest.raises(kvtier.InvalidArgument):
        session.register_pool(tmp_path, "dir", num_slots=4)  # a directory, not a pool file
    too_many = kvtier.BlockKeys.from_ints(range(1, MAX_BATCH + 2))
    with pytest.raises(kvtier.InvalidArgument) as e:
        session.match(h, too_many)  # over server.max_batch_blocks
    assert str(MAX_BATCH) in e.value.message
    # Over the message limit (4 MiB at this batch limit): refused before it is read.
    with pytest.raises(kvtier.OutOfRange):
        session.match(h, b"\x01" * (5 << 20))

    with pytest.raises(kvtier.NotFound):
        session.unpin(424242)
    with pytest.raises(kvtier.NotFound):
        session.match(987654, keys)  # unknown pool
    with pytest.raises(kvtier.NotFound) as e:
        session.register_pool(tmp_path / "no-such-pool", "x", num_slots=4)
    assert "no-such-pool" in e.value.message

    other = kvtier.Geometry(4, 2, 16, "f32", 4)
    with kvtier.CpuPool.create(other, 4, tmp_path / "f32") as wrong:
        with pytest.raises(kvtier.FailedPrecondition):
            session.register_pool(wrong, "wrong-geometry")
    with pytest.raises(kvtier.FailedPrecondition):  # a pool file whose header disagrees
        session.register_pool(pool.path, "claims-more", num_slots=64)
    with pytest.raises(kvtier.FailedPrecondition) as e:  # durable without a disk tier
        session.store(h, keys, [0, 1], durable=True)
    assert isinstance(e.value, kvtier.KvtierError) and "disk" in e.value.message


def test_cuda_pool_needs_a_layout_and_says_why_cuda_is_missing(session: kvtier.Session) -> None:
    g = session.geometry
    half = g.block_layer_bytes // 2
    slots = 8
    buffers = [(b"\x00" * 64, 0, 2 * slots * half) for _ in range(g.layers)]
    vllm = [(layer, 0, layer, slots * half, half) for layer in range(g.layers)]
    with pytest.raises(kvtier.InvalidArgument) as e:
        session.register_cuda_pool(buffers, [], "gpu", num_slots=slots)
    assert "layout" in e.value.message
    # This machine has no CUDA driver (CI): the sidecar says so; with one, the zero handle
    # does not open and the field is named.
    with pytest.raises((kvtier.FailedPrecondition, kvtier.InvalidArgument)) as e:
        session.register_cuda_pool(buffers, vllm, "gpu", num_slots=slots)
    assert "CUDA" in e.value.message or "cuda.buffers[0].ipc_handle" in e.value.message


def test_process_pools_are_this_processs_own_memory(session: kvtier.Session, sidecar: Sidecar) -> None:
    """Plain numpy arrays (no shared file) registered as pools: the sidecar reads stores out of
    them and writes loads into them itself, bit-exact, in kvtier's layer-major order and
    block-major; bad buffers are refused before anything is sent or by the sidecar, naming
    what is wrong."""
    g = GEOMETRY
    assert session.sidecar_pid == sidecar.process.pid
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(8, g.block_bytes), dtype=np.uint8)  # [slot][layer] rows
    src = session.register_process_pool([blocks], "process", num_slots=8,
                                        layout=kvtier.pool.block_major_layout(g))
    keys = src.keys(list(range(3000, 3000 + 8 * g.block_tokens)))
    assert session.store(src, keys, range(8)).stored_blocks == 8

    into = np.zeros((16, g.block_bytes), dtype=np.uint8)
    h = session.register_process_pool([into], "process", num_slots=16, layout=kvtier.pool.block_major_layout(g))
    assert h.memory[0] is into  # kept alive while registered
    assert session.load_wait(h, keys, range(4, 12)).loaded_blocks == 8
    assert np.array_equal(into[4:12], blocks) and not into[:4].any() and not into[12:].any()
    # The default layout: kvtier's [layer][slot] block-layers.
    layered = np.zeros((g.layers, 8, g.block_layer_bytes), dtype=np.uint8)
    lh = session.register_process_pool([layered], "process", num_slots=8)
    assert session.load_wait(lh, keys, range(8)).loaded_blocks == 8
    assert np.array_equal(layered.transpose(1, 0, 2).reshape(8, -1), blocks)
    session.unregister_pool(lh)

    with pytest.raises(ValueError, match=r"buffers\[0\]: not C-contiguous"):
        session.register_process_pool([layered[:, ::2]], "process", num_slots=1)
    ro = np.zeros(g.layers * g.block_layer_bytes, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        session.register_process_pool([ro], "process", num_slots=1)
    with pytest.raises(kvtier.InvalidArgument, match="past the end of buffer 0"):
        session.register_process_pool([layered], "process", num_slots=9)
    # An address this process has not mapped (page 1).
    with pytest.raises(kvtier.FailedPrecondition, match="not mapped"):
        session.register_process_pool([(4096, layered.nbytes)], "process", num_slots=8)

    # Memory taken away under a registered pool (PROT_NONE, as freed memory is to the kernel,
    # but still reserved, so nothing else of this process lands there): that load fails, the
    # pool's others and the sidecar go on.
    mm = mmap.mmap(-1, layered.nbytes)
    view = np.frombuffer(mm, np.uint8)
    address = view.ctypes.data
    gone = session.register_process_pool([(address, layered.nbytes)], "process", num_slots=8)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(layered.nbytes), 0) == 0
    with pytest.raises(kvtier.FailedPrecondition, match="not mapped"):
        session.load_wait(gone, keys, range(8))
    assert libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(layered.nbytes), 3) == 0
    session.unregister_pool(gone)
    del view
    mm.close()
    into[:] = 0
    assert session.load_wait(h, keys, range(8)).loaded_blocks == 8 and np.array_equal(into[:8], blocks)


def test_process_pools_need_the_unix_socket(big_sidecar: tuple[Sidecar, int]) -> None:
    _, port = big_sidecar
    with kvtier.Client(f"http://127.0.0.1:{port}", auth_token=TOKEN) as c, kvtier.Session(c, "tcp") as s:
        memory = np.zeros((2, s.geometry.block_bytes), np.uint8)
        with pytest.raises(kvtier.FailedPrecondition, match="Unix socket"):
            s.register_process_pool([memory], "process", num_slots=2,
                                    layout=kvtier.pool.block_major_layout(s.geometry))


async def _aio_process_pool(target: str) -> None:
    async with await kvtier.aio.connect(target, "aio-process") as s:
        blocks = np.arange(2 * s.geometry.block_bytes, dtype=np.uint64).astype(np.uint8).reshape(2, -1)
        h = await s.register_process_pool([blocks], "aio-process", num_slots=2,
                                          layout=kvtier.pool.block_major_layout(s.geometry))
        keys = h.keys(list(range(2 * s.geometry.block_tokens)))
        assert (await s.store(h, keys, range(2))).stored_blocks == 2
        out = np.zeros_like(blocks)
        o = await s.register_process_pool([out], "aio-process", num_slots=2,
                                          layout=kvtier.pool.block_major_layout(s.geometry))
        assert (await s.load_wait(o, keys, range(2))).loaded_blocks == 2
        assert np.array_equal(out, blocks) and s.sidecar_pid > 0


def test_asyncio_process_pool(sidecar: Sidecar) -> None:
    asyncio.run(_aio_process_pool(sidecar.target))


def test_engine_memory_registers_by_path_with_its_layout(session: kvtier.Session, tmp_path: Path) -> None:
    """A shared file without kvtier's header (an engine's own KV, here vLLM's [2, blocks, ...]
    per layer) registers with its layout: store from it, zero it, load back bit-exact; without
    a layout, or with one that runs past the file, it is refused."""
    g = session.geometry
    half = g.block_layer_bytes // 2
    slots = 6
    path = tmp_path / "engine-kv"
    size = g.layers * 2 * slots * half
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size)
    kv = np.frombuffer(mm, dtype=np.uint8).reshape(g.layers, 2, slots, half)  # [layer][K|V][slot]
    layout = [(0, layer * 2 * slots * half, 0, (layer * 2 + 1) * slots * half, half) for layer in range(g.layers)]
    h = session.register_pool(path, "engine-layout", num_slots=slots, layout=layout)
    rng = np.random.default_rng(5)
    kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
    want = kv[:, :, 0:3].copy()
    keys = h.keys(list(range(3 * g.block_tokens)))
    assert session.store(h, keys, [0, 1, 2]).stored_blocks == 3
    kv[:] = 0
    assert session.load_wait(h, keys, [3, 4, 5]).loaded_blocks == 3
    assert np.array_equal(kv[:, :, 3:6], want) and not kv[:, :, 0:3].any()
    session.unregister_pool(h)
    with pytest.raises(kvtier.FailedPrecondition) as e:  # no header, and no layout given
        session.register_pool(path, "no-layout", num_slots=slots)
    assert "not a kvtier device pool" in e.value.message and "layout" in e.value.message
    kb, ko, vb, vo, st = layout[-1]
    with pytest.raises(kvtier.InvalidArgument) as e:  # the last V runs half a block past the end
        session.register_pool(path, "past-the-end", num_slots=slots, layout=layout[:-1] + [(kb, ko, vb, vo + half, st)])
    assert f"layout.layers[{g.layers - 1}]" in e.value.message
    del kv
    mm.close()


def test_interleaved_engine_memory_registers_with_token_and_head_strides(
        session: kvtier.Session, tmp_path: Path) -> None:
    """vLLM ≥ 0.34's LBHNC per layer ([blocks, head, token, K‖V]: K and V interleaved per token
    and head) registers with token and head strides: a store reads, and a load writes, exactly
    the engine's K and V elements; strides that make heads overlap are InvalidArgument naming
    the field; a layout entry of the wrong length is a ValueError."""
    g = session.geometry
    d = g.head_dim * g.dtype_bytes  # bytes of one head of one token
    slots = 4
    path = tmp_path / "lbhnc-kv"
    per_slot = g.kv_heads * g.block_tokens * 2 * d
    size = g.layers * slots * per_slot
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size)
    # [layer, block, head, token, K|V, head bytes]
    kv = np.frombuffer(mm, dtype=np.uint8).reshape(g.layers, slots, g.kv_heads, g.block_tokens, 2, d)
    layout = [(0, layer * slots * per_slot, 0, layer * slots * per_slot + d, per_slot, 2 * d,
               g.block_tokens * 2 * d) for layer in range(g.layers)]
    h = session.register_pool(path, "engine-lbhnc", num_slots=slots, layout=layout)
    rng = np.random.default_rng(9)
    kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
    want = kv[:, 0:2].copy()
    keys = h.keys(list(range(2 * g.block_tokens)), cache_salt="lbhnc")
    assert session.store(h, keys, [0, 1], cache_salt="lbhnc").stored_blocks == 2
    kv[:] = 0
    assert session.load_wait(h, keys, [3, 2], cache_salt="lbhnc").loaded_blocks == 2
    assert np.array_equal(kv[:, 3], want[:, 0]) and np.array_equal(kv[:, 2], want[:, 1])
    assert not kv[:, 0:2].any()
    session.unregister_pool(h)
    # The head stride one token short of the tokens inside it: heads overlap.
    bad = [(kb, ko, vb, vo, st, ts, hs - 2 * d) for kb, ko, vb, vo, st, ts, hs in layout]
    with pytest.raises(kvtier.InvalidArgument) as err:
        session.register_pool(path, "overlapping-heads", num_slots=slots, layout=bad)
    assert "layout.layers[0].head_stride" in err.value.message and "heads would overlap" in err.value.message
    with pytest.raises(ValueError, match=r"layout\[0\] has 6 fields"):
        session.register_pool(path, "six", num_slots=slots, layout=[entry[:6] for entry in layout])
    del kv
    mm.close()


def test_layers_in_kv_cache_groups_take_a_slot_per_group(session: kvtier.Session, tmp_path: Path) -> None:
    """An engine with two KV cache groups over one memory (vLLM's hybrid KV cache manager:
    odd layers in group 1 lie over the even layer before them) registers each layer's group;
    a store reads each layer from its group's slot, a load writes each into its group's slot
    and none where a group gives ``NO_SLOT``; a store must give every group's slot."""
    g = session.geometry
    half = g.block_layer_bytes // 2
    slots = 8
    path = tmp_path / "hybrid-kv"
    planes = (g.layers + 1) // 2  # one memory per pair of layers
    size = planes * 2 * slots * half
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size)
    kv = np.frombuffer(mm, dtype=np.uint8).reshape(planes, 2, slots, half)  # [pair][K|V][slot]
    layout = [(0, (layer // 2) * 2 * slots * half, 0, ((layer // 2) * 2 + 1) * slots * half, half, 0, 0, layer % 2)
              for layer in range(g.layers)]
    h = session.register_pool(path, "engine-hybrid", num_slots=slots, layout=layout)
    rng = np.random.default_rng(11)
    kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)
    want = kv.copy()
    keys = h.keys(list(range(2 * g.block_tokens)), cache_salt="groups")
    with pytest.raises(kvtier.InvalidArgument) as e:
        session.store(h, keys, [0, 1], cache_salt="groups", group_slots=[[2, kvtier.NO_SLOT]])
    assert "group_slots[0]" in e.value.message and "NO_SLOT in a store" in e.value.message
    with pytest.raises(kvtier.InvalidArgument) as e:
        session.store(h, keys, [0, 1], cache_salt="groups")
    assert "for a pool of 2 KV cache group(s)" in e.value.message
    # Block i: group 0's layers in slot i, group 1's in slot 2 + i.
    assert session.store(h, keys, [0, 1], cache_salt="groups", group_slots=[[2, 3]]).stored_blocks == 2
    kv[:] = 0
    done = session.load_wait(h, keys, [4, 5], cache_salt="groups", group_slots=[[6, kvtier.NO_SLOT]])
    assert done.loaded_blocks == 2
    # Group 0 (even layers) of blocks 0, 1 in slots 4, 5; group 1 (odd layers) of block 0 in 6.
    for layer in range(g.layers):
        got, src = kv[layer // 2], want[layer // 2]
        if layer % 2 == 0:
            assert np.array_equal(got[:, 4:6], src[:, 0:2]), layer
        else:
            assert np.array_equal(got[:, 6], src[:, 2]), layer
    assert not kv[:, :, 7].any() and not kv[:, :, 0:4].any(), "nothing but the slots asked for"
    session.unregister_pool(h)
    del kv, got
    mm.close()


def test_a_watching_session_hears_the_blocks_that_leave(tmp_path: Path) -> None:
    """A session opened with watch_removals hears the blocks the sidecar evicts (named, each
    once) and that a clear happened; one that does not watch hears nothing."""
    small = start_sidecar(tmp_path / "small", host_capacity="256KiB")
    try:
        with kvtier.connect(small.target, "watcher", watch_removals=True) as watcher, \
                kvtier.connect(small.target, "writer") as s, kvtier.CpuPool.create(s.geometry, 8) as pool:
            h = s.register_pool(pool, "evictions")
            per_page = 4096 * -(-s.geometry.block_bytes // 4096)
            capacity = (256 << 10) // per_page
            stored: list[int] = []
            for run in range(3 * capacity // 8 + 2):
                keys = h.keys(list(range(run * 1000, run * 1000 + 8 * s.geometry.block_tokens)))
                pool.raw[:] = run
                assert s.store(h, keys, range(8)).stored_blocks == 8
                stored += list(keys)
            removed: list[int] = []
            deadline = time.monotonic() + 10
            while len(removed) < len(stored) - capacity and time.monotonic() < deadline:
                r = watcher.take_removals()
                assert not r.cleared and not r.lost
                removed += list(r.keys)
                time.sleep(0.02)
            assert len(removed) == len(set(removed)) >= len(stored) - capacity
            assert set(removed) <= set(stored)
            assert not s.take_removals()
            s.clear(h, all=True)
            while not (r := watcher.take_removals()).cleared and time.monotonic() < deadline:
                time.sleep(0.02)
            assert r.cleared and r.unnamed_at > 0

        async def on_asyncio() -> kvtier.Removals:
            async with await kvtier.aio.connect(small.target, "aio-watcher", watch_removals=True) as a:
                with kvtier.connect(small.target, "clearer") as c, kvtier.CpuPool.create(c.geometry, 1) as p1:
                    h1 = c.register_pool(p1, "evictions")
                    c.store(h1, h1.keys(list(range(c.geometry.block_tokens))), [0])
                    c.clear(h1, all=True)
                for _ in range(500):
                    if (got := a.take_removals()).cleared:
                        return got
                    await asyncio.sleep(0.02)
                return a.take_removals()

        assert asyncio.run(on_asyncio()).cleared
    finally:
        small.stop()


def test_asyncio_cuda_pool_says_why(sidecar: Sidecar) -> None:
    async def run() -> None:
        async with await kvtier.aio.connect(sidecar.target, "asyncio-cuda") as s:
            g = s.geometry
            half = g.block_layer_bytes // 2
            buffers = [(b"\x00" * 64, 0, 2 * 8 * half)]
            with pytest.raises(kvtier.InvalidArgument) as e:
                await s.register_cuda_pool(buffers, [], "gpu", num_slots=8)
            assert "layout" in e.value.message
            with pytest.raises((kvtier.FailedPrecondition, kvtier.InvalidArgument)) as e:
                await s.register_cuda_pool(buffers, [(0, 0, 0, 8 * half, half)] * g.layers, "gpu", num_slots=8)
            assert "CUDA" in e.value.message or "cuda.buffers[0].ipc_handle" in e.value.message
    asyncio.run(run())


def test_resource_exhausted_and_deadline_exceeded(big_sidecar: tuple[Sidecar, int], tmp_path: Path) -> None:
    sc, _ = big_sidecar
    n = 512  # 128 MiB a load or store
    with kvtier.connect(sc.target, "busy") as s, kvtier.CpuPool.create(s.geometry, n + 4, tmp_path / "p") as p:
        h = s.register_pool(p, "busy")
        keys = h.keys(list(range(n * s.geometry.block_tokens)))
        assert s.store(h, keys, range(n)).stored_blocks == n

        # A small load queued behind a big one on the single load thread misses a 1 ms deadline.
        with s.load(h, keys, range(n)) as big:
            assert next(big) == kvtier.LayerReady(0)  # 3 layers (96 MiB) still to copy
            with pytest.raises(kvtier.DeadlineExceeded) as e:
                s.load_wait(h, keys[:1], [n], deadline_ms=1)
            assert "deadline" in e.value.message
            assert big.wait().loaded_blocks == n

        # The store queue admits 1 MiB in flight: of two stores in flight together (128 MiB and
        # one block), the one that arrives second is refused, whichever it is.
        async def race() -> list[object]:
            async with await kvtier.aio.connect(sc.target, "race") as a:
                ha = await a.register_pool(p, "busy")  # pools belong to their session
                return await asyncio.gather(
                    a.store(ha, keys, range(n)),
                    a.store(ha, keys[:1], [n]),
                    return_exceptions=True,
                )

        seen: list[object] = []
        full: list[kvtier.ResourceExhausted] = []
        for _ in range(20):  # the second store must arrive while the first copies (~10 ms)
            s.clear(h)
            seen = asyncio.run(race())
            full = [x for x in seen if isinstance(x, kvtier.ResourceExhausted)]
            if full:
                break
        assert len(full) == 1, seen
        assert "store queue full" in full[0].message
        assert not any(isinstance(x, BaseException) for x in seen if x is not full[0]), seen


def test_unauthenticated_unavailable_unimplemented(big_sidecar: tuple[Sidecar, int], tmp_path: Path) -> None:
    _, port = big_sidecar
    with pytest.raises(kvtier.Unauthenticated):
        kvtier.Client(f"127.0.0.1:{port}").stats()
    with kvtier.Client(f"http://127.0.0.1:{port}", auth_token=TOKEN) as c:
        assert c.stats().host_capacity_bytes == 160 << 20
        with kvtier.Session(c, "tcp") as s:
            assert s.geometry.block_tokens == 16

    nothing = tmp_path / "nothing.sock"  # no sidecar there
    with pytest.raises(kvtier.Unavailable):
        kvtier.Client(f"unix://{nothing}", timeout=5).stats()
    with pytest.raises(kvtier.Unavailable):
        kvtier.connect(nothing, connect_timeout=0.5)

    # A method this server does not have: gRPC's own UNIMPLEMENTED, mapped like the rest.
    with kvtier.Client(f"http://127.0.0.1:{port}", auth_token=TOKEN) as c:
        call = c.channel.unary_unary("/kvtier.v1.KvTier/NoSuchMethod", request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            call(b"", timeout=10, metadata=c.metadata)
        err = errors.from_rpc_error(e.value)
        assert isinstance(err, kvtier.Unimplemented) and err.code == grpc.StatusCode.UNIMPLEMENTED


def test_sidecar_shutting_down_is_unavailable(tmp_path: Path) -> None:
    sc = start_sidecar(tmp_path / "sd")
    try:
        s = kvtier.connect(sc.target, "to-be-stopped")
        sc.process.send_signal(signal.SIGTERM)
        assert sc.process.wait(timeout=30) == 0
        # The session stream ended with the server; any request now fails as Unavailable
        # (or SessionClosed once the stream's end was seen first).
        with pytest.raises((kvtier.Unavailable, kvtier.SessionClosed)):
            s.stats()
        assert wait_for(lambda: s.closed)
        with pytest.raises(kvtier.SessionClosed):
            s.stats()
        s.close()
    finally:
        sc.stop()


# --- a client killed mid-load --------------------------------------------------------------

CHILD = r"""
import sys, kvtier, numpy as np
target, path, kind = sys.argv[1], sys.argv[2], sys.argv[3]
s = kvtier.connect(target, "doomed")
if kind == "process":  # the sidecar writes into this process's own memory
    memory = np.zeros((512, s.geometry.block_bytes), np.uint8)
    h = s.register_process_pool([memory], "killed-mid-load", num_slots=512,
                                layout=kvtier.pool.block_major_layout(s.geometry))
else:
    pool = kvtier.CpuPool.create(s.geometry, 512, path)
    h = s.register_pool(pool, "killed-mid-load")
keys = h.keys(list(range(512 * s.geometry.block_tokens)))
s.store(h, keys, range(512))
s.pin(h, keys[:100])
load = s.load(h, keys, range(512))
next(load)
print("mid-load", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("kind", ["shm", "process"])
def test_client_killed_mid_load_leaks_nothing(big_sidecar: tuple[Sidecar, int], tmp_path: Path, kind: str) -> None:
    sc, _ = big_sidecar
    client = kvtier.Client(sc.target)
    base = client.stats()
    child = subprocess.Popen([sys.executable, "-c", CHILD, sc.target, str(tmp_path / "child-pool"), kind],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "mid-load"
        st = client.stats()
        assert st.sessions == base.sessions + 1 and st.pinned_blocks >= base.pinned_blocks + 100
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    def released() -> bool:
        st = client.stats()
        snap = st.snapshot
        return (
            st.sessions == base.sessions
            and st.pools == base.pools
            and st.pinned_blocks == base.pinned_blocks
            and snap["tiers"]["host"]["pinned_pages"] == 0
            and snap["load_queue"]["inflight_bytes"] == 0
            and snap["load_queue"]["active_requests"] == 0
        )

    assert wait_for(released), client.stats()
    # The sidecar still serves, and another client can load the dead one's blocks.
    with kvtier.connect(sc.target, "survivor") as s, kvtier.CpuPool.create(s.geometry, 4, tmp_path / "p2") as p:
        h = s.register_pool(p, "killed-mid-load")
        assert s.load_wait(h, h.keys(list(range(4 * s.geometry.block_tokens))), range(4)).loaded_blocks == 4
    client.close()


def test_match_and_store_take_a_timeout_under_a_stopped_sidecar(tmp_path: Path) -> None:
    """A sidecar that is alive but answers nothing (SIGSTOP): match and store give up after
    their ``timeout`` with DeadlineExceeded, sync and asyncio alike, and work again once it
    runs."""
    sc = start_sidecar(tmp_path / "sc")
    try:
        with kvtier.connect(sc.target, "timeouts") as s, kvtier.CpuPool.create(s.geometry, 2, tmp_path / "p") as p:
            h = s.register_pool(p, "timeouts")
            keys = h.keys(list(range(2 * s.geometry.block_tokens)))

            async def aio_calls() -> None:
                async with await kvtier.aio.connect(sc.target, "timeouts-aio") as a:
                    ah = await a.register_pool(p, "timeouts")
                    sc.pause()
                    try:
                        with pytest.raises(kvtier.DeadlineExceeded):
                            await a.match(ah, keys, timeout=0.3)
                        with pytest.raises(kvtier.DeadlineExceeded):
                            await a.store(ah, keys, [0, 1], timeout=0.3)
                    finally:
                        sc.resume()

            asyncio.run(aio_calls())
            sc.pause()
            try:
                with pytest.raises(kvtier.DeadlineExceeded):
                    s.match(h, keys, timeout=0.3)
                with pytest.raises(kvtier.DeadlineExceeded):
                    s.store(h, keys, [0, 1], timeout=0.3)
            finally:
                sc.resume()
            # The stores that timed out may have landed when the sidecar ran again: either way
            # the blocks are stored once.
            r = s.store(h, keys, [0, 1], timeout=30)
            assert r.stored_blocks + r.already_stored == 2
            assert s.match(h, keys, timeout=30).matched_blocks == 2
    finally:
        sc.stop()


def test_a_store_with_not_after_publishes_nothing_late(tmp_path: Path) -> None:
    """``not_after`` (an engine that writes its blocks again once it stops waiting): a store
    sent to a stopped sidecar, read only once it runs again, stores nothing (without it, the
    test above shows such a store landing late); one whose time has passed is refused by name;
    one in time stores as usual."""
    sc = start_sidecar(tmp_path / "sc")
    try:
        with kvtier.connect(sc.target, "not-after") as s, kvtier.CpuPool.create(s.geometry, 4, tmp_path / "p") as p:
            h = s.register_pool(p, "not-after")
            bt = s.geometry.block_tokens
            keys = h.keys(list(range(2 * bt)))
            other = h.keys(list(range(10_000, 10_000 + 2 * bt)))
            sc.pause()
            try:
                with pytest.raises(kvtier.DeadlineExceeded):
                    s.store(h, keys, [0, 1], timeout=0.3, not_after=time.time() + 0.3)
            finally:
                sc.resume()
            # Sent after the late one on the same channel, so read after it too.
            assert s.store(h, other, [2, 3], timeout=30).stored_blocks == 2
            assert s.match(h, keys, timeout=30).matched_blocks == 0, "nothing landed late"
            with pytest.raises(kvtier.DeadlineExceeded, match="not_after: nothing was stored"):
                s.store(h, keys, [0, 1], not_after=time.time() - 1)
            assert s.store(h, keys, [0, 1], not_after=time.time() + 30).stored_blocks == 2
            assert s.match(h, keys).matched_blocks == 2
            with pytest.raises(ValueError, match="not_after = -1"):
                s.store(h, keys, [0, 1], not_after=-1)

            async def aio_store() -> None:
                async with await kvtier.aio.connect(sc.target, "not-after-aio") as a:
                    ah = await a.register_pool(p, "not-after")
                    with pytest.raises(kvtier.DeadlineExceeded, match="not_after"):
                        await a.store(ah, other, [2, 3], not_after=time.time() - 1)
                    assert (await a.store(ah, other, [2, 3], not_after=time.time() + 30)).already_stored == 2

            asyncio.run(aio_store())
    finally:
        sc.stop()
