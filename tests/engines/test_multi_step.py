"""Several greedy decode steps per engine step (`multi_step`, engines/spec_decode/executor.py): on the embedded
model as served (the fused CPU decoder with the LM head and argmax in its call), greedy requests answer exactly
as with one step per engine step, in fewer engine steps; requests that cannot take them (sampled, asking for
log-probabilities) keep one token a step, and so does every step they are in."""

from __future__ import annotations

import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels import integer_dot
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    """The served engine settings but speculation, with one decode step per engine step and with up to four."""
    one, four = (LLMEngine(EngineConfig(drafter="none", num_kv_blocks=256, multi_step=n)) for n in (1, 4))
    assert four.model.fused_decoder(four.kv_cache, 1) is not None
    return one, four


def run(engine: LLMEngine, batch: list[tuple[list[dict], SamplingParams]]) -> list[Request]:
    """The requests of `batch` (messages, params) added together and run to their ends."""
    reqs = [engine.add_request(messages, params) for messages, params in batch]
    while engine.has_unfinished():
        engine.step()
    return reqs


def answers(reqs: list[Request]) -> list[tuple[list[int], str, object]]:
    return [(r.output_token_ids, r.output_text, r.finish_reason) for r in reqs]


def test_greedy_requests_answer_as_with_one_step_a_call_in_fewer_steps(engines):
    """Greedy requests of several lengths (max_tokens not a multiple of the steps, a stop string, EOS) in one
    batch: the same tokens, text and finish reasons; the long ones in about a quarter of the engine steps."""
    one, four = engines
    batch = [
        (CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=7)),
        (CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=64, stop=["power"])),
        (CHAT_PROMPTS[2], SamplingParams(temperature=0, max_tokens=41)),
        (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=128)),
    ]
    want, got = run(one, batch), run(four, batch)
    assert answers(got) == answers(want)
    reasons = [r.finish_reason.value for r in want]
    assert reasons == ["length", "stop", "length", "stop"]
    assert want[3].output_token_ids[-1] in one.tokenizer.stop_token_ids and len(want[3].output_token_ids) < 128
    assert "power" not in want[1].output_text and len(want[1].output_token_ids) < 64
    for w in want:
        assert w.num_forwards >= len(w.output_token_ids)  # one token a step (the prompt's step gives the first)
    assert len(got[2].output_token_ids) == 41 and got[2].num_forwards <= 2 + 41 // 4 + 3


def test_sampled_requests_and_log_probabilities_keep_one_step_a_call(engines):
    """A seeded sampled request beside a greedy one, then a greedy one asking for log-probabilities: the same
    answers and log-probabilities as one step a call; while such a request runs, every step is one token."""
    one, four = engines
    batch = [
        (CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        (CHAT_PROMPTS[2], SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)),
    ]
    want, got = run(one, batch), run(four, batch)
    assert answers(got) == answers(want)
    assert got[1].num_forwards == want[1].num_forwards == got[0].num_forwards
    batch = [(CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True))]
    want, got = run(one, batch), run(four, batch)
    assert answers(got) == answers(want) and got[0].num_forwards == want[0].num_forwards
    assert got[0].output_logprobs == want[0].output_logprobs


def test_blocks_written_several_steps_a_call_serve_the_prefix_cache(engines):
    """A conversation's blocks computed several steps a call are cached under the right tokens: the next turn,
    which repeats the answer in its prompt, hits them and answers as an engine that steps one by one."""
    one, four = engines
    first = (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    answer = run(four, [first])[0].output_text
    turn = [*CHAT_PROMPTS[3], {"role": "assistant", "content": answer}, {"role": "user", "content": "Shorter?"}]
    hits = four.stats().prefix_cache_hits
    second = (turn, SamplingParams(temperature=0, max_tokens=20))
    got, want = run(four, [second]), run(one, [second])
    assert answers(got) == answers(want)
    assert four.stats().prefix_cache_hits - hits >= 3 * four.kv_cache.block_size


def test_a_prompt_s_last_token_is_read_as_a_prompt_token_not_in_a_multi_step_call(engines):
    """A prompt one token longer than its cached blocks (a prefix-cache hit) leaves its last token alone in a
    step: it is read as a prompt token (its own kernels), so that step gives one token, and the answer is what
    an engine stepping one by one gives in the same case."""
    one, four = engines
    block = four.kv_cache.block_size
    prompt = [(7 * i + 3) % 500 + 100 for i in range(3 * block + 1)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answers_of = []
    for engine in (one, four):
        engine.add_request(prompt_token_ids=prompt, params=params)
        while engine.has_unfinished():
            engine.step()
        again = engine.add_request(prompt_token_ids=prompt, params=params)
        engine.step()
        assert again.num_computed_tokens == 3 * block + 1 and len(again.output_token_ids) == 1
        while engine.has_unfinished():
            engine.step()
        answers_of.append(again.output_token_ids)
    assert answers_of[0] == answers_of[1]


def test_a_speculating_request_takes_several_steps_where_the_policy_drafts_nothing():
    """Under the served default (Lyanna, adaptive policy), greedy requests answer as plain decoding one step a
    call does, with and without speculation, in one batch."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, spec_policy="adaptive"))
    plain = LLMEngine(EngineConfig(drafter="none", num_kv_blocks=256, multi_step=1))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = run(plain, [(p, params) for p in CHAT_PROMPTS[:3]])
    reqs = [engine.add_request(p, params) for p in CHAT_PROMPTS[:3]]
    reqs.append(engine.add_request(CHAT_PROMPTS[0], params, spec=SpecParams(enabled=False)))
    while engine.has_unfinished():
        engine.step()
    assert answers(reqs[:3]) == answers(want) and answers(reqs[3:]) == answers(want[:1])
