"""Continuous batching on the real model: admission under a tiny KV budget, preemption, chunked
prefill, abort, stop strings, seeded sampling and rejected inputs."""

from __future__ import annotations

import pytest
import torch

from engines.errors import ContextLengthError, InvalidRequestError
from engines.kv_cache import PagedKVCache
from engines.request import FinishReason, Request
from engines.sampling import SamplingParams
from engines.scheduler import Scheduler
from engines.spec_params import SpecParams
from tests.conftest import CHAT_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(engine_fp32):
    """Each prompt's greedy output with a roomy cache, one at a time."""
    return [engine_fp32.generate([c], GREEDY)[0].token_ids for c in CHAT_PROMPTS]


def record_schedules(engine) -> list[list[tuple[str, int]]]:
    """From now on, every step's (request id, tokens) pairs, appended as the engine schedules them."""
    seen = []
    schedule = engine.scheduler.schedule

    def recording_schedule(*args):
        out = schedule(*args)
        seen.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    return seen


def run_collecting(engine, convs, params):
    """Drive `step()` by hand, recording the batch size of every forward."""
    reqs = [engine.add_request(c, params) for c in convs]
    outs = {r.request_id: [] for r in reqs}
    batch_sizes, preempted = [], 0
    while engine.has_unfinished():
        sched_before = engine.scheduler.running.copy()
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        batch_sizes.append(len(sched_before))
        preempted = max(preempted, sum(r.num_preemptions for r in reqs))
    return [outs[r.request_id] for r in reqs], batch_sizes, preempted


@pytest.mark.slow
def test_tiny_kv_budget_waits_and_preempts_but_outputs_are_unchanged(make_engine, reference):
    # 9 blocks x 16 tokens: two requests fit at the start, then decoding forces preemptions.
    engine = make_engine(num_kv_blocks=9, block_size=16)
    assert engine.max_model_len == 144
    outs, batch_sizes, preempted = run_collecting(engine, CHAT_PROMPTS, GREEDY)
    assert outs == reference
    assert max(batch_sizes) < len(CHAT_PROMPTS)  # never all at once: the rest waited
    assert preempted > 0
    assert engine.kv_cache.allocator.num_free == 9  # everything returned


@pytest.mark.slow
def test_chunked_prefill_under_small_token_budget(make_engine, reference):
    engine = make_engine(max_num_batched_tokens=7)  # prompts (25-70 tokens) prefill in chunks of <= 7
    outs, _, _ = run_collecting(engine, CHAT_PROMPTS, GREEDY)
    assert outs == reference


def test_request_that_can_never_fit_is_rejected(make_engine):
    engine = make_engine(num_kv_blocks=2, block_size=16)  # 32 tokens of KV in all
    with pytest.raises(ContextLengthError):
        engine.add_request(CHAT_PROMPTS[3], GREEDY)
    assert not engine.has_unfinished()


