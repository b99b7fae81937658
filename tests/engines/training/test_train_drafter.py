"""Distillation training of the Lyanna drafter on a small synthetic feature set."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engines.config import ModelConfig
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.training.data import Example, ShardWriter
from engines.training.features import StoredFeatures
from engines.training.train_drafter import (
    Run,
    TrainConfig,
    Validator,
    acceptance_by_step,
    distill_loss,
    train,
    training_weights,
)

TARGET = ModelConfig(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=30,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)


def synthetic_features(path, num=12, length=24):
    """A 'target' whose hidden state is a fixed function of the current token, so it is learnable."""
    torch.manual_seed(0)
    emb = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    state_of = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    writer = ShardWriter(path, shard_tokens=100)
    for i in range(num):
        toks = torch.randint(0, TARGET.vocab_size, (1,)).tolist()
        for _ in range(length - 1):  # tokens follow a deterministic cycle, as an easy language
            toks.append((toks[-1] * 7 + 3) % TARGET.vocab_size)
        writer.add(Example(f"s{i}", toks, [0] * 4 + [1] * (length - 4)), state_of[torch.tensor(toks)])
    # One sequence with nothing to learn (its answer was cut off): training must step over it.
    writer.add(Example("empty", toks, [0] * length), state_of[torch.tensor(toks)])
    writer.flush()
    return emb


def test_training_lowers_the_loss_and_resumes(tmp_path):
    emb = synthetic_features(tmp_path / "data")
    data = StoredFeatures(tmp_path / "data")
    model = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    cfg = TrainConfig(steps=3, lr=3e-3, epochs=6, batch_seqs=1, eval_every=1000, checkpoint_every=20)
    before = Validator(data, cfg)(model)
    progress = train(model, data, cfg, val=data, run=Run(tmp_path / "ckpt"))
    after = progress.curve[-1]
    assert progress.curve[0]["val_loss"] == before["val_loss"]  # the curve starts at the untrained drafter
    assert after["val_loss"] < 0.5 * before["val_loss"]
    assert after["acc1"] > before["acc1"] and after["acc1"] > 0.5
    assert after["cond1"] > 0.5 and after["chain_tokens"] > 1.5
    # The drafter's weights are written in the shipped dtype; train_state.pt keeps them at training precision.
    shipped = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert shipped["fuse.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(training_weights(tmp_path / "ckpt")["fuse.weight"], model.fuse.weight.detach())
    # Resume: a longer run continues from the saved step instead of starting over.
    state = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["progress"]
    assert state["step"] == 13 * 6  # the sequence without loss positions takes a step that learns nothing
    longer = TrainConfig(steps=3, lr=3e-3, epochs=7, batch_seqs=1, eval_every=1000, checkpoint_every=1000)
    fresh = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    resumed = train(fresh, data, longer, val=data, run=Run(tmp_path / "ckpt"))
    assert resumed.step == 13 * 7
    assert resumed.curve[: len(progress.curve)] == progress.curve
    assert resumed.curve[-1]["val_loss"] <= after["val_loss"] * 1.5  # it kept the trained weights
    # Another batch size would put the saved step at other data and another learning rate: refused.
    other = TrainConfig(steps=3, lr=3e-3, epochs=7, batch_seqs=2)
    with pytest.raises(ValueError, match="batch_seqs"):
        train(fresh, data, other, run=Run(tmp_path / "ckpt"))


def test_stop_after_checkpoints_mid_epoch_and_the_rest_matches_one_run(tmp_path):
    """A run stopped mid-epoch and resumed ends where an uninterrupted run ends."""
    emb = synthetic_features(tmp_path / "data")
    data = StoredFeatures(tmp_path / "data")
    weights = {}
    for name, stops in (("whole", [0]), ("stopped", [5, 0])):
        for stop in stops:
            torch.manual_seed(1)
            model = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
            cfg = TrainConfig(steps=2, lr=3e-3, epochs=2, batch_seqs=2, eval_every=1000, checkpoint_every=1000,
                              stop_after=stop)  # fmt: skip
            progress = train(model, data, cfg, run=Run(tmp_path / name))
        assert progress.step == 2 * (13 // 2)
        weights[name] = model.state_dict()
    for k, w in weights["whole"].items():
        torch.testing.assert_close(weights["stopped"][k], w, msg=k)


def test_acceptance_by_step_is_conditional():
    matches = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    got = acceptance_by_step(matches)
    assert got["cond1"] == 3 / 4  # three of four chains accept step 1
    assert got["cond2"] == 2 / 3  # of those three, two accept step 2 (row 2's match at step 2 does not count)
    assert got["cond3"] == 1 / 2
    assert got["chain_tokens"] == 1 + 3 / 4 + 2 / 4 + 1 / 4
    # Where the data did not go on with the matched token, the chain's later steps are not counted.
    follows = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    got = acceptance_by_step(matches, follows)
    assert got["cond1"] == 3 / 4 and got["cond2"] == 1 / 2 and got["cond3"] == 0.0
    assert got["chain_tokens"] == pytest.approx(1 + 3 / 4 + 3 / 8)


def random_drafter_and_sequence(seed: int):
    """A seeded random Lyanna over TARGET and one 20-token training sequence: (model, hidden, tokens, mask)."""
    torch.manual_seed(seed)
    embedding = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    model = LyannaDraftModel(LyannaConfig(TARGET), embedding, torch.randn(TARGET.vocab_size, TARGET.hidden_size))
    hidden = torch.randn(20, TARGET.hidden_size)
    tokens = torch.randint(0, TARGET.vocab_size, (20,))
    mask = torch.ones(20)
    return model, hidden, tokens, mask


def test_step_decay_weighs_each_unrolled_step_by_its_power():
    """With `step_decay` g the loss of 3 unrolled steps is l1 + g l2 + g^2 l3: at 0 it is one step's
    loss (the later steps get no gradient), and the steps' losses recovered from two decays give the
    third's loss."""
    model, hidden, tokens, mask = random_drafter_and_sequence(seed=1)
    one_step, _ = distill_loss(model, hidden, tokens, mask, 1, 1.0, 0.1)
    assert distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1, step_decay=0.0)[0].item() == pytest.approx(
        one_step.item()
    )
    losses = {
        g: distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1, step_decay=g)[0].item() for g in (1.0, 0.5, 0.25)
    }
    two_steps = distill_loss(model, hidden, tokens, mask, 2, 1.0, 0.1)[0].item()
    l1, l2 = one_step.item(), two_steps - one_step.item()
    l3 = losses[1.0] - two_steps
    for g in (0.5, 0.25):
        assert losses[g] == pytest.approx(l1 + g * l2 + g * g * l3, rel=1e-5)
    model.zero_grad()
    distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1, step_decay=0.0)[0].backward()
    with_decay = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    one_step.backward()
    alone = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(with_decay, alone, strict=True))


def test_chain_alpha_weighs_the_regression_of_the_later_steps_only():
    """`chain_alpha` replaces alpha at steps >= 2: the loss moves by (chain_alpha - alpha) times the later
    steps' MSE, which the difference of two beta-free losses recovers; negative keeps alpha."""
    model, hidden, tokens, mask = random_drafter_and_sequence(seed=2)
    with torch.no_grad():
        mse_all = distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.0)[0].item()
        mse_first = distill_loss(model, hidden, tokens, mask, 1, 1.0, 0.0)[0].item()
        base = distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1)[0].item()
        for chain_alpha in (0.0, 0.25):
            got = distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1, chain_alpha=chain_alpha)[0].item()
            assert got == pytest.approx(base + (chain_alpha - 1.0) * (mse_all - mse_first), rel=1e-5)
        assert distill_loss(model, hidden, tokens, mask, 3, 1.0, 0.1, chain_alpha=-1.0)[0].item() == pytest.approx(base)
