"""Seeded sampling does not depend on speculation: the token at output index i is the Gumbel-max draw
with the noise of (seed, i), whether it came from plain decoding, from any tree verified by any
deterministic drafter (Lyanna under the adaptive policy, EAGLE, n-gram), or alongside any batch.

fp32 is the contract: there the target's logits at a tree node and at the same position of plain
decoding agree to rounding, which a draw could only notice at a numerical near-tie of logp + noise.
"""

from __future__ import annotations

import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_decode.policy import AdaptiveSettings
from engines.spec_params import SpecParams
from tests.conftest import CHAT_PROMPTS

REPEAT = [
    {"role": "user", "content": "Repeat this list exactly three times: apple, banana, cherry, dates, elderberry."}
]
PROMPTS = [CHAT_PROMPTS[0], CHAT_PROMPTS[1], REPEAT]
SEEDS = [0, 7, -12345]
MAX_NEW = 32

# Batch 1: prompts and seeds at temperature 0.8, to full length (the first two: one prompt, two seeds).
SOLO = [
    (conv, SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_NEW, ignore_eos=True))
    for conv, seed in [(PROMPTS[0], SEEDS[0]), (PROMPTS[0], SEEDS[1]), (PROMPTS[1], SEEDS[1]), (PROMPTS[2], SEEDS[0])]
]
NO_SPEC = SpecParams(enabled=False)
# One mixed batch: prompts, seeds, temperatures and filters differ; greedy rows; one row without speculation.
MIXED = [
    (PROMPTS[2], SamplingParams(temperature=0.8, seed=SEEDS[2], max_tokens=MAX_NEW, ignore_eos=True), None),
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW), None),
    (PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=MAX_NEW, ignore_eos=True), None),
    (CHAT_PROMPTS[2], SamplingParams(temperature=0.6, min_p=0.05, seed=2**63 - 1, max_tokens=MAX_NEW), None),
    (PROMPTS[2], SamplingParams(temperature=0, max_tokens=20), None),
    (PROMPTS[0], SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True), NO_SPEC),
    (CHAT_PROMPTS[3], SamplingParams(temperature=1.2, top_k=40, seed=-1, max_tokens=24, ignore_eos=True), None),
]

# The adaptive policy without its start-up profile (minutes on a small CPU, after which it may decide
# drafting never pays there, and the test would verify nothing): it drafts at the caps until its cost
# model has online data, then probes often, so the trees' shapes change from step to step (depth 1-3,
# width 1-2, plain steps between) and with the machine's timing, which is what must not matter.
ADAPTIVE = AdaptiveSettings(profile=False, probe_cost=1.0, probe_every=2, shape_probe_every=4, plain_every=8)
SPEC_ENGINES = {
    "lyanna-adaptive": {"drafter": "lyanna", "spec_policy": "adaptive", "adaptive": ADAPTIVE},
    "eagle-fixed": {"drafter": "eagle", "spec_depth": 3, "spec_width": 2, "spec_budget": 6},
    "ngram": {"drafter": "ngram", "spec_depth": 4, "spec_width": 2, "spec_budget": 8},
}


@pytest.fixture(scope="module")
def solo_reference(engine_fp32):
    """Completions of SOLO without speculation, one request at a time."""
    return [engine_fp32.generate([conv], p)[0].token_ids for conv, p in SOLO]


@pytest.fixture(scope="module")
def mixed_reference(engine_fp32):
    """Completions of MIXED without speculation, one request at a time."""
    return [engine_fp32.generate([conv], p)[0].token_ids for conv, p, _ in MIXED]


@pytest.fixture(params=list(SPEC_ENGINES))
def spec_engine(request):
    """A fresh fp32 engine with one of the deterministic drafters (fresh: the adaptive policy's state
    from one test would steer what it drafts in the next)."""
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512, **SPEC_ENGINES[request.param]))


@pytest.mark.slow
def test_seeded_sampling_equals_plain_decoding_at_batch_1(spec_engine, solo_reference):
    before = spec_engine.stats().spec.num_accepted_tokens
    for (conv, params), want in zip(SOLO, solo_reference, strict=True):
        assert spec_engine.generate([conv], params)[0].token_ids == want, (params.seed, conv)
    assert spec_engine.stats().spec.num_accepted_tokens > before  # drafts were verified and accepted


@pytest.mark.slow
def test_seeded_sampling_equals_plain_decoding_in_a_mixed_batch(spec_engine, mixed_reference):
    reqs = [spec_engine.add_request(conv, p, spec=s) for conv, p, s in MIXED]
    while spec_engine.has_unfinished():
        spec_engine.step()
    for req, want in zip(reqs, mixed_reference, strict=True):
        assert req.output_token_ids == want, (req.params, req.prompt_token_ids[-5:])
    assert reqs[5].num_spec_steps == 0
    assert sum(r.num_accepted_tokens for r in reqs if not r.params.greedy) > 0


def test_same_seed_same_output_other_seed_other_output(engine_fp32, solo_reference):
    conv, params = SOLO[0]
    assert engine_fp32.generate([conv], params)[0].token_ids == solo_reference[0]
    assert solo_reference[0] != solo_reference[1]  # seeds 0 and 7 on the same prompt
    # each unseeded request draws its own seed: four draws on a prompt the model answers confidently are not
    # all the same (two at temperature 0.8 once were)
    unseeded = SamplingParams(temperature=1.2, max_tokens=24, ignore_eos=True)
    outs = engine_fp32.generate([conv] * 4, unseeded)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_seed_is_drawn_at_admission_when_not_given(engine_fp32):
    req = engine_fp32.make_request(CHAT_PROMPTS[0], SamplingParams(temperature=0.5))
    assert 0 <= req.seed < 2**63
    assert engine_fp32.make_request(CHAT_PROMPTS[0], SamplingParams(temperature=0.5, seed=-9)).seed == -9
