"""The Lyanna drafter inside the engine (random weights: this checks plumbing and losslessness)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engines.draft_tree import merge_trees
from engines.drafters.checkpoint import save_draft_model
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.drafters.token_info_sampling import resample_tree, token_info_tree
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from engines.training.data import target_hidden_states
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import random_draft_checkpoint

MAX_NEW = 24


@pytest.fixture(scope="module")
def lyanna_checkpoint(engine_fp32, tmp_path_factory):
    return random_draft_checkpoint(LyannaDraftModel, engine_fp32, tmp_path_factory.mktemp("lyanna"))


@pytest.fixture(scope="module")
def chain_fusion_checkpoint(engine_fp32, tmp_path_factory):
    return random_draft_checkpoint(LyannaDraftModel, engine_fp32, tmp_path_factory.mktemp("chain"), chain_fusion=True)


@pytest.fixture(params=["plain", "chain_fusion"])
def any_lyanna_checkpoint(request):
    """The random Lyanna, and one whose later steps read the fuse projection (`chain_fusion`)."""
    return request.getfixturevalue("lyanna_checkpoint" if request.param == "plain" else "chain_fusion_checkpoint")


def lyanna_engine(checkpoint, **overrides) -> LLMEngine:
    cfg = {
        "dtype": "float32",
        "num_kv_blocks": 256,
        "drafter": "lyanna",
        "draft_model": checkpoint,
        "spec_depth": 3,
        "spec_width": 2,
        "spec_budget": 6,
    } | overrides
    return LLMEngine(EngineConfig(**cfg))


def test_incremental_trajectory_equals_full_recomputation(any_lyanna_checkpoint):
    engine = lyanna_engine(any_lyanna_checkpoint)
    req = engine.add_request(CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
        if req.finished:
            break
        traj = engine.executor.drafter.trajectory(req, 3)
        tokens = req.token_ids(0, req.num_tokens)
        hidden = target_hidden_states(engine.model, tokens[:-1])  # H_0..H_{T-2}, one fresh forward
        want = engine.executor.drafter.model.draft_chain(hidden, torch.tensor(tokens), 3)
        torch.testing.assert_close(traj, want, rtol=1e-4, atol=1e-4)


def test_batched_trajectories_equal_each_request_alone(any_lyanna_checkpoint):
    engine = lyanna_engine(any_lyanna_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in CHAT_PROMPTS[:3]]  # contexts of different lengths
    engine.step()
    engine.step()
    batched = engine.executor.drafter.trajectories(reqs, 4)
    for req, got in zip(reqs, batched, strict=True):
        torch.testing.assert_close(got, engine.executor.drafter.trajectories([req], 4)[0], rtol=1e-4, atol=1e-4)


def test_batched_catch_up_equals_each_request_alone(lyanna_checkpoint):
    engine = lyanna_engine(lyanna_checkpoint)
    engine.executor.policy.plan = lambda reqs, caps, *rest: [None] * len(reqs)  # plain decoding only
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in CHAT_PROMPTS[:3]]  # contexts of different lengths
    for _ in range(5):
        engine.step()
    drafter = engine.executor.drafter
    before = copy.deepcopy(drafter.states)
    read = drafter.catch_up(reqs)
    assert read == [r.num_tokens - 1 for r in reqs]  # through position T-2, prompt included
    assert drafter.catch_up(reqs) == [0, 0, 0]  # nothing left to read
    batched = drafter.states
    for req in reqs:
        drafter.states = copy.deepcopy(before)
        assert drafter.catch_up([req]) == [req.num_tokens - 1]
        alone, together = drafter.states[req.request_id], batched[req.request_id]
        torch.testing.assert_close(together.keys, alone.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(together.last_out, alone.last_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fusion", [True, False])
def test_batched_proposal_equals_the_per_request_reference(lyanna_checkpoint, fusion):
    engine = lyanna_engine(lyanna_checkpoint, spec_depth=4, spec_width=2, spec_budget=8, lyanna_fusion=fusion)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in CHAT_PROMPTS]  # contexts of different lengths
    drafter, m, info = engine.executor.drafter, engine.executor.drafter.model, engine.executor.drafter.token_info
    for _ in range(4):  # without fusion, a step that verifies a re-sampled tree records none
        engine.step()
        pending = [drafter.states[r.request_id].pending for r in reqs]
        if any(p is not None for p in pending):  # random weights reject: re-sampled trees to build
            break
    assert any(p is not None for p in pending)
    drafter.states[reqs[0].request_id].pending = pending[0] = None  # a request with nothing to re-sample
    specs = [SpecParams(4, 2, 8), SpecParams(3, 3, 10), SpecParams(4, 2, 6), SpecParams(2, 1, 4)]
    # The reference: each request's Algorithm 1 and 2 alone, on logits from the same batched layer steps.
    resampled = [
        p and resample_tree(p.logits, p.bonus, info, p.width, drafter.resample_threshold, m.d2t) for p in pending
    ]
    want = [  # without fusion a re-sampled tree is the proposal
        None if p is None or fusion else tree.prune(s.budget + 1)
        for p, tree, s in zip(pending, resampled, specs, strict=True)
    ]
    drafting = [i for i, p in enumerate(pending) if fusion or p is None]
    trajs = drafter.trajectories([reqs[i] for i in drafting], max(specs[i].depth for i in drafting))
    depths = [specs[i].depth for i in drafting]
    logits = m.logits(torch.cat([t[:d] for t, d in zip(trajs, depths, strict=True)])).split(depths)
    for i, lg in zip(drafting, logits, strict=True):
        root = reqs[i].token_ids(reqs[i].num_tokens - 1, reqs[i].num_tokens)[0]
        want[i] = token_info_tree(lg, root, info, specs[i].width, specs[i].budget, m.d2t)
        if resampled[i] is not None:
            want[i] = merge_trees(want[i], resampled[i]).prune(specs[i].budget + 1)
    got = drafter.propose(reqs, specs)
    for tree, ref in zip(got, want, strict=True):
        assert tree.tokens == ref.tokens and tree.parents == ref.parents
        assert tree.scores == pytest.approx(ref.scores, abs=1e-6)
    assert all(drafter.states[r.request_id].pending is None for r in reqs)


def test_a_stale_resampled_tree_is_dropped(lyanna_checkpoint):
    spec = SpecParams(depth=4, width=2, budget=8)
    engine = lyanna_engine(lyanna_checkpoint, spec_depth=spec.depth, spec_width=spec.width, spec_budget=spec.budget)
    req = engine.add_request(CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    st = None
    for _ in range(4):
        engine.step()
        st = engine.executor.drafter.states[req.request_id]
        if st.pending is not None:
            break
    assert st.pending is not None
    st.pending = dataclasses.replace(st.pending, num_tokens=req.num_tokens - 1)  # as if recorded a token ago
    fused = engine.executor.drafter.num_fused
    tree = engine.executor.drafter.propose([req], [spec])[0]
    assert st.pending is None and engine.executor.drafter.num_fused == fused
    assert tree.tokens[0] == req.token_ids(req.num_tokens - 1, req.num_tokens)[0]


@pytest.mark.slow
def test_greedy_lyanna_speculation_equals_autoregressive(lyanna_checkpoint, engine_fp32):
    engine = lyanna_engine(lyanna_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS, params)
    want = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.stats().spec.num_steps > 0 and engine.stats().kv_free_blocks == 256


@pytest.mark.slow
def test_preemption_recomputes_drafter_state(lyanna_checkpoint, engine_fp32):
    engine = lyanna_engine(lyanna_checkpoint, num_kv_blocks=9)  # forces preemption and recompute
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = engine.generate(CHAT_PROMPTS, params)
    want = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_seeded_sampling_with_lyanna_reproduces(lyanna_checkpoint):
    engine = lyanna_engine(lyanna_checkpoint)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=16, ignore_eos=True)
    a = engine.generate([CHAT_PROMPTS[1]], params)[0].token_ids
    b = engine.generate([CHAT_PROMPTS[1]], params)[0].token_ids
    assert a == b and len(a) == 16


@pytest.mark.slow
def test_resampled_trees_are_fused_and_output_is_unchanged(lyanna_checkpoint, engine_fp32):
    engine = lyanna_engine(lyanna_checkpoint, spec_depth=4, spec_width=2, spec_budget=8)
    assert engine.executor.drafter.resample
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS, params)
    want = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.executor.drafter.num_fused > 0  # random weights reject often, so re-sampled trees were fused
    off = lyanna_engine(lyanna_checkpoint, lyanna_resampling=False)
    off.generate(CHAT_PROMPTS[:1], params)
    assert off.executor.drafter.num_fused == 0


@pytest.mark.slow
def test_hot_vocabulary_drafter_keeps_greedy_output(engine_fp32, tmp_path):
    torch.manual_seed(1)
    t = engine_fp32.model
    prompt_ids = engine_fp32.tokenizer.apply_chat_template(CHAT_PROMPTS[0])
    hot = torch.tensor(sorted(set(prompt_ids) | set(range(2048))))  # a plausible hot set
    model = LyannaDraftModel(
        LyannaConfig(engine_fp32.model_config, token_info_rank=8, draft_vocab=hot.numel()),
        t.embed_tokens.weight.data,
        t.lm_head_weight.data,
        hot,
    )
    save_draft_model(model, tmp_path)
    engine = lyanna_engine(str(tmp_path))
    model = engine.executor.drafter.model
    assert torch.equal(model.d2t, hot) and model.lm_head.shape[0] == hot.numel()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS[:2], params)
    want = engine_fp32.generate(CHAT_PROMPTS[:2], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@pytest.mark.slow
def test_resampled_trees_verified_alone_without_fusion(lyanna_checkpoint, engine_fp32):
    engine = lyanna_engine(lyanna_checkpoint, spec_depth=4, spec_width=2, spec_budget=8, lyanna_fusion=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = engine.generate(CHAT_PROMPTS[:2], params)
    want = engine_fp32.generate(CHAT_PROMPTS[:2], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.executor.drafter.num_fused == 0 and engine.executor.drafter.num_resampled_alone > 0
