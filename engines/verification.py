"""Lossless verification of draft trees and chains against the target's distributions.

The reference verifiers take the target's processed distributions at the draft's nodes and draw
their random numbers from an `Rng` *after* the draft is fixed. Randomness enters only through
`Rng.bernoulli` and `Rng.categorical`, so the exact-enumeration tests can run these very functions
with an enumerating Rng and compute the law of their output exactly.

- `verify_greedy`: temperature 0; longest path of argmax matches, bonus = argmax at its end.
- `verify_tree`: deterministic (top-k / n-gram) trees at temperature > 0. At each node children are
  tried in order; child x is accepted with probability p(x) under the current p, else p(x) := 0
  and p is renormalised; with no child accepted the bonus is drawn from what is left of p; at a
  leaf it is drawn from the leaf's p. This samples exactly from p at every node (EAGLE, SGLang).
  Kept as the reference for:
- `verify_tree_by_sampling`: the rule the engine runs on deterministic trees. Draw the target's own
  token y ~ p at a node; if a child carries y, accept it and go on, else stop with bonus y (at a leaf,
  bonus = y). Child c is accepted with probability p(c) and bonus y emitted with probability p(y),
  exactly as in `verify_tree`: same law of (accepted path, bonus). In `verify_batch` the draw at a
  node of depth d is the Gumbel-max argmax(logp + G(seed, base + d)) (positional_random.py), the very
  draw plain decoding makes for output index base + d, so a seeded request emits the same tokens
  with speculation on or off, whatever the trees.
- `verify_chain_rejection`: stochastic chains (tokens drawn from q): token-wise rejection sampling.
- `verify_chain_block`: stochastic chains: block verification (accepts at least as much in expectation).
- `verify_chain_hsd_published_lossy`: the HSD paper's published rule, which accepts the whole draft
  with probability min(1, prod rho) instead of block verification's capped weight. It is NOT
  lossless (tests/engines/test_verification.py measures its drift); kept for comparison only.

Stochastic chains compare the draft with q, so they cannot reuse the target's positional draw. In
`verify_batch` they run together in `verify_chains`, which makes the reference verifiers' decisions
for all chains at once with counter-based random numbers keyed by (seed, the step's base position)
in streams of their own (`chain_noise`). The draft-model drafter draws the chains themselves from the
request's torch.Generator, so a seeded request's output is reproducible but not equal to the
unspeculated one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from engines.draft_tree import DraftTree
from engines.positional_random import gumbel_noise, seed_to_int64, uniform_noise
from engines.sampling import SamplingParams, processed_logprobs, vocab_argmax
from lyanna_kernels.dispatch import use_triton


class Rng(Protocol):
    """The random decisions a verifier may take."""

    def bernoulli(self, p: float) -> bool:
        """True with probability p."""
        ...

    def categorical(self, probs: torch.Tensor) -> int:
        """An index drawn with the given (unnormalised, non-negative) weights."""
        ...


class TorchRng:
    """`Rng` over a request's torch.Generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def bernoulli(self, p: float) -> bool:
        if p >= 1.0:
            return True
        if p <= 0.0:
            return False
        return torch.rand((), generator=self.generator, device=self.generator.device).item() < p

    def categorical(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.float(), 1, generator=self.generator).item())


@dataclass
class VerifyResult:
    """The accepted root-to-node path (node indices, root first) and the token that follows it."""

    path: list[int]
    bonus: int

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (the root is not a draft)."""
        return len(self.path) - 1


def follow_target(tree: DraftTree, target_token: Callable[[int], int]) -> VerifyResult:
    """Walk down from the root taking, at each node, the child whose token is the target's token at that
    node (`target_token(node)`, asked once per visited node); stop with that token as the bonus when no
    child carries it. Children with equal tokens: the first one in node order."""
    node = 0
    path = [0]
    children = tree.child_lists()
    while True:
        want = target_token(node)
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(path, want)
        node = nxt
        path.append(node)


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> VerifyResult:
    """Follow children equal to the target's argmax at each node (target_argmax: [n])."""
    return follow_target(tree, target_argmax.__getitem__)


def verify_tree_sampled(tree: DraftTree, sampled: list[int]) -> VerifyResult:
    """Follow children equal to the target's sampled token at each node (sampled: [n], the draw at a
    node of depth d being the one for output index base + d): the batched form of
    `verify_tree_by_sampling`."""
    return follow_target(tree, sampled.__getitem__)