def test_abort_frees_blocks_and_reports_abort(engine_fp32):
    free_before = engine_fp32.kv_cache.allocator.num_free
    a = engine_fp32.add_request(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = engine_fp32.add_request(CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine_fp32.step()
    busy = engine_fp32.stats()
    assert busy.num_running == 2 and busy.num_waiting == 0 and busy.kv_cache_usage > 0
    assert busy.kv_free_blocks < free_before
    out = engine_fp32.abort(a.request_id)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert engine_fp32.abort(a.request_id) is None  # idempotent
    while engine_fp32.has_unfinished():
        engine_fp32.step()
    assert b.finish_reason is not None
    assert engine_fp32.stats().kv_free_blocks == free_before and engine_fp32.stats().num_running == 0


def test_abort_of_waiting_request(make_engine):
    engine = make_engine()
    req = engine.add_request(CHAT_PROMPTS[0], GREEDY)
    assert engine.abort(req.request_id).finish_reason is FinishReason.ABORT
    assert not engine.has_unfinished()


def test_stop_string_split_across_tokens(engine_fp32):
    tok = engine_fp32.tokenizer
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = engine_fp32.generate([CHAT_PROMPTS[3]], params)[0]
    # Pick a stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    k = next(i for i in range(3, len(pieces) - 2) if len(pieces[i + 1]) - len(pieces[i]) >= 2)
    start = len(pieces[k]) - 1
    stop = full.text[start : len(pieces[k + 1]) + 1]
    assert len(stop) >= 3 and full.text.find(stop) == start

    req = engine_fp32.add_request(
        CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
    )
    deltas = []
    while engine_fp32.has_unfinished():
        for o in engine_fp32.step():
            deltas.append(o)
    text = "".join(d.new_text for d in deltas)
    assert text == full.text[:start]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert req.output_token_ids == full.token_ids[: k + 2]  # stopped at the token completing the string
    # While streaming, a prefix of the stop string is held back rather than emitted and retracted.
    assert all(stop[:2] not in d.new_text for d in deltas)


def test_eos_and_max_tokens_finish_reasons(engine_fp32):
    short = engine_fp32.generate([CHAT_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=200))[0]
    assert short.finish_reason is FinishReason.STOP
    assert short.token_ids[-1] in engine_fp32.tokenizer.stop_token_ids
    assert "<|im_end|>" not in short.text
    cut = engine_fp32.generate([CHAT_PROMPTS[3]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert cut.finish_reason is FinishReason.LENGTH and len(cut.token_ids) == 5


def test_stop_token_ids_from_request(engine_fp32):
    full = engine_fp32.generate([CHAT_PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = full.token_ids[6]
    first = full.token_ids.index(stop_at)
    got = engine_fp32.generate(
        [CHAT_PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    )[0]
    assert got.token_ids == full.token_ids[: first + 1] and got.finish_reason is FinishReason.STOP


def test_seeded_sampling_is_reproducible_and_batch_independent(engine_fp32):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    a = engine_fp32.generate([CHAT_PROMPTS[1]], params)[0].token_ids
    # Same seed inside a batch with other (unseeded) requests: same tokens.
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    b = engine_fp32.generate([CHAT_PROMPTS[0], CHAT_PROMPTS[1], CHAT_PROMPTS[2]], [others, params, others])[1].token_ids
    c = engine_fp32.generate(
        [CHAT_PROMPTS[1]], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True)
    )[0].token_ids
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("messages", "params", "param"),
    [
        ([], SamplingParams(), "messages"),
        ("hello", SamplingParams(), "messages"),
        ([{"role": "wizard", "content": "x"}], SamplingParams(), "messages[0].role"),
        ([{"role": "user", "content": 5}], SamplingParams(), "messages[0].content"),
        ([{"role": "user"}], SamplingParams(), "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], SamplingParams(), "messages[0].content"),
        (CHAT_PROMPTS[0], SamplingParams(max_tokens=0), "max_tokens"),
        (CHAT_PROMPTS[0], SamplingParams(temperature=-1), "temperature"),
        (CHAT_PROMPTS[0], SamplingParams(temperature=float("nan")), "temperature"),
        (CHAT_PROMPTS[0], SamplingParams(top_p=0), "top_p"),
        (CHAT_PROMPTS[0], SamplingParams(top_p=1.5), "top_p"),
        (CHAT_PROMPTS[0], SamplingParams(top_k=-2), "top_k"),
        (CHAT_PROMPTS[0], SamplingParams(min_p=2), "min_p"),
        (CHAT_PROMPTS[0], SamplingParams(stop=[3]), "stop"),
        (CHAT_PROMPTS[0], SamplingParams(stop=[""]), "stop"),
        (CHAT_PROMPTS[0], SamplingParams(stop_token_ids=["<eos>"]), "stop_token_ids"),
        (CHAT_PROMPTS[0], SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        (CHAT_PROMPTS[0], SamplingParams(seed="x"), "seed"),
    ],
)
def test_bad_inputs_raise_and_leave_engine_untouched(engine_fp32, messages, params, param):
    free = engine_fp32.kv_cache.allocator.num_free
    with pytest.raises(InvalidRequestError) as e:
        engine_fp32.add_request(messages, params)
    assert e.value.param == param
    assert not engine_fp32.has_unfinished() and engine_fp32.kv_cache.allocator.num_free == free
    # And the engine still serves.
    assert engine_fp32.generate([CHAT_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_prompt_longer_than_context(make_engine):
    engine = make_engine(max_model_len=64)
    long_conv = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(ContextLengthError) as e:
        engine.add_request(long_conv, GREEDY)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthError) as e:  # prompt fits, prompt + max_tokens does not
        engine.add_request(CHAT_PROMPTS[0], SamplingParams(max_tokens=60))
    assert e.value.param == "max_tokens"


def test_duplicate_request_id(engine_fp32):
    engine_fp32.add_request(CHAT_PROMPTS[0], GREEDY, request_id="dup")
    with pytest.raises(InvalidRequestError):
        engine_fp32.add_request(CHAT_PROMPTS[0], GREEDY, request_id="dup")
    engine_fp32.abort("dup")


def test_prefill_and_decode_share_a_step_under_the_token_budget(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    seen = record_schedules(engine)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a = engine.add_request(CHAT_PROMPTS[0], params, request_id="a")
    while a.num_computed_tokens < a.num_prompt_tokens:
        engine.step()
    engine.add_request(CHAT_PROMPTS[3], params, request_id="b")
    engine.step()
    assert seen[-1] == [("a", 1), ("b", 15)]  # a decodes; b prefills a chunk with the rest of the budget
    assert all(sum(n for _, n in step) <= 16 for step in seen)
    while engine.has_unfinished():
        engine.step()


def test_prompts_wait_behind_at_most_one_chunk_while_others_decode(make_engine, reference):
    engine = make_engine(max_num_batched_tokens=64, prefill_chunk_tokens=8)
    seen = record_schedules(engine)
    a = engine.add_request(CHAT_PROMPTS[0], GREEDY, request_id="a")
    engine.step()
    assert seen[-1] == [("a", 64)] or seen[-1] == [("a", a.num_prompt_tokens)]  # nothing decodes: full budget
    while a.num_computed_tokens < a.num_prompt_tokens:
        engine.step()
    b = engine.add_request(CHAT_PROMPTS[3], GREEDY, request_id="b")
    c = engine.add_request(CHAT_PROMPTS[2], GREEDY, request_id="c")
    done = {"a": [], "b": [], "c": []}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id].extend(o.new_token_ids)
    decode_steps = [step for step in seen[1:] if ("a", 1) in step]
    # Steps where a decodes carry at most one chunk of prompt (b's and c's decodes are single tokens).
    assert decode_steps and all(sum(n for _, n in step if n > 1) <= 8 for step in decode_steps)
    assert b.num_prompt_tokens > 8 and c.num_prompt_tokens > 8  # so both really were chunked
    assert [done["b"], done["c"]] == [reference[3], reference[2]]


def test_draft_budgets_are_granted_before_drafting_within_tokens_and_blocks():
    kv = PagedKVCache(1, 1, 2, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10)

    def decoding(rid: str, computed: int, spec: SpecParams | None, max_tokens: int = 8) -> Request:
        req = Request(rid, list(range(computed + 1)), GREEDY, max_tokens, frozenset(), torch.Generator(), None)
        req.num_computed_tokens = computed
        req.spec = spec
        kv.allocate(rid, computed)
        sched.running.append(req)
        return req

    decoding("x", 3, SpecParams(depth=6, width=1, budget=6))  # 1 block held
    decoding("y", 6, SpecParams(depth=6, width=1, budget=6))  # 2 blocks held; 1 block left free
    decoding("z", 2, None)  # 1 block held; it does not speculate: its one token
    out = sched.schedule()
    grants = {s.request.request_id: (s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled}
    # x wants 1 + 6 tokens after its 3: the free block gives it room for 5 (3 + 5 = 8 = two blocks).
    assert grants["x"] == (1, 4)
    # y has 10 - 5 = 5 tokens of budget left but no free block: room for 2 in its second block.
    assert grants["y"] == (1, 1)
    assert grants["z"] == (1, 0)
    assert kv.allocator.num_free == 0
    assert out.num_tokens == 5 + 2 + 1


def test_a_draft_is_limited_by_the_tokens_left_to_generate():
    req = Request("r", [1, 2, 3], GREEDY, 4, frozenset(), torch.Generator(), None)
    req.spec = SpecParams(depth=3, width=2, budget=6)
    assert req.draft_limit() == req.spec
    req.output_token_ids = [5, 6]  # two of four generated: the bonus token must fit too
    assert req.draft_limit() == SpecParams(depth=1, width=2, budget=6)
    req.output_token_ids = [5, 6, 7]
    assert req.draft_limit() is None
    req.spec = None
    req.output_token_ids = []
    assert req.draft_limit() is None


def test_lookahead_steps_are_granted_to_greedy_decodes_that_do_not_speculate():
    """With `multi_step`, in a step of such decodes, a decoding request without speculation is granted the
    tokens and blocks of up to `multi_step` - 1 more, within its `max_tokens`, the budget and the free blocks;
    with a sampled request in the step (it takes one step a call, so the step does), none is."""

    def setup(sampled: bool) -> tuple[PagedKVCache, Scheduler]:
        kv = PagedKVCache(1, 1, 2, num_blocks=9, block_size=4, dtype=torch.float32, device="cpu")
        sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12, multi_step=4)

        def decoding(rid: str, computed: int, params: SamplingParams, max_tokens: int, generated: int = 0) -> None:
            prompt = list(range(computed + 1 - generated))
            req = Request(rid, prompt, params, max_tokens, frozenset(), torch.Generator(), None)
            req.num_computed_tokens = computed
            req.output_token_ids = list(range(generated))
            kv.allocate(rid, computed)
            sched.running.append(req)

        decoding("a", 3, GREEDY, 24, generated=1)  # 1 block held: up to 3 more steps, its blocks for 3 + 4 tokens
        decoding("b", 9, GREEDY, 8, generated=6)  # 3 held; 2 tokens left to generate: 1 more step
        decoding("d", 8, GREEDY, 24, generated=1)  # 2 held; a block more for 3 more steps
        if sampled:
            decoding("c", 2, SamplingParams(temperature=0.8, seed=1, max_tokens=24), 24, generated=1)
        return kv, sched

    kv, sched = setup(sampled=False)
    out = sched.schedule()
    grants = {s.request.request_id: (s.num_new_tokens, s.num_lookahead_tokens) for s in out.scheduled}
    assert grants == {"a": (1, 3), "b": (1, 1), "d": (1, 3)}
    assert all(s.num_draft_tokens == 0 for s in out.scheduled) and out.num_tokens == 4 + 2 + 4
    assert kv.allocator.num_free == 9 - 2 - 3 - 3
    kv, sched = setup(sampled=True)
    out = sched.schedule()
    assert [s.num_lookahead_tokens for s in out.scheduled] == [0, 0, 0, 0] and out.num_tokens == 4
