"""The adaptive policy in the real engine (embedded model, shipped Lyanna drafter): lossless whatever
it decides, with cost models profiled at start-up and corrected by traffic."""

from __future__ import annotations

import pytest
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_decode import profile
from engines.spec_decode.policy import AdaptiveSettings, make_policy
from engines.spec_decode.profile import TREE_WEIGHT, profile_key, profile_or_reuse
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow


def test_adaptive_greedy_output_equals_the_target_alone(engine_fp32):
    adaptive = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, spec_policy="adaptive"))
    policy = adaptive.executor.policy
    assert policy.target_cost.ready and policy.draft_cost.ready  # the start-up profile ran
    assert set(policy.target_cost.trees) == {1, 2, 4, 8}  # tree steps at batch 1, 2, 4 and 8 were profiled too
    assert all(fit.stt == pytest.approx(TREE_WEIGHT) for fit in policy.target_cost.trees.values())
    # Keys are priced from the profile's short- and long-context decodes; with attention reading only each
    # sequence's own keys, 192 more keys per request can cost less than a decode step's noise (slope 0).
    assert policy.target_cost.context_slope >= 0
    assert policy.draft_cost.predict_reading(100) > 0  # the drafter's context reading was timed apart
    params = SamplingParams(temperature=0, max_tokens=32)
    for _ in range(2):  # the second round runs on what the first taught it
        ours = adaptive.generate(CHAT_PROMPTS, params)
        alone = engine_fp32.generate(CHAT_PROMPTS, params)
        assert [o.token_ids for o in ours] == [a.token_ids for a in alone]
    stats = policy.stats()
    assert stats["observed_step_s"] > 0 and stats["predicted_step_s"] > 0
    assert not policy.requests, "finished requests leave no state behind"


@pytest.mark.parametrize("drafter", ["eagle", "ngram"])
def test_adaptive_policy_drives_every_drafter_losslessly(engine_fp32, drafter):
    # Whether drafting pays depends on this machine's timings; probes every other plan (a probe's draft is
    # verified whole) make sure this run drafts and verifies whatever the cost models say.
    settings = AdaptiveSettings(shape_probe_every=2, idle_probe_every=2, probe_cost=1.0)
    config = EngineConfig(
        dtype="float32", num_kv_blocks=256, spec_policy="adaptive", drafter=drafter, adaptive=settings
    )
    adaptive = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=32)
    ours = adaptive.generate(CHAT_PROMPTS, params)
    alone = engine_fp32.generate(CHAT_PROMPTS, params)
    assert [o.token_ids for o in ours] == [a.token_ids for a in alone]
    # it drafted and verified
    assert adaptive.executor.policy.draft_cost.ready and adaptive.executor.stats.num_steps > 0


def test_a_second_engine_of_the_same_settings_reuses_the_start_up_profile(tmp_path, monkeypatch):
    """The profile's cost models are saved under the cache folder; a policy of the same engine settings on
    this machine takes them instead of profiling; another thread count is another profile; a damaged
    file is profiled again and replaced."""
    settings = AdaptiveSettings(profile=False)
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, spec_policy="adaptive", adaptive=settings))
    first = engine.executor.policy
    assert not profile_or_reuse(engine, first, tmp_path)  # profiled, and saved
    (saved,) = tmp_path.glob("*.pkl")
    second = make_policy("adaptive", settings)
    assert profile_or_reuse(engine, second, tmp_path)  # reused
    assert second.target_cost.ready and second.draft_cost.ready
    for tokens in (1, 3, 16, 64):
        assert second.target_cost.predict(tokens, context=tokens) == first.target_cost.predict(tokens, context=tokens)
    assert second.target_cost.trees.keys() == first.target_cost.trees.keys() == {1, 2, 4, 8}
    assert second.draft_cost.predict(2, 2, 1) == first.draft_cost.predict(2, 2, 1) > 0

    threads = torch.get_num_threads()
    key = profile_key(engine)
    torch.set_num_threads(threads + 1)
    try:
        assert profile_key(engine) != key
    finally:
        torch.set_num_threads(threads)
    assert profile_key(engine) == key == saved.stem

    saved.write_bytes(b"not a profile")
    profiled = []
    monkeypatch.setattr(profile, "profile_engine", lambda e, p: profiled.append(p))
    third = make_policy("adaptive", settings)
    assert not profile_or_reuse(engine, third, tmp_path)
    assert profiled == [third]
    assert profile_or_reuse(engine, make_policy("adaptive", settings), tmp_path)  # the replacement reads back
