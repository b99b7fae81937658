"""Lyanna's draft model: the parallel training unroll computes what inference drafting computes."""

from __future__ import annotations

import pytest
import torch

from engines.config import ModelConfig
from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel

TARGET = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=30,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
)


def make(**switches) -> LyannaDraftModel:
    torch.manual_seed(0)
    emb = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    return LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8, **switches), emb, emb)


@pytest.mark.parametrize("switches", [{}, {"use_fusion": False}, {"chain_fusion": True}])
def test_training_unroll_equals_inference_chain_for_every_anchor(switches):
    model = make(**switches)
    torch.manual_seed(1)
    n, steps = 12, 4
    hidden = torch.randn(n, TARGET.hidden_size)
    tokens = torch.randint(0, TARGET.vocab_size, (n,))
    with torch.no_grad():
        preds = model.unroll(hidden, tokens, steps)
    assert [p.shape for p in preds] == [(n - 1, TARGET.hidden_size)] * steps
    for p in range(1, n):  # a context of p target states; anchor j = p - 1
        chain = model.draft_chain(hidden[:p], tokens[: p + 1], steps)
        for s in range(steps):
            torch.testing.assert_close(preds[s][p - 1], chain[s], rtol=1e-4, atol=1e-5)


def test_chain_fusion_feeds_later_steps_through_the_fuse_projection():
    """With `chain_fusion` steps >= 2 read fuse(h, the learned chain embedding); step 1 is unchanged, no token
    enters the trajectory, and the chain embedding is trained."""
    plain, fused = make(), make(chain_fusion=True)
    fused.load_state_dict(plain.state_dict() | {"chain_embed": fused.chain_embed.detach()})
    hidden = torch.randn(8, TARGET.hidden_size)
    tokens = torch.randint(0, TARGET.vocab_size, (8,))
    with torch.no_grad():
        a, b = plain.unroll(hidden, tokens, 3), fused.unroll(hidden, tokens, 3)
        torch.testing.assert_close(a[0], b[0])
        assert not torch.allclose(a[1], b[1])
        other = tokens.clone()
        other[5:] = (other[5:] + 1) % TARGET.vocab_size  # the chain's own tokens (after the bonus t_4) change nothing
        torch.testing.assert_close(
            fused.draft_chain(hidden[:4], tokens[:7], 3), fused.draft_chain(hidden[:4], other[:7], 3)
        )
    sum(p.pow(2).mean() for p in fused.unroll(hidden, tokens, 3)).backward()
    assert fused.chain_embed.grad is not None and fused.chain_embed.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="use_fusion"):
        make(chain_fusion=True, use_fusion=False)


def test_gradients_reach_trainable_parts_only():
    model = make()
    hidden = torch.randn(6, TARGET.hidden_size)
    tokens = torch.randint(0, TARGET.vocab_size, (6,))
    preds = model.unroll(hidden, tokens, 3)
    logits = model.logits(preds[-1]) + model.token_info(tokens[:5])  # token info of each step's parent
    (sum(p.pow(2).mean() for p in preds) + logits.logsumexp(-1).mean()).backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0} == trainable
    assert "fuse.weight" in trainable and "token_info.w1" in trainable
    assert not model.embed.requires_grad and not model.lm_head.requires_grad


def test_fusion_switch_decides_whether_the_bonus_token_enters():
    hidden = torch.randn(5, TARGET.hidden_size)
    a, b = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 2, 3, 4, 5, 7])  # differ only in the bonus
    fused, plain = make(), make(use_fusion=False)
    assert not torch.allclose(fused.draft_chain(hidden, a, 2), fused.draft_chain(hidden, b, 2))
    torch.testing.assert_close(plain.draft_chain(hidden, a, 2), plain.draft_chain(hidden, b, 2))
    assert make(use_token_info=False).token_info is None


def test_hot_vocabulary_head_selects_target_columns():
    torch.manual_seed(0)
    emb = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    hot = torch.tensor([3, 7, 8, 20, 41, 63])
    full = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    small = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8, draft_vocab=6), emb, emb, hot)
    h = torch.randn(4, TARGET.hidden_size)
    torch.testing.assert_close(small.logits(h), full.logits(h)[:, hot])
    assert small.token_info(torch.tensor([1, 2])).shape == (2, 6)
    # The map is part of the weights, and loading it restricts the head again.
    clone = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8, draft_vocab=6), emb, emb)
    clone.load_state_dict(small.state_dict())
    assert torch.equal(clone.d2t, hot)
    torch.testing.assert_close(clone.logits(h), small.logits(h))


def test_eagle_training_unroll_equals_inference_chain_with_true_tokens():
    torch.manual_seed(0)
    emb = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    model = EagleDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    assert model.token_info is None and model.cfg.use_fusion
    torch.manual_seed(1)
    n, steps = 12, 4
    hidden = torch.randn(n, TARGET.hidden_size)
    tokens = torch.randint(0, TARGET.vocab_size, (n,))
    with torch.no_grad():
        preds = model.unroll(hidden, tokens, steps)
    for p in range(1, n - steps + 1):  # chains whose later steps have a true token to take
        chain = model.draft_chain(hidden[:p], tokens[: p + steps], steps)
        for s in range(steps):
            torch.testing.assert_close(preds[s][p - 1], chain[s], rtol=1e-4, atol=1e-5)
    # Unlike Lyanna, the token drafted at a step changes every later state.
    other = tokens.clone()
    other[3] = (other[3] + 1) % TARGET.vocab_size
    a, b = model.draft_chain(hidden[:2], tokens[:5], 3), model.draft_chain(hidden[:2], other[:5], 3)
    torch.testing.assert_close(a[:1], b[:1])
    assert not torch.allclose(a[1:], b[1:])
