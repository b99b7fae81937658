"""Prefix caching in the engine: outputs equal to an uncached engine's (greedy and seeded; plain, Lyanna
under the adaptive policy, EAGLE and n-gram speculation; with chunked prefill and preemptions), hit
counting, same-prefix admission waiting for a prompt being computed, no hit for prompt log-probabilities,
steps writing only into blocks their request holds alone, and the drafters' context rebuilt for a cached
prefix. fp32 is the contract for equality (see test_seeded_speculation.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engines.engine import EngineConfig, LLMEngine
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_decode.policy import AdaptiveSettings
from tests.conftest import CHAT_PROMPTS

SYS = {
    "role": "system",
    "content": "You are a patient teacher. Answer every question in two or three plain sentences, and end "
    "with a short example.",
}
FRANCE = [SYS, {"role": "user", "content": "What is the capital of France?"}]
LEAVES = [SYS, {"role": "user", "content": "Why do leaves change colour in autumn?"}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
MAX_NEW = 16


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def seeded(seed: int, n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True)


# Wave 1, added at once: two prompts sharing the system prompt's blocks, and one prompt twice (as `n` = 2
# fans out) with two seeds. Wave 2, once wave 1 is done: each conversation's next turn (history + answer).
WAVE1 = [(FRANCE, greedy()), (LEAVES, seeded(11)), (HAIKU, seeded(1)), (HAIKU, seeded(2))]
ADAPTIVE = AdaptiveSettings(profile=False, probe_cost=1.0, probe_every=2, shape_probe_every=4, plain_every=8)
ENGINES = {
    "plain": {"drafter": "none"},
    "lyanna-adaptive": {"drafter": "lyanna", "spec_policy": "adaptive", "adaptive": ADAPTIVE},
    "eagle": {"drafter": "eagle", "spec_depth": 3, "spec_width": 2, "spec_budget": 6},
    "ngram": {"drafter": "ngram", "spec_depth": 4, "spec_width": 2, "spec_budget": 8},
}


def wave2(answers: list[str]) -> list[tuple[list[dict], SamplingParams]]:
    """The next turns, from wave 1's answers (FRANCE's and the first HAIKU's)."""
    more = {"role": "user", "content": "Tell me one more thing about it."}
    return [
        ([*FRANCE, {"role": "assistant", "content": answers[0]}, more], greedy()),
        ([*HAIKU, {"role": "assistant", "content": answers[2]}, more], seeded(5)),
    ]


def run(engine: LLMEngine, jobs) -> list[Request]:
    """Add the jobs together and step until they finish."""
    reqs = [engine.add_request(conv, params) for conv, params in jobs]
    while engine.has_unfinished():
        engine.step()
    return reqs


