#!/usr/bin/env python3
"""The Python side of the CUDA path, for scripts/gpu-check.sh: KV allocated by PyTorch on GPU 0
in vLLM's [2, blocks, token, head, dim] layout per layer, registered with the sidecar where it
lies by kvtier.integrations.in_place (what the vLLM connector's worker does: IPC handles from
torch's storages, the layout from the tensors' strides), then store -> zero -> load into other
blocks, checked bit-exact, with the blocks not loaded still zero. Also: the K||V-interleaved
[B, H, N, 2D] view is refused with the reason (it goes through staging).

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


def run(target: str) -> None:
    caches = [torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    with kvtier.connect(target, "gpu-in-place") as s:
        h = register_in_place(s, [(t[0], t[1]) for t in caches], "gpu/in-place")
        print(f"in_place_cuda: registered {LAYERS} layers x {BLOCKS} blocks in place (pool {h.pool_id})")
        g = torch.Generator(device="cuda")
        g.manual_seed(11)
        for t in caches:
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, device="cuda", generator=g))
        ref = [t[:, 0:8].clone() for t in caches]
        torch.cuda.synchronize()  # the writes are done before the sidecar reads
        keys = h.keys(list(range(8 * TOKENS)))
        r = s.store(h, keys, range(0, 8))
        assert r.stored_blocks == 8, r
        for t in caches:
            t.zero_()
        torch.cuda.synchronize()
        done = s.load_wait(h, keys, range(16, 24))
        assert done.loaded_blocks == 8 and not len(done.missing), done
        diff = sum(int((t[:, 16:24].view(torch.int16) != r_.view(torch.int16)).sum()) for t, r_ in zip(caches, ref))
        stray = sum(int(t[:, :16].view(torch.int16).count_nonzero()) + int(t[:, 24:].view(torch.int16).count_nonzero())
                    for t in caches)
        print(f"in_place_cuda: store -> zero -> load of 8 blocks: differing_elements={diff} nonzero_outside={stray}")
        if diff or stray:
            raise SystemExit(1)
        inter = [torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        try:
            register_in_place(s, [(t[..., :DIM].transpose(1, 2), t[..., DIM:].transpose(1, 2)) for t in inter], "x")
        except NotInPlace as e:
            print(f"in_place_cuda: K||V-interleaved layout refused: {e}")
        else:
            raise SystemExit("in_place_cuda: the interleaved layout was registered in place")
    print("in_place_cuda: ok")


if __name__ == "__main__":
    main()
