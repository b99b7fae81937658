"""A request resumed from any prefix of its answer (what the ingress sends another replica when one dies)
continues exactly as the uninterrupted request did: the same tokens, the same text (the detokenizer
picks up mid-word, and text a stop string held back is sent again), usage over the whole answer.

Served settings: the embedded model's 4-bit weights through the fused CPU decoder, whose rows do not
depend on their batch or on whether a token was read as part of a prompt or decoded; Lyanna drafting
3:2:6 trees, so both runs verify drafts."""

from __future__ import annotations

import dataclasses

import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS

MAX_NEW = 40
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
    "stop string": SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=["zzz"], logprobs=1),
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(drafter="lyanna", spec_depth=3, spec_width=2, spec_budget=6))


def deltas(engine: LLMEngine, request: GenerationRequest) -> list:
    """Every delta of one request, run alone."""
    engine.add(engine.admit(request))
    out = []
    while engine.has_unfinished():
        out += [d for d in engine.step() if d.request_id == request.request_id]
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_continues_exactly_where_it_stopped(engine, case):
    params = CASES[case]
    base = GenerationRequest(request_id=f"whole-{case}", messages=CHAT_PROMPTS[1], params=params)
    whole = deltas(engine, base)
    tokens = [t for d in whole for t in d.new_token_ids]
    text = "".join(d.new_text for d in whole)
    assert len(whole) > 3 and engine.stats().spec.num_steps > 0
    # cut after deltas 1, the middle one and the last but one (mid-word cuts among them)
    for cut in sorted({1, len(whole) // 2, len(whole) - 1}):
        done = [t for d in whole[:cut] for t in d.new_token_ids]
        sent = "".join(d.new_text for d in whole[:cut])
        resumed = dataclasses.replace(
            base, request_id=f"resumed-{case}-{cut}", resume_token_ids=done, resume_text_sent=len(sent)
        )
        rest = deltas(engine, resumed)
        assert done + [t for d in rest for t in d.new_token_ids] == tokens, f"cut after {len(done)} tokens"
        assert sent + "".join(d.new_text for d in rest) == text
        assert rest[-1].num_output_tokens == len(tokens) and rest[-1].finish_reason == whole[-1].finish_reason
        if params.logprobs is not None:  # the new tokens' log-probabilities, one each
            want = [lp for d in whole[cut:] for lp in d.logprobs]
            assert [lp.token_id for d in rest for lp in d.logprobs] == [lp.token_id for lp in want]


def test_a_resumption_past_max_tokens_is_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=3)
    request = GenerationRequest(messages=CHAT_PROMPTS[0], params=params, resume_token_ids=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="resume_token_ids"):
        engine.admit(request)