@pytest.fixture(scope="module")
def reference():
    """Every job's output from an engine without prefix caching, one job at a time."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, drafter="none", enable_prefix_caching=False))
    first = [engine.generate([c], p)[0] for c, p in WAVE1]
    second = [engine.generate([c], p)[0] for c, p in wave2([f.text for f in first])]
    return [f.token_ids for f in first], [f.token_ids for f in second], [f.text for f in first]


def watch_writes(engine: LLMEngine) -> list[int]:
    """From now on, check every forward's new tokens (chunks, decode tokens, draft tree nodes) go to cache
    indices >= the request's computed tokens, in blocks the request holds alone (never shared or cached).
    Returns a list that gets one entry per checked token."""
    checked: list[int] = []
    execute = engine.runner.execute
    kv, bs = engine.kv_cache, engine.kv_cache.block_size

    def checking_execute(plan, *args, **kwargs):
        for b, seq in enumerate(plan.seq_ids):
            req = engine.requests[seq]
            assert plan.num_cached[b] == req.num_computed_tokens
            n = plan.query_start[b + 1] - plan.query_start[b]
            for index in range(plan.num_cached[b], plan.num_cached[b] + n):
                block = plan.block_tables[b][index // bs]
                assert kv.allocator.ref_counts[block] == 1 and kv.allocator.block_hash[block] is None
                checked.append(index)
        return execute(plan, *args, **kwargs)

    engine.runner.execute = checking_execute
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINES))
def test_cached_generation_equals_uncached_with_chunks_and_preemption(name, reference):
    want1, want2, answers = reference
    # 9 blocks of 16 tokens for 4 prompts of 38-45 tokens growing by 16, read in chunks of at most 24:
    # the requests share blocks, and some are preempted (recomputing from their own cached blocks).
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=9, max_num_batched_tokens=24, **ENGINES[name]))
    written = watch_writes(engine)
    first = run(engine, WAVE1)
    assert [r.output_token_ids for r in first] == want1
    second = run(engine, wave2(answers))
    assert [r.output_token_ids for r in second] == want2
    stats = engine.stats()
    assert sum(r.num_preemptions for r in first + second) > 0
    assert stats.prefix_cache_hits >= 48  # at least the second HAIKU's 2 blocks and FRANCE's next turn's 3
    assert written and stats.kv_free_blocks == 9
    if name != "plain":
        assert stats.spec.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def plain():
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, drafter="none"))


def test_a_prompt_being_prefilled_is_waited_for_and_counted_as_a_hit(plain):
    plain.kv_cache.reset_prefix_cache()
    before = plain.stats()
    same = [plain.add_request(HAIKU, greedy(2)) for _ in range(3)]
    # another chat prompt shares only the template's default system prompt (one block) with HAIKU's
    other = plain.add_request(CHAT_PROMPTS[3], greedy(2))
    plain.step()
    # the first HAIKU computes the prompt; the other two wait for its blocks; the other prompt goes ahead
    # (waiting would save it one block of its 70 tokens)
    assert [r.num_computed_tokens for r in same] == [38, 0, 0] and other.num_computed_tokens > 0
    assert list(plain.scheduler.waiting) == same[1:]
    plain.step()  # its blocks are cached after the step that computed them: both take them
    assert [r.num_computed_tokens for r in same[1:]] == [38, 38]
    while plain.has_unfinished():
        plain.step()
    assert len({tuple(r.output_token_ids) for r in same}) == 1
    after = plain.stats()
    prompt = same[0].num_prompt_tokens  # 38: 2 full blocks may hit (never the last token)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 3 * prompt + other.num_prompt_tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * 32  # the other computed its block too
    assert 0 < after.prefix_cache_hit_rate < 1 and after.prefix_cache_blocks > 0


def test_prompt_logprobs_requests_take_no_hit(plain):
    plain.generate([HAIKU], greedy(2))
    before = plain.stats()
    req = plain.add_request(HAIKU, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    plain.step()
    assert req.num_computed_tokens == req.num_prompt_tokens  # computed from the first token
    while plain.has_unfinished():
        plain.step()
    after = plain.stats()
    assert after.prefix_cache_queries == before.prefix_cache_queries
    assert after.prefix_cache_hits == before.prefix_cache_hits
    again = plain.add_request(HAIKU, greedy(2))  # the same prompt without prompt log-probabilities hits
    plain.step()
    assert again.num_computed_tokens == again.num_prompt_tokens
    assert plain.stats().prefix_cache_hits == after.prefix_cache_hits + 32
    while plain.has_unfinished():
        plain.step()


def test_without_prefix_caching_nothing_is_shared(make_engine):
    engine = make_engine(enable_prefix_caching=False, num_kv_blocks=32)
    reqs = [engine.add_request(HAIKU, greedy(2)) for _ in range(2)]
    engine.step()  # both compute the whole prompt at once, into blocks of their own
    assert [r.num_computed_tokens for r in reqs] == [38, 38]
    tables = [engine.kv_cache.block_tables[r.request_id] for r in reqs]
    assert not set(tables[0]) & set(tables[1])
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_blocks) == (0, 0, 0)


def record_trees(engine: LLMEngine) -> dict[str, list]:
    """From now on, every proposed tree per request id (in proposal order)."""
    trees: dict[str, list] = {}
    drafter = engine.executor.drafter
    propose = drafter.propose

    def recording(requests, specs):
        out = propose(requests, specs)
        for req, tree in zip(requests, out, strict=True):
            trees.setdefault(req.request_id, []).append(tree)
        return out

    drafter.propose = recording
    return trees


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        {"dtype": "float32", "drafter": "lyanna"},
        {"dtype": "float32", "drafter": "eagle"},
        {"drafter": "lyanna"},  # the served default: bf16, the fused int8 drafter layer in the target's blocks
    ],
    ids=["lyanna-eager", "eagle-eager", "lyanna-fused"],
)
def test_the_drafter_rebuilds_its_context_over_a_cached_prefix(config):
    """One prompt twice (`n` = 2): the second request takes the first's blocks, and its drafter reads the
    prefix's hidden states from the store beside the cache. Its first draft must be the first request's
    first draft (same context, same root); without the rebuilt context it could not draft at all."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, spec_depth=3, spec_width=2, spec_budget=6, **config))
    drafter = engine.executor.drafter
    assert (drafter.fused_layer is not None) == ("dtype" not in config)
    assert engine.kv_cache.lookahead == (1 if drafter.fused_layer is not None else 0)
    trees = record_trees(engine)
    a, b = run(engine, [(LEAVES, greedy(8)), (LEAVES, greedy(8))])
    assert a.output_token_ids == b.output_token_ids
    assert drafter.num_rebuilt == 32  # b's two full blocks of the 45-token prompt
    first_a, first_b = trees[a.request_id][0], trees[b.request_id][0]
    assert first_b is not None and first_a.tokens == first_b.tokens and first_a.parents == first_b.parents
    assert torch.allclose(torch.tensor(first_a.scores), torch.tensor(first_b.scores), rtol=1e-3, atol=1e-5)


