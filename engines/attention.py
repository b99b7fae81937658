"""Attention over the paged KV cache for a ragged batch: decode, chunked prefill and tree verification.

The step's new tokens are flat: sequence b owns rows query_start[b]:query_start[b + 1]. Its
`num_cached` earlier tokens and then its new tokens live at cache indices 0, 1, ... in the blocks its
block table lists (index i in block table[i // block_size], at offset i % block_size). A new token
sees every cached token plus the new tokens its mask allows: causal (a prefill chunk or a decode
token), or itself and its ancestors for a draft tree (given by parent indices). A tree node's *cache
index* (num_cached + node) differs from its *position* (num_cached + depth).

`paged_attention` is the one function the model calls for every kind of step. On CPU it groups the
sequences (`plan_groups`) so that each scaled-dot-product call reads only keys its sequences have:
sequences with many new tokens (prefill chunks) attend alone, over a view of the cache when their
slots are contiguous; short queries (decodes, trees) of similar context lengths attend together,
padded to the longest in their group. `reference_paged_attention` is the per-sequence definition the
tests hold it to. On CUDA (or when forced) the Triton kernel of `lyanna_kernels/paged_attention.py` runs
instead, reading the blocks in place through the block tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lyanna_kernels.dispatch import use_triton

MAX_GROUPED_QUERIES = 64  # sequences with more new tokens than this attend alone
GROUP_PADDING_RATIO = 1.3  # a group's padded query-key pairs may exceed the real ones by this factor ...
GROUP_PADDING_SLACK = 2048  # ... plus this many pairs (a separate call costs about as much as that padding)


@dataclass
class SequenceLayout:
    """One sequence's share of a step: where its K/V live and which new tokens see which."""

    block_table: list[int]  # blocks holding cache indices 0.. (at least num_cached + num_new of them)
    num_cached: int
    num_new: int
    tree_parents: list[int] | None = None  # parent of each new token among them (-1: none); None = causal
    num_prompt: int = 0  # of a causal run's new tokens, how many lead ones are prompt tokens (see AttentionMetadata)

    @property
    def num_keys(self) -> int:
        """Keys the sequence's new tokens attend over (cached and new)."""
        return self.num_cached + self.num_new


@dataclass
class AttentionGroup:
    """Sequences attended over in one scaled-dot-product call (CPU layout), [G, Q] queries x [G, K] keys."""

    num_seqs: int
    num_queries: int  # Q: the most new tokens of a sequence in the group
    query_rows: torch.Tensor | None  # [G * Q] flat rows of the group's queries (padding repeats a row); None: a range
    query_range: tuple[int, int]  # (first, end) flat rows when query_rows is None
    key_slots: torch.Tensor | None  # [G * K] cache slots of the keys (padding: slot 0); None: a contiguous run
    key_range: tuple[int, int]  # (first slot, K) when key_slots is None
    mask: torch.Tensor | None  # [G, 1, Q, K] bool, True = may attend; None: every query sees every key
    is_causal: bool  # one sequence, no cached tokens, causal: SDPA's own causal masking
    real_rows: torch.Tensor | None  # rows of the padded [G * Q] output that are real queries; None: all
    out_rows: torch.Tensor | None  # flat rows those real queries go to; None: query_range


@dataclass
class AttentionMetadata:
    """The step's attention layout, shared by every layer: built once per step on the host, moved once."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max blocks] int32 (rows padded with 0)
    seq_lens: torch.Tensor  # [B] keys per sequence (cached + new)
    query_start: torch.Tensor  # [B + 1] offsets of each sequence's new tokens in the flat batch
    groups: list[AttentionGroup]  # the CPU implementation's calls (empty when the Triton kernel runs)
    num_tokens: int
    max_query_len: int = 1  # the most new tokens of one sequence
    block_size: int = 16
    tree_masks: torch.Tensor | None = None  # [T, words] int32 ancestor bitmasks of tree tokens; None: no tree
    is_tree: torch.Tensor | None = None  # [B] int32, 1 where the sequence's new tokens are a tree
    parents: torch.Tensor | None = None  # [T] int32 parent of each new token among its sequence's (-1: none); CPU
    # [B] int32: each causal run's lead prompt tokens, which the fused CPU decoder attends 16 at a time
    # (lyanna_kernels/fused_decoder.py); 0 for trees; CPU
    prompt_tokens: torch.Tensor | None = None


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i may attend to node j iff j is i or one of its ancestors (parents[i] < i)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def ancestor_bitmasks(parents: list[int], words: int) -> list[list[int]]:
    """Each node's `tree_mask` row as `words` int32 words (bit j of word w: node 32 w + j)."""
    rows = []
    masks: list[int] = []
    for i, p in enumerate(parents):
        bits = (masks[p] if p >= 0 else 0) | (1 << i)
        masks.append(bits)
        rows.append([((bits >> (32 * w)) & 0xFFFFFFFF) - ((bits >> (32 * w + 31)) & 1) * 2**32 for w in range(words)])
    return rows


