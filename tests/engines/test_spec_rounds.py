"""Lyanna's width-1 chains as several native rounds a call (lyanna_kernels/spec_rounds.py, the executor's spec rounds):
greedy answers are plain decoding's, drafts are accepted as the step-by-step path accepts them, and a request
stops where its tokens or its grant end."""

from __future__ import annotations

import pytest

from engines.bench.cli import served_settings
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_decode.policy import AdaptivePolicy, AdaptiveSettings
from lyanna_kernels import integer_dot
from lyanna_kernels.quantized_linear import dequantized
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="the integer-dot kernels do not build here")


def lyanna_chains(depth: int, multi_step: int = 4) -> LLMEngine:
    cfg = EngineConfig(num_kv_blocks=256, drafter="lyanna", spec_policy="fixed", spec_depth=depth, spec_width=1,
                       spec_budget=depth, multi_step=multi_step)  # fmt: skip
    return LLMEngine(cfg)


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=256, drafter="none"))


@pytest.fixture(scope="module")
def rounds() -> LLMEngine:
    engine = lyanna_chains(2)
    assert engine.executor.takes_spec_rounds() and engine.scheduler.spec_rounds_max_seqs == 8
    return engine


def test_rounds_answer_as_plain_decoding(plain, rounds):
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [c.token_ids for c in plain.generate(CHAT_PROMPTS, params)]
    got = []
    for prompt in CHAT_PROMPTS:  # one at a time: the rounds serve one sequence
        got.append(rounds.generate([prompt], params)[0].token_ids)
    assert got == want
    steps = rounds.executor.profile.breakdown()
    assert steps["rounds"]["steps"] > 0
    # a call commits the tokens of several rounds
    assert steps["rounds"]["tokens_per_step"] > 2.0
    stats = rounds.executor.stats
    # 2 drafts a round, but where max_tokens cuts the chain (Request.draft_limit)
    assert stats.num_accepted_tokens > 0 and 1.5 * stats.num_steps < stats.num_draft_tokens <= 2 * stats.num_steps


