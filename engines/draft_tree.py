"""Draft trees: the candidate continuations a drafter proposes for one request in one step.

Node 0 is the root: the request's last token, which is not in the KV cache yet (its K/V are
computed in the verification forward). Every other node is a draft token whose parent is an
earlier node, so parents[i] < i. The target's logits at node i are its prediction for i's
children. A chain is the tree where parents[i] = i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Tokens and shape of a draft tree, with the drafter's confidence in each node."""

    tokens: list[int]  # [n] node 0 is the root (last committed token)
    parents: list[int]  # [n] parents[0] = -1, parents[i] < i
    scores: list[float] | None = None  # [n] path score (joint draft probability); root = 1
    draft_probs: torch.Tensor | None = None  # [n, vocab] q at each node (stochastic drafts), else None
    depths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per token")
        depths = [0]
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depths.append(depths[p] + 1)
        self.depths = depths

    @classmethod
    def chain(
        cls, root: int, draft: list[int], scores: list[float] | None = None, draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        """A single path root -> draft[0] -> draft[1] -> ..."""
        n = len(draft) + 1
        return cls([root, *draft], list(range(-1, n - 1)), scores, draft_probs)

    @property
    def size(self) -> int:
        """Nodes including the root."""
        return len(self.tokens)

    @property
    def num_draft(self) -> int:
        """Draft tokens (nodes other than the root)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        """Longest root-to-leaf path in draft tokens."""
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        """Whether every node has at most one child."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        """Children of `node`, in node order (the drafter's preference order)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def child_lists(self) -> list[list[int]]:
        """Every node's children, in node order (one pass over the tree)."""
        children: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents[1:], 1):
            children[p].append(i)
        return children

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def attention_mask(self) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j iff j is i or one of its ancestors."""
        from engines.attention import tree_mask

        return tree_mask(self.parents)

    def positions(self, base: int) -> list[int]:
        """Position ids: the root sits at `base`, a node at depth d at `base + d`."""
        return [base + d for d in self.depths]

    def prune(self, budget: int, ranking: list[float] | None = None) -> DraftTree:
        """Keep at most `budget` nodes (root included) with the highest path scores, or the highest
        values of `ranking` (one per node, never above the parent's; the scores are kept as they are).

        Path scores never grow along a path, so the kept set is closed under ancestors; ties are
        broken by node order, which also lists parents before children.
        """
        if budget >= self.size:
            return self
        if budget < 1:
            raise ValueError("budget must keep at least the root")
        scores = ranking or self.scores or [1.0 / (1 + d) for d in self.depths]
        order = sorted(range(1, self.size), key=lambda i: (-scores[i], i))
        keep = {0}
        for i in order:
            if len(keep) == budget:
                break
            if self.parents[i] in keep:
                keep.add(i)
        return self._select(sorted(keep))

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than `max_depth` draft tokens."""
        if self.depth <= max_depth:
            return self
        return self._select([i for i in range(self.size) if self.depths[i] <= max_depth])

    def subtree(self, kept: list[int]) -> DraftTree:
        """The tree of the nodes `kept` (ascending, the root first, closed under ancestors), renumbered;
        scores and draft probabilities follow their nodes."""
        chosen = set(kept)
        if not kept or kept[0] != 0 or any(self.parents[i] not in chosen for i in kept[1:]):
            raise ValueError("a subtree keeps the root and every kept node's parent")
        return self._select(kept)

    def _select(self, kept: list[int]) -> DraftTree:
        """The subtree of the given nodes (ascending, closed under ancestors), renumbered."""
        index = {old: new for new, old in enumerate(kept)}
        return DraftTree(
            tokens=[self.tokens[i] for i in kept],
            parents=[index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept],
            scores=None if self.scores is None else [self.scores[i] for i in kept],
            draft_probs=None if self.draft_probs is None else self.draft_probs[kept],
        )


def merge_trees(a: DraftTree, b: DraftTree) -> DraftTree:
    """The union of two trees with the same root token (verification fusion): paths are merged
    token by token, a node shared by both keeps the higher score. `a`'s nodes come first."""
    if a.tokens[0] != b.tokens[0]:
        raise ValueError("only trees with the same root can be merged")
    if a.draft_probs is not None or b.draft_probs is not None:
        raise ValueError("stochastic drafts cannot be merged")
    tokens, parents, scores = list(a.tokens), list(a.parents), list(a.scores or [1.0] * a.size)
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    b_scores = b.scores or [1.0] * b.size
    where = {0: 0}  # node of b -> node of the union
    for i in range(1, b.size):
        parent = where[b.parents[i]]
        key = (parent, b.tokens[i])
        if key in child_of:
            node = child_of[key]
            scores[node] = max(scores[node], b_scores[i])
        else:
            tokens.append(b.tokens[i])
            parents.append(parent)
            scores.append(b_scores[i])
            node = child_of[key] = len(tokens) - 1
        where[i] = node
    return DraftTree(tokens, parents, scores)
