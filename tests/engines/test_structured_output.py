"""Structured outputs under speculation stay lossless: the law of what a verified step emits under a grammar
is the target's law masked by the grammar and renormalised, exactly.

The exact-enumeration harness of test_verification.py runs here on a tiny vocabulary ('a', 'b', 'c' and a
stop token) with real xgrammar grammars: the drafts are top-k trees (or sampled chains) over the whole
vocabulary, so they hold tokens the grammar forbids; `prune_draft` and `mask_logits` (what the executor
runs) prune and mask them, and the reference verifiers walk every branch of their random decisions.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from engines.draft_tree import DraftTree
from engines.errors import InvalidRequestError
from engines.sampling import SamplingParams
from engines.structured_output import (
    GrammarState,
    MaskedRows,
    StructuredOutputCompiler,
    mask_logits,
    prune_draft,
    unpack_bitmask,
)
from engines.structured_params import StructuredOutputParams
from engines.verification import (
    VerifyItem,
    verify_batch,
    verify_chain_block,
    verify_chain_rejection,
    verify_greedy,
    verify_tree,
    verify_tree_by_sampling,
)
from tests.engines.test_verification import ForcedRng, exact_law, total_variation

VOCAB = ["a", "b", "c", "</s>"]
EOS = 3
V = len(VOCAB)
L = 4  # emitted tokens whose joint law is checked (more than one step's worth)
GRAMMARS = {
    # at the start (and after each pair): a, c or the end; after 'a': b or c
    "regex": StructuredOutputParams(regex="(a[bc]|c)*"),
    # one to three b's between a and c, then the end: states that allow one token, or only the end
    "ebnf": StructuredOutputParams(grammar='root ::= "a" "b" "b"? "b"? "c"'),
    "choice": StructuredOutputParams(choice=("ab", "acb", "c")),
}
COMPILER = StructuredOutputCompiler.for_vocabulary(VOCAB, [EOS])


def state_after(params: StructuredOutputParams, prefix: tuple[int, ...]) -> GrammarState:
    """A fresh matcher advanced over `prefix` (which the grammar allows)."""
    state = COMPILER.matcher(params)
    for t in prefix:
        assert state.accept(t), prefix
    return state


def ended(params: StructuredOutputParams, prefix: tuple[int, ...]) -> bool:
    """Whether the engine ends a request whose output is `prefix` (its grammar allows only the end)."""
    return bool(prefix) and state_after(params, prefix[:-1]).advance(prefix[-1])


def emitted(params: StructuredOutputParams, out: tuple[int, ...], tokens: list[int]) -> tuple[int, ...]:
    """What the engine appends of a step's tokens after `out`: up to the token that ends the grammar."""
    state = state_after(params, out)
    for i, t in enumerate(tokens):
        if state.advance(t):
            return tuple(tokens[: i + 1])
    return tuple(tokens)


class World:
    """Random target p(.|prefix) and draft q(.|prefix) over the tiny vocabulary, fixed by a seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def dist(self, kind: str, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (kind, tuple(prefix))
        if key not in self.cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, kind, key[1])).encode()))
            x = -torch.log(torch.rand(V, generator=g, dtype=torch.float64))  # Dirichlet(1, ..., 1)
            self.cache[key] = x / x.sum()
        return self.cache[key]

    def masked_p(self, params: StructuredOutputParams, prefix: tuple[int, ...]) -> torch.Tensor:
        """The constrained target at `prefix`: p restricted to what the grammar allows, renormalised."""
        bits = torch.zeros(1, 1, dtype=torch.int32)
        state_after(params, prefix).fill(bits, 0)
        p = self.dist("p", prefix) * unpack_bitmask(bits, V)[0]
        return p / p.sum()

    def constrained_law(self, params: StructuredOutputParams) -> dict[tuple[int, ...], float]:
        """Law of the first L tokens of constrained decoding, a sequence ending where the grammar ends."""
        law: dict[tuple[int, ...], float] = defaultdict(float)

        def expand(prefix: tuple[int, ...], prob: float) -> None:
            if len(prefix) >= L or ended(params, prefix):
                law[prefix[:L]] += prob
                return
            p = self.masked_p(params, prefix)
            for t in range(V):
                if p[t] > 0:
                    expand((*prefix, t), prob * p[t].item())

        expand((), 1.0)
        return dict(law)


def top_k_tree(world: World, widths: list[int], out: tuple[int, ...]) -> tuple[DraftTree, list[tuple[int, ...]]]:
    """A deterministic top-k tree from q over the whole vocabulary, and each node's prefix."""
    tokens, parents, prefixes, frontier = [-1], [-1], [out], [0]
    for k in widths:
        nxt = []
        for node in frontier:
            for x in torch.argsort(world.dist("q", prefixes[node]), descending=True)[:k].tolist():
                tokens.append(x)
                parents.append(node)
                prefixes.append((*prefixes[node], x))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents), prefixes


