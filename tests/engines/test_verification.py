"""The product's central promise: verification never changes the target's output distribution.

The verifiers draw all their randomness through an `Rng`. Here an enumerating Rng runs the real
verifier code down every branch of every random decision (drafting included), with exact
probabilities, so the law of the emitted tokens is computed exactly, not estimated.
"""

from __future__ import annotations

import itertools
import zlib
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from engines.draft_tree import DraftTree
from engines.verification import (
    TorchRng,
    verify_chain_block,
    verify_chain_hsd_published_lossy,
    verify_chain_rejection,
    verify_greedy,
    verify_tree,
    verify_tree_by_sampling,
)

V = 3  # vocabulary
GAMMA = 3  # draft length
L = 4  # emitted tokens whose joint law is checked (more than one speculative step's worth)


class ForcedRng:
    """Replays forced choices, then takes the first option, recording each new decision's options."""

    def __init__(self, forced: list[int]):
        self.forced = forced
        self.taken: list[int] = []
        self.num_options: list[int] = []
        self.prob = 1.0

    def _choose(self, probs: list[float]) -> int:
        options = [k for k, p in enumerate(probs) if p > 0]
        pos = len(self.taken)
        k = self.forced[pos] if pos < len(self.forced) else 0
        self.taken.append(k)
        self.num_options.append(len(options))
        self.prob *= probs[options[k]]
        return options[k]

    def bernoulli(self, p: float) -> bool:
        p = min(max(p, 0.0), 1.0)
        return self._choose([p, 1.0 - p]) == 0

    def categorical(self, probs: torch.Tensor) -> int:
        w = probs.double() / probs.double().sum()
        return self._choose(w.tolist())


def exact_law(process: Callable[[ForcedRng], tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """Run `process` down every branch of its random decisions; the probability of each outcome."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        forced = stack.pop()
        rng = ForcedRng(forced)
        outcome = process(rng)
        law[outcome] += rng.prob
        for pos in range(len(forced), len(rng.taken)):
            for k in range(1, rng.num_options[pos]):
                stack.append([*rng.taken[:pos], k])
    return dict(law)


class World:
    """Random target p(.|prefix) and draft q(.|prefix) for every prefix, fixed by a seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def dist(self, kind: str, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (kind, prefix)
        if key not in self.cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, kind, prefix)).encode()))
            self.cache[key] = _dirichlet(g)
        return self.cache[key]

    def p(self, prefix):
        return self.dist("p", tuple(prefix))

    def q(self, prefix):
        return self.dist("q", tuple(prefix))

    def target_law(self) -> dict[tuple[int, ...], float]:
        law = {}
        for seq in itertools.product(range(V), repeat=L):
            prob = 1.0
            for t in range(L):
                prob *= self.p(seq[:t])[seq[t]].item()
            law[seq] = prob
        return law


def _dirichlet(g: torch.Generator) -> torch.Tensor:
    x = -torch.log(torch.rand(V, generator=g, dtype=torch.float64))  # Exp(1) draws -> Dirichlet(1,...,1)
    return x / x.sum()


def chain_step(world: World, verifier, out: tuple[int, ...]) -> Callable[[ForcedRng], tuple[int, ...]]:
    """One speculative step after `out`: draw a chain from q, verify it, emit accepted + bonus."""

    def run(rng) -> tuple[int, ...]:
        draft: list[int] = []
        for _ in range(GAMMA):
            draft.append(rng.categorical(world.q(out + tuple(draft))))
        prefixes = [out + tuple(draft[:t]) for t in range(GAMMA + 1)]
        tree = DraftTree.chain(-1, draft, draft_probs=torch.stack([world.q(pre) for pre in prefixes]))
        res = verifier(tree, torch.stack([world.p(pre) for pre in prefixes]), rng)
        return (*tuple(tree.tokens[i] for i in res.path[1:]), res.bonus)

    return run


