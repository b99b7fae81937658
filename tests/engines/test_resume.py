"""A request resumed from any prefix of its answer (what the ingress sends another replica when one dies)
continues exactly as the uninterrupted request did: the same tokens, the same text (the detokenizer
picks up mid-word, and text a stop string held back is sent again), usage over the whole answer.

Served settings: the embedded model's 4-bit weights through the fused CPU decoder, whose rows do not
depend on their batch or on whether a token was read as part of a prompt or decoded; Lyanna drafting
3:2:6 trees, so both runs verify drafts."""

from __future__ import annotations

import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import assert_resumes_exactly

MAX_NEW = 40
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
    "stop string": SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=["zzz"], logprobs=1),
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(drafter="lyanna", spec_depth=3, spec_width=2, spec_budget=6))


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_continues_exactly_where_it_stopped(engine, case):
    assert_resumes_exactly(engine, GenerationRequest(request_id=case, messages=CHAT_PROMPTS[1], params=CASES[case]))


def test_a_resumption_past_max_tokens_is_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=3)
    request = GenerationRequest(messages=CHAT_PROMPTS[0], params=params, resume_token_ids=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="resume_token_ids"):
        engine.admit(request)
