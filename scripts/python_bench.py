#!/usr/bin/env python3
"""Put/get throughput from Python: the kvtier package (python/kvtier) against Redis, on the same
bytes in the same run. Started by scripts/python_bench.sh, which makes the venv and starts the
servers (one `kvtier serve` per block size, one redis-server); run it directly with
``--kvtier unix:///…sock`` (repeatable, one per block size: the size is the sidecar's geometry)
and ``--redis-port``.

Each (block size, client count) runs in fresh client processes (multiprocessing, spawn), each
with its own kvtier session and CPU pool and its own Redis connection, and its own blocks
(``--ws`` bytes of random data per client, keys of its own). The processes start each pass
together (a barrier); a pass's GiB/s is all clients' bytes over the time from the first start
to the last end.

- kvtier put: copy each batch's blocks into pool slots (numpy) + ``Session.store`` of the batch.
  The pools are block-major by default (``CpuPool.create(..., block_major=True)``: a run of
  slots is one contiguous run of bytes, so a batch's copy is one memcpy); ``--pool layer``
  uses kvtier's layer-major pool file (one 1-layer run per block and layer).
- kvtier-in-place (``--no-in-place`` skips it): the client's blocks *are* its pool's slots
  (block-major, one slot per block, as an engine whose KV is registered in place: the vLLM
  connector's in-place path, SGLang's host pool): put is ``Session.store`` of the batch's slots
  and get ``Session.load`` into them, two loads in flight; nothing to copy. The bytes are
  checked from the pool after each get pass, untimed.
- kvtier-process (``--no-process`` skips it): the client's own blocks and its get buffer — the
  same plain numpy arrays the Redis client uses, not shared memory — are registered as two
  process pools (``Session.register_process_pool``, block-major): put is ``Session.store`` of
  the batch's rows of the blocks, get ``Session.load`` into the batch's rows of the buffer, two
  loads in flight; the sidecar copies straight between its host tier and the client's memory
  (``process_vm_readv`` / ``process_vm_writev``), the one copy a Redis client's own copy stands
  for.
- kvtier get: ``Session.load`` of the batch (``done_only``: one reply message) + copy out of
  the slots into a numpy buffer. With ``--pipeline`` (the default) a client double-buffers: it
  starts the next batch's Store/Load on the other half of its pool before copying the current
  one, so its copies overlap the sidecar's.
- Redis put: a non-transactional pipeline of SET per batch (redis-py + hiredis), values handed
  over as memoryviews of the same numpy blocks; get: a pipeline of GET per batch + copy of each
  reply into the numpy buffer.

The copies are timed on both sides. After each get pass every client checks its whole buffer
against its blocks (outside the timed part) and the pass fails on any difference; before each
put pass the blocks of the previous pass are cleared (kvtier ``clear``, Redis ``DEL``), untimed,
so every put stores. Reported: the median pass of ``--reps``, and the best.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


@dataclass
class Job:
    system: str           # "kvtier" | "redis"
    target: str           # kvtier target or redis port
    client: int
    clients: int
    batch: int
    blocks: int
    reps: int
    pipeline: bool
    seed: int
    copy_threads: int = 1
    block_major: bool = True


def _copier(threads: int):  # noqa: ANN202
    """np.copyto, split along the first axis over ``threads`` threads (numpy releases the GIL
    while it copies)."""
    if threads <= 1:
        return np.copyto
    from concurrent.futures import ThreadPoolExecutor
    ex = ThreadPoolExecutor(threads - 1)

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        cuts = np.linspace(0, dst.shape[0], threads + 1).astype(int)
        if cuts[1] == cuts[0]:
            np.copyto(dst, src)
            return
        futs = [ex.submit(np.copyto, dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]])
                for i in range(1, threads)]
        np.copyto(dst[cuts[0]:cuts[1]], src[cuts[0]:cuts[1]])
        for f in futs:
            f.result()
    return copy


def _tokens(client: int, blocks: int, block_tokens: int) -> np.ndarray:
    # Distinct token ids per client: distinct keys, and one sequence per client.
    base = 1_000_000 * (client + 1)
    return np.arange(base, base + blocks * block_tokens, dtype=np.int64) % (2**32)


def worker(job: Job, barrier, out) -> None:  # noqa: ANN001 (multiprocessing objects)
    try:
        out.put((job.client, _worker(job, barrier)))
    except BaseException as e:  # report, and break the barrier so the others stop too
        import traceback
        barrier.abort()
        out.put((job.client, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def _worker(job: Job, barrier) -> dict:  # noqa: ANN001
    import kvtier

    rng = np.random.default_rng(job.seed + job.client)
    res: dict[str, list] = {"put": [], "get": [], "detail": []}
    if job.system.startswith("kvtier"):
        sess = kvtier.connect(job.target, f"bench-{job.client}")
        g = sess.geometry
    else:
        # The block size comes from the kvtier sidecar of that size (same bytes either way).
        with kvtier.connect(job.target.split("|")[1], "probe") as probe:
            g = probe.geometry
    bb = g.block_bytes
    n, b = job.blocks, job.batch
    src = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)    # the blocks, one row each
    dst = np.zeros((n, bb), dtype=np.uint8)                      # where gets land (touched)

    if job.system.startswith("kvtier"):
        # In place: the blocks live in the pool (an engine whose KV is the pool), no copies;
        # process: the client's own arrays are its pools.
        process = job.system == "kvtier-process"
        in_place = process or job.system == "kvtier-in-place"
        halves = 2 if job.pipeline else 1
        slots = n if in_place else halves * b
        pool: kvtier.CpuPool | None = None
        if process:
            layout = kvtier.pool.block_major_layout(g)
            h_put = sess.register_process_pool([src], f"python-bench-{job.client}", num_slots=n, layout=layout)
            h = sess.register_process_pool([dst], f"python-bench-{job.client}", num_slots=n, layout=layout)
        else:
            pool = kvtier.CpuPool.create(g, num_slots=slots, block_major=job.block_major or in_place)
            pool.raw[:] = 1                                      # map every page now
            if in_place:
                pool.blocks[:] = src
            h = h_put = sess.register_pool(pool, f"python-bench-{job.client}")
        keys = h.keys(_tokens(job.client, n, g.block_tokens))
        L, B = g.layers, g.block_layer_bytes
        # Block i as the pool lays it out: (layers, block-layer bytes); a batch: (layers, n, B).
        src_l = src.reshape(n, L, B).transpose(1, 0, 2)
        dst_l = dst.reshape(n, L, B).transpose(1, 0, 2)
        starts = list(range(0, n, b))
        copy = _copier(job.copy_threads)

        def slot_range(k: int, m: int) -> range:
            s0 = starts[k] if in_place else (k % halves) * b
            return range(s0, s0 + m)

        def put_pass() -> tuple[float, float, dict]:
            d = {"copy": 0.0, "rpc": 0.0, "srv_active_us": 0, "srv_latency_us": 0, "calls": 0}
            pending = None  # (future, m) of the Store in flight
            barrier.wait()
            t0 = time.perf_counter()
            for k, i0 in enumerate(starts):
                m = min(b, n - i0)
                sr = slot_range(k, m)
                c0 = time.perf_counter()
                if in_place:
                    pass
                elif job.block_major:  # each block one run: one memcpy per batch
                    assert pool is not None
                    copy(pool.blocks[sr.start:sr.stop], src[i0:i0 + m])
                else:
                    copy(pool.raw[:, sr.start:sr.stop], src_l[:, i0:i0 + m])
                c1 = time.perf_counter()
                d["copy"] += c1 - c0
                parent = None if i0 == 0 else keys[i0 - 1]
                if job.pipeline:
                    if pending is not None:
                        _store_done(pending.result(), d)
                    pending = executor.submit(sess.store, h_put, keys[i0:i0 + m], sr, parent=parent)
                else:
                    _store_done(sess.store(h_put, keys[i0:i0 + m], sr, parent=parent), d)
                d["rpc"] += time.perf_counter() - c1
            if pending is not None:
                w0 = time.perf_counter()
                _store_done(pending.result(), d)
                d["rpc"] += time.perf_counter() - w0
            t1 = time.perf_counter()
            if d.get("stored") != n:
                raise RuntimeError(f"kvtier store: {d.get('stored')} of {n} blocks stored")
            return t0, t1, d

        def _store_done(r, d: dict) -> None:  # noqa: ANN001
            if len(r.no_space):
                raise RuntimeError(f"kvtier store: {len(r.no_space)} blocks dropped for lack of space")
            d["srv_active_us"] += r.timing.active_us
            d["srv_latency_us"] += r.timing.latency_us
            d["calls"] += 1
            d["stored"] = d.get("stored", 0) + r.stored_blocks

        def get_pass() -> tuple[float, float, dict]:
            d = {"copy": 0.0, "rpc": 0.0, "srv_active_us": 0, "srv_latency_us": 0, "calls": 0}

            def start(k: int):  # noqa: ANN202
                i0 = starts[k]
                m = min(b, n - i0)
                return sess.load(h, keys[i0:i0 + m], slot_range(k, m), done_only=True), i0, m

            def finish(ld, m: int) -> None:  # noqa: ANN001
                done = ld.wait()
                if done.loaded_blocks != m or len(done.missing):
                    raise RuntimeError(f"kvtier load: {done.loaded_blocks}/{m} blocks, {len(done.missing)} missing")
                d["srv_active_us"] += done.timing.active_us
                d["srv_latency_us"] += done.timing.latency_us
                d["calls"] += 1

            barrier.wait()
            t0 = time.perf_counter()
            if in_place:  # two loads in flight, nothing to copy
                ahead = [start(0)]
                for k in range(len(starts)):
                    if k + 1 < len(starts):
                        ahead.append(start(k + 1))
                    ld, _, m = ahead.pop(0)
                    r0 = time.perf_counter()
                    finish(ld, m)
                    d["rpc"] += time.perf_counter() - r0
                t1 = time.perf_counter()
                if pool is not None:
                    dst[:] = pool.blocks                        # for the check, untimed
                return t0, t1, d
            nxt = start(0)
            for k in range(len(starts)):
                ld, i0, m = nxt
                r0 = time.perf_counter()
                finish(ld, m)
                # Double-buffered: the next batch loads into the other half while this one is
                # copied out (a load returns at once; the reply is waited for in finish()).
                nxt = start(k + 1) if job.pipeline and k + 1 < len(starts) else None
                r1 = time.perf_counter()
                sr = slot_range(k, m)
                if job.block_major:
                    copy(dst[i0:i0 + m], pool.blocks[sr.start:sr.stop])
                else:
                    copy(dst_l[:, i0:i0 + m], pool.raw[:, sr.start:sr.stop])
                c1 = time.perf_counter()
                d["rpc"] += r1 - r0
                d["copy"] += c1 - r1
                if not job.pipeline and k + 1 < len(starts):
                    nxt = start(k + 1)
            t1 = time.perf_counter()
            return t0, t1, d

        def clear() -> None:
            sess.clear(h)

        def reset_for_get() -> None:
            if pool is not None:
                pool.raw[:] = 0

        executor = None
        if job.pipeline:
            from concurrent.futures import ThreadPoolExecutor
            executor = ThreadPoolExecutor(1)
    else:
        import redis
        port = int(job.target.split("|")[0])
        r = redis.Redis(host="127.0.0.1", port=port)
        rkeys = [f"c{job.client}:b{i}".encode() for i in range(n)]
        views = [memoryview(src[i]) for i in range(n)]
        starts = list(range(0, n, b))

        def put_pass() -> tuple[float, float, dict]:
            p = r.pipeline(transaction=False)
            barrier.wait()
            t0 = time.perf_counter()
            for i0 in starts:
                for i in range(i0, min(i0 + b, n)):
                    p.set(rkeys[i], views[i])
                p.execute()
            t1 = time.perf_counter()
            return t0, t1, {}

        def get_pass() -> tuple[float, float, dict]:
            p = r.pipeline(transaction=False)
            d = {"copy": 0.0, "rpc": 0.0}
            barrier.wait()
            t0 = time.perf_counter()
            for i0 in starts:
                m = min(b, n - i0)
                r0 = time.perf_counter()
                for i in range(i0, i0 + m):
                    p.get(rkeys[i])
                vals = p.execute()
                r1 = time.perf_counter()
                for j, v in enumerate(vals):
                    dst[i0 + j] = np.frombuffer(v, dtype=np.uint8)
                d["rpc"] += r1 - r0
                d["copy"] += time.perf_counter() - r1
            t1 = time.perf_counter()
            return t0, t1, d

        def clear() -> None:
            p = r.pipeline(transaction=False)
            for i0 in range(0, n, 256):
                p.delete(*rkeys[i0:i0 + 256])
            p.execute()

        def reset_for_get() -> None:
            pass

    try:
        for _ in range(job.reps):
            clear()
            res["put"].append(put_pass())
        for _ in range(job.reps):
            dst[:] = 0
            reset_for_get()
            res["get"].append(get_pass())
            if not np.array_equal(dst, src):                     # outside the timed part
                bad = int(np.count_nonzero((dst != src).any(axis=1)))
                raise RuntimeError(f"{job.system} get: {bad} of {n} blocks differ from what was put")
        clear()
    finally:
        if job.system.startswith("kvtier"):
            if executor is not None:
                executor.shutdown()
            for handle in {h.pool_id: h, h_put.pool_id: h_put}.values():
                sess.unregister_pool(handle)
            sess.close()
            if pool is not None:
                pool.close()
    res["block_bytes"] = bb
    return res


def run(system: str, target: str, clients: int, batch: int, blocks: int, reps: int,
        pipeline: bool, seed: int, copy_threads: int = 1, block_major: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(Job(system, target, c, clients, batch, blocks, reps,
                                                   pipeline, seed, copy_threads, block_major), barrier, out))
             for c in range(clients)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        c, r = out.get()
        results[c] = r
    for p in procs:
        p.join()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise SystemExit(f"{system} with {clients} clients failed:\n" + "\n".join(errors))
    bb = results[0]["block_bytes"]
    total = bb * blocks * clients
    agg: dict[str, object] = {}
    for op in ("put", "get"):
        rates, details = [], []
        for rep in range(reps):
            t0 = min(results[c][op][rep][0] for c in results)
            t1 = max(results[c][op][rep][1] for c in results)
            rates.append(total / (t1 - t0) / GiB)
            details.append([results[c][op][rep][2] for c in results])
        med = statistics.median(rates)
        # The detail of the median pass (summed over clients).
        i = min(range(reps), key=lambda k: abs(rates[k] - med))
        dsum: dict[str, float] = {}
        for d in details[i]:
            for k, v in d.items():
                dsum[k] = dsum.get(k, 0) + v
        agg[op] = (med, max(rates), dsum)
    return agg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtier", action="append", required=True,
                    help="a kvtier sidecar target (repeatable; one per block size)")
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--clients", default="1,4", help="client process counts (default 1,4)")
    ap.add_argument("--batch", default="128,4",
                    help="blocks per call, one value for all sizes or one per size, smallest size first\n(default 128,4: 16 MiB of 128 KiB blocks, 24 MiB of 6 MiB blocks per call)")
    ap.add_argument("--ws", default="256", help="MiB of blocks per client (default 256)")
    ap.add_argument("--reps", type=int, default=5, help="passes per measurement (default 5)")
    ap.add_argument("--batch1-ws", default="64", help="MiB per client for the batch-1 reference (default 64)")
    ap.add_argument("--batch1-reps", type=int, default=3)
    ap.add_argument("--no-batch1", action="store_true", help="skip the one-block-per-call reference")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="kvtier clients wait for each call before copying the next batch")
    ap.add_argument("--pool", choices=("block", "layer"), default="block",
                    help="kvtier clients' pools: block-major (each block one run, the default) or "
                         "layer-major (kvtier's pool file format: a block is one run per layer)")
    ap.add_argument("--no-in-place", action="store_true",
                    help="skip the in-place rows (the blocks live in the client's pool: no copies)")
    ap.add_argument("--no-process", action="store_true",
                    help="skip the process-pool rows (the client's own arrays registered as pools)")
    ap.add_argument("--copy-threads", type=int, default=1,
                    help="threads a kvtier client copies into/out of its pool with (default 1)")
    ap.add_argument("--detail", action="store_true", help="print where the time goes")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]

    import kvtier
    import redis
    from redis.utils import HIREDIS_AVAILABLE
    sizes = []
    for t in a.kvtier:
        with kvtier.connect(t, "probe") as s:
            sizes.append((s.geometry.block_bytes, t, s.geometry))
    sizes.sort()
    rinfo = redis.Redis(host="127.0.0.1", port=a.redis_port).info("server")
    print(f"# python {sys.version.split()[0]}, numpy {np.__version__}, redis-py {redis.__version__} "
          f"(hiredis {'yes' if HIREDIS_AVAILABLE else 'NO'}), redis-server {rinfo['redis_version']}, "
          f"{os.cpu_count()} CPUs")
    print(f"# GiB/s over all clients, median of {a.reps} passes (best in brackets); "
          f"copies into/out of the pool and of Redis replies timed; bytes verified after each get")
    print(f"# kvtier: {'double-buffered' if not a.no_pipeline else 'one call at a time'}, "
          f"load done_only, store/load one call per batch, {a.pool}-major pools")

    batches = [int(x) for x in a.batch.split(",")]
    if len(batches) == 1:
        batches *= len(sizes)
    if len(batches) != len(sizes):
        ap.error(f"--batch: {len(batches)} values for {len(sizes)} block sizes")

    def measure(batch_of: list[int], ws_mib: float, reps: int, pipeline: bool) -> None:
        for (bb, target, g), batch in zip(sizes, batch_of):
            blocks = -(-int(ws_mib * MiB) // (bb * batch)) * batch   # whole batches, >= ws
            for c in clients:
                rows = {}
                systems = ["kvtier"]
                if pipeline and not a.no_in_place:
                    systems.append("kvtier-in-place")
                if pipeline and not a.no_process:
                    systems.append("kvtier-process")
                systems.append("redis")
                for system in systems:
                    tgt = target if system.startswith("kvtier") else f"{a.redis_port}|{target}"
                    rows[system] = run(system, tgt, c, batch, blocks, reps, pipeline, a.seed,
                                       a.copy_threads if system == "kvtier" else 1, a.pool == "block")
                    for op in ("put", "get"):
                        med, best, d = rows[system][op]
                        line = (f"{system:6s} block={human(bb):7s} clients={c} batch={batch:<3d} "
                                f"{op}  {med:7.3f} GiB/s  [{best:.3f}]")
                        if a.detail and d:
                            calls = d.get("calls", 0)
                            extra = f"  client: copy {d['copy']:.3f} s, call {d['rpc']:.3f} s"
                            if calls:
                                extra += (f"; sidecar {calls} calls: active {d['srv_active_us'] / 1e6:.3f} s,"
                                          f" latency {d['srv_latency_us'] / calls:.0f} us/call")
                            line += extra
                        print(line, flush=True)
                k, r = rows["kvtier"], rows["redis"]
                print(f"ratio  block={human(bb):7s} clients={c} batch={batch:<3d} "
                      f"kvtier_to_redis put={k['put'][0] / r['put'][0]:.2f} get={k['get'][0] / r['get'][0]:.2f}"
                      f"  ({blocks} blocks = {blocks * bb / MiB:.0f} MiB per client, layers={g.layers})",
                      flush=True)
                for system in ("kvtier-in-place", "kvtier-process"):
                    if system in rows:
                        k = rows[system]
                        name = system.replace("-", "_")
                        print(f"ratio  block={human(bb):7s} clients={c} batch={batch:<3d} "
                              f"{name}_to_redis put={k['put'][0] / r['put'][0]:.2f} "
                              f"get={k['get'][0] / r['get'][0]:.2f}", flush=True)

    t = time.monotonic()
    measure(batches, float(a.ws), a.reps, not a.no_pipeline)
    if not a.no_batch1:
        print("# reference: one block per call (batch 1)")
        measure([1] * len(sizes), float(a.batch1_ws), a.batch1_reps, False)
    print(f"# {time.monotonic() - t:.0f} s")


if __name__ == "__main__":
    main()
