"""Start-up profile: seed the speculation policy's cost models with a few real steps.

Target: prefill steps of 1, 2, 4, ... tokens (one request each, no speculation), each size once to
warm up and then `REPEATS` times, the fastest kept. Drafter: a short speculative decode of two
requests at the configured tree. The acceptance statistics of these synthetic prompts are dropped.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING

from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from policies.acceptance import AcceptanceModel
from policies.speculation import ShapeTable

if TYPE_CHECKING:
    from engines.engine import LLMEngine
    from policies.speculation import AdaptivePolicy

MAX_PROFILE_TOKENS = 256
REPEATS = 3  # timed runs per size; one slow run on a noisy machine must not set a bucket


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
    policy.target_cost.reset()  # the steps above also reported themselves, warm-ups included
    for n, seconds in fastest.items():
        policy.target_cost.observe(n, seconds)
    prompts = [[rng.randrange(vocab) for _ in range(min(64, limit))] for _ in range(2)]
    _run(engine, prompts, 12, dataclasses.replace(engine.config.spec, fixed=True))  # the drafter at its full shape
    policy.acceptance = AcceptanceModel()  # random prompts say nothing about real acceptance
    policy.shapes = ShapeTable()
    policy.requests.clear()
