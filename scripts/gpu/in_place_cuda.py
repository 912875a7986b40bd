#!/usr/bin/env python3
"""The Python side of the CUDA path, for scripts/gpu-check.sh: KV allocated by PyTorch on GPU 0
in vLLM's [2, blocks, token, head, dim] layout per layer, registered with the sidecar where it
lies by kvtier.integrations.in_place (what the vLLM connector's worker does: IPC handles from
torch's storages, the layout from the tensors' strides), then store -> zero -> load into other
blocks, checked bit-exact, with the blocks not loaded still zero. The same for vLLM >= 0.34's
LBHNC layout (per layer [blocks, head, token, K||V], K and V interleaved per token and head),
which the sidecar copies with the copy kernel (many small pieces), and a head whose elements are
not contiguous must be refused with the reason. Then a hybrid model's KV (two KV cache groups,
each group-1 layer over the same memory as a group-0 layer, as vLLM's hybrid KV cache manager
lays them out): each layer stored from and loaded into its own group's blocks, none into a
NO_SLOT.

Usage: in_place_cuda.py path/to/kvtier   (the kvtier package and its dependencies importable)
Prints one line per check; exits 1 on any failure.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import kvtier
from kvtier.integrations.in_place import NotInPlace, register_in_place

LAYERS, HEADS, DIM, TOKENS, BLOCKS = 4, 2, 64, 16, 32


def serve(binary: str, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    sock = tmp / "kvtier.sock"
    proc = subprocess.Popen(
        [binary, "serve", "--socket", str(sock), "--metrics", "off", "--host-capacity", "64MiB",
         "--set", f"model.layers={LAYERS}", "--set", f"model.kv_heads={HEADS}", "--set", f"model.head_dim={DIM}",
         "--set", "model.dtype=bf16", "--set", f"model.block_tokens={TOKENS}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    for line in proc.stderr:
        print("  serve:", line.rstrip())
        if "kvtier: serving" in line:
            stderr = proc.stderr
            threading.Thread(target=lambda: [print("  serve:", x.rstrip()) for x in stderr], daemon=True).start()
            return proc, f"unix://{sock}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("in_place_cuda: kvtier serve did not start")


def main() -> None:
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        proc, target = serve(sys.argv[1], Path(d))
        try:
            run(target)
        finally:
            proc.terminate()
            proc.wait()


def round_trip(s: kvtier.Session, name: str, caches: list[torch.Tensor],
               planes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Registers ``planes`` (per layer K and V as [blocks, token, head, dim] views of
    ``caches``) in place, stores blocks 0..8, zeroes everything, loads them into 16..24 and
    compares every element, and that nothing else was written."""
    h = register_in_place(s, planes, f"gpu/{name}")
    print(f"in_place_cuda: {name}: registered {LAYERS} layers x {BLOCKS} blocks in place (pool {h.pool_id})")
    g = torch.Generator(device="cuda")
    g.manual_seed(11)
    for t in caches:
        t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, device="cuda", generator=g))
    ref = [torch.stack([k[0:8], v[0:8]]).clone() for k, v in planes]
    torch.cuda.synchronize()  # the writes are done before the sidecar reads
    keys = h.keys(list(range(8 * TOKENS)), cache_salt=name)
    t0 = time.perf_counter()
    r = s.store(h, keys, range(0, 8), cache_salt=name)
    t_store = time.perf_counter() - t0
    assert r.stored_blocks == 8, r
    for t in caches:
        t.zero_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = s.load_wait(h, keys, range(16, 24), cache_salt=name)
    t_load = time.perf_counter() - t0
    assert done.loaded_blocks == 8 and not len(done.missing), done
    diff = sum(int((torch.stack([k[16:24], v[16:24]]).view(torch.int16) != r_.view(torch.int16)).sum())
               for (k, v), r_ in zip(planes, ref))
    loaded = sum(int(torch.stack([k[16:24], v[16:24]]).view(torch.int16).count_nonzero()) for k, v in planes)
    stray = sum(int(t.view(torch.int16).count_nonzero()) for t in caches) - loaded
    print(f"in_place_cuda: {name}: store -> zero -> load of 8 blocks: differing_elements={diff} "
          f"nonzero_outside={stray} store_ms={t_store * 1e3:.2f} load_ms={t_load * 1e3:.2f}")
    if diff or stray:
        raise SystemExit(1)
    s.unregister_pool(h)


