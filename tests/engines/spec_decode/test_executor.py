"""The step executor on the embedded model: one result per scheduled request, the engine alone moves
requests on, drafts stay within the scheduler's grants, plain decoding is the executor without a drafter."""

from __future__ import annotations

import pytest

from engines.draft_tree import DraftTree
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from tests.conftest import CHAT_PROMPTS

REPEAT = [{"role": "user", "content": "Repeat exactly, three times: one two three four five six seven eight."}]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ngram_engine():
    return LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=256, drafter="ngram", spec_depth=4, spec_width=2, spec_budget=5)
    )


def test_execute_reports_each_request_and_leaves_progress_to_update(ngram_engine):
    engine = ngram_engine
    spec = engine.add_request(REPEAT, GREEDY)
    plain = engine.add_request(CHAT_PROMPTS[0], GREEDY, spec=SpecParams(enabled=False))
    drafted = 0
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        before = {s.request.request_id: (s.request.num_computed_tokens, s.request.num_tokens) for s in sched.scheduled}
        grants = {s.request.request_id: s.num_draft_tokens for s in sched.scheduled}
        results = engine.executor.execute(sched)
        assert [r.request for r in results] == [s.request for s in sched.scheduled]
        for r in results:
            rid = r.request.request_id
            assert (r.request.num_computed_tokens, r.request.num_tokens) == before[rid]  # untouched until update
            assert r.num_draft_tokens <= grants[rid]
            assert grants[plain.request_id] == 0  # a request that does not speculate is granted nothing
            if r.num_draft_tokens:
                drafted += 1
                assert len(r.token_ids) == r.num_accepted_tokens + 1 == r.num_computed_tokens
        engine.update(results)
        for r in results:
            computed, _ = before[r.request.request_id]
            assert r.request.num_computed_tokens == computed + r.num_computed_tokens
    assert drafted > 0 and spec.num_spec_steps == drafted
    assert len(spec.output_token_ids) == len(plain.output_token_ids) == GREEDY.max_tokens


def test_a_draft_larger_than_its_grant_is_refused(ngram_engine, monkeypatch):
    engine = ngram_engine
    policy = engine.executor.policy

    def oversized(requests, specs, trees, other_tokens):
        roots = [r.token_ids(r.num_tokens - 1, r.num_tokens)[0] for r in requests]
        return [DraftTree.chain(root, list(range(1, s.budget + 3))) for root, s in zip(roots, specs, strict=True)]

    monkeypatch.setattr(policy, "allocate", oversized)
    req = engine.add_request(REPEAT, GREEDY)
    with pytest.raises(RuntimeError, match="exceeds"):
        while engine.has_unfinished():
            engine.step()
    engine.abort(req.request_id)
    assert not engine.has_unfinished() and engine.kv_cache.usage() == 0.0


def test_plain_decoding_is_the_executor_without_a_drafter(engine_fp32):
    assert engine_fp32.executor.drafter is None
    req = engine_fp32.add_request(CHAT_PROMPTS[1], GREEDY, spec=SpecParams(depth=3, width=2, budget=6))
    assert req.spec is None and req.draft_limit() is None  # nothing to speculate with: no grants
    while engine_fp32.has_unfinished():
        sched = engine_fp32.scheduler.schedule()
        assert all(s.num_draft_tokens == 0 for s in sched.scheduled)
        engine_fp32.update(engine_fp32.executor.execute(sched))
    assert len(req.output_token_ids) == GREEDY.max_tokens and req.num_spec_steps == 0
