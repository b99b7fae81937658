"""Triton KV commit: copy the K/V of accepted draft nodes into place, every layer, in one launch.

Behind `engines.kv_cache.copy_slots` (same arguments; that module imports this one only where the kernel
runs, and this one imports nothing from `engines`). The moves of a step may overlap: `PagedKVCache.path_moves`
of a path that skips a node moves each later node one index down, onto the slot the previous move reads
from. So they must act as a gather followed by a scatter, like the PyTorch reference:
- within a program, every move's source is loaded, then a barrier (on a GPU a program's moves run on
  different threads, with no order between warps otherwise), then every destination is stored;
- across programs, nothing overlaps: one program per (layer, K or V, chunk of a slot's row) takes every
  move, so the programs read and write disjoint elements whatever the moves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lyanna_kernels.dispatch import next_power_of_2

MAX_COMMIT_MOVES = 4096  # moves one launch takes (all in registers at once); a step with more takes PyTorch's copy
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
    if plane == 0:
        cache = k_ptr
    else:
        cache = v_ptr
    i = tl.arange(0, BLOCK_MOVES)
    e = chunk * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    ok = (i < num_moves)[:, None] & (e < row)[None, :]
    src = tl.load(src_ptr + i, mask=i < num_moves, other=0)
    dst = tl.load(dst_ptr + i, mask=i < num_moves, other=0)
    from_offsets = layer.to(tl.int64) * layer_stride + src[:, None] * row + e[None, :]
    to_offsets = layer.to(tl.int64) * layer_stride + dst[:, None] * row + e[None, :]
    rows = tl.load(cache + from_offsets, mask=ok)  # every move's source ...
    tl.debug_barrier()  # ... read by every thread of the program before any destination is written
    tl.store(cache + to_offsets, rows, mask=ok)


def triton_copy_slots(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """`engines.kv_cache.copy_slots` as one Triton launch (up to `MAX_COMMIT_MOVES` moves)."""
    moves = src.shape[0]
    if moves == 0:
        return
    if moves > MAX_COMMIT_MOVES:
        raise ValueError(f"at most {MAX_COMMIT_MOVES} slot moves per launch, got {moves}")
    if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError("the K and V caches must be contiguous, of one shape and dtype")
    if dst.shape != src.shape:
        raise ValueError(f"{moves} sources but {dst.shape[0]} destinations")
    layers, _, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    block_moves = next_power_of_2(max(moves, 2))
    block_row = min(next_power_of_2(row), max(16, TILE // block_moves))
    grid = (layers, 2, triton.cdiv(row, block_row))
    _kv_commit_kernel[grid](
        k, v, src.long(), dst.long(), moves, k.stride(0), row, BLOCK_MOVES=block_moves, BLOCK_ROW=block_row
    )
