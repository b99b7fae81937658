"""Lyanna's token-info embedding: the collapsed hot-token table equals the low-rank product."""

from __future__ import annotations

from collections import Counter

import torch

from engines.drafters.token_info import DenseTokenInfo, TokenInfoEmbedding, hot_tokens
from engines.drafters.token_info_sampling import build_subtree, build_subtrees


def make(vocab=50, hidden=16, rank=4, vocab_out=50):
    torch.manual_seed(0)
    return TokenInfoEmbedding(torch.randn(vocab, hidden), rank, vocab_out)


def test_shapes_and_trainable_parameters():
    emb = make(vocab_out=30)
    out = emb(torch.tensor([1, 2, 3]))
    assert out.shape == (3, 30)
    # Normalised rows: RMS of each row is 1 before the (unit-initialised) weight.
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(3), rtol=1e-4, atol=1e-4)
    trainable = {n for n, p in emb.named_parameters() if p.requires_grad}
    assert trainable == {"w1", "w2", "norm.weight"}  # W_E stays frozen (a buffer)


def test_collapsed_table_equals_low_rank_product_on_hot_tokens():
    emb = make()
    with torch.no_grad():
        emb.norm.weight.uniform_(0.5, 1.5)  # a trained-looking norm weight
    counts = Counter({5: 100, 7: 90, 1: 80, 3: 2, 9: 1})
    hot = hot_tokens(counts, 3)
    assert hot.tolist() == [1, 5, 7]
    table = emb.collapse(hot)
    queries = torch.tensor([5, 3, 7, 1, 9, 0])
    got = table(queries)
    with torch.no_grad():
        want = emb(queries)
    for i, t in enumerate(queries.tolist()):
        if t in hot.tolist():
            torch.testing.assert_close(got[i], want[i])
        else:
            assert torch.count_nonzero(got[i]) == 0  # cold tokens carry no token info
    assert table.num_hot == 3 and table.nbytes == 4 * 50 * 4 + 50 * 8


def test_dense_inference_form_equals_the_trained_product_on_every_token():
    """What the engine uses by default: every token's offsets as training computes them (in fp32), also for
    a drafter held in bf16."""
    emb = make(vocab=300, hidden=32, rank=8, vocab_out=64)
    with torch.no_grad():
        emb.norm.weight.uniform_(0.5, 1.5)
        tokens = torch.arange(300)
        want = emb(tokens)
        torch.testing.assert_close(DenseTokenInfo(emb)(tokens), want, rtol=1e-5, atol=1e-5)
        half = DenseTokenInfo(emb.to(torch.bfloat16))(tokens)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, want, rtol=0.05, atol=0.05)  # bf16 weights, fp32 arithmetic


def test_table_plugs_into_tree_sampling():
    emb = make()
    table = emb.collapse(torch.arange(50))
    tree = build_subtree(torch.zeros(3, 50), root=4, token_info=table, k=2)
    assert tree.size == 1 + 2 + 4 + 4 and tree.depth == 3


def test_table_plugs_into_batched_tree_sampling():
    emb = make()
    table = emb.collapse(torch.tensor([1, 4, 9, 20]))  # other tokens: zero rows
    torch.manual_seed(1)
    logits = [torch.randn(3, 50), torch.randn(2, 50), torch.randn(4, 50)]
    roots, widths = [4, 7, 9], [2, 3, 2]
    with torch.no_grad():
        got = build_subtrees(logits, roots, table, widths)
        for lg, root, k, tree in zip(logits, roots, widths, got, strict=True):
            want = build_subtree(lg, root, table, k)
            assert tree.tokens == want.tokens and tree.parents == want.parents
            assert max(abs(a - b) for a, b in zip(tree.scores, want.scores, strict=True)) < 1e-6
