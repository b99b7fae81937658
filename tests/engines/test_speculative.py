"""Speculative decoding in the engine gives the outputs of autoregressive decoding."""

from __future__ import annotations

import pytest
import torch

from engines.datasets import humaneval_prompts, sharegpt_prompts
from engines.draft_tree import DraftTree
from engines.drafters.ngram import NgramIndex, tree_from_continuations
from engines.engine import EngineConfig, LLMEngine
from engines.request import FinishReason
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import forward_one, new_cache

REPEAT = [
    {"role": "user", "content": "Repeat this list exactly three times: apple, banana, cherry, dates, elderberry."}
]
PROMPTS = [
    *CHAT_PROMPTS,
    REPEAT,
    *(r["messages"] for r in sharegpt_prompts(2, max_chars=400)),
    humaneval_prompts(1)[0]["messages"],
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def ngram_engine():
    return LLMEngine(
        EngineConfig(dtype="float32", num_kv_blocks=512, drafter="ngram", spec_depth=4, spec_width=2, spec_budget=8)
    )


@pytest.fixture(scope="module")
def reference(engine_fp32):
    """Greedy autoregressive outputs of PROMPTS."""
    return engine_fp32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))


def assert_same_or_near_tie(engine, conv, want: list[int], got: list[int]) -> None:
    """Equal, or the first difference sits where the target's top two logits are within 1e-3."""
    if want == got:
        return
    i = next(k for k in range(min(len(want), len(got))) if want[k] != got[k])
    prompt = engine.tokenizer.apply_chat_template(conv)
    logits, _ = forward_one(engine.model, new_cache(engine.model), "s", prompt + want[:i], 0)
    top2 = logits[-1].topk(2).values
    assert (top2[0] - top2[1]).item() < 1e-3, f"diverged at token {i} without a near-tie"


@pytest.mark.slow
def test_greedy_ngram_speculation_equals_autoregressive(ngram_engine, engine_fp32, reference):
    got = ngram_engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    for conv, want, out in zip(PROMPTS, reference, got, strict=True):
        assert_same_or_near_tie(engine_fp32, conv, want.token_ids, out.token_ids)
        assert out.finish_reason == want.finish_reason or out.token_ids != want.token_ids
    stats = ngram_engine.stats().spec
    assert stats.num_steps > 0 and stats.num_accepted_tokens > 0
    assert sum(o.num_forwards for o in got) < sum(len(o.token_ids) for o in got)  # fewer target forwards
    assert ngram_engine.stats().kv_free_blocks == 512 and not ngram_engine.has_unfinished()


@pytest.mark.slow
def test_mixed_batch_with_and_without_speculation_and_stops(ngram_engine, engine_fp32, reference):
    specs = [
        SpecParams(enabled=False),
        SpecParams(depth=2, width=1, budget=2),
        SpecParams(depth=5, width=3, budget=12),
        None,
        SpecParams(depth=3, width=2, budget=4),
    ]
    convs = PROMPTS[: len(specs)]
    # A stop string inside the repeated list and a small max_tokens make requests end mid-run.
    stop_text = engine_fp32.tokenizer.decode(reference[4].token_ids)[12:17]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=MAX_NEW),
        SamplingParams(temperature=0, max_tokens=MAX_NEW),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop_text]),
    ]
    reqs = [ngram_engine.add_request(c, p, spec=s) for c, p, s in zip(convs, params, specs, strict=True)]
    assert reqs[0].spec is None and reqs[3].spec == ngram_engine.config.spec
    texts = {r.request_id: "" for r in reqs}
    while ngram_engine.has_unfinished():
        for out in ngram_engine.step():
            texts[out.request_id] += out.new_text
    for conv, p, req in zip(convs, params, reqs, strict=True):
        ar = engine_fp32.generate([conv], p)[0]
        assert_same_or_near_tie(engine_fp32, conv, ar.token_ids, req.output_token_ids)
        if ar.token_ids == req.output_token_ids:
            assert texts[req.request_id] == ar.text and req.finish_reason == ar.finish_reason
    assert reqs[0].num_spec_steps == 0 and reqs[2].num_spec_steps > 0
    assert len(reqs[1].output_token_ids) == 7 and reqs[1].finish_reason is FinishReason.LENGTH
    assert reqs[4].finish_reason is FinishReason.STOP and stop_text not in texts[reqs[4].request_id]
    assert ngram_engine.stats().kv_free_blocks == 512


