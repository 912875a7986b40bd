"""The vLLM connector's staging copies on a GPU (kvtier.integrations.staged_copies, the path for
KV the sidecar cannot reach in place, e.g. a sidecar without CUDA): PyTorch KV in
vLLM's layouts, each layer's blocks copied out on the copy stream into the pinned staging pool
right after GPU work that writes them (as save_kv_layer does after a layer's attention), then
back into zeroed blocks; bit-exact, with the copy-out rate. Run by scripts/gpu-check.sh with
the kvtier package on PYTHONPATH; needs torch with CUDA, no engine package
(KVTIER_STAGED_DEVICE=cpu: a dry run of the same checks on CPU tensors).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch

from kvtier import CpuPool, Geometry
from kvtier.integrations.staged_copies import StagedCopies, blocks_to_kvtier

#: "cpu" runs the same checks without a GPU (a dry run of this script).
DEVICE = os.environ.get("KVTIER_STAGED_DEVICE", "cuda")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(layout: str, layers: int, blocks: int, slots_n: int, heads: int, dim: int, tokens: int) -> float:
    """One round trip through a staging pool of ``slots_n`` slots; returns the copy-out GiB/s."""
    dev = torch.device(DEVICE)
    g = Geometry(layers, heads, dim, "bf16", tokens)
    if layout == "BHNC":  # vLLM >= 0.34's [B, H, N, K||V] per layer
        caches = [torch.zeros(blocks, heads, tokens, 2 * dim, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    else:  # older [2, B, N, H, D]
        caches = [torch.zeros(2, blocks, tokens, heads, dim, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    with CpuPool.create(g, slots_n) as pool:
        staging = torch.from_numpy(pool.raw).view(torch.bfloat16).view(layers, slots_n, 2, tokens, heads, dim)
        copies = StagedCopies(staging, caches, [0] * layers, dim)
        if dev.type == "cuda":
            assert copies.stream is not None and copies.pinned, "CUDA KV: a copy stream into the pinned pool"
        # Slots in several runs (2, 3, 5-...), blocks scattered.
        slots = [2, 3, 7, 8, 9] + list(range(12, slots_n))
        ids = [(7 * i + 3) % blocks for i in range(len(slots))]
        gen = torch.Generator(device=dev).manual_seed(0)
        sync()
        start = time.perf_counter()
        run = copies.run([ids], slots)
        for layer in range(layers):
            # The "attention" writes the layer's blocks on the compute stream; the copy must
            # wait for it.
            t = caches[layer]
            t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(torch.bfloat16))
            copies.copy_layer_in(layer, run)
        copies.done()
        secs = time.perf_counter() - start
        sl = torch.tensor(slots)
        for layer in range(layers):
            want = blocks_to_kvtier(caches[layer].cpu(), torch.tensor(ids), dim)
            got = staging[layer].index_select(0, sl)
            assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)), f"{layout} layer {layer} out"
        kept = [t.clone() for t in caches]
        for t in caches:
            t.zero_()
        copies.copy_out(slots, [ids], range(layers))
        sync()
        index, axis = torch.tensor(ids, device=dev), 0 if layout == "BHNC" else 1
        for layer in range(layers):
            a = caches[layer].index_select(axis, index)
            b = kept[layer].index_select(axis, index)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{layout} layer {layer} back"
        copies.close()
    nbytes = layers * len(slots) * g.block_layer_bytes
    # The time includes the random writes on the compute stream (they overlap the copies).
    return nbytes / secs / 2**30


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("staged copies: no CUDA device", file=sys.stderr)
        return 1
    for layout in ("BHNC", "2BNHD"):
        check(layout, layers=4, blocks=64, slots_n=24, heads=2, dim=64, tokens=16)
    # 128 KiB block-layers (Qwen3-30B-A3B geometry: 4 KV heads of 128, bf16, 64-token blocks),
    # as many slots as a quarter of /dev/shm's free space holds (at most 128: 768 MiB).
    slots_n = max(16, min(128, shutil.disk_usage("/dev/shm").free // 4 // (48 << 17)))
    bw = check("BHNC", layers=48, blocks=512, slots_n=slots_n, heads=4, dim=128, tokens=64)
    print(f"staged copies{' (dry run on CPU: no stream, not pinned)' if DEVICE == 'cpu' else ''}: bit-exact ([B,H,N,K||V] and [2,B,N,H,D] views, slots in runs, blocks scattered), "
          f"pinned pool; save path (write + gather + copy out per layer, 48 layers x {slots_n - 7} blocks of "
          f"128 KiB): {bw:.2f} GiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
