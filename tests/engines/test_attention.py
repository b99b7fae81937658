"""Paged ragged attention (decode, chunked prefill, trees; GQA) against a dense per-sequence reference,
and the CPU grouping's promise: every call reads about the keys its sequences really have."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engines.attention import (
    GROUP_PADDING_RATIO,
    GROUP_PADDING_SLACK,
    SequenceLayout,
    build_attention_metadata,
    paged_attention,
    plan_groups,
    reference_paged_attention,
)


def ancestors_mask(parents: list[int]) -> torch.Tensor:
    """Independent of the module: walk up from each node."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


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


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def make_batch(specs, block_size, num_blocks, contiguous, seed=0):
    """Layouts for (cached, new, tree parents or None) specs, with scattered or consecutive blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    if not contiguous:
        rng.shuffle(free)
    layouts = []
    for cached, new, parents in specs:
        need = -(-(cached + new) // block_size)
        table, free = free[:need], free[need:]
        layouts.append(SequenceLayout(table, cached, new, parents))
    return layouts


CASES = {
    "decodes of different lengths": [(7, 1, None), (30, 1, None), (2, 1, None), (0, 1, None)],
    "mixed: decode, prefill from scratch, chunk after cache, tree": [
        (7, 1, None),
        (0, 70, None),
        (40, 80, None),
        (12, 5, [-1, 0, 0, 1, 1]),
        (3, 3, None),
    ],
    "trees of several shapes": [(5, 9, "random"), (17, 1, [-1]), (0, 6, "random"), (33, 12, "random")],
    "one long prompt among decodes": [(0, 150, None)] + [(20 + i, 1, None) for i in range(9)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense_reference(case, contiguous, block_size):
    torch.manual_seed(0)
    rng = random.Random(1)
    specs = [(c, n, random_tree(rng, n) if p == "random" else p) for c, n, p in CASES[case]]
    heads, kv_heads, dim, num_blocks = 6, 2, 8, 200
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, kv_heads, dim, dtype=torch.float64)
    v_cache = torch.randn(slots, kv_heads, dim, dtype=torch.float64)
    layouts = make_batch(specs, block_size, num_blocks, contiguous)
    meta = build_attention_metadata(layouts, block_size, "cpu")
    T = sum(n for _, n, _ in specs)
    q = torch.randn(T, heads, dim, dtype=torch.float64)
    k_cache.index_copy_(0, meta.slot_mapping, torch.randn(T, kv_heads, dim, dtype=torch.float64))
    v_cache.index_copy_(0, meta.slot_mapping, torch.randn(T, kv_heads, dim, dtype=torch.float64))

    out = paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    ref = reference_paged_attention(q, k_cache, v_cache, layouts, block_size, dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    offset = 0
    for (cached, new, parents), layout in zip(specs, layouts, strict=True):
        table = torch.tensor(layout.block_table)
        idx = torch.arange(cached + new)
        seq_slots = table[idx // block_size] * block_size + idx % block_size
        mask_new = ancestors_mask(parents) if parents is not None else torch.ones(new, new, dtype=torch.bool).tril()
        want = dense_reference(q[offset : offset + new], k_cache[seq_slots], v_cache[seq_slots], cached, mask_new)
        torch.testing.assert_close(out[offset : offset + new], want, rtol=1e-10, atol=1e-10)
        offset += new


def test_a_long_prompt_attends_alone_and_decodes_pad_little():
    specs = [(0, 2000, None)] + [(100 + 7 * i, 1, None) for i in range(31)]
    layouts = make_batch(specs, 16, 400, contiguous=True)
    groups = plan_groups(layouts)
    assert [0] in groups  # the prompt alone
    real = padded = 0
    for members in groups:
        q = max(layouts[b].num_new for b in members)
        k = max(layouts[b].num_keys for b in members)
        padded += len(members) * q * k
        real += sum(layouts[b].num_new * layouts[b].num_keys for b in members)
        assert len(members) * q * k <= GROUP_PADDING_RATIO * real + GROUP_PADDING_SLACK or len(members) == 1
    # The 31 decodes do not pad to the prompt's 2000 keys (the old layout read 32 x 2000 x 2000 pairs).
    assert padded <= 1.3 * real + GROUP_PADDING_SLACK * len(groups)


def test_equal_length_decodes_make_one_unmasked_call_and_contiguous_blocks_are_read_in_place():
    layouts = make_batch([(5, 1, None)] * 3, 4, 16, contiguous=True)
    meta = build_attention_metadata(layouts, 4, "cpu")
    assert len(meta.groups) == 1 and meta.groups[0].mask is None
    alone = build_attention_metadata(make_batch([(40, 30, None)], 4, 64, contiguous=True), 4, "cpu")
    assert alone.groups[0].key_slots is None  # a view of the cache, no gather
    scattered = build_attention_metadata(make_batch([(40, 30, None)], 4, 64, contiguous=False, seed=3), 4, "cpu")
    assert scattered.groups[0].key_slots is not None


def test_a_wider_cache_dtype_attends_in_it():
    layouts = make_batch([(6, 2, None), (3, 1, None)], 4, 16, contiguous=False)
    meta = build_attention_metadata(layouts, 4, "cpu")
    k_cache = torch.randn(64, 1, 8)
    v_cache = torch.randn(64, 1, 8)
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, meta, 8**-0.5)
    assert out.dtype == torch.float32
    ref = reference_paged_attention(q.float(), k_cache, v_cache, layouts, 4, 8**-0.5)
    torch.testing.assert_close(out, ref)