def masked_target(
    world: World, params: StructuredOutputParams, state: GrammarState, tree: DraftTree, out: tuple[int, ...]
) -> torch.Tensor:
    """The target's logits at the tree's nodes, masked in place as the executor masks them; as probabilities."""
    prefixes = [out]
    for i in range(1, tree.size):
        prefixes.append((*prefixes[tree.parents[i]], tree.tokens[i]))
    logits = torch.stack([world.dist("p", pre).log() for pre in prefixes])  # float64: exact sums
    rows = MaskedRows()
    rows.add(state, tree, 0)
    mask_logits(logits, rows)
    return logits.softmax(-1)


def constrained_tree_step(
    world: World, params: StructuredOutputParams, widths: list[int], out: tuple[int, ...], verifier
) -> Callable[[ForcedRng], tuple[int, ...]]:
    """One speculative step after `out`: draft a top-k tree, prune it, mask the target, verify, emit."""

    def run(rng: ForcedRng) -> tuple[int, ...]:
        tree, _ = top_k_tree(world, widths, out)
        state = state_after(params, out)
        pruned = prune_draft(state, tree, SamplingParams())
        if pruned is None:  # nothing left to verify: the engine samples the plain row
            pruned = DraftTree([tree.tokens[0]], [-1])
        probs = masked_target(world, params, state, pruned, out)
        res = verifier(pruned, probs, rng)
        return emitted(params, out, [*(pruned.tokens[i] for i in res.path[1:]), res.bonus])

    return run


def constrained_chain_step(
    world: World, params: StructuredOutputParams, gamma: int, out: tuple[int, ...], verifier
) -> Callable[[ForcedRng], tuple[int, ...]]:
    """One step with a chain sampled from q (forbidden tokens included): not pruned, the target masked."""

    def run(rng: ForcedRng) -> tuple[int, ...]:
        draft: list[int] = []
        for _ in range(gamma):
            draft.append(rng.categorical(world.dist("q", out + tuple(draft))))
        q = torch.stack([world.dist("q", out + tuple(draft[:t])) for t in range(gamma + 1)])
        tree = DraftTree.chain(-1, draft, draft_probs=q)
        state = state_after(params, out)
        kept = prune_draft(state, tree, SamplingParams(temperature=1.0))
        assert kept is tree  # a sampled chain is verified whole
        res = verifier(tree, masked_target(world, params, state, tree, out), rng)
        return emitted(params, out, [*(tree.tokens[i] for i in res.path[1:]), res.bonus])

    return run


def decoding_law(params: StructuredOutputParams, step: Callable[[tuple[int, ...]], Callable]) -> dict:
    """Exact law of the first L emitted tokens when steps repeat until L are out or the grammar ends."""
    step_laws: dict[tuple[int, ...], dict] = {}
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) >= L or ended(params, prefix):
            law[prefix[:L]] += prob
            return
        if prefix not in step_laws:
            step_laws[prefix] = exact_law(step(prefix))
        for out, p in step_laws[prefix].items():
            expand(prefix + out, prob * p)

    expand((), 1.0)
    return dict(law)


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("widths", [[2, 2], [3, 1, 1], [4, 2]])
@pytest.mark.parametrize("verifier", [verify_tree_by_sampling, verify_tree], ids=["by-sampling", "sequential"])
def test_pruned_trees_on_the_masked_target_follow_the_constrained_law(grammar, seed, widths, verifier):
    params, world = GRAMMARS[grammar], World(seed)
    law = decoding_law(params, lambda out: constrained_tree_step(world, params, widths, out, verifier))
    want = world.constrained_law(params)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    assert total_variation(law, want) < 1e-9


