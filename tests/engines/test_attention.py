"""Paged ragged attention against a dense per-sequence reference, with causal and tree masks."""

from __future__ import annotations

import math

import torch

from engines.attention import SequenceLayout, build_attention_metadata, paged_attention


def dense_reference(q, k, v, num_cached, mask_new):
    """softmax(q k^T) v for one sequence; k/v hold cached then new keys; GQA by repetition."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    n = q.shape[0]
    allowed = torch.cat([torch.ones(n, num_cached, dtype=torch.bool), mask_new], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def test_ragged_batch_with_tree_matches_dense():
    torch.manual_seed(0)
    heads, kv_heads, dim, slots_total = 4, 2, 8, 512
    k_cache = torch.randn(slots_total, kv_heads, dim, dtype=torch.float64)
    v_cache = torch.randn(slots_total, kv_heads, dim, dtype=torch.float64)
    perm = torch.randperm(slots_total)  # scattered slots, as a paged cache gives
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    specs = [(7, 1, None), (0, 5, None), (12, 4, tree), (3, 3, None)]
    layouts, used = [], 0
    for cached, new, mask in specs:
        layouts.append(SequenceLayout(perm[used : used + cached + new], cached, new, mask))
        used += cached + new
    meta = build_attention_metadata(layouts, "cpu")
    T = sum(n for _, n, _ in specs)
    q = torch.randn(T, heads, dim, dtype=torch.float64)
    new_k = torch.randn(T, kv_heads, dim, dtype=torch.float64)
    new_v = torch.randn(T, kv_heads, dim, dtype=torch.float64)
    k_cache.index_copy_(0, meta.slot_mapping, new_k)
    v_cache.index_copy_(0, meta.slot_mapping, new_v)
    out = paged_attention(q, k_cache, v_cache, meta, dim**-0.5)

    offset = 0
    for (cached, new, mask), layout in zip(specs, layouts, strict=True):
        mask_new = mask if mask is not None else torch.ones(new, new, dtype=torch.bool).tril()
        ref = dense_reference(q[offset : offset + new], k_cache[layout.slots], v_cache[layout.slots], cached, mask_new)
        torch.testing.assert_close(out[offset : offset + new], ref, rtol=1e-10, atol=1e-10)
        offset += new


def test_equal_length_decode_needs_no_mask():
    layouts = [SequenceLayout(torch.arange(i * 10, i * 10 + 6), 5, 1) for i in range(3)]
    assert build_attention_metadata(layouts, "cpu").attn_mask is None
    layouts.append(SequenceLayout(torch.arange(40, 44), 3, 1))
    assert build_attention_metadata(layouts, "cpu").attn_mask is not None