def hybrid_round_trip(s: kvtier.Session) -> None:
    """Layers 2i (group 0) and 2i + 1 (group 1) share a [2, blocks, token, head, dim] tensor:
    block b is stored from blocks b (group 0) and 8 + b (group 1), loaded into 16 + b and
    24 + b, except block 3's group-1 layers (NO_SLOT)."""
    shared = [torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS // 2)]
    planes = [(shared[i // 2][0], shared[i // 2][1]) for i in range(LAYERS)]
    h = register_in_place(s, planes, "gpu/hybrid", groups=[i % 2 for i in range(LAYERS)])
    g = torch.Generator(device="cuda")
    g.manual_seed(12)
    for t in shared:
        t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, device="cuda", generator=g))
    ref = [t.clone() for t in shared]
    torch.cuda.synchronize()
    keys = h.keys(list(range(8 * TOKENS)), cache_salt="hybrid")
    r = s.store(h, keys, range(0, 8), cache_salt="hybrid", group_slots=[range(8, 16)])
    assert r.stored_blocks == 8, r
    for t in shared:
        t.zero_()
    torch.cuda.synchronize()
    into1 = [24 + b if b != 3 else kvtier.NO_SLOT for b in range(8)]
    done = s.load_wait(h, keys, range(16, 24), cache_salt="hybrid", group_slots=[into1])
    assert done.loaded_blocks == 8, done
    diff = 0
    for t, r_ in zip(shared, ref):
        diff += int((t[:, 16:24].view(torch.int16) != r_[:, 0:8].view(torch.int16)).sum())
        got1 = torch.cat([t[:, 24:27], t[:, 28:32]], dim=1)
        want1 = torch.cat([r_[:, 8:11], r_[:, 12:16]], dim=1)
        diff += int((got1.view(torch.int16) != want1.view(torch.int16)).sum())
    stray = sum(int(t[:, :16].view(torch.int16).count_nonzero()) + int(t[:, 27].view(torch.int16).count_nonzero())
                for t in shared)
    print(f"in_place_cuda: hybrid (2 KV cache groups over shared memory): store -> zero -> load of 8 blocks: "
          f"differing_elements={diff} nonzero_outside={stray}")
    if diff or stray:
        raise SystemExit(1)
    s.unregister_pool(h)


def run(target: str) -> None:
    with kvtier.connect(target, "gpu-in-place") as s:
        # vLLM before 0.34: [2, blocks, token, head, dim] per layer.
        old = [torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        round_trip(s, "vllm", old, [(t[0], t[1]) for t in old])
        del old
        # vLLM >= 0.34 LBHNC: [blocks, head, token, K||V] per layer, viewed as [B, N, H, D].
        inter = [torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        round_trip(s, "vllm-lbhnc", inter,
                   [(t[..., :DIM].transpose(1, 2), t[..., DIM:].transpose(1, 2)) for t in inter])
        odd = [t[..., ::2].transpose(1, 2) for t in inter]
        try:
            register_in_place(s, [(x, x) for x in odd], "x")
        except NotInPlace as e:
            print(f"in_place_cuda: a head with strided elements refused: {e}")
        else:
            raise SystemExit("in_place_cuda: a head with strided elements was registered in place")
        del inter, odd
        hybrid_round_trip(s)
    print("in_place_cuda: ok")


if __name__ == "__main__":
    main()