def top_k_tree(world: World, widths: list[int], out: tuple[int, ...]) -> tuple[DraftTree, torch.Tensor]:
    """A deterministic top-k tree built from q after `out` (widths per depth) and the target's p at its nodes."""
    tokens, parents, prefixes = [-1], [-1], [out]
    frontier = [0]
    for k in widths:
        nxt = []
        for node in frontier:
            for x in torch.argsort(world.q(prefixes[node]), descending=True)[:k].tolist():
                tokens.append(x)
                parents.append(node)
                prefixes.append((*prefixes[node], x))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents), torch.stack([world.p(pre) for pre in prefixes])


def tree_step(
    world: World, widths: list[int], out: tuple[int, ...], verifier=verify_tree
) -> Callable[[ForcedRng], tuple[int, ...]]:
    """One speculative step after `out` with a deterministic top-k tree built from q (widths per depth)."""

    def run(rng) -> tuple[int, ...]:
        tree, probs = top_k_tree(world, widths, out)
        res = verifier(tree, probs, rng)
        return (*tuple(tree.tokens[i] for i in res.path[1:]), res.bonus)

    return run


def decoding_law(step: Callable[[tuple[int, ...]], Callable]) -> dict[tuple[int, ...], float]:
    """Exact law of the first L emitted tokens when speculative steps repeat until L are out.

    A step's outcome depends only on what was emitted before it, so each prefix's one-step law is
    enumerated once and the steps are chained by dynamic programming.
    """
    step_laws: dict[tuple[int, ...], dict] = {}
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) >= L:
            law[prefix[:L]] += prob
            return
        if prefix not in step_laws:
            step_laws[prefix] = exact_law(step(prefix))
        for emitted, p in step_laws[prefix].items():
            expand(prefix + emitted, prob * p)

    expand((), 1.0)
    return dict(law)


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("verifier", [verify_chain_rejection, verify_chain_block], ids=["rejection", "block"])
def test_chain_verifiers_are_exactly_lossless(seed, verifier):
    world = World(seed)
    law = decoding_law(lambda out: chain_step(world, verifier, out))
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, world.target_law()) < 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("widths", [[2, 1, 1], [3, 2], [1, 1, 1], [2, 2, 2]])
@pytest.mark.parametrize("verifier", [verify_tree, verify_tree_by_sampling], ids=["sequential", "by-sampling"])
def test_tree_verifier_is_exactly_lossless(seed, widths, verifier):
    world = World(seed)
    law = decoding_law(lambda out: tree_step(world, widths, out, verifier))
    assert total_variation(law, world.target_law()) < 1e-9


def path_and_bonus(verifier, tree: DraftTree, probs: torch.Tensor) -> Callable[[ForcedRng], tuple]:
    """One verification of `tree`, its outcome as (accepted path, bonus)."""

    def run(rng) -> tuple:
        res = verifier(tree, probs, rng)
        return (tuple(res.path), res.bonus)

    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("widths", [[2, 1, 1], [3, 2], [1, 1, 1], [2, 2, 2], [3, 3]])
def test_sampling_rule_accepts_exactly_as_the_sequential_rule(seed, widths):
    """Not only the output: the law of (accepted path, bonus) of one step is the same, so the
    sampling rule accepts as many draft tokens as the sequential one, in law."""
    world = World(seed)
    for out in [(), (0,), (2, 1)]:
        tree, probs = top_k_tree(world, widths, out)

        sequential = exact_law(path_and_bonus(verify_tree, tree, probs))
        by_sampling = exact_law(path_and_bonus(verify_tree_by_sampling, tree, probs))
        assert abs(sum(by_sampling.values()) - 1.0) < 1e-12
        assert total_variation(sequential, by_sampling) < 1e-12


def test_published_hsd_rule_drifts():
    """The published HSD acceptance rule is measurably lossy; block verification is not."""
    tvs = []
    for seed in range(3):
        world = World(seed)
        law = decoding_law(lambda out, w=world: chain_step(w, verify_chain_hsd_published_lossy, out))
        tvs.append(total_variation(law, world.target_law()))
    print(f"HSD published rule, total variation from the target law: {[round(t, 4) for t in tvs]}")
    assert all(tv > 1e-3 for tv in tvs)


