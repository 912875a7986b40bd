"""Copies between an engine's paged KV (vLLM's per-layer views) and a staging pool's slots
(kvtier's ``[layer][slot][K|V][token][head][dim]``), for KV the sidecar cannot reach where it
lies. Needs torch only (no engine package), so the GPU check runs it as the connector does.

CUDA KV: a layer's blocks are gathered on the GPU and copied out on a copy stream that waits
for the work queued so far (the layer's attention), into the staging pool registered with the
driver (page-locked), so the copies run by DMA while the forward goes on; :meth:`done` waits
for them. CPU KV: every copy is done when it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): what a KV cache
#: group's block table holds where the group keeps no block, e.g. sliding-window layers before
#: their window.
NULL_BLOCK = 0

logger = logging.getLogger(__name__)


def kv_planes(kv_layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V as ``[blocks, token, head, dim]`` views (no copy)."""
    if kv_layer.dim() == 4:  # [B, H, N, K‖V]
        return kv_layer[..., :head_dim].transpose(1, 2), kv_layer[..., head_dim:].transpose(1, 2)
    return kv_layer[0], kv_layer[1]  # [2, B, N, H, D]


def blocks_to_kvtier(kv_layer: torch.Tensor, block_ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    """vLLM blocks ``block_ids`` of one layer as kvtier's ``(n, K|V, token, head, dim)``
    (a gathered copy, strided)."""
    if kv_layer.dim() == 4:  # [B, H, N, K‖V]
        return kv_layer.index_select(0, block_ids).unflatten(-1, (2, head_dim)).permute(0, 3, 2, 1, 4)
    return kv_layer.index_select(1, block_ids).transpose(0, 1)  # [2, B, N, H, D]


def kvtier_to_blocks(kv_layer: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Writes kvtier's ``(n, K|V, token, head, dim)`` ``src`` into vLLM blocks ``block_ids``
    of one layer."""
    if kv_layer.dim() == 4:
        n, _, t, h, d = src.shape
        kv_layer[block_ids] = src.permute(0, 3, 2, 1, 4).reshape(n, h, t, 2 * d).to(kv_layer.device)
    else:
        kv_layer[:, block_ids] = src.transpose(0, 1).to(kv_layer.device)


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """``slots`` as (first slot, count) runs of consecutive slots."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


@dataclass(frozen=True)
class BlockRun:
    """Engine blocks paired with staging slots, ready for every layer's copy (:meth:`StagedCopies.run`)."""

    slots: list[int]
    slot_runs: list[tuple[int, int]]
    slot_idx: torch.Tensor
    #: Per KV cache group, the engine block indices on the KV's device.
    idx: list[torch.Tensor]


class StagedCopies:
    """Copies blocks of the engine's per-layer KV ``caches`` to and from ``staging`` (a
    ``(layers, slots, 2, token, head, dim)`` tensor over the staging pool's memory). Block ids
    come per KV cache group; layer ``l`` uses group ``layer_groups[l]``'s."""

    def __init__(self, staging: torch.Tensor, caches: list[torch.Tensor], layer_groups: list[int],
                 head_dim: int) -> None:
        self.staging = staging
        self.caches = caches
        self.layer_groups = layer_groups
        self.head_dim = head_dim
        #: CUDA KV: the stream saved layers go out on, and whether the pool is page-locked
        #: (else those copies wait for the GPU).
        self.stream: torch.cuda.Stream | None = None
        self.pinned = False
        if caches and caches[0].is_cuda:
            self.stream = torch.cuda.Stream(device=caches[0].device)
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                    staging.data_ptr(), staging.numel() * staging.element_size(), 0))
                self.pinned = True
            except RuntimeError as e:
                logger.warning("kvtier: the staging pool could not be pinned (%s); copies to it wait for the GPU", e)

    def close(self) -> None:
        """Waits for the copies in flight and unpins the pool (before its memory is unmapped)."""
        self.done()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.staging.data_ptr())
            self.pinned = False

    def run(self, block_ids: list[list[int]], slots: list[int]) -> BlockRun:
        """Engine blocks (``block_ids`` per KV cache group) paired with staging ``slots``, their
        indices made once for every layer's copy. CUDA KV: the indices go to the GPU on the copy
        stream from page-locked memory, so making them waits for nothing."""
        if self.stream is None:
            return BlockRun(slots, slot_runs(slots), torch.tensor(slots, dtype=torch.long),
                            [torch.tensor(g, dtype=torch.long) for g in block_ids])
        with torch.cuda.stream(self.stream):
            idx = [torch.tensor(g, dtype=torch.long).pin_memory().to(self.stream.device, non_blocking=True)
                   for g in block_ids]
        return BlockRun(slots, slot_runs(slots), torch.tensor(slots, dtype=torch.long), idx)

    def copy_in(self, block_ids: list[list[int]], slots: list[int]) -> None:
        """Engine blocks (``block_ids`` per KV cache group) → staging ``slots``, every layer;
        done when it returns."""
        run = self.run(block_ids, slots)
        for layer in range(len(self.caches)):
            self.copy_layer_in(layer, run)
        self.done()

    def copy_layer_in(self, layer: int, run: BlockRun) -> None:
        """One layer of a run's engine blocks → its staging slots. CPU KV: done when it
        returns. CUDA KV: queued on the copy stream after the work queued so far (the layer's
        attention), nothing waited for; :meth:`done` waits for it."""
        kv = self.caches[layer]
        idx = run.idx[self.layer_groups[layer]]
        if self.stream is None:
            src = blocks_to_kvtier(kv, idx, self.head_dim)
            self.staging[layer].index_copy_(0, run.slot_idx, src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(self.stream):
            src = blocks_to_kvtier(kv, idx, self.head_dim).contiguous()
            start = 0
            for s0, n in run.slot_runs:
                self.staging[layer, s0 : s0 + n].copy_(src[start : start + n], non_blocking=self.pinned)
                start += n

    def done(self) -> None:
        """Waits for the copies :meth:`copy_layer_in` queued on the copy stream."""
        if self.stream is not None:
            self.stream.synchronize()

    def copy_out(self, slots: list[int], block_ids: list[list[int]], layers: range) -> None:
        """Staging ``slots`` → engine blocks (``block_ids`` per KV cache group; each layer into
        its group's, none where that is ``NULL_BLOCK``); done when it returns."""
        per_group: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for ids in block_ids:  # the indices once per group, not per layer
            pairs = [(s, b) for s, b in zip(slots, ids) if b != NULL_BLOCK]
            per_group.append((torch.tensor([s for s, _ in pairs], dtype=torch.long),
                              torch.tensor([b for _, b in pairs], dtype=torch.long)) if pairs else None)
        for layer in layers:
            if (got := per_group[self.layer_groups[layer]]) is not None:
                sl, idx = got
                kvtier_to_blocks(self.caches[layer], idx, self.staging[layer].index_select(0, sl))