def test_rounds_accept_as_the_step_by_step_path_accepts(rounds):
    params = SamplingParams(temperature=0, max_tokens=48)
    stepwise = lyanna_chains(2, multi_step=1)  # one verification a step: the executor's own path
    assert not stepwise.executor.takes_spec_rounds()
    counts = []
    for engine in (rounds, stepwise):
        stats = engine.executor.stats
        before = (stats.num_steps, stats.num_accepted_tokens)
        for prompt in CHAT_PROMPTS:
            engine.generate([prompt], params)
        counts.append((stats.num_steps - before[0], stats.num_accepted_tokens - before[1]))
    # the same drafts but where the drafter's output norm, summed in another order, tips a near tie
    (steps_a, accepted_a), (steps_b, accepted_b) = counts
    assert accepted_a > 0 and abs(accepted_a / steps_a - accepted_b / steps_b) < 0.1


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_rounds_stop_at_max_tokens(plain, rounds, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = plain.generate(CHAT_PROMPTS[:1], params)[0]
    got = rounds.generate(CHAT_PROMPTS[:1], params)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == max_tokens
    assert got.finish_reason == want.finish_reason


def test_rounds_stop_at_a_stop_token(plain, rounds):
    """A stop token in the middle of a call's rounds ends the request there, and the rounds after it are not counted."""
    free = plain.generate(CHAT_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    stop = free[17]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    want = plain.generate(CHAT_PROMPTS[:1], params)[0]
    stats = rounds.executor.stats
    before = (stats.num_steps, stats.num_accepted_tokens)
    got = rounds.generate(CHAT_PROMPTS[:1], params)[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop and got.finish_reason == want.finish_reason
    verified = stats.num_steps - before[0]  # rounds counted: each emits its accepted drafts and a bonus token
    assert verified + stats.num_accepted_tokens - before[1] < len(got.token_ids) + 2  # (the last round cut short)


def test_fixed_trees_of_another_shape_take_no_rounds():
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, drafter="lyanna", spec_policy="fixed", spec_depth=2,
                                    spec_width=2, spec_budget=4))  # fmt: skip
    req = engine.add_request(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    assert not engine.executor.rounds_request_ok(req)
    while engine.has_unfinished():
        engine.step()
    assert "rounds" not in engine.executor.profile.breakdown()


def test_batches_run_rounds_together(plain, rounds):
    params = SamplingParams(temperature=0, max_tokens=24)
    before = rounds.executor.profile.breakdown().get("rounds", {}).get("tokens_per_step", 0.0)
    got = [c.token_ids for c in rounds.generate(CHAT_PROMPTS, params)]
    assert got == [c.token_ids for c in plain.generate(CHAT_PROMPTS, params)]
    # three requests decode together: a call commits several rounds of every one of them
    assert rounds.executor.profile.breakdown()["rounds"]["tokens_per_step"] > before


def test_rounds_follow_a_prompt_read_through_the_fp32_copy(plain):
    """On a CPU without bf16 arithmetic the drafter reads a long prompt's rows through its fusion's fp32 copy (the
    wide path); the rounds that follow take its state as they take any other."""
    engine = lyanna_chains(2)
    fuse = engine.executor.drafter.model.fuse
    fuse.wide = dequantized(fuse.quant).float()  # what such a CPU keeps; every read here takes it
    fuse.takes_wide = lambda rows: True
    params = SamplingParams(temperature=0, max_tokens=24)
    got = [c.token_ids for c in engine.generate(CHAT_PROMPTS[:2], params)]
    assert got == [c.token_ids for c in plain.generate(CHAT_PROMPTS[:2], params)]
    assert engine.executor.profile.breakdown()["rounds"]["steps"] > 0


def test_the_served_default_chooses_between_rounds_and_its_plans(plain):
    """The adaptive policy (the served default's) measures the rounds at each depth against its own plans and takes
    what delivers the most; every answer stays plain decoding's."""
    served = LLMEngine(EngineConfig(**served_settings() | {"num_kv_blocks": 256}))
    assert served.executor.takes_spec_rounds() and isinstance(served.executor.policy, AdaptivePolicy)
    assert served.scheduler.spec_rounds_max_seqs == 2
    params = SamplingParams(temperature=0, max_tokens=64)
    prompts = CHAT_PROMPTS * 2
    want = [c.token_ids for c in plain.generate(prompts, params)]
    got = [served.generate([p], params)[0].token_ids for p in prompts]
    assert got == want
    outcomes = served.executor.policy.rounds_outcomes
    assert {depth for ((size, _), depth) in outcomes if size == 0} >= {0, 1}
    assert served.executor.profile.breakdown()["rounds"]["steps"] > 0


def test_choose_rounds_measures_every_option_then_takes_the_best():
    settings = AdaptiveSettings(rounds_depths=(1, 2), rounds_samples=2, rounds_recheck_every=4)
    policy = AdaptivePolicy(settings)
    rates = {0: 100.0, 1: 300.0, 2: 200.0}
    tried = []
    for _ in range(6):  # every option twice, least measured first
        depth = policy.choose_rounds(1, [1, 2, 3])
        tried.append(depth)
        policy.observe_rounds(1, depth, int(rates[depth]), 1.0)
    assert sorted(tried) == [0, 0, 1, 1, 2, 2]
    chosen = []
    for _ in range(8):
        depth = policy.choose_rounds(1, [1, 2, 3])
        chosen.append(depth)
        policy.observe_rounds(1, depth, int(rates[depth]), 1.0)
    assert chosen.count(1) == 6 and set(chosen) <= {0, 1, 2}  # the best, but for one re-measure in four
    assert policy.choose_rounds(1, []) == 0  # no depth allowed: the plan
    assert policy.choose_rounds(9, [1]) in (0, 1)  # another batch size is measured apart


def test_choose_rounds_weighs_steps_by_their_time():
    """An option whose steps vary (a round that accepts little, one that accepts much) is judged by the tokens a
    second it delivered over its steps, not by the mean of its steps' rates."""
    settings = AdaptiveSettings(rounds_depths=(1,), rounds_samples=4, rounds_recheck_every=1000)
    policy = AdaptivePolicy(settings)
    uneven = iter([(1, 0.01), (20, 0.1)] * 10)  # 100 and 200 tokens/s a step: 191 tokens/s delivered
    for _ in range(8):
        depth = policy.choose_rounds(1, [1])
        tokens, seconds = next(uneven) if depth == 1 else (10, 0.06)  # the plan: 167 tokens/s, every step
        policy.observe_rounds(1, depth, tokens, seconds)
    assert policy.choose_rounds(1, [1]) == 1


def test_choose_rounds_measures_a_clear_loser_less():
    """An option far below the best (`rounds_drop`) stops being sampled after `rounds_min_samples` steps."""
    settings = AdaptiveSettings(rounds_depths=(1, 2), rounds_samples=8, rounds_min_samples=3, rounds_drop=0.8)
    policy = AdaptivePolicy(settings)
    rates = {0: 300.0, 1: 100.0, 2: 290.0}
    tried = []
    for _ in range(19):
        depth = policy.choose_rounds(1, [1, 2])
        tried.append(depth)
        policy.observe_rounds(1, depth, int(rates[depth]), 1.0)
    assert tried.count(1) == 3 and tried.count(0) == 8 and tried.count(2) == 8
    assert policy.choose_rounds(1, [1, 2]) == 0


def test_choose_rounds_measures_a_drafter_behind_apart():
    """Rounds that must first read many tokens (after text drafts) are measured apart from rounds that need not."""
    policy = AdaptivePolicy(AdaptiveSettings(rounds_depths=(1,), rounds_samples=3, rounds_recheck_every=1000))
    rates = {(False, 0): 100.0, (False, 1): 200.0, (True, 0): 100.0, (True, 1): 50.0}
    for _ in range(6):
        for behind in (False, True):
            depth = policy.choose_rounds(1, [1], behind)
            policy.observe_rounds(1, depth, int(rates[behind, depth]), 1.0, behind)
    assert policy.choose_rounds(1, [1], behind=False) == 1
    assert policy.choose_rounds(1, [1], behind=True) == 0


def test_choose_rounds_keeps_the_plan_unless_rounds_lead_it_clearly():
    """Rounds within `rounds_margin` of the policy's own plan are not taken: a few steps' noise could have put them
    ahead."""
    policy = AdaptivePolicy(AdaptiveSettings(rounds_depths=(1,), rounds_samples=2, rounds_recheck_every=1000))
    for rates, want in (({0: 100.0, 1: 103.0}, 0), ({0: 100.0, 1: 110.0}, 1)):
        policy.rounds_outcomes.clear()
        for _ in range(4):
            depth = policy.choose_rounds(1, [1])
            policy.observe_rounds(1, depth, int(rates[depth]), 1.0)
        assert policy.choose_rounds(1, [1]) == want