def verify_tree_by_sampling(tree: DraftTree, target_probs: torch.Tensor, rng: Rng) -> VerifyResult:
    """Deterministic trees by sampling the target: one `rng.categorical(p_node)` per visited node, accept
    the child carrying it, else emit it as the bonus. Same law of (path, bonus) as `verify_tree`."""
    return follow_target(tree, lambda node: rng.categorical(target_probs[node]))


def _sequential_tests(tree: DraftTree, target_probs: torch.Tensor, children: list[list[int]]) -> list[list[float]]:
    """`verify_tree`'s numbers for every node, computed as tensors and copied to the host at once: node i
    with children c_1..c_m gets [M_0, p_0(x_1), M_1, p_1(x_2), ..., M_m], where p_j is its target row with
    the tokens x_1..x_j of its first j children set to 0 and M_j = p_j.sum() (each sum the same 1-D
    reduction the walk would make, so the numbers are bit for bit those of testing child by child)."""
    values: list[torch.Tensor] = []
    counts: list[int] = []
    for node, kids in enumerate(children):
        p = target_probs[node]
        for c in kids:
            x = tree.tokens[c]
            values += [p.sum(), p[x]]
            p = p.clone()
            p[x] = 0.0
        values.append(p.sum())
        counts.append(2 * len(kids) + 1)
    flat = torch.stack(values).tolist()  # the one host copy
    return [flat[a - n : a] for a, n in zip(accumulate(counts), counts, strict=True)]


def verify_tree(tree: DraftTree, target_probs: torch.Tensor, rng: Rng) -> VerifyResult:
    """Sequential acceptance down a deterministic tree (target_probs: [n, vocab], rows sum to 1). Every
    node's acceptance probabilities come to the host in one copy (`_sequential_tests`); the walk reads them."""
    children = tree.child_lists()
    tests = _sequential_tests(tree, target_probs, children)
    node = 0
    path = [0]
    while True:
        kids, numbers = children[node], tests[node]
        accepted, zeroed = None, 0  # zeroed: children rejected so far (their tokens' mass removed)
        for j, c in enumerate(kids):
            mass = numbers[2 * j]
            if mass <= 0:
                break
            if rng.bernoulli(numbers[2 * j + 1] / mass):
                accepted = c
                break
            zeroed = j + 1
        if accepted is None:
            p = target_probs[node]
            if zeroed and numbers[2 * zeroed] > 0:  # what is left of p (else all of p)
                p = p.clone()
                p[[tree.tokens[c] for c in kids[:zeroed]]] = 0.0
            return VerifyResult(path, rng.categorical(p))
        node = accepted
        path.append(node)


def _chain_tokens(tree: DraftTree) -> list[int]:
    if not tree.is_chain:
        raise ValueError("chain verification needs a chain draft")
    if tree.draft_probs is None:
        raise ValueError("stochastic verification needs the draft's probabilities q")
    return tree.tokens[1:]


def verify_chain_rejection(tree: DraftTree, target_probs: torch.Tensor, rng: Rng) -> VerifyResult:
    """Token-wise rejection sampling: accept x_t w.p. min(1, p/q); on rejection draw from (p - q)+. Every
    step's ratio and whether its residual has mass come to the host in one copy."""
    draft = _chain_tokens(tree)
    q = tree.draft_probs
    g = len(draft)
    p, q = target_probs[:g], q[:g].to(target_probs.device)
    idx = torch.tensor(draft, dtype=torch.int64, device=p.device)[:, None]
    p_x, q_x = p.gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]
    has_residual = ((p - q).clamp_min(0) > 0).any(-1)  # (p - q)+ sums to > 0 iff an entry is > 0
    ratios, q_pos, residual_pos = torch.stack([p_x / q_x, q_x > 0, has_residual]).tolist()  # one host copy
    for t in range(g):
        if not rng.bernoulli(min(1.0, ratios[t]) if q_pos[t] else 1.0):
            p_t = target_probs[t]
            residual = (p_t - tree.draft_probs[t]).clamp_min(0)
            return VerifyResult(list(range(t + 1)), rng.categorical(residual if residual_pos[t] else p_t))
    return VerifyResult(list(range(g + 1)), rng.categorical(target_probs[g]))