class _StoreWrites(TorchDispatchMode):
    """Counts the in-place index copies into one tensor (the drafter's hidden-state store)."""

    def __init__(self, store: torch.Tensor):
        super().__init__()
        self.store, self.count = store, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_copy_.default and args[0].data_ptr() == self.store.data_ptr():
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_step_writes_its_verified_requests_hidden_states_to_the_store_at_once():
    """Four speculating requests: each step's verified paths reach the store in one write (one host-to-
    device copy of their slots on a GPU), not one per request."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, drafter="lyanna", spec_policy="fixed"))
    reqs = [engine.add_request(conv, greedy(12)) for conv in (FRANCE, LEAVES, HAIKU, CHAT_PROMPTS[3])]
    while not all(r.output_token_ids for r in reqs):
        engine.step()
    engine.step()  # the first verification step: its paths are written with the next step's drafting
    writes = []
    for _ in range(3):
        with _StoreWrites(engine.executor.drafter.hidden_store) as counter:
            engine.step()
        writes.append(counter.count)
    assert writes == [1, 1, 1]


@pytest.mark.slow
def test_tensor_parallel_ranks_follow_shared_blocks(reference):
    """Two ranks (rank 1 a Ray actor): the block tables rank 0 broadcasts name shared blocks like any
    other, so cached generation on two ranks equals the uncached single rank's."""
    import ray

    want1, want2, answers = reference
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = None
    try:
        engine = LLMEngine(
            EngineConfig(dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, max_num_seqs=8, drafter="lyanna")
        )
        first = run(engine, WAVE1)
        second = run(engine, wave2(answers))
        assert [r.output_token_ids for r in first] == want1 and [r.output_token_ids for r in second] == want2
        assert engine.stats().prefix_cache_hits >= 48
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


def test_a_finished_request_leaves_its_prefix_anchors_for_routing(plain):
    req = plain.add_request(HAIKU, greedy(20))  # 38 + 20 tokens: 2 blocks in the prompt, 3 computed in all
    while plain.has_unfinished():
        plain.step()
    finished = plain.pop_finished_prefix(req.request_id)
    assert finished is not None and finished.output_text == req.output_text
    assert plain.pop_finished_prefix(req.request_id) is None  # handed over once
    kv = plain.kv_cache
    assert finished.prompt_anchor != finished.full_anchor
    assert kv.is_cached(finished.prompt_anchor) and kv.is_cached(finished.full_anchor)
    # the prompt anchor is the block a next turn reaches through the prompt: a longer prompt hits it last
    longer = plain.add_request(prompt_token_ids=[*req.prompt_token_ids, *req.output_token_ids, 42], params=greedy(2))
    plain.step()
    table = kv.block_tables[longer.request_id]
    assert kv.allocator.block_hash[table[1]] == finished.prompt_anchor
    assert kv.allocator.block_hash[table[2]] == finished.full_anchor
    while plain.has_unfinished():
        plain.step()


@pytest.mark.slow
def test_the_prefix_cache_benchmark_times_a_hit_and_the_drafters_rebuild():
    from engines.bench.prefix_cache import measure

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, drafter="lyanna"))
    (row,) = measure(engine, [96], repeats=1)
    assert row["prefix_tokens"] == 96 and 0 < row["hit_prefill_s"] and 0 < row["cold_prefill_s"]
    assert row["drafter_store_read_s"] > 0 and row["drafter_first_catch_up_s"] > 0 and row["drafter_store_write_s"] > 0
