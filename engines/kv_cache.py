"""Paged KV cache: fixed-size blocks, a block allocator with capacity accounting, per-sequence block
tables, commit of an accepted root-to-node path after tree verification, and automatic prefix caching.

Prefix caching (vLLM v1's design): a full block whose K/V are computed is identified by the hash of its
parent block's hash and its tokens (plus `lookahead` tokens past it, where a drafter's K/V at the block's
last position read the next token). Blocks are reference-counted and shared read-only by every sequence
whose tokens chain to the same hash; a freed block keeps its hash and stays findable until the pool
needs it, least recently used first. Only full, computed blocks are shared: a sequence's partly filled
last block, and every block a step writes (prefill chunk, decode token or draft tree, all at indices
>= the sequence's computed tokens), belong to that sequence alone (`check_writable`)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.errors import CacheCapacityError
from lyanna_kernels.dispatch import cpu_has_half_precision_math, use_triton


def kv_cache_dtype(
    setting: torch.dtype | None, model_dtype: torch.dtype, device: torch.device, fused: bool = False
) -> torch.dtype:
    """The KV cache's dtype: `setting`, or for None ("auto") the model's, except on a CPU that would emulate the
    model's half-precision arithmetic: there bf16 where the fused CPU decoder reads every step (`fused`: it widens
    the values to fp32 as it loads them, and a decode's attention reads half the bytes of fp32), else fp32."""
    if setting is not None:
        return setting
    if device.type == "cpu" and not cpu_has_half_precision_math(model_dtype):
        return torch.bfloat16 if fused and model_dtype != torch.float32 else torch.float32
    return model_dtype


