"""The drafters' decoder layer in one call (lyanna_kernels/fused_decoder.py: FusedDraftLayer) in the served
configuration: the embedded model (bf16, the GGUF's int4 blocks, the fused decoder) with the shipped Lyanna
and EAGLE, whose projections and LM head run int8 over a paged cache addressed by the target's block tables
(EAGLE's frontier nodes each over a path of scratch blocks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.drafters import eagle
from engines.drafters.checkpoint import SHIPPED
from engines.drafters.token_info_sampling import build_subtrees
from engines.engine import EngineConfig, LLMEngine
from engines.parallel import PackableLinear
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels import integer_dot
from lyanna_kernels.quantized_linear import dequantized
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="the integer-dot kernels do not build here")

LONG_PROMPT = [{"role": "user", "content": "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 14}]


def served_engine(**overrides) -> LLMEngine:
    cfg = {"num_kv_blocks": 256, "spec_depth": 4, "spec_width": 2, "spec_budget": 8} | overrides
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # one decode step per engine step: `run_plain`'s steps leave contexts under the 256 rows from which the
    # drafter's input projection takes its fp32 copy (reading them together would then differ from alone)
    engine = served_engine(multi_step=1)
    assert engine.quantization == "gguf" and engine.executor.drafter.fused_layer is not None
    return engine


def run_plain(engine: LLMEngine, prompts, steps: int) -> list[Request]:
    """Add `prompts` and take `steps` steps without drafting, so the drafter has context left to read."""
    plan = engine.executor.policy.plan
    engine.executor.policy.plan = lambda reqs, caps, *rest: [None] * len(reqs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(steps):
        engine.step()
    engine.executor.policy.plan = plan
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
    drafter = engine.executor.drafter
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


def test_the_fused_layer_computes_a_chain_fusion_drafters_later_steps(tmp_path):
    """A Lyanna whose steps >= 2 read fuse(h, chain embedding) (the shipped weights with a chain embedding
    added): the fused layer's trajectory follows its fp32 layer as the plain drafter's does."""
    shipped = Path(SHIPPED["lyanna"])
    config = json.loads((shipped / "config.json").read_text())
    config["draft"]["chain_fusion"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(shipped / "model.safetensors"))
    torch.manual_seed(0)
    save_file(
        weights | {"chain_embed": torch.randn(weights["fuse.weight"].shape[0]) * 0.05},
        str(tmp_path / "model.safetensors"),
    )
    engine = served_engine(draft_model=str(tmp_path))
    drafter = engine.executor.drafter
    assert drafter.fused_layer is not None and drafter.model.chain_embed is not None
    reqs = run_plain(engine, [CHAT_PROMPTS[3]], steps=3)
    traj = drafter.trajectories(reqs, 4)[0]
    T = reqs[0].num_tokens
    hidden = torch.stack(drafter.states[reqs[0].request_id].hidden[: T - 1]).float()
    want = eager_fp32_reference(drafter).draft_chain(hidden, torch.tensor(reqs[0].token_ids(0, T)), 4)
    for step in range(4):
        err = (traj[step].float() - want[step]).norm() / want[step].norm()
        assert err < 0.02, (step, err)
    plain = drafter.model.chain_embed
    drafter.model.chain_embed = None  # the same weights reading h alone draft otherwise from step 2 on
    assert not torch.allclose(drafter.trajectories(reqs, 4)[0][1:], traj[1:], atol=1e-2)
    drafter.model.chain_embed = plain


def test_a_fused_row_does_not_depend_on_its_batch(engine):
    """Reading contexts together or one by one, and drafting together or alone, give the same bits."""
    reqs = run_plain(engine, [CHAT_PROMPTS[0], LONG_PROMPT, CHAT_PROMPTS[2]], steps=4)
    drafter, fused = engine.executor.drafter, engine.executor.drafter.fused_layer
    before = copy.deepcopy(drafter.states)
    assert drafter.catch_up(reqs) == [r.num_tokens - 1 for r in reqs]
    together = {r.request_id: drafter.states[r.request_id].last_out.clone() for r in reqs}
    slots = torch.cat([engine.kv_cache.slots(r.request_id, 0, r.num_tokens - 1) for r in reqs])
    keys = fused.k[0, slots].clone()
    # prefix caching: requests may share blocks (their keys there are the same); a slot's first row
    row_of = {slot: row for row, slot in reversed(list(enumerate(slots.tolist())))}
    batched = drafter.trajectories(reqs, 4)
    for req, traj in zip(reqs, batched, strict=True):
        drafter.states[req.request_id] = copy.deepcopy(before[req.request_id])
        fused.k.zero_()
        assert drafter.catch_up([req]) == [req.num_tokens - 1]
        assert torch.equal(drafter.states[req.request_id].last_out, together[req.request_id])
        own = engine.kv_cache.slots(req.request_id, 0, req.num_tokens - 1)
        assert torch.equal(fused.k[0, own], keys[[row_of[slot] for slot in own.tolist()]])
        assert torch.equal(drafter.trajectories([req], 4)[0], traj)
    finish(engine, reqs)


def test_native_chains_are_the_python_chains(engine):
    """Width-1 drafting in one native call (lyanna_kernels/draft_native.py) gives `LyannaDraftModel.logits` bit for bit
    and the tokens Algorithm 1 picks at width 1, with their joint probabilities up to fp32 rounding; a root that is no
    target token is refused."""
    drafter = engine.executor.drafter
    model, chains = drafter.model, drafter.chains
    assert chains is not None and model.d2t is not None  # the shipped drafter's head is restricted to hot tokens
    torch.manual_seed(0)
    for steps in ([3, 1, 2], [1], [4, 4]):
        roots = torch.randint(0, model.embed.shape[0], (len(steps),)).tolist()
        hidden = (3 * torch.randn(sum(steps), model.embed.shape[1])).bfloat16()
        logits, tokens, scores = chains(hidden, steps, roots)
        want_logits = model.logits(hidden)
        assert torch.equal(logits, want_logits)
        want = build_subtrees(list(want_logits.split(steps)), roots, drafter.token_info, [1] * len(steps), model.d2t)
        at = 0
        for tree, n in zip(want, steps, strict=True):
            assert tree.tokens[1:] == tokens[at : at + n]
            assert scores[at : at + n] == pytest.approx(tree.scores[1:], rel=1e-4)
            at += n
    with pytest.raises(IndexError, match="not a target token"):
        chains(hidden[:1], [1], [model.embed.shape[0]])


def test_the_native_fusion_is_the_models_fusion(engine):
    """Lyanna's input fusion in one native call (`DraftFuse`) rounds as `LyannaDraftModel.fused_input` does: the
    same bf16 rows but where a norm's sum, taken in another order, rounds a value the other way."""
    drafter = engine.executor.drafter
    model, fuse = drafter.model, drafter.fuse
    assert fuse is not None
    torch.manual_seed(0)
    hidden = (2 * torch.randn(40, model.embed.shape[1])).bfloat16()
    tokens = torch.randint(0, model.embed.shape[0], (40,))
    got, want = fuse(hidden, tokens), model.fused_input(hidden, tokens).float()
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # bf16 values
    assert (got == want).all(1).float().mean() > 0.9  # whole rows equal
    assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < 0.01
    assert torch.equal(fuse(hidden[:1], tokens[:1]), got[:1])  # a row alone is the row in a batch
    with pytest.raises(IndexError, match="no embedding"):
        fuse(hidden[:2], torch.tensor([0, model.embed.shape[0]]))


