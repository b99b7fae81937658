"""The draft-model drafter (SPS): any causal LM with the target's vocabulary."""

from __future__ import annotations

import pytest
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels.dispatch import cpu_has_half_precision_math
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import tiny_llama_checkpoint

MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A tiny random Llama over the target's 49152-token vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    return str(tiny_llama_checkpoint(folder, 49152, 8192, hidden=32, layers=1, heads=2, kv_heads=1))


def spec_engine(draft: str, spec: SpecParams) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype="float32",
            num_kv_blocks=256,
            drafter="draft-model",
            draft_model=draft,
            spec_depth=spec.depth,
            spec_width=spec.width,
            spec_budget=spec.budget,
        )
    )


@pytest.mark.slow
def test_target_as_its_own_draft_model_accepts_nearly_everything(engine_fp32, checkpoint):
    engine = spec_engine(str(checkpoint), SpecParams(depth=3, width=2, budget=6))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS[:2], params)
    want = engine_fp32.generate(CHAT_PROMPTS[:2], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = engine.stats().spec
    assert stats.mean_accepted_tokens > 3.5  # depth 3 + bonus = 4 when every draft is right
    assert engine.stats().kv_free_blocks == 256 and engine.executor.drafter.kv.allocator.num_free == 256


@pytest.mark.slow
def test_sampled_chains_from_the_target_itself_are_accepted(checkpoint):
    engine = spec_engine(str(checkpoint), SpecParams(depth=3, width=1, budget=3))
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
    a = engine.generate([CHAT_PROMPTS[1]], params)[0]
    b = engine.generate([CHAT_PROMPTS[1]], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == MAX_NEW  # seeded: reproducible
    # q equals p up to float noise, so block verification keeps (almost) every drafted token.
    stats = engine.stats().spec
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


@pytest.mark.slow
def test_tiny_random_draft_model_keeps_greedy_output(engine_fp32, tiny_draft):
    engine = spec_engine(tiny_draft, SpecParams(depth=3, width=2, budget=5))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS, params)
    want = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.stats().spec.num_steps > 0


def test_draft_model_needs_the_target_vocabulary(tmp_path):
    tiny_llama_checkpoint(tmp_path, 100, 2048, hidden=32, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="vocabulary"):
        spec_engine(str(tmp_path), SpecParams())


def test_a_draft_model_beside_the_served_target_has_a_cache_its_layers_compute_in(tiny_draft):
    """Beside the served target (bf16, its cache read by the fused decoder), an eager draft model keeps its own
    cache in a dtype its layers compute in natively (fp32 on CPUs without bf16 arithmetic), and greedy output
    is still the target's."""
    engine = LLMEngine(
        EngineConfig(
            num_kv_blocks=64, drafter="draft-model", draft_model=tiny_draft, spec_depth=2, spec_width=1, spec_budget=2
        )
    )
    emulated = not cpu_has_half_precision_math(torch.bfloat16)
    assert engine.kv_cache.k.dtype == torch.bfloat16
    assert engine.executor.drafter.kv.k.dtype == (torch.float32 if emulated else torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(CHAT_PROMPTS[0], params, spec=spec) for spec in (None, SpecParams(enabled=False))]
    while engine.has_unfinished():
        engine.step()
    assert reqs[0].output_token_ids == reqs[1].output_token_ids and engine.stats().spec.num_steps > 0
