"""Lyanna's decoder layer in one call (kernels/fused_decoder.py: FusedDraftLayer) in the served configuration:
the embedded model (bf16, the GGUF's int4 blocks, the fused decoder) with the shipped Lyanna, whose
projections and LM head run int8 over a paged cache addressed by the target's block tables."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.parallel import PackableLinear
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from kernels import integer_dot
from kernels.quantized_linear import dequantized
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="the integer-dot kernels do not build here")

LONG_PROMPT = [{"role": "user", "content": "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 14}]


def served_engine(**overrides) -> LLMEngine:
    cfg = {"num_kv_blocks": 256, "spec": SpecParams(depth=4, width=2, budget=8)} | overrides
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    engine = served_engine()
    assert engine.quantization == "gguf" and engine.drafter.fused_layer is not None
    return engine


def run_plain(engine: LLMEngine, prompts, steps: int) -> list[Request]:
    """Add `prompts` and take `steps` steps without drafting, so the drafter has context left to read."""
    plan = engine.policy.plan
    engine.policy.plan = lambda reqs, caps, other, context=None: [None] * len(reqs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(steps):
        engine.step()
    engine.policy.plan = plan
    return reqs


def finish(engine: LLMEngine, reqs: list[Request]) -> None:
    for req in reqs:
        engine.abort(req.request_id)


def eager_fp32_reference(drafter):
    """The drafter with its int8 projections dequantized into an fp32 eager copy: the same weights, only the
    fused layer's int8 activation blocks and fp32 accumulation order differ."""
    model, packed = drafter.model, drafter.model.lm_head_packed
    model.lm_head_packed = None  # oneDNN's packed head cannot be copied (and draft_chain does not use it)
    try:
        ref = copy.deepcopy(model)
    finally:
        model.lm_head_packed = packed
    for m in ref.modules():
        if isinstance(m, PackableLinear) and m.quant is not None:
            m.weight = torch.nn.Parameter(dequantized(m.quant), requires_grad=False)
            m.quant, m.packed = None, None
    return ref.float()


def test_the_fused_layer_computes_the_drafters_layer(engine):
    reqs = run_plain(engine, [CHAT_PROMPTS[3], LONG_PROMPT], steps=3)  # the long prompt is read in pieces
    drafter = engine.drafter
    trajs = drafter.trajectories(reqs, 4)
    ref = eager_fp32_reference(drafter)
    for req, traj in zip(reqs, trajs, strict=True):
        st = drafter.states[req.request_id]
        T = req.num_tokens
        assert st.processed == T - 1 and T - 1 > 64
        hidden = torch.stack(st.hidden[: T - 1]).float()  # the target's states the drafter was given
        want = ref.draft_chain(hidden, torch.tensor(req.token_ids(0, T)), 4)
        for step in range(4):  # bf16 outputs: each step within ~1% of the fp32 layer
            err = (traj[step].float() - want[step]).norm() / want[step].norm()
            assert err < 0.02, (step, err)
        assert not torch.equal(traj[1], traj[2])  # the steps move on
    finish(engine, reqs)


def test_a_fused_row_does_not_depend_on_its_batch(engine):
    """Reading contexts together or one by one, and drafting together or alone, give the same bits."""
    reqs = run_plain(engine, [CHAT_PROMPTS[0], LONG_PROMPT, CHAT_PROMPTS[2]], steps=4)
    drafter, fused = engine.drafter, engine.drafter.fused_layer
    before = copy.deepcopy(drafter.states)
    assert drafter.catch_up(reqs) == [r.num_tokens - 1 for r in reqs]
    together = {r.request_id: drafter.states[r.request_id].last_out.clone() for r in reqs}
    slots = torch.cat([engine.kv_cache.slots(r.request_id, 0, r.num_tokens - 1) for r in reqs])
    keys = fused.k[0, slots].clone()
    batched = drafter.trajectories(reqs, 4)
    for req, traj in zip(reqs, batched, strict=True):
        drafter.states[req.request_id] = copy.deepcopy(before[req.request_id])
        fused.k.zero_()
        assert drafter.catch_up([req]) == [req.num_tokens - 1]
        assert torch.equal(drafter.states[req.request_id].last_out, together[req.request_id])
        own = engine.kv_cache.slots(req.request_id, 0, req.num_tokens - 1)
        assert torch.equal(fused.k[0, own], keys[torch.isin(slots, own)])
        assert torch.equal(drafter.trajectories([req], 4)[0], traj)
    finish(engine, reqs)


def test_lyanna_with_the_fused_layer_is_lossless_through_preemption():
    """A cache too small for three requests preempts and recomputes; the drafter's paged keys follow the
    request's new blocks, and greedy outputs equal plain decoding's. (Prompt plus output stay within
    one fused step, so a recomputed prefill is bit-identical to the decoded one.)"""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    small = served_engine(num_kv_blocks=7)
    reqs = [small.add_request(p, params) for p in CHAT_PROMPTS[:3]]
    while small.has_unfinished():
        small.step()
    want = served_engine(drafter="none").generate(CHAT_PROMPTS[:3], params)
    assert [r.output_token_ids for r in reqs] == [w.token_ids for w in want]
    assert sum(r.num_preemptions for r in reqs) > 0
    assert small.stats().spec.num_accepted_tokens > 0


def test_draft_quantization_none_keeps_the_eager_layer():
    engine = served_engine(draft_quantization="none")
    assert engine.drafter.fused_layer is None and engine.drafter.model.lm_head_quant is None
    reqs = run_plain(engine, [CHAT_PROMPTS[1]], steps=2)
    assert engine.drafter.trajectories(reqs, 3)[0].shape[0] == 3
    assert engine.drafter.states[reqs[0].request_id].keys is not None
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(draft_quantization="int4")
