"""Lyanna's token-info injected tree sampling (paper Algorithm 1) and re-sampling (Algorithm 2).

The drafter computes its hidden-state trajectory h_1..h_N once, independent of the sampled tokens,
and one LM-head GEMM turns it into per-depth logits l_1..l_N. Token information enters only here:
a node with token t sees depth i's logits as softmax(l_i + r(t)), where r(t) = RMSNorm(E'(t)) is a
table lookup. Every frontier node contributes its top-k children to the tree; only the k children
with the highest joint probability become the next frontier, so the tree grows by k^2 nodes per
depth rather than exponentially. Re-sampling reuses the logits of the depths past a rejection with
the bonus token's information, building a new tree without another drafter forward.

`build_subtrees` runs Algorithm 1 for many requests at once on the logits' device, with a single
device-to-host copy; `build_subtree` is the one-request reference it must match node for node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby

import torch

from engines.draft_tree import DraftTree
from engines.drafters.token_info import TokenInfoTable
from lyanna_kernels.dispatch import use_triton

TokenInfo = Callable[[torch.Tensor], torch.Tensor]  # [F] token ids -> [F, vocab] logit offsets


def top_candidates(scores: list[float], k: int) -> list[int]:
    """Indices of the k highest scores (ties: first listed), in listing order: the next frontier."""
    return sorted(sorted(range(len(scores)), key=lambda c: (-scores[c], c))[:k])


def build_subtree(
    logits: torch.Tensor, root: int, token_info: TokenInfo | None, k: int, d2t: torch.Tensor | None = None
) -> DraftTree:
    """Algorithm 1's BuildSubtree over logits [steps, vocab]; node scores are joint probabilities.

    With a hot vocabulary, logits column i stands for target token `d2t[i]`; trees always hold
    target token ids.

    `token_info` None samples without token information (the paper's ablation): every frontier
    node then sees the same logits.

    Nodes are listed depth by depth, and within a depth by parent then by rank, so parents always
    come before their children.
    """
    tokens, parents, scores = [root], [-1], [1.0]
    frontier = [0]  # node indices
    frontier_tokens = torch.tensor([root], device=logits.device)
    frontier_scores = torch.ones(1, device=logits.device)
    for step in range(logits.shape[0]):
        raw = logits[step].float().unsqueeze(0)
        z = raw if token_info is None else raw + token_info(frontier_tokens).float()  # [F or 1, vocab]
        top_z, top_tok = z.topk(k, dim=-1)
        top_p = (top_z - z.logsumexp(-1, keepdim=True)).exp().expand(len(frontier), k)  # softmax's top-k
        top_tok = top_tok.expand(len(frontier), k)
        if d2t is not None:
            top_tok = d2t[top_tok]
        joint = (frontier_scores.unsqueeze(1) * top_p).flatten()  # [F * k]
        new_tokens, new_scores = top_tok.flatten(), joint.tolist()
        first_new = len(tokens)
        tokens += new_tokens.tolist()
        parents += [node for node in frontier for _ in range(k)]
        scores += new_scores
        # The next frontier: the k candidates with the highest joint probability (ties: first listed).
        keep = top_candidates(new_scores, k)
        frontier = [first_new + c for c in keep]
        index = torch.tensor(keep, device=logits.device)
        frontier_tokens, frontier_scores = new_tokens[index], joint[index]
    return DraftTree(tokens, parents, scores)


class TreeLevels:
    """Draft-tree levels grown on the device for several requests, brought to the host in one copy.

    Each `add` appends one depth's new nodes for some requests; a request's levels must be added in
    depth order. `trees` copies everything to the host at once and builds the `DraftTree`s there.
    """

    def __init__(self, roots: Sequence[int]):
        self.roots = list(roots)
        self.blocks: list[tuple[list[int], torch.Tensor]] = []  # (request indices, [n, 3, w] int32)

    def add(self, rows: list[int], tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> None:
        """New nodes of requests `rows`: tokens, parent node indices and joint scores, each [len(rows), w]."""
        packed = torch.stack([tokens.int(), parents.int(), scores.float().view(torch.int32)], dim=1)
        self.blocks.append((rows, packed))

    def trees(self) -> list[DraftTree]:
        """One tree per root, from a single device-to-host copy of every level."""
        tokens = [[root] for root in self.roots]
        parents = [[-1] for _ in self.roots]
        scores = [[1.0] for _ in self.roots]
        if self.blocks:
            host = torch.cat([packed.flatten() for _, packed in self.blocks]).cpu()  # the one copy
            ints, floats = host.tolist(), host.view(torch.float32).tolist()
            offset = 0
            for rows, packed in self.blocks:
                w = packed.shape[2]
                for r in rows:
                    tokens[r] += ints[offset : offset + w]
                    parents[r] += ints[offset + w : offset + 2 * w]
                    scores[r] += floats[offset + 2 * w : offset + 3 * w]
                    offset += 3 * w
        return [DraftTree(t, p, s) for t, p, s in zip(tokens, parents, scores, strict=True)]


def next_frontier(joint: torch.Tensor, k: int) -> torch.Tensor:
    """`top_candidates` for each row of joint scores [n, c]: [n, k] candidate indices, ascending."""
    order = joint.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def expand_depth(
    raw: torch.Tensor,
    frontier_tokens: torch.Tensor,
    frontier_scores: torch.Tensor,
    token_info: TokenInfo | None,
    k: int,
    d2t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One depth of Algorithm 1 for n requests: raw [n, vocab] fp32 logits of the depth, each request's
    frontier tokens and joint scores [n, F]. Returns the candidates' tokens and joint probabilities
    [n, F * k] (frontier node by node, each node's top k by rank) and the next frontier, `next_frontier`
    of the joint scores ([n, k]). A collapsed token-info table (or none) runs the Triton kernels of
    `lyanna_kernels/token_info_expansion.py` where `use_triton` says so."""
    if use_triton(raw) and (token_info is None or isinstance(token_info, TokenInfoTable)):
        from lyanna_kernels.token_info_expansion import triton_expand_depth

        return triton_expand_depth(raw, frontier_tokens, frontier_scores, token_info, k, d2t)
    n, f = frontier_tokens.shape
    z = raw.float().unsqueeze(1)  # [n, 1, vocab]
    if token_info is not None:
        z = z + token_info(frontier_tokens.flatten()).float().view(n, f, -1)
    top_z, top_tok = z.topk(k, dim=-1)  # [n, F or 1, k]
    top_p = (top_z - z.logsumexp(-1, keepdim=True)).exp().expand(n, f, k)  # softmax's top-k
    top_tok = top_tok.expand(n, f, k)
    if d2t is not None:
        top_tok = d2t[top_tok]
    joint = (frontier_scores.unsqueeze(2) * top_p).flatten(1)  # [n, F * k]
    return top_tok.flatten(1), joint, next_frontier(joint, k)


def build_subtrees(
    logits: Sequence[torch.Tensor],
    roots: Sequence[int],
    token_info: TokenInfo | None,
    widths: Sequence[int],
    d2t: torch.Tensor | None = None,
) -> list[DraftTree]:
    """`build_subtree` for several requests at once: request r's logits are [steps_r, vocab], its
    width widths[r]; the same trees, node for node.

    Requests of one width grow together, every depth in tensor operations on the logits' device
    (a request with fewer steps stops growing); the trees come to the host in one copy at the end.
    """
    steps = [lg.shape[0] for lg in logits]
    # Requests of one width form a contiguous run, most steps first, so a depth's growing requests
    # are a prefix of their run.
    order = sorted((r for r in range(len(roots)) if steps[r] > 0), key=lambda r: (widths[r], -steps[r]))
    levels = TreeLevels(roots)
    if not order:
        return levels.trees()
    device = logits[order[0]].device
    root_tokens = torch.tensor([roots[r] for r in order], device=device)  # one host-to-device copy
    start = 0
    for k, members in groupby(order, key=lambda r: widths[r]):
        group = list(members)
        padded = torch.nn.utils.rnn.pad_sequence([logits[r] for r in group], batch_first=True).float()
        roots_k = root_tokens[start : start + len(group)]
        _grow_levels(levels, group, padded, [steps[r] for r in group], roots_k, token_info, k, d2t)
        start += len(group)
    return levels.trees()


def _grow_levels(
    levels: TreeLevels,
    rows: list[int],
    logits: torch.Tensor,
    steps: list[int],
    roots: torch.Tensor,
    token_info: TokenInfo | None,
    k: int,
    d2t: torch.Tensor | None,
) -> None:
    """Algorithm 1 for requests of one width, `steps` descending: logits [n, max steps, vocab], roots [n].
    At width 1 each row's top token and its probability are the whole step (no frontier to select)."""
    if k == 1 and not use_triton(logits):  # chains: one node per request and depth, the child of the last
        tokens, scores = roots, torch.ones(roots.shape, device=logits.device)
        for step in range(steps[0]):
            a = sum(1 for s in steps if s > step)  # requests still growing
            z = logits[:a, step]
            if token_info is not None:
                z = z + token_info(tokens[:a]).float()
            top_z, top = z.max(dim=-1)  # the first maximum, as `topk(1)` and `top_candidates` take it
            scores = scores[:a] * (top_z - z.logsumexp(-1)).exp()
            tokens = top if d2t is None else d2t[top]
            parents = torch.full((a, 1), step, dtype=torch.int32, device=logits.device)  # node `step`: the last
            levels.add(rows[:a], tokens.unsqueeze(1), parents, scores.unsqueeze(1))
        return
    frontier_tokens = roots.unsqueeze(1)  # [n, F]
    frontier_nodes = torch.zeros_like(frontier_tokens)
    frontier_scores = torch.ones(frontier_tokens.shape, device=logits.device)
    first_new = 1
    for step in range(steps[0]):
        a = sum(1 for s in steps if s > step)  # requests still growing
        f = frontier_tokens.shape[1]
        frontier = (frontier_tokens[:a], frontier_scores[:a])
        tokens, joint, keep = expand_depth(logits[:a, step], *frontier, token_info, k, d2t)
        levels.add(rows[:a], tokens, frontier_nodes[:a].unsqueeze(2).expand(a, f, k).flatten(1), joint)
        frontier_nodes = first_new + keep
        frontier_tokens, frontier_scores = tokens.gather(1, keep), joint.gather(1, keep)
        first_new += f * k


def token_info_tree(
    logits: torch.Tensor, root: int, token_info: TokenInfo | None, k: int, budget: int, d2t: torch.Tensor | None = None
) -> DraftTree:
    """Algorithm 1: the full tree from the last verified token, pruned to `budget` draft tokens."""
    return build_subtree(logits, root, token_info, k, d2t).prune(budget + 1)


def resample_tree(
    remaining_logits: torch.Tensor,
    bonus: int,
    token_info: TokenInfo | None,
    k: int,
    threshold: int,
    d2t: torch.Tensor | None = None,
) -> DraftTree:
    """Algorithm 2: after a rejection, a tree rooted at the bonus token from the logits of the depths
    past the rejection (no drafter forward); just the root when `threshold` or fewer steps remain."""
    if remaining_logits.shape[0] > threshold:
        return build_subtree(remaining_logits, bonus, token_info, k, d2t)
    return DraftTree([bonus], [-1], [1.0])
