"""Block accounting, and committing an accepted tree path leaves the cache as if only that path was seen."""

from __future__ import annotations

import pytest
import torch

from engines.errors import CacheCapacityError
from engines.kv_cache import BlockAllocator, PagedKVCache
from tests.engines.helpers import forward_one, new_cache


def test_allocator_accounting():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.num_free == 1 and len(set(a)) == 3
    with pytest.raises(CacheCapacityError):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.free(a)
    assert alloc.num_free == 4


def test_block_tables_grow_truncate_and_free():
    kv = PagedKVCache(1, 1, 2, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    kv.allocate("a", 5)
    assert len(kv.block_tables["a"]) == 2
    assert kv.can_allocate("a", 32) and not kv.can_allocate("a", 33)
    kv.allocate("a", 9)
    slots = kv.slots("a", 0, 9)
    assert len(set(slots.tolist())) == 9
    kv.truncate("a", 4)
    assert len(kv.block_tables["a"]) == 1 and kv.allocator.num_free == 7
    kv.free("a")
    assert kv.allocator.num_free == 8 and "a" not in kv.block_tables


def test_batch_slots_equal_each_sequences_slots_in_order():
    kv = PagedKVCache(1, 1, 2, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    kv.allocate("a", 3)
    kv.allocate("b", 10)
    kv.allocate("a", 13)  # a's blocks are not consecutive: b's lie between them
    spans = [("a", 2, 9), ("b", 9, 1), ("a", 12, 1), ("b", 0, 0), ("b", 3, 6)]
    got = kv.batch_slots([s for s, _, _ in spans], [a for _, a, _ in spans], [n for _, _, n in spans])
    want = torch.cat([kv.slots(s, a, a + n) for s, a, n in spans])
    assert got.dtype == torch.long and torch.equal(got, want)
    assert kv.batch_slots([], [], []).numel() == 0


def test_an_int8_cache_moves_codes_with_their_scales():
    """An int8 cache holds codes and a bf16 scale per 32 values of a slot's KV head; committing a path moves both,
    and its bytes per token count the scales."""
    kv = PagedKVCache(2, 3, 64, 4, 4, torch.int8, "cpu")
    assert kv.k_scale is not None and kv.v_scale is not None and kv.k_scale.shape == (2, 16, 3, 2)
    assert kv.k_scale.dtype == torch.bfloat16 and kv.value_dtype == torch.bfloat16
    assert PagedKVCache.bytes_per_token(2, 3, 64, torch.int8) == 2 * 2 * 3 * (64 + 4)
    kv.k.random_(-127, 128)
    kv.v.random_(-127, 128)
    kv.k_scale.uniform_()
    kv.v_scale.uniform_()
    before = [t.clone() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)]
    kv.move_slots([5, 6], [1, 9])
    for now, then in zip((kv.k, kv.v, kv.k_scale, kv.v_scale), before, strict=True):
        assert torch.equal(now[:, [1, 9]], then[:, [5, 6]])
        rest = [i for i in range(16) if i not in (1, 9)]
        assert torch.equal(now[:, rest], then[:, rest])
    with pytest.raises(ValueError, match="multiple of 32"):
        PagedKVCache(2, 3, 16, 4, 4, torch.int8, "cpu")


def test_int8_rows_keep_each_value_to_half_a_step_of_its_group():
    """`quantize_rows`: per 32 values a bf16 scale no smaller than max |x| / 127 (no code saturates), codes within
    half a step of each value, and a zero group all zero."""
    from engines.kv_cache import dequantize_rows, quantize_rows

    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0, :32] = 0
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (5, 3, 2)
    groups = x.unflatten(-1, (2, 32))
    assert (scales.float() >= groups.abs().amax(-1) / 127).all() and codes.abs().max() <= 127
    assert (scales.float() <= groups.abs().amax(-1) / 127 * (1 + 2**-7)).all()
    back = dequantize_rows(codes, scales, torch.float32).unflatten(-1, (2, 32))
    assert ((back - groups).abs() <= scales.float().unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert scales[0, 0, 0] == 0 and (codes[0, 0, :32] == 0).all()


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


@pytest.mark.parametrize("path", [[0, 1, 4], [0, 2, 5], [0], [0, 1, 3, 6]])
def test_tree_write_then_commit_equals_cache_of_path_alone(engine_fp32, path):
    model = engine_fp32.model
    cfg = model.cfg
    tok = engine_fp32.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "List three colours of the rainbow."}])
    base = len(prompt)
    parents = [-1, 0, 0, 1, 1, 2, 3]  # a 4-level tree; node 0 is the root token after the prompt
    g = torch.Generator().manual_seed(len(path))
    tree_tokens = torch.randint(0, cfg.vocab_size, (len(parents),), generator=g).tolist()
    nxt = 42

    def cache():  # block size 4 so the tree and the path cross block boundaries
        return new_cache(model, block_size=4)

    def forward(kv, seq, tokens, cached, positions, parents=None):
        return forward_one(model, kv, seq, tokens, cached, positions, parents)

    # A: prompt, then the whole tree in one forward, then commit the accepted path.
    a = cache()
    forward(a, "s", prompt, 0, list(range(base)))
    tree_logits, _ = forward(a, "s", tree_tokens, base, [base + d for d in depths(parents)], parents)
    a.commit_path("s", base, path)
    assert len(a.block_tables["s"]) == a.num_blocks_for(base + len(path))
    logits_a, _ = forward(a, "s", [nxt], base + len(path), [base + len(path)])

    # B: a cache that only ever saw prompt + path tokens.
    b = cache()
    path_tokens = [tree_tokens[i] for i in path]
    seq_logits, _ = forward(b, "s", prompt + path_tokens, 0, list(range(base + len(path))))
    logits_b, _ = forward(b, "s", [nxt], base + len(path), [base + len(path)])

    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)
    # Tree attention itself: each path node's logits equal the sequential ones at that position.
    torch.testing.assert_close(tree_logits[path], seq_logits[base:], rtol=1e-4, atol=1e-4)
