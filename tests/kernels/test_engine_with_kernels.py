"""The engine end to end with every Triton kernel forced on (Triton's interpreter on CPU): a tiny random
target with a Lyanna drafter (a collapsed token-info table, a hot draft vocabulary) and an n-gram one. Greedy
and seeded sampled outputs equal plain decoding; the KV blocks all come back."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engines.cuda_graphs import StepGraphs, graph_buckets
from engines.drafters.checkpoint import save_draft_model, save_hot_tokens
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels import dispatch
from tests.engines.helpers import tiny_llama_checkpoint

pytest.importorskip("triton")
VOCAB = 512
PROMPTS = [[5, 17, 33, 2 + i, 99, 7 * i + 1] * (i + 1) for i in range(3)] + [list(range(40, 77))]
MAX_NEW = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 2-layer random Llama (GQA: 4 query heads over 2 KV heads) with the embedded model's tokenizer."""
    return str(tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-target"), vocab_size=VOCAB, max_positions=1024))


def engine(target: str, kernels: str, drafter: str = "none", draft: str | None = None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=target,
            dtype="float32",
            device=DEVICE,
            num_kv_blocks=64,
            block_size=4,  # trees and prompts cross block boundaries
            drafter=drafter,
            draft_model=draft,
            spec_depth=3,
            spec_width=2,
            spec_budget=6,
            kernels=kernels,
            lyanna_token_info_rows=1024,  # Lyanna's token info as a table: what the expansion kernel takes
        )
    )


@pytest.fixture(scope="module")
def drafters(tiny_target, tmp_path_factory):
    """A random Lyanna drafter: a hot vocabulary of 384 tokens, a token-info table over 256 hot tokens."""
    plain = engine(tiny_target, "torch")
    t = plain.model
    torch.manual_seed(1)
    hot = torch.randperm(VOCAB)[:384].sort().values
    lyanna = LyannaDraftModel(
        LyannaConfig(plain.model_config, token_info_rank=8, draft_vocab=hot.numel()),
        t.embed_tokens.weight.data,
        t.lm_head_weight.data,
        hot,
    )
    lyanna_dir = tmp_path_factory.mktemp("lyanna")
    save_draft_model(lyanna, lyanna_dir)
    save_hot_tokens(lyanna_dir, Counter({tok: VOCAB - tok for tok in range(0, VOCAB, 2)}))
    return {"lyanna": str(lyanna_dir)}


def run(e: LLMEngine, params: list[SamplingParams], specs: list[SpecParams | None] | None = None) -> list[list[int]]:
    reqs = [
        e.add_request(None, p, prompt_token_ids=prompt, spec=None if specs is None else specs[i])
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    while any(not r.finished for r in reqs):
        e.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def plain_outputs(tiny_target):
    """Plain decoding with the PyTorch references: greedy and seeded sampled."""
    e = engine(tiny_target, "torch")
    greedy = run(e, [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(PROMPTS))
    sampled = run(e, sampled_params())
    dispatch.set_kernel_mode("auto")
    return greedy, sampled


def sampled_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=-3, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lyanna", "ngram"])
def test_engine_with_triton_kernels_equals_plain_decoding(tiny_target, drafters, plain_outputs, drafter):
    greedy_want, sampled_want = plain_outputs
    try:
        e = engine(tiny_target, "triton", drafter, drafters.get(drafter))
        assert dispatch.kernel_mode() == "triton"
        # Speculation and (the second request) plain decoding through the kernels, in one batch.
        greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(PROMPTS)
        assert run(e, greedy, [None, SpecParams(enabled=False), None, None]) == greedy_want
        assert run(e, sampled_params()) == sampled_want  # seeded draws do not depend on speculation
        stats = e.stats()
        assert stats.spec.num_steps > 0 and stats.spec.num_accepted_tokens > 0
        assert stats.kv_free_blocks == 64
        if drafter == "lyanna":
            assert e.executor.drafter.token_info.__class__.__name__ == "TokenInfoTable"  # the expansion kernel's input
    finally:
        dispatch.set_kernel_mode("auto")


def same_as_eager(e: LLMEngine):
    """The runner's `execute`, checking each step against the eager forward from the same cache: logits,
    hidden states and every K/V written."""
    runner, execute, kv = e.runner, e.runner.execute, e.kv_cache

    def checked(plan, logits=True):
        graphs, before = runner.graphs, (kv.k.clone(), kv.v.clone())
        runner.graphs = None
        want, want_cache = execute(plan, logits), (kv.k.clone(), kv.v.clone())
        kv.k.copy_(before[0])
        kv.v.copy_(before[1])
        runner.graphs = graphs
        got = execute(plan, logits)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close((kv.k, kv.v), want_cache, rtol=1e-5, atol=1e-5)
        return got

    return checked


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "lyanna"])
def test_steps_through_the_graph_buffers_equal_plain_decoding(tiny_target, drafters, plain_outputs, drafter):
    """Steps replayed from `StepGraphs`' static buffers (captured CUDA graphs on a GPU; on CPU the same
    buffers and padding, run eagerly): decode tokens of three sequences padded to a bucket of four (Q = 1),
    draft trees of four sequences padded to Q = 8; each step equals the eager one."""
    greedy_want, sampled_want = plain_outputs
    first = 1 if drafter == "none" else 0
    try:
        e = engine(tiny_target, "triton", drafter, drafters.get(drafter))
        if e.runner.graphs is None:
            e.runner.graphs = StepGraphs(e.model, e.kv_cache, graph_buckets(8, 7, 2048), 32, capture=False)
        graphs = e.runner.graphs
        e.runner.execute = same_as_eager(e)
        for params, want in [
            ([SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 4, greedy_want),
            (sampled_params(), sampled_want),
        ]:
            before = graphs.replays.copy()
            pairs = zip(PROMPTS[first:], params[first:], strict=True)
            reqs = [e.add_request(None, p, prompt_token_ids=q) for q, p in pairs]
            while any(not r.finished for r in reqs):
                e.step()
            assert [r.output_token_ids for r in reqs] == want[first:]
            replays = graphs.replays - before
            if drafter == "none":
                assert replays[1] == MAX_NEW - 1  # every step after the prompts' is a decode replay
            else:
                assert replays[8] > 0  # the trees' steps
        stats = e.stats()
        assert stats.kv_free_blocks == 64
        assert drafter == "none" or stats.spec.num_accepted_tokens > 0
    finally:
        dispatch.set_kernel_mode("auto")