def test_block_accepts_at_least_as_much_as_tokenwise_in_expectation():
    for seed in range(3):
        world = World(seed)
        mean_len = {}
        for name, verifier in (("rejection", verify_chain_rejection), ("block", verify_chain_block)):
            law = exact_law(chain_step(world, verifier, ()))
            mean_len[name] = sum((len(k) - 1) * v for k, v in law.items())
        assert mean_len["block"] >= mean_len["rejection"] - 1e-12


def test_greedy_verifier_follows_argmax():
    # root -> a(5) -> c(7); root -> b(6) -> d(8)
    tree = DraftTree([1, 5, 6, 7, 8], [-1, 0, 0, 1, 2])
    assert verify_greedy(tree, [6, 7, 8, 0, 9]) == verify_greedy(tree, [6, 7, 8, 0, 9])
    res = verify_greedy(tree, [6, 0, 8, 0, 9])
    assert res.path == [0, 2, 4] and res.bonus == 9
    res = verify_greedy(tree, [4, 0, 0, 0, 0])
    assert res.path == [0] and res.bonus == 4


def test_tree_verifier_monte_carlo_with_torch_rng():
    """The same rule with real random numbers: frequencies of the first two tokens match p."""
    world = World(7)
    step = tree_step(world, [2, 2], ())
    rng = TorchRng(torch.Generator().manual_seed(0))
    n = 6000
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for _ in range(n):
        out = step(rng)
        if len(out) < 2:
            out = out + tree_step(world, [2, 2], out)(rng)
        counts[out[:2]] += 1
    for a, b in itertools.product(range(V), repeat=2):
        want = world.p(())[a].item() * world.p((a,))[b].item()
        got = counts[(a, b)] / n
        assert abs(got - want) <= 5 * (want * (1 - want) / n) ** 0.5 + 1e-9, (a, b, got, want)


def test_verify_batch_equals_per_request_verifiers():
    from engines.sampling import SamplingParams, gumbel_argmax, processed_logprobs
    from engines.verification import VerifyItem, chain_noise, verify_batch, verify_tree_sampled

    torch.manual_seed(3)
    vocab = 11
    trees = [
        DraftTree([1, 2, 3, 4], [-1, 0, 0, 1]),  # greedy tree
        DraftTree([5, 6, 7], [-1, 0, 1]),  # sampled deterministic tree
        DraftTree.chain(8, [9, 10], draft_probs=torch.softmax(torch.randn(3, vocab), -1)),  # sampled chain
        DraftTree([5, 6, 7, 1, 2], [-1, 0, 0, 1, 2]),  # another sampled tree: two nodes per depth
    ]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=1.0, min_p=0.05),
    ]
    bases = [0, 4, 9, 17]
    logits = torch.randn(sum(t.size for t in trees), vocab) * 2
    rows = logits.split([t.size for t in trees])

    def by_position(k: int, seed: int) -> list[int]:
        # The token drawn at a node of depth d is the one plain sampling draws at output index base + d.
        tree, n = trees[k], trees[k].size
        lp = processed_logprobs(rows[k], [params[k]] * n)
        return gumbel_argmax(lp, [seed + 100 * k] * n, [bases[k] + d for d in tree.depths]).tolist()

    for seed in range(20):
        items = [
            VerifyItem(t, p, seed + 100 * k, base)
            for k, (t, p, base) in enumerate(zip(trees, params, bases, strict=True))
        ]
        got, _ = verify_batch(items, logits)
        uniforms, gumbel = chain_noise(torch.tensor([seed + 200]), torch.tensor([bases[2]]), 2, vocab)

        want = [
            verify_greedy(trees[0], rows[0].argmax(-1).tolist()),
            verify_tree_sampled(trees[1], by_position(1, seed)),
            verify_chain_block(
                trees[2],
                processed_logprobs(rows[2], [params[2]] * 3).exp(),
                ReplayRng(uniforms[0], gumbel[0]),
            ),
            verify_tree_sampled(trees[3], by_position(3, seed)),
        ]
        assert got == want


