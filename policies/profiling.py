"""Start-up profile: seed the speculation policy's cost models with a few real steps.

Target: prefill steps of 1, 2, 4, ... tokens (one request each, no speculation), each size once to
warm up and then `REPEATS` times, the fastest kept. Trees and drafter: short speculative decodes of
1, 2, 4 and 8 requests (`TREE_BATCHES`, as many as the engine runs at once) at the configured shape,
with a small and the full verification budget, so the verification overhead of each of these batch
buckets is fitted per tree and per draft token from the start (a decode before them warms up and is
forgotten). A bucket fitted from its first few online tree steps instead is priced by steps that are
noisy and slow (a new token count's first forward costs a few ms more on a CPU), and a high first
price stops drafting there until rare probes correct it: two greedy runs at batch 4 drafted in 332
of 544 and in 3 of 336 steps, as their first tree steps fell. Plain decodes of the same batches run
just before the trees, so the overhead is measured against typical decode steps of the same batch
(measured against the fastest prefill of one token, a tree step's ordinary noise and its context
counted as verification cost: two start-ups priced a batch-1 tree at 0 and at 14 ms, where online
steps say 1-2 ms). The profile's tree steps then weigh `TREE_WEIGHT` steps, so the first real tree
steps soon rule. The acceptance statistics of these synthetic prompts are dropped.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING

from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from policies.acceptance import AcceptanceModel
from policies.cost_model import DraftCostModel
from policies.speculation import ShapeTable

if TYPE_CHECKING:
    from engines.engine import LLMEngine
    from policies.speculation import AdaptivePolicy

MAX_PROFILE_TOKENS = 256
REPEATS = 3  # timed runs per size; one slow run on a noisy machine must not set a bucket
TREE_STEPS = 6  # tokens per speculative decode (the synthetic prompts accept almost nothing: ~one per step)
TREE_BATCHES = (1, 2, 4, 8)  # batch sizes whose tree overhead is profiled (up to the engine's max_num_seqs)
TREE_WEIGHT = 2.0  # steps the profile's tree fit of a batch bucket weighs once online tree steps come in


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, spec: SpecParams) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts:
        engine.add_request(prompt_token_ids=ids, params=params, spec=spec)
    while engine.has_unfinished():
        engine.step()


def profile_engine(engine: LLMEngine, policy: AdaptivePolicy) -> None:
    """Measure the target's step time by token count and the drafter's round time (a second or two)."""
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    limit = min(MAX_PROFILE_TOKENS, engine.config.max_num_batched_tokens, engine.max_model_len - 2)
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    no_spec = SpecParams(enabled=False)
    fastest: dict[int, float] = {}
    for n in sizes:  # one prefill step each; the first run warms up, the fastest of the rest counts
        for rep in range(1 + REPEATS):
            start = time.perf_counter()
            _run(engine, [[rng.randrange(vocab) for _ in range(n)]], 1, no_spec)
            if rep:
                fastest[n] = min(fastest.get(n, float("inf")), time.perf_counter() - start)
    batches = [b for b in TREE_BATCHES if b <= engine.config.max_num_seqs]
    prompts = [[rng.randrange(vocab) for _ in range(min(64, limit))] for _ in range(batches[-1])]
    full = dataclasses.replace(engine.config.spec, fixed=True)  # the drafter at its full shape
    _run(engine, prompts[:1], 4, full)  # warms the tree steps up
    policy.target_cost.reset()  # the steps above also reported themselves, warm-ups included
    policy.draft_cost = DraftCostModel()
    for n, seconds in fastest.items():
        policy.target_cost.observe(n, seconds, context=n)  # one sequence: its own n keys
    for batch in batches:  # plain decode steps of the batches whose tree overhead is measured next
        _run(engine, prompts[:batch], TREE_STEPS, no_spec)
    for budget in sorted({max(1, full.budget // 4), full.budget}):
        for batch in batches:
            _run(engine, prompts[:batch], TREE_STEPS, dataclasses.replace(full, budget=budget))
    for fit in policy.target_cost.trees.values():
        fit.reweigh(TREE_WEIGHT)
    policy.acceptance = AcceptanceModel()  # random prompts say nothing about real acceptance
    policy.shapes = ShapeTable()
    policy.requests.clear()