def test_native_chains_propose_what_the_python_path_proposes(engine):
    reqs = run_plain(engine, [CHAT_PROMPTS[0], CHAT_PROMPTS[2]], steps=3)
    drafter = engine.executor.drafter
    specs = [SpecParams(3, 1, 3), SpecParams(2, 1, 2)]
    before = copy.deepcopy(drafter.states)
    native = drafter.propose(reqs, specs)
    drafter.states, chains = before, drafter.chains
    drafter.chains = None
    try:
        python = drafter.propose(reqs, specs)
    finally:
        drafter.chains = chains
    for a, b in zip(native, python, strict=True):
        assert a.tokens == b.tokens and a.parents == b.parents == [-1, 0, 1, 2][: len(a.tokens)]
        assert a.scores == pytest.approx(b.scores, rel=1e-4)
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
    assert engine.executor.drafter.fused_layer is None and engine.executor.drafter.model.lm_head_quant is None
    reqs = run_plain(engine, [CHAT_PROMPTS[1]], steps=2)
    assert engine.executor.drafter.trajectories(reqs, 3)[0].shape[0] == 3
    assert engine.executor.drafter.states[reqs[0].request_id].keys is not None
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(draft_quantization="int4")


@pytest.fixture(scope="module")
def eagle_engine() -> LLMEngine:
    engine = served_engine(drafter="eagle")
    assert engine.executor.drafter.fused_layer is not None and engine.executor.drafter.model.lm_head_quant is not None
    return engine


