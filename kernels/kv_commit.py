"""Triton KV commit: copy the K/V of accepted draft nodes into place, every layer, in one launch.

Behind `engines.kv_cache.PagedKVCache.move_slots`' copy (`copy_slots`, same arguments). One program per
(layer, K or V, chunk of a slot's row) reads the rows of every source slot before it writes any
destination, so overlapping moves (a destination that is another move's source) behave as a gather
followed by a scatter, like the PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kv_cache import MAX_COMMIT_MOVES
from kernels.dispatch import next_power_of_2

TILE = 8192  # elements one program holds: moves x row chunk


@triton.jit
def _kv_commit_kernel(
    k_ptr,  # [layers, slots, row] (row = kv_heads * head_dim, contiguous)
    v_ptr,
    src_ptr,  # [moves] int64
    dst_ptr,  # [moves] int64
    num_moves,
    layer_stride,
    row,
    BLOCK_MOVES: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    layer = tl.program_id(0)
    plane = tl.program_id(1)
    chunk = tl.program_id(2)
    i = tl.arange(0, BLOCK_MOVES)
    e = chunk * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    ok = (i < num_moves)[:, None] & (e < row)[None, :]
    src = tl.load(src_ptr + i, mask=i < num_moves, other=0)
    dst = tl.load(dst_ptr + i, mask=i < num_moves, other=0)
    from_offsets = layer.to(tl.int64) * layer_stride + src[:, None] * row + e[None, :]
    to_offsets = layer.to(tl.int64) * layer_stride + dst[:, None] * row + e[None, :]
    if plane == 0:
        tl.store(k_ptr + to_offsets, tl.load(k_ptr + from_offsets, mask=ok), mask=ok)
    else:
        tl.store(v_ptr + to_offsets, tl.load(v_ptr + from_offsets, mask=ok), mask=ok)


def triton_copy_slots(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """`engines.kv_cache.copy_slots` as one Triton launch (up to `MAX_COMMIT_MOVES` moves)."""
    moves = src.shape[0]
    if moves == 0:
        return
    if moves > MAX_COMMIT_MOVES:
        raise ValueError(f"at most {MAX_COMMIT_MOVES} slot moves per launch, got {moves}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    layers, _, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    block_moves = next_power_of_2(max(moves, 2))
    block_row = min(next_power_of_2(row), max(16, TILE // block_moves))
    grid = (layers, 2, triton.cdiv(row, block_row))
    _kv_commit_kernel[grid](
        k, v, src.long(), dst.long(), moves, k.stride(0), row, BLOCK_MOVES=block_moves, BLOCK_ROW=block_row
    )
