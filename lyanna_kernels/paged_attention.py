"""Triton paged attention over a ragged batch: decode, chunked prefill and tree verification.

Behind `engines.attention.paged_attention` (same arguments). One program handles one sequence, one
block of its new tokens and one KV head: its rows are (new token, query head of that KV head's group)
pairs, so GQA reads each K/V block once for the whole group. Keys are read in place through the
block table, BLOCK_N at a time, with an online softmax in fp32. A new token sees every cached key and
the new keys its mask allows: causal by cache index, or, for a draft tree, the nodes set in its
ancestor bitmask (32 nodes per int32 word). A causal block stops at its last query's key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lyanna_kernels.dispatch import deterministic, interpreting, next_power_of_2

BLOCK_N = 32  # keys per iteration
MAX_BLOCK_M = 64  # (new token, query head) rows per program


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, heads, head_dim]
    k_ptr,  # [slots, kv_heads, head_dim]
    v_ptr,
    out_ptr,  # [T, heads * head_dim]
    tables_ptr,  # [B, >= blocks] int32
    seq_lens_ptr,  # [B] int32: keys per sequence (cached + new)
    query_start_ptr,  # [B + 1] int32
    is_tree_ptr,  # [B] int32 (HAS_TREES only)
    masks_ptr,  # [T, mask_words] int32 ancestor bitmasks (HAS_TREES only)
    scale,
    table_stride,
    mask_words,
    q_stride_t,
    q_stride_h,
    kv_stride_s,
    kv_stride_h,
    out_stride_t,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HAS_TREES: tl.constexpr,
    UPCAST: tl.constexpr,  # dot products in fp32 (Triton's interpreter mis-computes bf16 dots)
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" for fp32 caches)
):
    b = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_lo = tl.load(query_start_ptr + b)
    num_new = tl.load(query_start_ptr + b + 1) - q_lo
    if q_block * BLOCK_Q < num_new:
        seq_len = tl.load(seq_lens_ptr + b)
        num_cached = seq_len - num_new
        m = tl.arange(0, BLOCK_M)
        q_local = q_block * BLOCK_Q + m // GROUP  # the row's new token, among the sequence's
        head = kv_head * GROUP + m % GROUP
        row_ok = (m < BLOCK_Q * GROUP) & (q_local < num_new)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        rows = (q_lo + q_local).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        kv_end = num_cached + tl.minimum(num_new, (q_block + 1) * BLOCK_Q)  # causal: up to the last query
        if HAS_TREES:
            is_tree = tl.load(is_tree_ptr + b)
            kv_end = tl.where(is_tree != 0, seq_len, kv_end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            block = tl.load(tables_ptr + b * table_stride + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
            kv_offsets = slot[:, None] * kv_stride_s + kv_head * kv_stride_h + d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] fp32
            new_key = n - num_cached  # the key's index among the new tokens (< 0: cached)
            cached = (new_key < 0)[None, :]
            allowed = cached | (new_key[None, :] <= q_local[:, None])
            if HAS_TREES:
                word_index = tl.maximum(new_key, 0) // 32
                words = tl.load(
                    masks_ptr + rows[:, None] * mask_words + word_index[None, :],
                    mask=row_ok[:, None] & (n_ok & (new_key >= 0) & (word_index < mask_words))[None, :],
                    other=0,
                )
                bit = (words >> (tl.maximum(new_key, 0) % 32)[None, :]) & 1
                allowed = tl.where(is_tree != 0, cached | (bit != 0), allowed)
            allowed = allowed & n_ok[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + rows[:, None] * out_stride_t + head[:, None] * HEAD_DIM + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def triton_paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta,  # engines.attention.AttentionMetadata
    scale: float,
) -> torch.Tensor:  # [T, num_heads * head_dim], in the cache's dtype
    """`engines.attention.paged_attention` as one Triton launch."""
    T, heads, dim = q.shape
    q = q.to(k_cache.dtype)
    if k_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged attention needs head_dim contiguous in q and the caches")
    out = q.new_empty(T, heads * dim)
    num_seqs = meta.seq_lens.shape[0]
    if T == 0 or num_seqs == 0:
        return out
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    block_m = min(MAX_BLOCK_M, next_power_of_2(max(16, meta.max_query_len * group)))
    if deterministic():  # one tile shape whatever the step: a row's products do not depend on its step's longest query
        block_m = MAX_BLOCK_M
    block_m = max(block_m, next_power_of_2(group))
    block_q = block_m // group
    has_trees = meta.tree_masks is not None
    masks = meta.tree_masks if has_trees else meta.seq_lens
    is_tree = meta.is_tree if has_trees else meta.seq_lens
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start,
        is_tree,
        masks,
        scale,
        meta.block_tables.stride(0),
        masks.shape[1] if has_trees else 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        HEAD_DIM=dim,
        BLOCK_D=max(16, next_power_of_2(dim)),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_SIZE=meta.block_size,
        HAS_TREES=has_trees,
        UPCAST=interpreting() and k_cache.dtype != torch.float32,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out