@pytest.mark.parametrize("grammar", ["regex", "ebnf"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("verifier", [verify_chain_block, verify_chain_rejection], ids=["block", "rejection"])
def test_sampled_chains_on_the_masked_target_follow_the_constrained_law(grammar, seed, verifier):
    """A chain drawn from q is verified whole: its forbidden tokens meet a target that gives them 0."""
    params, world = GRAMMARS[grammar], World(seed)
    law = decoding_law(params, lambda out: constrained_chain_step(world, params, 3, out, verifier))
    assert total_variation(law, world.constrained_law(params)) < 1e-9


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_greedy_verification_equals_constrained_greedy_decoding(grammar):
    params = GRAMMARS[grammar]
    for seed in range(6):
        world = World(seed)
        want: tuple[int, ...] = ()
        while len(want) < L and not ended(params, want):
            want += (int(world.masked_p(params, want).argmax()),)
        got: tuple[int, ...] = ()
        while len(got) < L and not ended(params, got):
            tree, _ = top_k_tree(world, [2, 2], got)
            state = state_after(params, got)
            pruned = prune_draft(state, tree, SamplingParams(temperature=0)) or DraftTree([tree.tokens[0]], [-1])
            res = verify_greedy(pruned, masked_target(world, params, state, pruned, got).argmax(-1).tolist())
            got += emitted(params, got, [*(pruned.tokens[i] for i in res.path[1:]), res.bonus])
        assert got[:L] == want[:L], (seed, got, want)


def test_engine_batched_verification_keeps_the_constrained_law():
    """The engine's batched rule (positional Gumbel draws in `verify_batch`) on a pruned tree and masked
    logits, one seed per request: the frequencies of what a step emits match the exact law."""
    params, world = GRAMMARS["regex"], World(4)
    out = (0, 2)  # "ac": a, c or the end may follow
    tree, _ = top_k_tree(world, [3, 2], out)
    state = state_after(params, out)
    pruned = prune_draft(state, tree, SamplingParams())
    assert pruned is not None and pruned.size < tree.size  # the tree held forbidden tokens
    probs = masked_target(world, params, state, pruned, out)
    want = exact_law(lambda rng: (lambda r: (tuple(r.path), r.bonus))(verify_tree(pruned, probs, rng)))
    n = 3000
    items = [VerifyItem(pruned, SamplingParams(temperature=1.0), seed, 9) for seed in range(n)]
    counts: dict[tuple, int] = defaultdict(int)
    for res in verify_batch(items, probs.float().log().repeat(n, 1))[0]:
        counts[(tuple(res.path), res.bonus)] += 1
    assert set(counts) <= {k for k, p in want.items() if p > 0}
    for key, p in want.items():
        got = counts[key] / n
        assert abs(got - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9, (key, got, p)


# ---- the pieces ----------------------------------------------------------------------------------
def test_prune_drops_forbidden_tokens_with_their_subtrees():
    state = state_after(GRAMMARS["regex"], (0, 1))  # "ab": a, c or the end next
    # root -> a(1) -> b(3), a(1) -> </s>(4) [forbidden after a]; root -> b(2) [forbidden] -> c(5); root -> c(6)
    tree = DraftTree([1, 0, 1, 1, 3, 2, 2], [-1, 0, 0, 1, 1, 2, 0], scores=[1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    pruned = prune_draft(state, tree, SamplingParams())
    assert pruned.tokens == [1, 0, 1, 2] and pruned.parents == [-1, 0, 1, 0]  # nodes 0, 1, 3, 6
    assert pruned.scores == [1, 0.9, 0.7, 0.4]
    assert state.accept(2) and not state.accept(1)  # the walk left the state where it was
    assert prune_draft(state_after(GRAMMARS["regex"], (0,)), DraftTree([0, 0, 3], [-1, 0, 0]), SamplingParams()) is None


def test_tree_masks_are_the_states_after_each_path():
    params = GRAMMARS["ebnf"]
    state = state_after(params, (0,))  # "a": b next
    tree = DraftTree([0, 1, 1, 2, 1, 2], [-1, 0, 1, 2, 2, 1])  # a> b> b> (c, b), b> c
    rows = MaskedRows()
    rows.add(state, tree, 0)
    logits = torch.zeros(tree.size, V)
    mask_logits(logits, rows)
    for node in range(tree.size):
        path = tuple(tree.tokens[i] for i in tree.path_to(node)[1:])
        bits = torch.zeros(1, 1, dtype=torch.int32)
        state_after(params, (0, *path)).fill(bits, 0)
        assert ((logits[node] == 0) == unpack_bitmask(bits, V)[0]).all(), (node, path)
    assert (logits[3] == 0).tolist() == [False, False, False, True]  # "abbc": only the end


def test_compile_cache_and_errors():
    compiler = StructuredOutputCompiler.for_vocabulary(VOCAB, [EOS])
    spec = StructuredOutputParams(json_schema='{"type": "object", "properties": {"a": {"type": "string"}}}')
    same = StructuredOutputParams(json_schema='{"type":"object",  "properties":{"a":{"type":"string"}}}')
    threads = [threading.Thread(target=compiler.compile, args=(spec,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.compile(same) is compiler.compile(spec)
    assert (compiler.misses, compiler.hits) == (1, 5)
    bad = [
        StructuredOutputParams(json_schema='{"type": "no-such-type"}', param="response_format"),
        StructuredOutputParams(json_schema='{"type": ', param="response_format"),
        StructuredOutputParams(regex="(a", param="guided_regex"),
        StructuredOutputParams(grammar="root ::= ", param="guided_grammar"),
    ]
    for params in bad:
        for _ in range(2):  # the failure is cached too, and raised anew
            with pytest.raises(InvalidRequestError) as err:
                compiler.compile(params)
            assert err.value.param == params.param and params.kind in err.value.message
    assert compiler.misses == 5


def test_only_a_complete_output_allows_the_stop_token():
    for name, params in GRAMMARS.items():
        for prefix in itertools.chain.from_iterable(itertools.product(range(3), repeat=n) for n in range(4)):
            state = COMPILER.matcher(params)
            if not all(state.accept(t) for t in prefix):
                continue
            bits = torch.zeros(1, 1, dtype=torch.int32)
            state.fill(bits, 0)
            assert bool(unpack_bitmask(bits, V)[0, EOS]) == state.matcher.is_completed(), (name, prefix)


def test_the_cpu_kernel_and_the_tensor_ops_mask_alike():
    """mask_logits on fp32 CPU logits (xgrammar's kernel) equals `apply_masks` (the accelerator's path)
    on the one packed buffer that path copies to the device; rows of no constrained request stay as they were."""
    from engines.structured_output import apply_masks

    params = GRAMMARS["regex"]
    rows = MaskedRows()
    rows.add(state_after(params, (0,)), None, 1)
    rows.add(state_after(params, ()), DraftTree([2, 0, 2, 1, 3], [-1, 0, 0, 1, 1]), 3)
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(0))
    by_kernel, by_ops = logits.clone(), logits.clone()
    mask_logits(by_kernel, rows)
    apply_masks(by_ops, rows.host_masks(V), rows.num_rows)
    assert torch.equal(by_kernel, by_ops)
    for r in (0, 2, 8):
        assert torch.equal(by_kernel[r], logits[r])
    assert torch.isinf(by_kernel[1]).tolist() == [True, False, False, True]  # after "a": b or c