def new_token_mask(seq: SequenceLayout) -> torch.Tensor:
    """[num_new, num_new] bool: which of its new tokens each new token sees."""
    if seq.tree_parents is not None:
        return tree_mask(seq.tree_parents)
    return torch.ones(seq.num_new, seq.num_new, dtype=torch.bool).tril_()


def sequence_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Flat cache slots of cache indices [start, end) of a sequence ([end - start] int64)."""
    table = torch.tensor(block_table, dtype=torch.long)
    idx = torch.arange(start, end, dtype=torch.long)
    return table[idx // block_size] * block_size + idx % block_size


def padded_tables(block_tables: list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[B, max blocks] block-table rows padded with 0, built in one call."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=dtype)


def flat_slots(block_tables: list[list[int]], block_size: int, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Flat cache slots of cache indices starts[b] .. starts[b] + lengths[b] of every sequence b, in order
    ([sum(lengths)] int64), in one tensor: a step's few rows per sequence cost less on the host than
    tensor operations per sequence would."""
    bs = block_size
    return torch.tensor(
        [
            t[i // bs] * bs + i % bs
            for t, a, n in zip(block_tables, starts, lengths, strict=True)
            for i in range(a, a + n)
        ],
        dtype=torch.long,
    )


def contiguous_run(block_table: list[int], num_keys: int, block_size: int) -> bool:
    """Whether the sequence's first `num_keys` cache indices sit in consecutive slots (ascending blocks)."""
    used = -(-num_keys // block_size)
    first = block_table[0]
    return all(b == first + i for i, b in enumerate(block_table[:used]))


def plan_groups(seqs: list[SequenceLayout]) -> list[list[int]]:
    """Which sequences attend together: long queries alone; the others by context length, most keys first,
    a group taking the next sequence while its padding stays within `GROUP_PADDING_RATIO`/`_SLACK`."""
    alone = [[b] for b, s in enumerate(seqs) if s.num_new > MAX_GROUPED_QUERIES]
    short = sorted((b for b, s in enumerate(seqs) if s.num_new <= MAX_GROUPED_QUERIES), key=lambda b: -seqs[b].num_keys)
    groups: list[list[int]] = []
    real = q_max = k_max = 0
    for b in short:
        s = seqs[b]
        if groups:
            q, k = max(q_max, s.num_new), max(k_max, s.num_keys)
            pairs = real + s.num_new * s.num_keys
            if (len(groups[-1]) + 1) * q * k <= GROUP_PADDING_RATIO * pairs + GROUP_PADDING_SLACK:
                groups[-1].append(b)
                real, q_max, k_max = pairs, q, k
                continue
        groups.append([b])
        real, q_max, k_max = s.num_new * s.num_keys, s.num_new, s.num_keys
    return alone + groups


def _group(seqs: list[SequenceLayout], members: list[int], starts: list[int], block_size: int) -> AttentionGroup:
    """The tensors of one group's call, on the host."""
    G = len(members)
    Q = max(seqs[b].num_new for b in members)
    K = max(seqs[b].num_keys for b in members)
    if G == 1:
        b = members[0]
        s = seqs[b]
        run = contiguous_run(s.block_table, K, block_size)
        causal = s.num_cached == 0 and s.tree_parents is None
        mask = None
        if not causal and Q > 1:
            mask = torch.ones(1, 1, Q, K, dtype=torch.bool)
            mask[0, 0, :, s.num_cached :] = new_token_mask(s)
        return AttentionGroup(
            num_seqs=1,
            num_queries=Q,
            query_rows=None,
            query_range=(starts[b], starts[b] + Q),
            key_slots=None if run else sequence_slots(s.block_table, block_size, 0, K),
            key_range=(s.block_table[0] * block_size, K),
            mask=mask,
            is_causal=causal and Q > 1,
            real_rows=None,
            out_rows=None,
        )
    query_rows = torch.empty(G, Q, dtype=torch.long)
    key_slots = torch.zeros(G, K, dtype=torch.long)
    needs_mask = Q > 1 or any(seqs[b].num_keys != K for b in members)
    mask = torch.zeros(G, 1, Q, K, dtype=torch.bool) if needs_mask else None
    real, out = [], []
    for g, b in enumerate(members):
        s = seqs[b]
        rows = torch.arange(starts[b], starts[b] + s.num_new)
        query_rows[g, : s.num_new] = rows
        query_rows[g, s.num_new :] = starts[b]  # padding queries: any row of the sequence, dropped after
        key_slots[g, : s.num_keys] = sequence_slots(s.block_table, block_size, 0, s.num_keys)
        if mask is not None:
            m = mask[g, 0]
            m[: s.num_new, : s.num_cached] = True
            m[: s.num_new, s.num_cached : s.num_keys] = new_token_mask(s)
            m[s.num_new :, 0] = True  # padding queries see one key so softmax stays finite
        real.append(torch.arange(g * Q, g * Q + s.num_new))
        out.append(rows)
    real_rows = torch.cat(real)
    return AttentionGroup(
        num_seqs=G,
        num_queries=Q,
        query_rows=query_rows.view(-1),
        query_range=(0, 0),
        key_slots=key_slots.view(-1),
        key_range=(0, K),
        mask=mask,
        is_causal=False,
        real_rows=None if len(real_rows) == G * Q else real_rows,
        out_rows=torch.cat(out),
    )


def build_attention_metadata(
    seqs: list[SequenceLayout],
    block_size: int,
    device: torch.device | str,
    block_tables: torch.Tensor | None = None,
    cpu_groups: bool = True,
) -> AttentionMetadata:
    """Lay out a ragged batch for `paged_attention`: computed on the host, moved to the device once.
    `block_tables`, when given, is the caller's persistent device buffer ([>= B, >= max blocks] int32)
    whose leading rows are filled in place; otherwise a new tensor is made. Without `cpu_groups` the CPU
    implementation's groups are not planned (a caller that attends by other means: lyanna_kernels/fused_decoder.py)."""
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new)
    tables = padded_tables([s.block_table for s in seqs])
    width = tables.shape[1]
    slot_mapping = flat_slots(
        [s.block_table for s in seqs], block_size, [s.num_cached for s in seqs], [s.num_new for s in seqs]
    )
    to = {"device": device, "non_blocking": True}
    triton = use_triton(torch.empty(0, device=device))
    groups = []
    if cpu_groups and not triton:
        groups = [_group(seqs, members, starts, block_size) for members in plan_groups(seqs)]
    tree_masks = is_tree = None
    trees = [s for s in seqs if s.tree_parents is not None]
    if triton and trees:
        words = -(-max(s.num_new for s in trees) // 32)
        rows = [[0] * words] * starts[-1]
        for b, s in enumerate(seqs):
            if s.tree_parents is not None:
                rows[starts[b] : starts[b + 1]] = ancestor_bitmasks(s.tree_parents, words)
        tree_masks = torch.tensor(rows, dtype=torch.int32).to(**to)
        is_tree = torch.tensor([s.tree_parents is not None for s in seqs], dtype=torch.int32).to(**to)
    if block_tables is None:
        device_tables = tables.to(**to)
    else:
        device_tables = block_tables[: len(seqs), :width]
        device_tables.copy_(tables, non_blocking=True)
    moved = []
    for g in groups:
        fields = ("query_rows", "key_slots", "mask", "real_rows", "out_rows")
        moved.append(
            AttentionGroup(
                **{**g.__dict__, **{f: None if getattr(g, f) is None else getattr(g, f).to(**to) for f in fields}}
            )
        )
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(**to),
        block_tables=device_tables,
        seq_lens=torch.tensor([s.num_keys for s in seqs], dtype=torch.int32).to(**to),
        query_start=torch.tensor(starts, dtype=torch.int32).to(**to),
        groups=moved,
        num_tokens=starts[-1],
        max_query_len=max(s.num_new for s in seqs),
        block_size=block_size,
        tree_masks=tree_masks,
        is_tree=is_tree,
        parents=None if triton else torch.tensor(_flat_parents(seqs), dtype=torch.int32),
        prompt_tokens=None if triton else torch.tensor([_prompt_tokens(s) for s in seqs], dtype=torch.int32),
    )


def _prompt_tokens(seq: SequenceLayout) -> int:
    """A causal run's lead prompt tokens (0 for a tree)."""
    return 0 if seq.tree_parents is not None else max(0, min(seq.num_prompt, seq.num_new))


def _flat_parents(seqs: list[SequenceLayout]) -> list[int]:
    """Each new token's parent among its sequence's new tokens (-1: none; a causal run is a chain)."""
    return [p for s in seqs for p in (s.tree_parents if s.tree_parents is not None else range(-1, s.num_new - 1))]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads * head_dim], in the cache's dtype
    """Scaled dot-product attention of each new token over its sequence's cached and new keys."""
    if use_triton(q):
        from lyanna_kernels.paged_attention import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, meta, scale)
    T, heads, dim = q.shape
    q = q.to(k_cache.dtype)
    if len(meta.groups) == 1 and meta.groups[0].out_rows is None and meta.groups[0].real_rows is None:
        # reshape, not view: CUDA's SDPA hands back heads-major memory, so the rows may need a copy
        return _attend(q, k_cache, v_cache, meta.groups[0], scale).reshape(T, heads * dim)
    out = q.new_empty(T, heads * dim)
    for g in meta.groups:
        res = _attend(q, k_cache, v_cache, g, scale).reshape(-1, heads * dim)
        if g.real_rows is not None:
            res = res.index_select(0, g.real_rows)
        if g.out_rows is None:
            out[g.query_range[0] : g.query_range[1]] = res
        else:
            out.index_copy_(0, g.out_rows, res)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup, scale: float):
    """One group's SDPA: [G * Q, heads, head_dim] out, queries in the group's padded order."""
    G, Q = g.num_seqs, g.num_queries
    if g.query_rows is None:
        queries = q[g.query_range[0] : g.query_range[1]].unsqueeze(0)  # [1, Q, heads, d]
    else:
        queries = q.index_select(0, g.query_rows).view(G, Q, *q.shape[1:])
    if g.key_slots is None:
        first, K = g.key_range
        keys, values = k_cache[first : first + K].unsqueeze(0), v_cache[first : first + K].unsqueeze(0)
    else:
        K = g.key_range[1]
        # index_select copies whole rows; advanced indexing (k_cache[slots]) is several times slower here.
        keys = k_cache.index_select(0, g.key_slots).view(G, K, *k_cache.shape[1:])
        values = v_cache.index_select(0, g.key_slots).view(G, K, *v_cache.shape[1:])
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=g.mask,
        is_causal=g.is_causal,
        scale=scale,
        enable_gqa=True,
    )  # [G, heads, Q, d]
    return out.transpose(1, 2).reshape(G * Q, *q.shape[1:])


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: list[SequenceLayout],
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """The definition `paged_attention` implements, one sequence at a time in plain tensor math (tests)."""
    outs, start = [], 0
    for s in seqs:
        slots = sequence_slots(s.block_table, block_size, 0, s.num_keys).to(q.device)
        keys, values = k_cache[slots], v_cache[slots]  # [K, kv_heads, d]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        allowed = torch.cat([torch.ones(s.num_new, s.num_cached, dtype=torch.bool), new_token_mask(s)], 1)
        queries = q[start : start + s.num_new].to(keys.dtype)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        scores = scores.masked_fill(~allowed.to(q.device), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(s.num_new, -1))
        start += s.num_new
    return torch.cat(outs)


def attention_keys(spans: list[tuple[int, int]]) -> int:
    """Keys a step's attention reads, for sequences given as (cached tokens, new tokens): each
    sequence's own keys (0 for no sequence)."""
    return sum(cached + new for cached, new in spans)