def test_seeded_sampled_speculation_is_reproducible(ngram_engine):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=32, ignore_eos=True)
    a = ngram_engine.generate([REPEAT], params)[0]
    b = ngram_engine.generate([REPEAT, CHAT_PROMPTS[0]], [params, SamplingParams(temperature=1.0, max_tokens=32)])[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32


def test_ngram_index_and_tree():
    idx = NgramIndex(max_n=3)
    idx.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    conts = idx.continuations([1, 2], depth=3, max_matches=8)
    assert conts == [[3, 5, 1], [3, 4, 1]]  # most recent first
    tree = tree_from_continuations(2, conts, width=2, budget=8)
    assert tree.tokens[:2] == [2, 3] and tree.parents[:2] == [-1, 0]
    assert sorted(tree.tokens[2:4]) == [4, 5]  # the branch point after the shared "3"
    assert tree.scores[1] == 1.0 and tree.scores[2] == 0.5


def test_draft_tree_mask_positions_and_prune():
    tree = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3], scores=[1.0, 0.6, 0.3, 0.5, 0.1])
    assert tree.depths == [0, 1, 1, 2, 3] and tree.positions(10) == [10, 11, 11, 12, 13]
    mask = tree.attention_mask()
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]
    pruned = tree.prune(3)
    assert pruned.tokens == [9, 1, 3] and pruned.parents == [-1, 0, 1]
    assert tree.truncate_depth(1).tokens == [9, 1, 2]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])
    assert torch.equal(DraftTree.chain(5, [6, 7]).attention_mask(), torch.ones(3, 3, dtype=torch.bool).tril())


def test_spec_stats_count_conditional_acceptance_by_depth():
    from engines.spec_decode.stats import SpecStats
    from engines.verification import VerifyResult

    chain = DraftTree.chain(1, [2, 3, 4])
    branchy = DraftTree([1, 2, 3, 4], [-1, 0, 0, 1])  # node 2 is a leaf at depth 1
    stats = SpecStats()
    stats.record(chain, VerifyResult([0, 1], 9))  # accepted depth 1, rejected at depth 2
    stats.record(chain, VerifyResult([0, 1, 2, 3], 9))  # all 3 accepted
    stats.record(branchy, VerifyResult([0, 2], 9))  # accepted a leaf: depth 2 was never tried
    assert stats.reached_depth == [3, 2, 1] and stats.accepted_depth == [3, 1, 1]
    assert stats.acceptance_by_depth == [1.0, 0.5, 1.0]
    assert stats.mean_accepted_tokens == (1 + 3 + 1 + 3) / 3
    total = SpecStats()
    total.add(stats)
    total.add(stats)
    assert total.reached_depth == [6, 4, 2] and total.num_steps == 6


def test_merge_trees_unions_paths_and_keeps_higher_scores():
    from engines.draft_tree import merge_trees

    a = DraftTree([9, 1, 2, 3], [-1, 0, 0, 1], scores=[1.0, 0.5, 0.3, 0.2])
    b = DraftTree([9, 1, 4, 5], [-1, 0, 1, 0], scores=[1.0, 0.6, 0.25, 0.1])
    m = merge_trees(a, b)
    assert m.tokens == [9, 1, 2, 3, 4, 5] and m.parents == [-1, 0, 0, 1, 1, 0]
    assert m.scores == [1.0, 0.6, 0.3, 0.2, 0.25, 0.1]
    with pytest.raises(ValueError):
        merge_trees(a, DraftTree([8], [-1]))
