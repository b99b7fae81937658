"""Distillation training of the Lyanna drafter on a small synthetic feature set."""

from __future__ import annotations

import torch

from engines.config import ModelConfig
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.training.data import Example, ShardWriter
from engines.training.train_drafter import TrainConfig, evaluate, train

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
    model = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    cfg = TrainConfig(steps=3, lr=3e-3, epochs=6, log_every=1000, checkpoint_every=20)
    before = evaluate(model, tmp_path / "data", cfg)
    after = train(model, tmp_path / "data", tmp_path / "ckpt", cfg, val_dir=tmp_path / "data")
    assert after["loss"] < 0.5 * before["loss"]
    assert after["acc1"] > before["acc1"] and after["acc1"] > 0.5
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    # Resume: a longer run continues from the saved step instead of starting over.
    state = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)
    assert state["step"] == 12 * 6  # the sequence without loss positions took no optimizer step
    longer = TrainConfig(steps=3, lr=3e-3, epochs=7, log_every=1000, checkpoint_every=1000)
    fresh = LyannaDraftModel(LyannaConfig(TARGET, token_info_rank=8), emb, emb)
    resumed = train(fresh, tmp_path / "data", tmp_path / "ckpt", longer, val_dir=tmp_path / "data")
    assert torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["step"] == 12 * 7
    assert resumed["loss"] <= after["loss"] * 1.5  # it kept the trained weights
