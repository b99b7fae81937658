"""Log-probabilities of emitted and prompt tokens: what they are (the target's, against transformers),
how they come back (aligned with the tokens, the asked number of alternatives), and that speculation
does not change them (every deterministic drafter, greedy and seeded sampling, in a mixed batch)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import RequestOutput, TokenLogprob
from engines.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.engines.test_seeded_speculation import SPEC_ENGINES

GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=12, logprobs=3, ignore_eos=True)


def run(engine: LLMEngine, conv, params: SamplingParams, prompt_ids: list[int] | None = None) -> list[RequestOutput]:
    """All deltas of one request, stepped to completion."""
    req = engine.add_request(None if prompt_ids else conv, params, prompt_token_ids=prompt_ids)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def collected(outs: list[RequestOutput]) -> tuple[list[int], list[TokenLogprob]]:
    """The tokens and their log-probabilities over all deltas."""
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    return tokens, logprobs


def test_logprobs_are_the_targets_and_align_with_tokens(engine_fp32, hf_fp32):
    outs = run(engine_fp32, CHAT_PROMPTS[0], GREEDY)
    tokens, logprobs = collected(outs)
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top) == 5 for lp in logprobs)
    prompt = engine_fp32.tokenizer.apply_chat_template(CHAT_PROMPTS[0])
    with torch.no_grad():
        ref = hf_fp32(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=2e-3)
        values, ids = row.topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()  # greedy: the emitted token is the top one
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-3)
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))


def test_no_logprobs_unless_asked(engine_fp32):
    outs = run(engine_fp32, CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)
    outs = run(engine_fp32, CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    tokens, logprobs = collected(outs)
    assert [lp.token_id for lp in logprobs] == tokens and all(lp.top == [] for lp in logprobs)


def test_prompt_logprobs_score_every_prompt_token_and_match_output_logprobs(engine_fp32, make_engine):
    """A second request whose prompt is the first's prompt + output scores those output tokens exactly
    as the first request's logprobs did; chunked prefill (small chunks) changes nothing."""
    outs = run(engine_fp32, CHAT_PROMPTS[1], GREEDY)
    tokens, logprobs = collected(outs)
    prompt = engine_fp32.tokenizer.apply_chat_template(CHAT_PROMPTS[1])
    chunked = make_engine(prefill_chunk_tokens=7, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    again = run(chunked, None, params, prompt_ids=prompt + tokens)
    scored = again[0].prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(prompt) + len(tokens)
    assert [lp.token_id for lp in scored[1:]] == (prompt + tokens)[1:]
    assert all(len(lp.top) == 2 and lp.logprob <= lp.top[0][1] + 1e-6 for lp in scored[1:])
    for mine, theirs in zip(scored[len(prompt) :], logprobs, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=2e-3)
    assert all(o.prompt_logprobs is None for o in again[1:])


def test_processed_logprobs_follow_the_sampling_distribution(make_engine):
    engine = make_engine(logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, top_k=4, seed=3, max_tokens=8, logprobs=6, ignore_eos=True)
    tokens, logprobs = collected(run(engine, CHAT_PROMPTS[2], params))
    for token, lp in zip(tokens, logprobs, strict=True):
        assert token in [t for t, v in lp.top if math.isfinite(v)]  # drawn from what top-k kept
        finite = [v for _, v in lp.top if math.isfinite(v)]
        assert len(finite) <= 4  # top-k 4: the rest is filtered out
        assert math.isfinite(lp.logprob)
        assert sum(math.exp(v) for v in finite) == pytest.approx(1.0, abs=1e-4)


def test_too_many_alternatives_is_a_clear_error(engine_fp32):
    with pytest.raises(InvalidRequestError, match="logprobs") as e:
        engine_fp32.add_request(CHAT_PROMPTS[0], SamplingParams(logprobs=21))
    assert e.value.param == "logprobs"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", list(SPEC_ENGINES))
def test_speculation_returns_the_logprobs_of_plain_decoding(engine_fp32, drafter):
    """In one batch (greedy, seeded, a prompt-logprobs row), with trees of every deterministic drafter."""
    spec = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512, **SPEC_ENGINES[drafter]))
    batch = [
        (CHAT_PROMPTS[0], GREEDY),
        (CHAT_PROMPTS[1], SEEDED),
        (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=1)),
    ]
    for engine in (engine_fp32, spec):
        for conv, params in batch:
            engine.add_request(conv, params, request_id=f"{drafter}-{conv[0]['content'][:12]}-{params.temperature}")
    results: dict[LLMEngine, dict[str, list[RequestOutput]]] = {engine_fp32: {}, spec: {}}
    for engine in (engine_fp32, spec):
        while engine.has_unfinished():
            for o in engine.step():
                results[engine].setdefault(o.request_id, []).append(o)
    assert spec.stats().spec.num_draft_tokens > 0
    for rid, plain_outs in results[engine_fp32].items():
        plain_tokens, plain_lps = collected(plain_outs)
        spec_tokens, spec_lps = collected(results[spec][rid])
        assert spec_tokens == plain_tokens
        assert [lp.token_id for lp in spec_lps] == spec_tokens
        for a, b in zip(spec_lps, plain_lps, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] or a.top == pytest.approx(b.top, abs=1e-3)
        if plain_outs[0].prompt_logprobs is not None:
            first = results[spec][rid][0].prompt_logprobs
            assert [x and x.token_id for x in first] == [x and x.token_id for x in plain_outs[0].prompt_logprobs]


@pytest.mark.slow
def test_sampled_chains_return_the_targets_logprobs_of_their_tokens(engine_fp32, checkpoint):
    """The draft-model drafter's stochastic chains (scored after verification): each emitted token's
    log-probability is the target's, as a prompt-logprobs rescoring of prompt + output finds it."""
    spec = LLMEngine(
        EngineConfig(
            dtype="float32",
            num_kv_blocks=256,
            drafter="draft-model",
            draft_model=str(checkpoint),
            spec_depth=3,
            spec_width=1,
            spec_budget=3,
        )
    )
    tokens, logprobs = collected(run(spec, CHAT_PROMPTS[1], SEEDED))
    assert spec.stats().spec.num_accepted_tokens > 0
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 3 for lp in logprobs)
    prompt = engine_fp32.tokenizer.apply_chat_template(CHAT_PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scored = run(engine_fp32, None, params, prompt_ids=prompt + tokens)[0].prompt_logprobs[len(prompt) :]
    for mine, theirs in zip(logprobs, scored, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=2e-3)
