"""The same request, the same answer, in the served dtype: on the embedded model as served (bf16, its 4-bit weights,
every step through the fused CPU decoder), a greedy or seeded request's tokens are those it gets alone on a plain
engine, whatever else runs beside it (a batch that changes under it), however its prompt is chunked, whether its
prompt comes from the prefix cache, whichever drafter speculates under a fixed tree or the adaptive policy, when
it is resumed from a cut, and on a second engine. (The fp32 tests of speculation and resumption stay beside this.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from lyanna_kernels import integer_dot
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import deltas

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")

MAX_NEW = 32
REQUESTS = [
    (messages, SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_NEW, ignore_eos=True))
    for messages in CHAT_PROMPTS[:3]
    for temperature, seed in ((0.0, None), (0.8, 7))
]
SERVED = {"num_kv_blocks": 256, "dtype": "bfloat16"}  # the served dtype and weights (serve_config.yaml's engine:)


def run_staggered(engine: LLMEngine, requests=REQUESTS) -> list[list[int]]:
    """The requests added two at a time, a few steps apart, so each one's batch changes as it runs."""
    reqs = []
    for i, (messages, params) in enumerate(requests):
        reqs.append(engine.add_request(messages, params))
        if i % 2:
            for _ in range(3):
                engine.step()
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each request alone on a plain engine without prefix caching."""
    engine = LLMEngine(EngineConfig(drafter="none", enable_prefix_caching=False, **SERVED))
    assert engine.model.fused_decoder(engine.kv_cache, 1) is not None  # the served path
    return [engine.generate([messages], params)[0].token_ids for messages, params in REQUESTS]


def test_a_request_answers_the_same_in_a_changing_batch_and_on_a_second_engine(alone):
    for _ in range(2):  # two engines of the same settings
        engine = LLMEngine(EngineConfig(drafter="none", **SERVED))
        assert run_staggered(engine) == alone


def test_a_request_answers_the_same_chunked_and_from_the_prefix_cache(alone):
    """Prompts read 7 tokens a step beside the others' decodes; then the same requests again, their prompts'
    blocks now cached (and the first answers' blocks too: a second turn would read them)."""
    engine = LLMEngine(EngineConfig(drafter="none", prefill_chunk_tokens=7, **SERVED))
    assert run_staggered(engine) == alone
    before = engine.stats().prefix_cache_hits
    assert run_staggered(engine) == alone
    assert engine.stats().prefix_cache_hits - before >= 3 * 16  # every prompt's full blocks at least


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter,policy", [("lyanna", "fixed"), ("lyanna", "adaptive"), ("eagle", "fixed"), ("eagle", "adaptive"),
                       ("ngram", "fixed"), ("suffix", "fixed"), ("lyanna+suffix", "fixed"),
                       ("lyanna+suffix", "adaptive")]
)  # fmt: skip
def test_a_speculated_request_answers_as_alone_unspeculated(alone, drafter, policy):
    """Each drafter, with a fixed 3:2:6 tree and under the adaptive policy (caps 4:4:16, as served); the drafters
    that remember recent outputs run the requests twice (the second time, unseeded ones draft from the first's)."""
    tree = (3, 2, 6) if policy == "fixed" else (4, 4, 16)
    config = EngineConfig(drafter=drafter, spec_policy=policy, spec_depth=tree[0], spec_width=tree[1],
                          spec_budget=tree[2], **SERVED)  # fmt: skip
    engine = LLMEngine(config)
    for _ in range(2 if "suffix" in drafter else 1):
        assert run_staggered(engine) == alone
    if policy == "fixed":
        assert engine.stats().spec.num_draft_tokens > 0
    if drafter == "lyanna+suffix" and policy == "fixed":  # both drafters' trees were verified
        assert 0 < engine.executor.drafter.num_text_trees < engine.stats().spec.num_steps


def test_greedy_trees_are_verified_by_each_rows_argmax_in_the_target_call(alone):
    """Steps of greedy requests only (Lyanna trees beside plain decodes) run the target with every row's argmax
    in its call (`ModelRunner.execute_argmax`), no logits: the answers are those each request got alone; a seeded
    request beside them sends the step back to the logits (`execute`)."""
    engine = LLMEngine(EngineConfig(drafter="lyanna", spec_depth=3, spec_width=2, spec_budget=6, **SERVED))
    runner, calls = engine.executor.runner, {"argmax": 0, "logits": 0}
    argmax_call, logits_call = runner.execute_argmax, runner.execute

    def counted(kind, call):
        def run(*args, **kwargs):
            out = call(*args, **kwargs)
            calls[kind] += out is not None
            return out

        return run

    runner.execute_argmax, runner.execute = counted("argmax", argmax_call), counted("logits", logits_call)
    greedy = [i for i, (_, params) in enumerate(REQUESTS) if params.greedy]
    assert run_staggered(engine, [REQUESTS[i] for i in greedy]) == [alone[i] for i in greedy]
    assert engine.stats().spec.num_draft_tokens > 0 and calls["argmax"] > 10
    before = dict(calls)
    assert run_staggered(engine, REQUESTS[:2]) == alone[:2]  # a seeded request beside a greedy one
    assert calls["logits"] - before["logits"] > 10


def test_a_resumed_request_continues_as_alone(alone):
    """A request resumed from cuts of its answer (its generated tokens re-read as prompt, as on another replica)
    on a speculating engine gives the rest of the answer it got alone."""
    engine = LLMEngine(EngineConfig(drafter="lyanna", spec_policy="adaptive", spec_depth=4, spec_width=4,
                                    spec_budget=16, **SERVED))  # fmt: skip
    for (messages, params), want in zip(REQUESTS[:2], alone[:2], strict=True):
        for cut in (1, 13, MAX_NEW - 1):
            request = GenerationRequest(request_id=f"cut-{cut}", messages=messages, params=params,
                                        resume_token_ids=want[:cut])  # fmt: skip
            rest = [t for d in deltas(engine, request) for t in d.new_token_ids]
            assert want[:cut] + rest == want, cut


def test_answers_equal_on_every_cpu_kernel(alone):
    """The AVX2 kernels (what a replica on a CPU without AVX512 runs; `LYANNA_VNNI=0` here) give the same
    answers as VNNI's, so a request resumed on a replica of another CPU kind continues as it was."""
    if not integer_dot.vnni_supported():
        pytest.skip("this CPU runs the AVX2 kernels already")
    script = (
        "import json, sys\n"
        "from engines.engine import EngineConfig, LLMEngine\n"
        "from tests.engines.test_reproducible import REQUESTS, SERVED\n"
        "e = LLMEngine(EngineConfig(drafter='none', **SERVED))\n"
        "print(json.dumps([e.generate([m], p)[0].token_ids for m, p in REQUESTS]))\n"
    )
    env = {**os.environ, "LYANNA_VNNI": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, cwd=".")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == alone
