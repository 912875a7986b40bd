#!/usr/bin/env python3
"""An engine's KV cache in vLLM's layout, allocated with PyTorch on GPU 0, for the CUDA IPC
test (tests/cuda_ipc.rs, run by scripts/gpu-check.sh).

Allocates one tensor per layer, [2, num_blocks, block_tokens, kv_heads, head_dim] bf16 (vLLM's
FlashAttention layout: the K plane, then the V plane), prints one JSON line with each tensor's
CUDA IPC handle (what a kvtier connector sends in RegisterPoolRequest.cuda), then answers
commands on stdin, one per line, each with one line on stdout:

  fill SEED           random bits in every layer, kept as a reference copy  -> ok
  expect SEED         the reference of `fill SEED`, the tensors untouched    -> ok
  zero                every layer zeroed                                     -> ok
  compare SRC DST N   reference blocks SRC..SRC+N against current DST..DST+N,
                      K and V of every layer, bit for bit                    -> {"differing_elements": n}
  zeros FIRST N       blocks FIRST..FIRST+N are all zero in every layer      -> {"nonzero_elements": n}
  quit                exits
"""
import argparse
import json
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-tokens", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    a = ap.parse_args()
    torch.cuda.set_device(0)
    shape = (2, a.blocks, a.block_tokens, a.kv_heads, a.head_dim)
    layers = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(a.layers)]
    torch.cuda.synchronize()
    buffers = []
    for t in layers:
        share = t.untyped_storage()._share_cuda_()
        # (device, handle, storage size, storage offset in the allocation, ...)
        handle, size, offset = share[1], share[2], share[3]
        buffers.append({"ipc_handle": bytes(handle).hex(), "offset_bytes": int(offset), "size_bytes": int(size)})
    uuid = str(torch.cuda.get_device_properties(0).uuid).replace("GPU-", "").replace("-", "")
    print(json.dumps({
        "device_uuid": uuid if len(uuid) == 32 else "",
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "buffers": buffers,
    }), flush=True)
    reference: list = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] in ("fill", "expect"):
            g = torch.Generator(device="cuda")
            g.manual_seed(int(cmd[1]))
            reference = [
                torch.randint(-32768, 32767, t.shape, dtype=torch.int16, device="cuda", generator=g)
                for t in layers
            ]
            if cmd[0] == "fill":
                for t, r in zip(layers, reference):
                    t.view(torch.int16).copy_(r)
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif cmd[0] == "zero":
            for t in layers:
                t.zero_()
            torch.cuda.synchronize()
            print("ok", flush=True)
        elif cmd[0] == "compare":
            src, dst, n = (int(x) for x in cmd[1:4])
            torch.cuda.synchronize()
            diff = 0
            for t, r in zip(layers, reference):
                diff += int((t.view(torch.int16)[:, dst:dst + n] != r[:, src:src + n]).sum().item())
            print(json.dumps({"differing_elements": diff}), flush=True)
        elif cmd[0] == "zeros":
            first, n = int(cmd[1]), int(cmd[2])
            torch.cuda.synchronize()
            nz = sum(int((t.view(torch.int16)[:, first:first + n] != 0).sum().item()) for t in layers)
            print(json.dumps({"nonzero_elements": nz}), flush=True)
        elif cmd[0] == "quit":
            return
        else:
            print(json.dumps({"error": f"unknown command {cmd[0]!r}"}), flush=True)


if __name__ == "__main__":
    main()
