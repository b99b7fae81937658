"""Paged KV cache: fixed-size blocks, a block allocator with capacity accounting, per-sequence block
tables, and commit of an accepted root-to-node path after tree verification."""

from __future__ import annotations

from collections import deque

import torch

from engines.errors import CacheCapacityError
from kernels.dispatch import use_triton


def cpu_has_half_precision_math(dtype: torch.dtype) -> bool:
    """Whether this CPU computes in `dtype` natively (AVX512-BF16 or AMX for bf16, AMX-FP16 for fp16)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if dtype == torch.float16:
        return getattr(cpu, "_is_amx_fp16_supported", lambda: False)()
    return True


def kv_cache_dtype(setting: torch.dtype | None, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: `setting`, or for None ("auto") the model's, except fp32 on a CPU that would
    emulate the model's half-precision arithmetic."""
    if setting is not None:
        return setting
    if device.type == "cpu" and not cpu_has_half_precision_math(model_dtype):
        return torch.float32
    return model_dtype


@torch.no_grad()
def copy_slots(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """k[:, dst] = k[:, src] and the same for v ([layers, slots, kv_heads, head_dim] caches, [M] int64
    slot indices on their device): every source is read before any destination is written. Runs the
    Triton kernel of `kernels/kv_commit.py` where `use_triton` says so (up to its moves per launch)."""
    if use_triton(k):
        from kernels.kv_commit import MAX_COMMIT_MOVES, triton_copy_slots  # lazily: triton is optional

        if len(src) <= MAX_COMMIT_MOVES:
            triton_copy_slots(k, v, src, dst)
            return
    # Advanced indexing gathers into a new tensor first, so overlapping moves are safe.
    k[:, dst] = k[:, src]
    v[:, dst] = v[:, src]


class BlockAllocator:
    """Hands out fixed-size KV blocks from a free list and takes them back."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks; raises CacheCapacityError (taking nothing) when fewer are free."""
        if n > len(self._free):
            raise CacheCapacityError(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list."""
        self._free.extend(blocks)


class PagedKVCache:
    """K and V tensors for every layer, addressed by flat slot = block_id * block_size + offset.

    A sequence's token at cache index i lives in block `table[i // block_size]`. The cache holds
    storage only: which indices hold committed tokens is the caller's business (the scheduler tracks
    `num_computed_tokens`), except for `commit_path` and `truncate`, which reshape a sequence's storage.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token's K and V take across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.allocator.num_free / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks a sequence must still get to hold `num_tokens` tokens in all."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence could grow to `num_tokens` tokens now."""
        return self.num_new_blocks(seq_id, num_tokens) <= self.allocator.num_free

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence's block table to hold `num_tokens` tokens (raises CacheCapacityError if full)."""
        need = self.num_new_blocks(seq_id, num_tokens)
        table = self.block_tables.setdefault(seq_id, [])
        if need:
            table.extend(self.allocator.allocate(need))

    def slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slots of the sequence's cache indices [start, end), as a CPU int64 tensor."""
        from engines.attention import sequence_slots

        return sequence_slots(self.block_tables[seq_id], self.block_size, start, end)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep storage for the first `num_tokens` cache indices; free whole blocks past them."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        if keep < len(table):
            self.allocator.free(table[keep:])
            del table[keep:]

    def path_moves(self, commits: list[tuple[str, int, list[int]]]) -> tuple[list[int], list[int]]:
        """After tree verification: the slot moves (sources, destinations) that put each sequence's
        accepted tree nodes at contiguous indices; releases storage past each accepted path.

        A commit (seq_id, base, path): the tree's nodes were written at cache indices `base + node`;
        `path` lists the accepted nodes root to leaf. After the moves node `path[i]` sits at `base + i`.
        Positions need no fix-up: a node at depth i was already rotated for position `base + i`.
        """
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for seq_id, base, path in commits:
            table = self.block_tables[seq_id]
            for i, node in enumerate(path):
                if node != i:
                    s, d = base + node, base + i
                    src.append(table[s // bs] * bs + s % bs)
                    dst.append(table[d // bs] * bs + d % bs)
        for seq_id, base, path in commits:
            self.truncate(seq_id, base + len(path))
        return src, dst

    @torch.no_grad()
    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots `src` to slots `dst` in every layer, in one indexed copy."""
        if src:
            index = torch.tensor([src, dst], dtype=torch.long).to(self.k.device, non_blocking=True)
            copy_slots(self.k, self.v, index[0], index[1])

    def commit_paths(self, commits: list[tuple[str, int, list[int]]]) -> None:
        """`path_moves`, then the moves on this cache (the engine sends them through its model runner,
        which applies them on every tensor-parallel rank)."""
        self.move_slots(*self.path_moves(commits))

    def commit_path(self, seq_id: str, base: int, path: list[int]) -> None:
        """`commit_paths` for one sequence."""
        self.commit_paths([(seq_id, base, path)])

    def free(self, seq_id: str) -> None:
        """Release all of a sequence's blocks (finish, abort or preemption)."""
        table = self.block_tables.pop(seq_id, None)
        if table:
            self.allocator.free(table)