INT8_GROUP = 32  # values of an int8 cache's row that share a scale


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x (>= 0) rounded up to the nearest bf16 value, as bf16."""
    bits = x.float().contiguous().view(torch.int32)
    up = torch.where((bits & 0xFFFF) != 0, bits + 0x10000, bits) & ~0xFFFF
    return up.view(torch.float32).to(torch.bfloat16)


@torch.no_grad()
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] as an int8 cache holds it: per group of `INT8_GROUP` values the scale s = max |x| / 127
    rounded up to bf16 ([..., head_dim / INT8_GROUP]) and codes round(x * (1 / s)) (int8; a zero group has codes
    and scale 0). decoder.c's store_row computes the same formula in fp32 (round half to even)."""
    groups = x.float().unflatten(-1, (-1, INT8_GROUP))
    scales = round_up_to_bf16(groups.abs().amax(dim=-1) / 127.0)
    s = scales.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes.flatten(-2), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 cache's rows as values: codes * their group's scale (fp32), in `dtype`."""
    return (codes.float().unflatten(-1, (-1, INT8_GROUP)) * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


@torch.no_grad()
def copy_slots(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """k[:, dst] = k[:, src] and the same for v ([layers, slots, kv_heads, head_dim] caches, [M] int64
    slot indices on their device): every source is read before any destination is written. Runs the
    Triton kernel of `lyanna_kernels/kv_commit.py` where `use_triton` says so (up to its moves per launch)."""
    if use_triton(k):
        from lyanna_kernels.kv_commit import MAX_COMMIT_MOVES, triton_copy_slots  # lazily: triton is optional

        if len(src) <= MAX_COMMIT_MOVES:
            triton_copy_slots(k, v, src, dst)
            return
    # Advanced indexing gathers into a new tensor first, so overlapping moves are safe.
    k[:, dst] = k[:, src]
    v[:, dst] = v[:, src]


class BlockAllocator:
    """Hands out fixed-size KV blocks and takes them back, counting references.

    A block no sequence holds is free: either empty (`_free`), or cached (it has a hash and its K/V are
    still findable, `_evictable`, least recently freed first). `allocate` takes empty blocks first and
    then evicts cached ones, oldest first; `touch` takes a cached block for one more sequence.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> the block holding its K/V
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence (empty or cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a hash (held or not)."""
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, empty ones first, then evicting the least recently used cached ones; raises
        CacheCapacityError (taking nothing) when fewer are free."""
        if n > self.num_free:
            raise CacheCapacityError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evicted += 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no sequence holds any more becomes free (cached
        blocks are released last first, so a sequence's first blocks are the last evicted)."""
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each of these cached blocks (off the eviction list if unheld)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def cache(self, block: int, block_hash: int) -> None:
        """Make a computed full block findable by its hash (a second block with a hash already cached
        stays private and is freed empty)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None

    def reset_cache(self) -> None:
        """Forget every cached block's hash (held blocks stay with their sequences)."""
        for block in list(self.cached.values()):
            self._uncache(block)
        self._free.extend(self._evictable)
        self._evictable.clear()


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache at admission, and how many of them it held."""

    queries: int = 0  # prompt tokens of the requests admitted with a lookup
    hits: int = 0  # of them, tokens whose K/V came from cached blocks
    requests: int = 0  # requests admitted with a lookup
    hit_requests: int = 0  # of them, requests with at least one cached block

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


def hash_block(parent: int | None, tokens: list[int]) -> int:
    """The chain hash of a block: BLAKE2b over the parent block's hash and the block's tokens (stable
    across processes, so replicas and the router may compare them)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


TokenSource = Callable[[int, int], list[int]]  # (start, end) -> the sequence's tokens [start, end)


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
        enable_prefix_caching: bool = False,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # int8 codes: a value is code * scale, one bf16 scale per INT8_GROUP values of a slot's KV head
        # ([layers, slots, kv_heads, head_dim / INT8_GROUP])
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            if head_dim % INT8_GROUP:
                raise ValueError(f"an int8 KV cache takes head_dim a multiple of {INT8_GROUP}, not {head_dim}")
            scales = (*shape[:3], head_dim // INT8_GROUP)
            self.k_scale = torch.zeros(scales, dtype=torch.bfloat16, device=device)
            self.v_scale = torch.zeros(scales, dtype=torch.bfloat16, device=device)
        self.block_tables: dict[str, list[int]] = {}
        self.prefix_caching = enable_prefix_caching
        # Tokens past a block that its hash also covers: 1 where a drafter keeps K/V in these blocks
        # (its K/V at a block's last position read the next token), else 0.
        self.lookahead = 0
        self.prefix_stats = PrefixCacheStats()
        self._hashes: dict[str, list[int]] = {}  # seq -> chain hashes of its full blocks known so far
        self._num_cached: dict[str, int] = {}  # seq -> its leading blocks that are cached
        self._pending: dict[int, str] = {}  # hash -> the sequence whose prefill computes that block now
        self._pending_of: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.block_size

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype the cache's values are read in: its own, or bf16 for int8 codes (a drafter's own cache
        beside this one takes it)."""
        return torch.bfloat16 if self.k.dtype == torch.int8 else self.k.dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token's K and V take across all layers (an int8 cache's scales included)."""
        if dtype == torch.int8:
            return 2 * num_layers * num_kv_heads * (head_dim + 2 * head_dim // INT8_GROUP)
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
        return self.batch_slots([seq_id], [start], [end - start])

    def batch_slots(self, seq_ids: list[str], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """Flat slots of cache indices starts[b] .. starts[b] + lengths[b] of each sequence, concatenated
        (a CPU int64 tensor): `slots` for a batch at once."""
        from engines.attention import flat_slots

        return flat_slots([self.block_tables[s] for s in seq_ids], self.block_size, starts, lengths)

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
            if self.k_scale is not None and self.v_scale is not None:
                copy_slots(self.k_scale, self.v_scale, index[0], index[1])

    def commit_paths(self, commits: list[tuple[str, int, list[int]]]) -> None:
        """`path_moves`, then the moves on this cache (the engine sends them through its model runner,
        which applies them on every tensor-parallel rank)."""
        self.move_slots(*self.path_moves(commits))

    def commit_path(self, seq_id: str, base: int, path: list[int]) -> None:
        """`commit_paths` for one sequence."""
        self.commit_paths([(seq_id, base, path)])

    def free(self, seq_id: str) -> None:
        """Release all of a sequence's blocks (finish, abort or preemption); cached ones stay findable."""
        table = self.block_tables.pop(seq_id, None)
        if table:
            self.allocator.free(table)
        self._hashes.pop(seq_id, None)
        self._num_cached.pop(seq_id, None)
        for h in self._pending_of.pop(seq_id, ()):
            if self._pending.get(h) == seq_id:
                del self._pending[h]

    # ---- prefix caching ------------------------------------------------------------------------
    def _chain_hashes(self, seq_id: str, tokens: TokenSource, num_blocks: int) -> list[int]:
        """The sequence's first `num_blocks` chain hashes (computed once, kept while it holds blocks)."""
        hashes = self._hashes.setdefault(seq_id, [])
        bs, extra = self.block_size, self.lookahead
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens(i * bs, (i + 1) * bs + extra)))
        return hashes

    def num_matchable_blocks(self, num_tokens: int) -> int:
        """Full blocks of a `num_tokens`-token sequence that a cache hit may cover: never its last token
        (its logits are needed), and each block's lookahead tokens must exist."""
        return max(0, (num_tokens - max(1, self.lookahead)) // self.block_size)

    def match(self, seq_id: str, tokens: TokenSource, num_tokens: int) -> tuple[list[int], int]:
        """The cached blocks holding the longest prefix of the sequence's tokens, and how many of its
        full blocks right after them other sequences' prefills are computing now (the caller may wait
        for those rather than compute them twice)."""
        hashes = self._chain_hashes(seq_id, tokens, self.num_matchable_blocks(num_tokens))
        hit: list[int] = []
        for h in hashes:
            block = self.allocator.cached.get(h)
            if block is None:
                break
            hit.append(block)
        pending = 0
        for h in hashes[len(hit) :]:
            owner = self._pending.get(h)
            if owner is None or owner == seq_id:
                break
            pending += 1
        return hit, pending

    def can_allocate_with(self, seq_id: str, hit: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding no blocks could take the cached blocks `hit` and grow to
        `num_tokens` tokens now (hit blocks that no one holds count against the free ones)."""
        reclaimed = sum(1 for b in hit if self.allocator.ref_counts[b] == 0)
        need = max(0, self.num_blocks_for(num_tokens) - len(hit))
        return need + reclaimed <= self.allocator.num_free

    def attach(self, seq_id: str, hit: list[int], num_tokens: int) -> None:
        """Start a sequence's block table with the cached blocks `hit` (shared read-only), mark the full
        blocks of its first `num_tokens` tokens past them as being computed by it, and record the lookup."""
        if self.block_tables.get(seq_id):
            raise RuntimeError(f"sequence {seq_id!r} already holds KV blocks")
        self.allocator.touch(hit)
        self.block_tables[seq_id] = list(hit)
        self._num_cached[seq_id] = len(hit)
        hashes = self._hashes.get(seq_id, [])
        mine = [h for h in hashes[len(hit) : self.num_matchable_blocks(num_tokens)] if h not in self._pending]
        for h in mine:
            self._pending[h] = seq_id
        self._pending_of[seq_id] = mine

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (prompt tokens, and those served from the cache)."""
        st = self.prefix_stats
        st.queries += num_tokens
        st.hits += num_hit_tokens
        st.requests += 1
        st.hit_requests += num_hit_tokens > 0

    def cache_blocks(self, seq_id: str, tokens: TokenSource, num_computed: int, num_tokens: int) -> None:
        """Make the sequence's full blocks whose K/V are computed (its first `num_computed` tokens) findable
        by hash; call it after the step that computed them, before the sequence frees its blocks."""
        if not self.prefix_caching:
            return
        table = self.block_tables.get(seq_id)
        if not table:
            return
        full = min(num_computed, num_tokens - self.lookahead) // self.block_size
        done = self._num_cached.get(seq_id, 0)
        if full <= done:
            return
        hashes = self._chain_hashes(seq_id, tokens, full)
        for i in range(done, full):
            self.allocator.cache(table[i], hashes[i])
            if self._pending.get(hashes[i]) == seq_id:
                del self._pending[hashes[i]]
        self._num_cached[seq_id] = full

    def cached_block_hashes(self, seq_id: str) -> list[int]:
        """Chain hashes of the sequence's cached leading blocks."""
        return self._hashes.get(seq_id, [])[: self._num_cached.get(seq_id, 0)]

    def prefix_anchors(self, seq_id: str, num_prompt_tokens: int) -> tuple[int | None, int | None]:
        """Chain hashes of the sequence's last cached block within its first `num_prompt_tokens` tokens and
        of its last cached block overall (None where it has none): while a block is cached, so is,
        most likely, what precedes it (a sequence's blocks are evicted tail first)."""
        hashes = self.cached_block_hashes(seq_id)
        in_prompt = min(len(hashes), num_prompt_tokens // self.block_size)
        return (hashes[in_prompt - 1] if in_prompt else None), (hashes[-1] if hashes else None)

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block with this chain hash is in the cache."""
        return block_hash in self.allocator.cached

    def check_writable(self, seq_id: str, start: int) -> None:
        """Raise unless every block holding the sequence's cache indices >= start is its own: a step writes
        there (a chunk, a decode token, a draft tree), and a shared or cached block is read-only."""
        table = self.block_tables.get(seq_id, [])
        alloc = self.allocator
        for block in table[start // self.block_size :]:
            if alloc.ref_counts[block] != 1 or alloc.block_hash[block] is not None:
                raise RuntimeError(
                    f"sequence {seq_id!r} would write at index >= {start} into KV block {block}, which is "
                    f"shared or cached (references {alloc.ref_counts[block]})"
                )

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the K/V stay with the sequences holding them)."""
        self.allocator.reset_cache()
        self._num_cached = dict.fromkeys(self._num_cached, 0)
