"""The EAGLE-2-style baseline drafter in the engine (random weights: plumbing, tree growth, losslessness)."""

from __future__ import annotations

import pytest
import torch

from engines.drafters.checkpoint import load_draft_model
from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna_model import LyannaDraftModel
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from engines.training.data import target_hidden_states
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import random_draft_checkpoint

MAX_NEW = 24


@pytest.fixture(scope="module")
def eagle_checkpoint(engine_fp32, tmp_path_factory):
    return random_draft_checkpoint(EagleDraftModel, engine_fp32, tmp_path_factory.mktemp("eagle"))


def eagle_engine(checkpoint, **overrides) -> LLMEngine:
    cfg = {
        "dtype": "float32",
        "num_kv_blocks": 256,
        "drafter": "eagle",
        "draft_model": checkpoint,
        "spec_depth": 3,
        "spec_width": 3,
        "spec_budget": 8,
    } | overrides
    return LLMEngine(EngineConfig(**cfg))


def test_width_one_tree_is_the_greedy_draft_chain(eagle_checkpoint):
    engine = eagle_engine(eagle_checkpoint)
    req = engine.add_request(CHAT_PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    engine.step()
    tree = engine.executor.drafter.grow(req, 4, 1)
    assert tree.parents == [-1, 0, 1, 2, 3]
    tokens = req.token_ids(0, req.num_tokens)
    hidden = target_hidden_states(engine.model, tokens[:-1])
    model = engine.executor.drafter.model
    drafted: list[int] = []
    for d in range(1, 5):  # each step's argmax feeds the next step, as EAGLE drafts
        chain = model.draft_chain(hidden, torch.tensor(tokens + drafted), d)
        drafted.append(int(model.logits(chain[-1:]).argmax()))
    assert tree.tokens[1:] == drafted
    assert tree.scores == sorted(tree.scores, reverse=True)  # joint probabilities shrink along a chain


def test_trees_grow_k_squared_candidates_per_depth_and_prune_to_budget(eagle_checkpoint):
    engine = eagle_engine(eagle_checkpoint)
    req = engine.add_request(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    calls = engine.executor.drafter.lm_head_calls
    full = engine.executor.drafter.grow(req, 3, 3)
    assert engine.executor.drafter.lm_head_calls - calls == 3  # one LM-head GEMM per depth
    assert full.size == 1 + 3 + 9 + 9
    expanded = {p for p in full.parents if p >= 0}
    for d in (1, 2):  # the expanded nodes at each depth are that depth's top-k by joint probability
        at_d = [i for i in range(full.size) if full.depths[i] == d]
        best = sorted(at_d, key=lambda i: -full.scores[i])[:3]
        assert expanded & set(at_d) == set(best)
    pruned = engine.executor.drafter.propose([req], [SpecParams(depth=3, width=3, budget=8)])[0]
    assert pruned.size == 9


def test_batched_growth_equals_each_request_alone(eagle_checkpoint):
    engine = eagle_engine(eagle_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in CHAT_PROMPTS[:4]]  # contexts of different lengths
    engine.step()
    engine.step()
    assert len({r.num_tokens for r in reqs}) == len(reqs)
    reqs.append(engine.add_request(CHAT_PROMPTS[0], params))  # not prefilled: no context, no tree
    drafter = engine.executor.drafter
    for depths, widths in [([3] * 5, [3] * 5), ([3, 2, 4, 1, 3], [2, 3, 2, 1, 2]), ([4, 0, 2, 2, 1], [1, 4, 4, 2, 3])]:
        calls = drafter.lm_head_calls
        got = drafter.grow_batch(reqs, depths, widths)
        if len(set(widths)) == 1:
            assert drafter.lm_head_calls - calls == max(depths)  # one LM-head GEMM per depth for every request
        assert got[-1] is None
        for req, depth, k, tree in zip(reqs[:-1], depths, widths, got, strict=False):
            want = drafter.grow(req, depth, k)
            assert tree.tokens == want.tokens and tree.parents == want.parents
            assert tree.scores == pytest.approx(want.scores, rel=5e-5)


@pytest.mark.slow
def test_greedy_eagle_speculation_equals_autoregressive(eagle_checkpoint, engine_fp32):
    engine = eagle_engine(eagle_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS, params)
    want = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.stats().spec.num_steps > 0 and engine.stats().kv_free_blocks == 256


def test_checkpoint_kind_is_checked(eagle_checkpoint, engine_fp32):
    assert isinstance(load_draft_model(eagle_checkpoint, engine_fp32), EagleDraftModel)
    with pytest.raises(ValueError, match="holds a 'eagle' drafter"):
        load_draft_model(eagle_checkpoint, engine_fp32, kind="lyanna")
    assert type(load_draft_model(eagle_checkpoint, engine_fp32, kind="eagle")) is not LyannaDraftModel