def test_batched_sampling_rule_has_the_sequential_rules_law():
    """verify_batch's positional Gumbel draws, one seed per request: the frequencies of (path, bonus)
    over many seeds match the exact law of `verify_tree` (a chi-square-style bound per outcome)."""
    from engines.sampling import SamplingParams
    from engines.verification import VerifyItem, verify_batch

    world = World(5)
    tree, probs = top_k_tree(world, [2, 2], ())
    want = exact_law(path_and_bonus(verify_tree, tree, probs))
    n = 3000
    params = SamplingParams(temperature=1.0)
    items = [VerifyItem(tree, params, seed, 7) for seed in range(n)]
    logits = probs.float().log().repeat(n, 1)
    counts: dict[tuple, int] = defaultdict(int)
    for res in verify_batch(items, logits)[0]:
        counts[(tuple(res.path), res.bonus)] += 1
    assert set(counts) <= set(want)
    for key, p in want.items():
        got = counts[key] / n
        assert abs(got - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9, (key, got, p)


class ReplayRng:
    """The decisions `verify_chains` makes from given numbers: the k-th bernoulli(p) is uniforms[k] < p,
    and categorical(w) is argmax(log w + gumbel)."""

    def __init__(self, uniforms: torch.Tensor, gumbel: torch.Tensor):
        self.uniforms = uniforms.tolist()
        self.gumbel = gumbel.double()
        self.taken = 0

    def bernoulli(self, p: float) -> bool:
        u = self.uniforms[self.taken]
        self.taken += 1
        return u < p

    def categorical(self, probs: torch.Tensor) -> int:
        return int((probs.double().log() + self.gumbel).argmax())


REFERENCE_CHAIN_VERIFIERS = {
    "rejection": verify_chain_rejection,
    "block": verify_chain_block,
    "hsd-published-lossy": verify_chain_hsd_published_lossy,
}


@pytest.mark.parametrize("rule", sorted(REFERENCE_CHAIN_VERIFIERS))
def test_batched_chain_verifiers_make_the_reference_decisions(rule):
    """verify_chains over a padded batch of chains of lengths 1-4 equals the reference verifier run chain by
    chain with the same random numbers, including targets that give a draft token probability 0."""
    from engines.verification import verify_chains

    g = torch.Generator().manual_seed(11)
    vocab, num, g_max = 7, 8, 4
    outcomes = set()
    for _ in range(150):
        lengths = torch.randint(1, g_max + 1, (num,), generator=g)
        target_logits = torch.randn(num, g_max + 1, vocab, generator=g) * 2
        target_logits[torch.rand(num, g_max + 1, vocab, generator=g) < 0.2] = -torch.inf  # filtered tokens
        target_logits[..., 0] = 0.0  # every row keeps a token
        target = target_logits.softmax(-1)
        q = (torch.randn(num, g_max + 1, vocab, generator=g) * 2).softmax(-1)
        draft = torch.multinomial(q[:, :g_max].reshape(-1, vocab), 1, generator=g).view(num, g_max)
        uniforms = torch.rand(num, g_max, generator=g, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(torch.rand(num, vocab, generator=g)))
        accepted, bonus = verify_chains(target, q, draft, lengths, uniforms, gumbel, rule)
        for r in range(num):
            n = int(lengths[r])
            tree = DraftTree.chain(-1, draft[r, :n].tolist(), draft_probs=q[r, : n + 1])
            want = REFERENCE_CHAIN_VERIFIERS[rule](tree, target[r, : n + 1], ReplayRng(uniforms[r], gumbel[r]))
            assert (int(accepted[r]), int(bonus[r])) == (want.num_accepted, want.bonus), (rule, r)
            outcomes.add((n, want.num_accepted))
    assert {(4, 0), (4, 4), (3, 1)} <= outcomes  # rejected first, all accepted, and in between


@pytest.mark.parametrize("rule", ["rejection", "block"])
def test_batched_chain_verification_keeps_the_target_law(rule):
    """verify_batch on stochastic chains, one seed per request: the frequencies of what a step emits over
    many seeds (the chain drawn from q, then verified with the counter-based draws) match the exact
    law of the reference verifier's step."""
    from engines.sampling import SamplingParams
    from engines.verification import VerifyItem, verify_batch

    world = World(2)
    want = exact_law(chain_step(world, REFERENCE_CHAIN_VERIFIERS[rule], ()))
    n = 4000
    params = SamplingParams(temperature=1.0)
    items, logits = [], []
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        draft: list[int] = []
        for _ in range(GAMMA):
            draft.append(int(torch.multinomial(world.q(tuple(draft)), 1, generator=gen)))
        prefixes = [tuple(draft[:t]) for t in range(GAMMA + 1)]
        tree = DraftTree.chain(-1, draft, draft_probs=torch.stack([world.q(pre) for pre in prefixes]).float())
        items.append(VerifyItem(tree, params, seed, 5))
        logits.append(torch.stack([world.p(pre) for pre in prefixes]).float().log())
    counts: dict[tuple, int] = defaultdict(int)
    for item, res in zip(items, verify_batch(items, torch.cat(logits), rule)[0], strict=True):
        counts[(*(item.tree.tokens[i] for i in res.path[1:]), res.bonus)] += 1
    assert set(counts) <= set(want)
    for key, p in want.items():
        got = counts[key] / n
        assert abs(got - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9, (key, got, p)


def fused_tree_step(world: World, out: tuple[int, ...]) -> Callable[[ForcedRng], tuple[int, ...]]:
    """Verification fusion: a fresh top-k tree merged with one built from a stale distribution."""
    from engines.draft_tree import merge_trees

    def build(kind: str, widths: list[int]) -> DraftTree:
        tokens, parents, prefixes, frontier = [-1], [-1], [out], [0]
        for k in widths:
            nxt = []
            for node in frontier:
                for x in torch.argsort(world.dist(kind, prefixes[node]), descending=True)[:k].tolist():
                    tokens.append(x)
                    parents.append(node)
                    prefixes.append((*prefixes[node], x))
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        return DraftTree(tokens, parents)

    def run(rng) -> tuple[int, ...]:
        tree = merge_trees(build("q", [2, 1]), build("stale", [1, 2]))
        prefixes = [out]
        for i in range(1, tree.size):
            prefixes.append((*prefixes[tree.parents[i]], tree.tokens[i]))
        res = verify_tree(tree, torch.stack([world.p(pre) for pre in prefixes]), rng)
        return (*(tree.tokens[i] for i in res.path[1:]), res.bonus)

    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_trees_are_exactly_lossless(seed):
    world = World(seed)
    law = decoding_law(lambda out: fused_tree_step(world, out))
    assert total_variation(law, world.target_law()) < 1e-9


class TokenRng:
    """An Rng that decides without reading any tensor: bernoulli(p) is p >= 0.5, categorical is token 0."""

    def bernoulli(self, p: float) -> bool:
        return p >= 0.5

    def categorical(self, probs: torch.Tensor) -> int:
        return 0


def test_reference_verifiers_copy_their_numbers_to_the_host_once(monkeypatch):
    """A verification's per-node and per-step numbers come to the host in one copy, whatever the tree's size
    or how far down the walk goes: every host read of a tensor is counted."""
    world = World(4)
    tree, probs = top_k_tree(world, [3, 2, 2], ())  # 1 + 3 + 6 + 12 nodes
    steps = [world.p(()) for _ in range(6)]
    chain = DraftTree.chain(-1, [0, 1, 2, 0, 1], draft_probs=torch.stack([world.q(()) for _ in range(6)]))
    reads: list[str] = []

    def counted(name: str) -> Callable:
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            reads.append(name)
            return original(self, *args)

        return read

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    cases = [(verify_tree, tree, probs)] + [(v, chain, torch.stack(steps)) for v in REFERENCE_CHAIN_VERIFIERS.values()]
    for verifier, draft, target in cases:
        reads.clear()
        verifier(draft, target, TokenRng())
        assert reads == ["tolist"], (verifier.__name__, reads)
    monkeypatch.undo()
    assert verify_tree(tree, probs, TokenRng()).num_accepted >= 2  # the walk went down the tree
