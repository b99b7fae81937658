"""Lyanna's token-info injected tree sampling (paper Algorithm 1) and re-sampling (Algorithm 2).

The drafter computes its hidden-state trajectory h_1..h_N once, independent of the sampled tokens,
and one LM-head GEMM turns it into per-depth logits l_1..l_N. Token information enters only here:
a node with token t sees depth i's logits as softmax(l_i + r(t)), where r(t) = RMSNorm(E'(t)) is a
table lookup. Every frontier node contributes its top-k children to the tree; only the k children
with the highest joint probability become the next frontier, so the tree grows by k^2 nodes per
depth rather than exponentially. Re-sampling reuses the logits of the depths past a rejection with
the bonus token's information, building a new tree without another drafter forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.draft_tree import DraftTree

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