def block_weights(tree: DraftTree, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's capped path weights w_0..w_g and the log-ratio prefix sums s_0..s_g."""
    draft = _chain_tokens(tree)
    g = len(draft)
    device = target_probs.device
    idx, rows = torch.tensor(draft, device=device), torch.arange(g, device=device)
    p_x = target_probs[rows, idx].double()
    q_x = tree.draft_probs.to(device)[rows, idx].double()
    s = torch.cat(
        [torch.zeros(1, dtype=torch.float64, device=device), torch.cumsum(torch.log(p_x) - torch.log(q_x), 0)]
    )
    w = torch.exp(s - torch.cummax(s.clamp_min(0), 0).values)  # w_t = min(1, w_{t-1} rho_t)
    return w, s


def _block_verify(tree: DraftTree, target_probs: torch.Tensor, rng: Rng, published: bool) -> VerifyResult:
    """Block verification's decisions (`published`: the HSD paper's whole-chain probability instead); its
    numbers (the whole-chain probability, the h_t and the residual masses) come to the host in one copy."""
    draft = tree.tokens[1:]
    g = len(draft)
    w, s = block_weights(tree, target_probs)
    accept_all = torch.exp(s[-1]) if published else w[-1]
    p = target_probs[:g].double()
    q = tree.draft_probs[:g].to(p.device).double()
    res = (w[:g, None] * p - q).clamp_min(0)  # [g, vocab]
    S = res.sum(-1)
    denom = S + 1 - w[:g]
    h = torch.where(denom > 0, S / denom.clamp_min(1e-300), torch.ones_like(S))
    if g:
        h[0] = 1.0
    numbers = torch.cat([accept_all.double().reshape(1), h, S]).tolist()  # the one host copy
    accept, h_host, S_host = numbers[0], numbers[1 : g + 1], numbers[g + 1 :]
    if rng.bernoulli(min(1.0, accept) if published else accept):
        return VerifyResult(list(range(g + 1)), rng.categorical(target_probs[g]))
    tau = 0
    for t in range(1, g):  # tau = the last t with U_t < h_t
        if rng.bernoulli(h_host[t]):
            tau = t
    weights = res[tau] if S_host[tau] > 0 else p[tau]
    return VerifyResult(list(range(tau + 1)), rng.categorical(weights))


def verify_chain_block(tree: DraftTree, target_probs: torch.Tensor, rng: Rng) -> VerifyResult:
    """Block verification: accept the whole chain w.p. w_g, else the longest prefix by the h_t draws."""
    _chain_tokens(tree)
    return _block_verify(tree, target_probs, rng, published=False)


def verify_chain_hsd_published_lossy(tree: DraftTree, target_probs: torch.Tensor, rng: Rng) -> VerifyResult:
    """LOSSY: the HSD paper's published code, accepting the whole chain w.p. min(1, prod rho)."""
    _chain_tokens(tree)
    return _block_verify(tree, target_probs, rng, published=True)


CHAIN_VERIFIERS = {
    "rejection": verify_chain_rejection,
    "block": verify_chain_block,
    "hsd-published-lossy": verify_chain_hsd_published_lossy,
}


# Stochastic chains draw in streams of their own: positions offset by these never meet plain
# decoding's positional draws (output indices below 2**40).
CHAIN_ACCEPT_STREAM = 1 << 40
CHAIN_BONUS_STREAM = 1 << 41


def chain_noise(seeds: torch.Tensor, bases: torch.Tensor, slots: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of one stochastic-chain verification per row (seeds, bases: [R] int64): `slots`
    uniforms in (0, 1) for its accept tests ([R, slots] float64) and Gumbel noise for its bonus draw
    ([R, vocab] float32). A request's steps have distinct base positions (each emits a token), so no
    two verifications of a request share numbers."""
    uniforms = uniform_noise(seeds, bases + CHAIN_ACCEPT_STREAM, slots)
    return uniforms, gumbel_noise(seeds, bases + CHAIN_BONUS_STREAM, vocab)


def verify_chains(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft: torch.Tensor,
    lengths: torch.Tensor,
    uniforms: torch.Tensor,
    gumbel: torch.Tensor,
    rule: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`CHAIN_VERIFIERS[rule]` for R stochastic chains at once, on the device, given their random numbers.

    Chain r has lengths[r] draft tokens draft[r, :lengths[r]] ([R, G] int64, padded); target_probs and
    draft_probs are [R, G + 1, vocab] (rows past a chain's end are ignored). The reference verifier's
    k-th `rng.bernoulli(p)` of chain r is `uniforms[r, k] < p` ([R, >= G] float64 in (0, 1)), and its
    `rng.categorical(w)` is argmax(log w + gumbel[r]): with independent uniforms and Gumbel noise these
    are exact draws, and the decisions are the reference's. Returns the accepted counts [R] and the
    bonus tokens [R], int64 on the device.
    """
    num, g_max = draft.shape
    rows = torch.arange(num, device=draft.device)
    steps = torch.arange(g_max, device=draft.device)
    valid = steps[None, :] < lengths[:, None]
    p_x = target_probs[:, :g_max].gather(2, draft[..., None])[..., 0]
    q_x = draft_probs[:, :g_max].gather(2, draft[..., None])[..., 0]
    u = uniforms[:, :g_max]
    if rule == "rejection":
        ratio = torch.where(q_x > 0, p_x / q_x, torch.ones_like(p_x)).clamp_max(1.0)
        rejected = valid & ~(u < ratio)
        accepted = torch.where(rejected.any(1), rejected.int().argmax(1), lengths)
        p_row = target_probs[rows, accepted]
        q_row = draft_probs[rows, accepted] * (accepted < lengths)[:, None]  # none once all are accepted
        residual = (p_row - q_row).clamp_min(0)
        weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row).double()
    elif rule in ("block", "hsd-published-lossy"):
        log_ratio = torch.where(valid, p_x.double().log() - q_x.double().log(), 0.0)
        s = torch.cat([torch.zeros(num, 1, dtype=torch.float64, device=draft.device), log_ratio.cumsum(1)], 1)
        w = torch.exp(s - torch.cummax(s.clamp_min(0), 1).values)  # w_t = min(1, w_{t-1} rho_t)
        if rule == "block":
            accept_all = w[rows, lengths]
        else:  # LOSSY: the HSD paper's published rule
            accept_all = torch.exp(s[rows, lengths]).clamp_max(1.0)
        every = uniforms[:, 0] < accept_all

        def residual(w_t: torch.Tensor, p_t: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
            return (w_t[:, None] * p_t.double() - q_t.double()).clamp_min(0)

        # one [R, vocab] float64 residual at a time: all G at once would be G times the memory
        mass = torch.stack([residual(w[:, t], target_probs[:, t], draft_probs[:, t]).sum(-1) for t in range(g_max)], 1)
        denom = mass + 1 - w[:, :g_max]
        h = torch.where(denom > 0, mass / denom.clamp_min(1e-300), torch.ones_like(mass))
        passed = valid & (steps[None, :] >= 1) & (u < h)  # tau = the last t >= 1 with U_t < h_t, else 0
        tau = torch.where(passed.any(1), g_max - 1 - passed.flip(1).int().argmax(1), 0)
        p_tau = target_probs[rows, tau]
        res_tau = residual(w[rows, tau], p_tau, draft_probs[rows, tau])
        partial = torch.where(mass[rows, tau][:, None] > 0, res_tau, p_tau.double())
        weights = torch.where(every[:, None], target_probs[rows, lengths].double(), partial)
        accepted = torch.where(every, lengths, tau)
    else:
        raise ValueError(f"unknown chain verifier {rule!r}; choose one of {sorted(CHAIN_VERIFIERS)}")
    bonus = (weights.log() + gumbel.double()).argmax(-1)
    return accepted, bonus


def _chain_arrays(items: list[VerifyItem], logits: torch.Tensor, offsets: list[int]) -> dict[str, torch.Tensor]:
    """`verify_chains`' inputs for the stochastic chains `items`, whose nodes start at `offsets` in logits."""
    device, vocab = logits.device, logits.shape[-1]
    lengths = [it.tree.num_draft for it in items]
    g_max = max(1, *lengths)
    node_rows = [off + min(t, g) for off, g in zip(offsets, lengths, strict=True) for t in range(g_max + 1)]
    params = [it.params for it in items for _ in range(g_max + 1)]
    host = torch.tensor(
        [
            *node_rows,
            *(x for it, g in zip(items, lengths, strict=True) for x in it.tree.tokens[1:] + [0] * (g_max - g)),
            *lengths,
            *(seed_to_int64(it.seed) for it in items),
            *(it.base_position for it in items),
        ],
        dtype=torch.int64,
    ).to(device, non_blocking=True)
    node_rows_t, draft, lengths_t, seeds, bases = host.split([len(node_rows), len(items) * g_max, *[len(items)] * 3])
    target = processed_logprobs(logits[node_rows_t], params).exp().view(len(items), g_max + 1, vocab)
    q = torch.nn.utils.rnn.pad_sequence(
        [it.tree.draft_probs[: g + 1].to(device, torch.float32) for it, g in zip(items, lengths, strict=True)],
        batch_first=True,
    )
    q = torch.nn.functional.pad(q, (0, 0, 0, g_max + 1 - q.shape[1]))
    uniforms, gumbel = chain_noise(seeds, bases, g_max, vocab)
    return {
        "target_probs": target,
        "draft_probs": q,
        "draft": draft.view(len(items), g_max),
        "lengths": lengths_t,
        "uniforms": uniforms,
        "gumbel": gumbel,
    }


def _chains_on_device(
    items: list[VerifyItem], offsets: list[int], chains: list[int], logits: torch.Tensor, chain_verifier: str
) -> torch.Tensor:
    """The accepted counts then bonus tokens of the stochastic chains items[i] for i in `chains` (node
    rows from offsets[i] in logits), [2 * len(chains)] int64 on the device."""
    arrays = _chain_arrays([items[i] for i in chains], logits, [offsets[i] for i in chains])
    accepted, bonus = verify_chains(**arrays, rule=chain_verifier)
    return torch.cat([accepted, bonus])


def chain_results(host: list[int]) -> list[VerifyResult]:
    """`_chains_on_device`' output, copied to the host, as each chain's accepted path and bonus."""
    num = len(host) // 2
    return [VerifyResult(list(range(a + 1)), b) for a, b in zip(host[:num], host[num:], strict=True)]


@dataclass
class VerifyItem:
    """One request's draft and how to judge it.

    `seed` and `base_position` fix the target's draws at temperature > 0: on a deterministic tree a node
    at depth d draws with the noise of (seed, base_position + d), where base_position is the number of
    output tokens the request had before this step; a stochastic chain's decisions use the noise of
    `chain_noise(seed, base_position)`.
    """

    tree: DraftTree
    params: SamplingParams
    seed: int
    base_position: int


def walk_sampled_trees(items: list[VerifyItem], logits: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The positional sampling rule on deterministic trees at temperature > 0, for all of `items` at
    once and on the device: level by level, each request's current node draws the target's token
    (Gumbel-max with the noise of (seed, base + level)) and moves to the child that carries it. Only
    the visited nodes are processed and drawn (one row per request and level, not one per node).

    logits: the step's [total nodes, vocab]; offsets: each item's first node row. Returns, on the
    device, [items, 2, levels]: the visited global node rows (root first, -1 once stopped) and the
    token drawn at each (the last one drawn at a visited node is the bonus); `walked_results` reads it.
    """
    device, vocab = logits.device, logits.shape[-1]
    children = [it.tree.child_lists() for it in items]
    width = max((len(c) for kids in children for c in kids), default=0) or 1
    # [total nodes, width]: each node's children as global rows and their tokens (-1: none)
    total = logits.shape[0]
    child = [[[-1] * width for _ in range(total)] for _ in range(2)]  # built on the host, moved in one copy
    for it, kids, off in zip(items, children, offsets, strict=True):
        for node, cs in enumerate(kids):
            for k, c in enumerate(cs):
                child[0][off + node][k] = off + c
                child[1][off + node][k] = it.tree.tokens[c]
    child_row, child_tok = torch.tensor(child, dtype=torch.int64).to(device, non_blocking=True)
    seeds = torch.tensor([seed_to_int64(it.seed) for it in items], dtype=torch.int64, device=device)
    base = torch.tensor([it.base_position for it in items], dtype=torch.int64, device=device)
    params = [it.params for it in items]
    node = torch.tensor(offsets[: len(items)], dtype=torch.int64, device=device)  # each root
    alive = torch.ones(len(items), dtype=torch.bool, device=device)
    visited, drawn = [], []
    for level in range(max(it.tree.depth for it in items) + 1):
        logprobs = processed_logprobs(logits[node], params)
        token = vocab_argmax(logprobs + gumbel_noise(seeds, base + level, vocab))
        visited.append(torch.where(alive, node, -1))
        drawn.append(token)
        match = (child_tok[node] == token[:, None]) & alive[:, None]  # a request that stopped stays put
        alive = match.any(-1)
        node = torch.where(alive, child_row[node].gather(1, match.int().argmax(-1, keepdim=True))[:, 0], node)
    return torch.stack([torch.stack(visited, 1), torch.stack(drawn, 1)], 1)


def walk_trees(
    target_tokens: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    offsets: torch.Tensor,
    levels: int,
    max_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`follow_target` for a flattened batch of trees on the device: tree r owns nodes
    offsets[r]:offsets[r + 1] ([N] int64 target tokens, draft tokens and parents within the tree);
    `levels` >= the deepest tree's depth + 1, `max_size` >= the largest tree. Returns the accepted
    paths [R, levels] (node indices within each tree, root first, -1 after the end) and the bonus
    tokens [R]. Runs the Triton kernel of `lyanna_kernels/tree_walk.py` where `use_triton` says so."""
    if use_triton(target_tokens):
        from lyanna_kernels.tree_walk import triton_walk_trees

        return triton_walk_trees(target_tokens, tree_tokens, parents, offsets, levels, max_size)
    device = target_tokens.device
    num_trees, total = offsets.shape[0] - 1, tree_tokens.shape[0]
    tree_of = torch.repeat_interleave(torch.arange(num_trees, device=device), offsets[1:] - offsets[:-1])
    parent_row = torch.where(parents >= 0, parents + offsets[tree_of], -1)  # [N] global parent rows
    node_ids = torch.arange(total, device=device)
    node = offsets[:-1].clone()  # [R] current global rows
    walking = torch.ones(num_trees, dtype=torch.bool, device=device)
    path = torch.full((num_trees, levels), -1, dtype=torch.int64, device=device)
    bonus = torch.zeros(num_trees, dtype=torch.int64, device=device)
    for level in range(levels):
        want = target_tokens[node]
        path[:, level] = torch.where(walking, node - offsets[:-1], -1)
        match = (parent_row[None, :] == node[:, None]) & (tree_tokens[None, :] == want[:, None])
        child = torch.where(match, node_ids, total).min(1).values
        found = child < total
        bonus = torch.where(walking & ~found, want, bonus)
        walking = walking & found
        node = torch.where(walking, child, node)
    return path, bonus


def walked_results(walk: list[list[list[int]]], offsets: list[int]) -> list[VerifyResult]:
    """`walk_sampled_trees`' output, copied to the host, as each tree's accepted path and bonus."""
    results = []
    for off, (rows, tokens) in zip(offsets, walk, strict=True):
        n = sum(r >= 0 for r in rows)
        results.append(VerifyResult([r - off for r in rows[:n]], tokens[n - 1]))
    return results


def _is_chain(item: VerifyItem) -> bool:
    """A stochastic chain at temperature > 0 (a draft model's sampled draft), verified by `verify_chains`."""
    return not item.params.greedy and item.tree.draft_probs is not None


def verify_batch(
    items: list[VerifyItem], logits: torch.Tensor, chain_verifier: str = "block", also: torch.Tensor | None = None
) -> tuple[list[VerifyResult], list[int]]:
    """Verify every request's draft of a step against the target's logits at all their nodes.

    logits: [sum of tree sizes, vocab] fp32, the requests' nodes concatenated in order. The tensor
    work runs once for the batch: argmax for greedy rows; for deterministic trees at temperature > 0
    the level-by-level walk of `walk_sampled_trees`, which draws only at the nodes it visits, with
    the noise of (seed, base + depth); for stochastic chains `verify_chains` with `chain_verifier`'s
    rule. All come to the host in one copy, with `also` (the step's other sampled tokens, [M] int64 on
    the device), returned as a list beside the results.
    """
    if use_triton(logits):
        return _verify_batch_walking(items, logits, chain_verifier, also)
    sizes = [it.tree.size for it in items]
    offsets = [0, *accumulate(sizes)]
    chains = [i for i, it in enumerate(items) if _is_chain(it)]
    trees = [i for i, it in enumerate(items) if not it.params.greedy and not _is_chain(it)]
    tree_offsets = [offsets[i] for i in trees]
    on_device = [vocab_argmax(logits)]
    if trees:
        on_device.append(walk_sampled_trees([items[i] for i in trees], logits, tree_offsets).flatten())
    if chains:
        on_device.append(_chains_on_device(items, offsets, chains, logits, chain_verifier))
    if also is not None:
        on_device.append(also)
    host = torch.cat(on_device).tolist()  # the one host copy of the step's verification
    greedy, host = host[: len(logits)], host[len(logits) :]
    walk_len = 2 * (max(items[i].tree.depth for i in trees) + 1) * len(trees) if trees else 0
    walk, host = host[:walk_len], host[walk_len:]
    chained, also_host = host[: 2 * len(chains)], host[2 * len(chains) :]
    results: dict[int, VerifyResult] = dict(zip(chains, chain_results(chained), strict=True))
    if trees:
        levels = walk_len // (2 * len(trees))
        by_tree = [[walk[k : k + levels], walk[k + levels : k + 2 * levels]] for k in range(0, walk_len, 2 * levels)]
        results.update(zip(trees, walked_results(by_tree, tree_offsets), strict=True))
    for i, it in enumerate(items):
        if it.params.greedy:
            results[i] = verify_greedy(it.tree, greedy[offsets[i] : offsets[i + 1]])
    return [results[i] for i in range(len(items))], also_host


def _verify_batch_walking(
    items: list[VerifyItem], logits: torch.Tensor, chain_verifier: str, also: torch.Tensor | None
) -> tuple[list[VerifyResult], list[int]]:
    """`verify_batch` with the target's token drawn at every node (argmax, or the positional draw for
    the node's depth) and one `walk_trees` over all greedy and deterministic trees: a fixed number of
    device operations, whatever the trees' depths (the GPU path)."""
    device = logits.device
    sizes = [it.tree.size for it in items]
    offsets = [0, *accumulate(sizes)]
    walked = [i for i, it in enumerate(items) if not _is_chain(it)]
    sampled = [i for i in walked if not items[i].params.greedy]
    nodes = [(i, node) for i in walked for node in range(sizes[i])]
    host_rows = [offsets[i] + node for i, node in nodes]
    host = [
        host_rows,
        [items[i].tree.tokens[node] for i, node in nodes],
        [items[i].tree.parents[node] for i, node in nodes],
    ]
    drawn_rows = [offsets[i] + node for i in sampled for node in range(sizes[i])]
    host.append(drawn_rows)
    host.append([seed_to_int64(items[i].seed) for i in sampled for _ in range(sizes[i])])
    host.append([items[i].base_position + d for i in sampled for d in items[i].tree.depths])
    walk_offsets = [0, *accumulate(sizes[i] for i in walked)]
    lengths = [len(h) for h in host] + [len(walk_offsets)]
    flat = torch.tensor([x for h in host for x in h] + walk_offsets, dtype=torch.int64).to(device, non_blocking=True)
    rows, tokens, parents, drawn, seeds, positions, walk_off = flat.split(lengths)
    target = vocab_argmax(logits)
    if sampled:
        params = [items[i].params for i in sampled for _ in range(sizes[i])]
        logprobs = processed_logprobs(logits[drawn], params)
        target = target.index_copy(0, drawn, vocab_argmax(logprobs + gumbel_noise(seeds, positions, logits.shape[-1])))
    on_device = []
    levels = max((items[i].tree.depth for i in walked), default=0) + 1
    if walked:
        largest = max(sizes[i] for i in walked)
        path, bonus = walk_trees(target[rows], tokens, parents, walk_off, levels, largest)
        on_device += [path.flatten(), bonus]
    chains = [i for i, it in enumerate(items) if _is_chain(it)]
    if chains:
        on_device.append(_chains_on_device(items, offsets, chains, logits, chain_verifier))
    if also is not None:
        on_device.append(also)
    host_out = torch.cat(on_device).tolist() if on_device else []  # the one host copy
    results: dict[int, VerifyResult] = {}
    for r, i in enumerate(walked):
        nodes_r = host_out[r * levels : (r + 1) * levels]
        results[i] = VerifyResult([n for n in nodes_r if n >= 0], host_out[len(walked) * levels + r])
    host_out = host_out[len(walked) * (levels + 1) :]
    results.update(zip(chains, chain_results(host_out[: 2 * len(chains)]), strict=True))
    also_host = host_out[2 * len(chains) :]
    return [results[i] for i in range(len(items))], also_host
