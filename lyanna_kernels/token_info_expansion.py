"""Triton kernels for one depth of Lyanna's Algorithm 1 over all requests.

Behind `engines.drafters.token_info_sampling.expand_depth` (same arguments), one program per request.
It reads the depth's logits once for all F frontier nodes: each node adds its token-info row (a lookup
in the collapsed hot-token table; cold tokens add nothing), and the program finds every node's
log-sum-exp and top k over the vocabulary in k + 1 passes (ties: the lower index first), the joint
probabilities of the F * k candidates, and the k best of them as the next frontier (ties: the
candidate listed first), returned in listing order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lyanna_kernels.dispatch import next_power_of_2

TILE = 4096  # frontier nodes x vocabulary entries one pass step holds


@triton.jit
def _node_logits(logits_row_ptr, table_ptr, row, table_stride, idx, ok, BLOCK_F: tl.constexpr, HAS_INFO: tl.constexpr):
    """[BLOCK_F, len(idx)] fp32: the depth's logits at vocabulary entries `idx` plus each node's token-info row."""
    z = tl.load(logits_row_ptr + idx, mask=ok, other=float("-inf"))[None, :] + tl.zeros(
        [BLOCK_F, idx.shape[0]], tl.float32
    )
    if HAS_INFO:
        z += tl.load(table_ptr + row[:, None] * table_stride + idx[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    return z


@triton.jit
def _expand_depth_kernel(
    logits_ptr,  # [n, vocab] fp32: the depth's raw drafter logits per request
    logits_stride,
    frontier_ptr,  # [n, F] int64 frontier tokens
    frontier_stride,
    scores_ptr,  # [n, F] fp32 frontier joint scores
    scores_stride,
    table_ptr,  # [rows, vocab] token-info table, the last row zeros (HAS_INFO only)
    table_stride,
    row_of_ptr,  # [target vocab] int64 table row of each token, -1 for cold ones (HAS_INFO only)
    num_rows,
    d2t_ptr,  # [vocab] int64 drafter column -> target token (HAS_D2T only)
    tokens_ptr,  # [n, F * K] int64 out: candidate tokens, node by node, each node's top K by rank
    joint_ptr,  # [n, F * K] fp32 out: their joint probabilities
    keep_ptr,  # [n, K] int64 out: the next frontier's candidates, ascending
    num_frontier,
    vocab,
    K: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_INFO: tl.constexpr,
    HAS_D2T: tl.constexpr,
):
    r = tl.program_id(0)
    f = tl.arange(0, BLOCK_F)
    f_ok = f < num_frontier
    v = tl.arange(0, BLOCK_V)
    row = tl.zeros([BLOCK_F], tl.int64)
    if HAS_INFO:
        token = tl.load(frontier_ptr + r * frontier_stride + f, mask=f_ok, other=0)
        row = tl.load(row_of_ptr + token, mask=f_ok, other=-1)
        row = tl.where(row < 0, num_rows - 1, row)
    score = tl.load(scores_ptr + r * scores_stride + f, mask=f_ok, other=0.0)
    # Pass 1: each node's log-sum-exp over the vocabulary (online).
    m = tl.full([BLOCK_F], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_F], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + v
        ok = idx < vocab
        z = _node_logits(logits_ptr + r * logits_stride, table_ptr, row, table_stride, idx, ok, BLOCK_F, HAS_INFO)
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
        m = m_new
    lse = m + tl.log(s)
    # Passes 2..K+1: each node's next best entry after the last pick (value descending, index ascending).
    prev_z = tl.full([BLOCK_F], float("inf"), tl.float32)
    prev_i = tl.full([BLOCK_F], -1, tl.int32)
    for j in tl.static_range(K):
        best_z = tl.full([BLOCK_F], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_F], 2147483647, tl.int32)
        for start in range(0, vocab, BLOCK_V):
            idx = start + v
            ok = idx < vocab
            z = _node_logits(logits_ptr + r * logits_stride, table_ptr, row, table_stride, idx, ok, BLOCK_F, HAS_INFO)
            later = (z < prev_z[:, None]) | ((z == prev_z[:, None]) & (idx[None, :] > prev_i[:, None]))
            eligible = ok[None, :] & later
            z = tl.where(eligible, z, float("-inf"))
            block_z = tl.max(z, 1)
            block_i = tl.min(tl.where(eligible & (z == block_z[:, None]), idx[None, :], 2147483647), 1)
            better = (block_z > best_z) | ((block_z == best_z) & (block_i < best_i))
            best_z = tl.where(better, block_z, best_z)
            best_i = tl.where(better, block_i, best_i)
        token = best_i.to(tl.int64)
        if HAS_D2T:
            token = tl.load(d2t_ptr + best_i, mask=f_ok, other=0)
        out = r * num_frontier * K + f * K + j
        tl.store(tokens_ptr + out, token, mask=f_ok)
        tl.store(joint_ptr + out, score * tl.exp(best_z - lse), mask=f_ok)
        prev_z = best_z
        prev_i = best_i
    tl.debug_barrier()  # the joint scores stored above are read back by every thread below
    # The next frontier: the K candidates of highest joint probability (ties: listed first), ascending.
    c = tl.arange(0, BLOCK_C)
    count = num_frontier * K
    ok = c < count
    joint = tl.load(joint_ptr + r * count + c, mask=ok, other=float("-inf"))
    mine, other = joint[:, None], joint[None, :]
    earlier = c[None, :] < c[:, None]
    ahead = ok[None, :] & ((other > mine) | ((other == mine) & earlier))  # candidates ranked before mine
    kept = ok & (tl.sum(ahead.to(tl.int32), 1) < K)
    slot = tl.sum((kept[None, :] & earlier).to(tl.int32), 1)
    tl.store(keep_ptr + r * K + slot, c.to(tl.int64), mask=kept)


def triton_expand_depth(
    raw: torch.Tensor,
    frontier_tokens: torch.Tensor,
    frontier_scores: torch.Tensor,
    table,  # engines.drafters.token_info.TokenInfoTable or None
    k: int,
    d2t: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expand_depth` with a collapsed token-info table (or none) as one Triton launch."""
    n, num_frontier = frontier_tokens.shape
    vocab = raw.shape[1]
    device = raw.device
    tokens = torch.empty(n, num_frontier * k, dtype=torch.int64, device=device)
    joint = torch.empty(n, num_frontier * k, dtype=torch.float32, device=device)
    keep = torch.empty(n, k, dtype=torch.int64, device=device)
    if n == 0:
        return tokens, joint, keep
    raw = raw.float().contiguous()
    frontier_tokens = frontier_tokens.long().contiguous()
    scores = frontier_scores.float().contiguous()
    info = raw if table is None else table.table
    block_f = next_power_of_2(num_frontier)
    _expand_depth_kernel[(n,)](
        raw,
        raw.stride(0),
        frontier_tokens,
        frontier_tokens.stride(0),
        scores,
        scores.stride(0),
        info,
        info.stride(0),
        frontier_tokens if table is None else table.row_of.long(),
        info.shape[0],
        raw if d2t is None else d2t.long(),
        tokens,
        joint,
        keep,
        num_frontier,
        vocab,
        K=k,
        BLOCK_F=block_f,
        BLOCK_V=min(max(16, TILE // block_f), next_power_of_2(vocab)),
        BLOCK_C=next_power_of_2(max(num_frontier * k, 2)),
        HAS_INFO=table is not None,
        HAS_D2T=d2t is not None,
    )
    return tokens, joint, keep
