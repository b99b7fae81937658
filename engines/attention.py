"""Attention over the paged KV cache for a ragged batch, with optional per-sequence tree masks.

The batch is flattened: T new tokens from B sequences. Each sequence has `num_cached` tokens whose
K/V are already in the cache (cache indices 0..num_cached-1) and `num_new` new tokens written at
cache indices num_cached..num_cached+num_new-1. A new token sees every cached token plus the new
tokens its mask allows: causal by default, or ancestor-or-self for a draft tree. Note that a tree
node's *cache index* (num_cached + node) differs from its *position* (num_cached + depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SequenceLayout:
    """One sequence's share of a step: where its K/V live and which new tokens see which."""

    slots: torch.Tensor  # [num_cached + num_new] flat cache slots, cache index order
    num_cached: int
    num_new: int
    tree_mask: torch.Tensor | None = None  # [num_new, num_new] bool, True = may attend; None = causal


@dataclass
class AttentionMetadata:
    """The step's layout shared by every layer."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    key_slots: torch.Tensor  # [B, K] slots each sequence attends over (padding points at slot 0)
    query_index: torch.Tensor | None  # [B, Q] rows of the T new tokens (None: one sequence, Q = T)
    query_rows: torch.Tensor | None  # [T] rows of the padded [B * Q] output holding real tokens (None: no padding)
    attn_mask: torch.Tensor | None  # [B, 1, Q, K] bool (None: every query sees every key)


def build_attention_metadata(seqs: list[SequenceLayout], device: torch.device | str) -> AttentionMetadata:
    """Lay out a ragged batch for `paged_attention`; runs on CPU, then moves the tensors once."""
    num_new = [s.num_new for s in seqs]
    num_keys = [s.num_cached + s.num_new for s in seqs]
    B, Q, K = len(seqs), max(num_new), max(num_keys)
    slot_mapping = torch.cat([s.slots[s.num_cached :] for s in seqs])

    key_slots = torch.zeros(B, K, dtype=torch.long)
    for b, s in enumerate(seqs):
        key_slots[b, : num_keys[b]] = s.slots

    query_index = query_rows = None
    if B > 1:
        query_index = torch.zeros(B, Q, dtype=torch.long)
        rows = []
        offset = 0
        for b, n in enumerate(num_new):
            query_index[b, :n] = torch.arange(offset, offset + n)
            rows.append(torch.arange(b * Q, b * Q + n))
            offset += n
        if offset < B * Q:
            query_rows = torch.cat(rows)

    has_tree = any(s.tree_mask is not None for s in seqs)
    if Q == 1 and not has_tree and len(set(num_keys)) == 1:
        attn_mask = None  # pure decode of equal-length sequences: every key is visible
    else:
        attn_mask = torch.zeros(B, 1, Q, K, dtype=torch.bool)
        for b, s in enumerate(seqs):
            m = attn_mask[b, 0]
            m[: s.num_new, : s.num_cached] = True
            new = s.tree_mask if s.tree_mask is not None else torch.ones(s.num_new, s.num_new, dtype=torch.bool).tril_()
            m[: s.num_new, s.num_cached : num_keys[b]] = new
            m[s.num_new :, 0] = True  # padding queries see one key so softmax stays finite
    to = {"device": device, "non_blocking": True}
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(**to),
        key_slots=key_slots.to(**to),
        query_index=None if query_index is None else query_index.to(**to),
        query_rows=None if query_rows is None else query_rows.to(**to),
        attn_mask=None if attn_mask is None else attn_mask.to(**to),
    )


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads * head_dim]
    """Scaled dot-product attention of each new token over its sequence's cached and new keys."""
    B, K = meta.key_slots.shape
    flat = meta.key_slots.view(-1)
    # index_select copies whole rows; advanced indexing (k_cache[slots]) is several times slower here.
    keys = k_cache.index_select(0, flat).view(B, K, *k_cache.shape[1:]).transpose(1, 2)  # [B, kv_heads, K, d]
    values = v_cache.index_select(0, flat).view(B, K, *v_cache.shape[1:]).transpose(1, 2)
    if meta.query_index is None:
        queries = q.unsqueeze(0)  # [1, T, heads, head_dim]
    else:
        queries = q.index_select(0, meta.query_index.view(-1)).view(B, -1, *q.shape[1:])  # [B, Q, heads, d]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=meta.attn_mask, scale=scale, enable_gqa=True
    )  # [B, heads, Q, head_dim]
    out = out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])  # [B * Q, heads * head_dim]
    if meta.query_rows is not None:
        out = out.index_select(0, meta.query_rows)  # drop padding, back to the flat token order
    return out


def attention_keys(spans: list[tuple[int, int]]) -> int:
    """Keys a step's attention reads, for sequences given as (cached tokens, new tokens): the padded
    batch `paged_attention` runs, sequences × the longest one's keys (0 for no sequence)."""
    return len(spans) * max((cached + new for cached, new in spans), default=0)
