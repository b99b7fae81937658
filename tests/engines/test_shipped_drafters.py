"""The drafters shipped for the embedded target: small, documented, loaded by default, and good enough."""

from __future__ import annotations

import json

import pytest
import torch

from engines.datasets import sharegpt_prompts
from engines.drafters.checkpoint import SHIPPED, hot_tokens_by_frequency
from engines.drafters.eagle import EagleDrafter
from engines.drafters.lyanna import LyannaDrafter
from engines.drafters.token_info import DenseTokenInfo, TokenInfoTable
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams

SPEC = SpecParams(depth=3, width=4, budget=16)
# Floors far under what the shipped drafters measure on validation prompts (README), far over what
# an untrained drafter gets (~0.0-0.05 at step 1).
FLOOR = {"lyanna": {"step1": 0.2, "tokens_per_step": 1.25}, "eagle": {"step1": 0.2, "tokens_per_step": 1.25}}


@pytest.mark.parametrize("kind", ["lyanna", "eagle"])
def test_shipped_checkpoint_is_small_and_has_a_model_card(kind):
    folder = SHIPPED[kind]
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 30 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["kind"] == kind and config["train"]["epochs"] >= 1
    card = (folder / "README.md").read_text()
    for needed in ("Data", "Training", "Validation", "wall"):
        assert needed in card
    assert len(hot_tokens_by_frequency(folder)) >= 1024


def test_engine_loads_the_shipped_lyanna_drafter_by_default():
    """With every token's token info, as trained (a hot-token table on request)."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=64))
    drafter = engine.executor.drafter
    assert isinstance(drafter, LyannaDrafter) and isinstance(drafter.token_info, DenseTokenInfo)
    tokens = torch.tensor([0, 17, 5000, 49151])  # rare and frequent alike
    with torch.no_grad():
        want = drafter.model.token_info(tokens).float()
    torch.testing.assert_close(drafter.token_info(tokens), want, rtol=0.05, atol=0.05)
    table = LLMEngine(EngineConfig(num_kv_blocks=64, lyanna_token_info_rows=1024)).executor.drafter.token_info
    assert isinstance(table, TokenInfoTable) and table.num_hot == 1024


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lyanna", "eagle"])
def test_shipped_drafter_accepts_above_a_floor_on_validation_prompts(kind, engine_fp32):
    prompts = [r["messages"] for r in sharegpt_prompts(4, max_chars=400, split="val")]
    engine = LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=256, drafter=kind, spec_depth=3, spec_width=4, spec_budget=16)
    )
    assert isinstance(engine.executor.drafter, LyannaDrafter if kind == "lyanna" else EagleDrafter)
    params = SamplingParams(temperature=0, max_tokens=48)
    got = engine.generate(prompts, params)
    want = engine_fp32.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]  # lossless
    stats = engine.stats().spec
    assert stats.acceptance_by_depth[0] >= FLOOR[kind]["step1"]
    assert stats.mean_accepted_tokens >= FLOOR[kind]["tokens_per_step"]