def expanded_nodes(tree, depth: int) -> list[int]:
    """The nodes at `depth` that have children, in index order (the frontier that ran at depth + 1)."""
    return sorted({p for p in tree.parents if p >= 0 and tree.depths[p] == depth})


def path_tokens(tree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def test_eagle_frontier_nodes_attend_to_their_own_ancestors(monkeypatch):
    """Every frontier node's layer output, through its path of scratch blocks, is the drafter's layer
    run on the chain from the root to that node (an fp32 eager copy of the same int8 weights). Width 3
    at depth 4: a path is copied into another that is itself a parent; 6 paths grow scratch room made
    for 2 sequences."""
    eagle_engine = served_engine(drafter="eagle", max_num_seqs=2)
    reqs = run_plain(eagle_engine, [CHAT_PROMPTS[3], LONG_PROMPT], steps=3)
    drafter = eagle_engine.executor.drafter
    assert drafter.fused_layer.max_seqs == 2
    outputs: list[torch.Tensor] = []
    forward = eagle._PagedFrontier.forward
    monkeypatch.setattr(
        eagle._PagedFrontier, "forward", lambda self, d, a, x: outputs.append(forward(self, d, a, x)) or outputs[-1]
    )
    k, depth = 3, 4
    trees = drafter.grow_batch(reqs, [depth] * 2, [k] * 2)
    assert len(outputs) == depth - 1 and drafter.fused_layer.max_seqs >= 2 * k
    ref = eager_fp32_reference(drafter)
    bs = eagle_engine.kv_cache.block_size
    assert any(drafter.states[r.request_id].processed % bs for r in reqs)  # a partial last block was copied
    for b, (req, tree) in enumerate(zip(reqs, trees, strict=True)):
        T = req.num_tokens
        hidden = torch.stack(drafter.states[req.request_id].hidden[: T - 1]).float()
        context = req.token_ids(0, T)
        for d in range(2, depth + 1):
            nodes = expanded_nodes(tree, d - 1)
            assert len(nodes) == k
            for j, node in enumerate(nodes):
                path = path_tokens(tree, node)
                want = ref.draft_chain(hidden, torch.tensor(context + path), d)[-1]
                got = outputs[d - 2][b * k + j].float()
                err = (got - want).norm() / want.norm()
                assert err < 0.02, (b, d, j, err)


def test_eagle_trees_do_not_depend_on_their_batch(eagle_engine):
    reqs = run_plain(eagle_engine, [CHAT_PROMPTS[0], LONG_PROMPT, CHAT_PROMPTS[2]], steps=4)
    drafter = eagle_engine.executor.drafter
    together = drafter.grow_batch(reqs, [3, 4, 2], [2, 2, 3])
    for req, depth, k, tree in zip(reqs, [3, 4, 2], [2, 2, 3], together, strict=True):
        alone = drafter.grow_batch([req], [depth], [k])[0]
        assert (alone.tokens, alone.parents, alone.scores) == (tree.tokens, tree.parents, tree.scores)
    finish(eagle_engine, reqs)


def test_eagle_with_the_fused_layer_is_lossless_through_preemption():
    """Greedy and seeded EAGLE trees over the paged frontier paths equal plain decoding, with preemptions."""
    # 6 blocks of 16: the first two prompts (37 and 38 tokens) take 3 blocks each, so whichever of them
    # first passes 48 tokens (well before its 24th output token) must preempt, whatever the drafts accept.
    small = served_engine(drafter="eagle", num_kv_blocks=6, spec_depth=3, spec_width=2, spec_budget=6)
    plain = served_engine(drafter="none")
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    ):
        # In bf16, K/V cached by the first round's steps differ in rounding from the ones a prefill
        # computes (as chunked prefill's do): each round starts from empty prefix caches in both engines.
        small.kv_cache.reset_prefix_cache()
        plain.kv_cache.reset_prefix_cache()
        reqs = [small.add_request(p, params) for p in CHAT_PROMPTS[:3]]
        while small.has_unfinished():
            small.step()
        want = plain.generate(CHAT_PROMPTS[:3], params)
        assert [r.output_token_ids for r in reqs] == [w.token_ids for w in want]
        assert sum(r.num_preemptions for r in reqs) > 0
    assert small.stats().spec.num_accepted_tokens > 0
