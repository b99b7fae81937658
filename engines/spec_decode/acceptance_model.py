"""Acceptance model: how likely each draft node is to be accepted, calibrated online.

A drafter scores each tree node with its path score (the joint draft probability of the path).
Those scores are not the target's acceptance probabilities, so they are calibrated twice:

- per depth, globally: `k_d` = (observed acceptances at depth d) / (sum of raw scores at depth d),
  both as moving averages over verified trees, so `k_d · score` estimates P(node accepted);
- per request: `m_r` = (observed accepted tokens) / (tokens the globally calibrated model
  predicted), moving averages shrunk toward one by a prior, so a request whose drafts keep failing (an
  unusual domain, a high temperature) sees its estimates shrink and stops paying for drafts; its
  evidence fades while it does not draft, so it is tried again after a while.

A node's estimate is `min(k_d · score · m_r, its parent's estimate)`: never above its parent's, so
choosing nodes by estimate keeps a tree closed under ancestors. Drafters that give no scores (all
nodes 1.0) get per-depth acceptance rates learned from scratch the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.draft_tree import DraftTree


@dataclass
class _RequestCalibration:
    observed: float = 0.0
    predicted: float = 0.0


@dataclass
class AcceptanceModel:
    """Calibrated node acceptance estimates; `observe` after every verification."""

    decay: float = 0.02  # weight of one verified tree in the global per-depth averages
    request_decay: float = 0.1  # weight of one verified tree in a request's multiplier
    prior: float = 4.0  # pseudo-tokens behind a request multiplier of 1 before it has history
    observed_by_depth: list[float] = field(default_factory=list)  # moving averages per depth (1-based)
    scores_by_depth: list[float] = field(default_factory=list)
    requests: dict[str, _RequestCalibration] = field(default_factory=dict)
    predicted_mean: float = 0.0  # moving averages of a verified tree's predicted and observed accepted tokens
    observed_mean: float = 0.0

    def depth_factor(self, depth: int) -> float:
        """k_d: observed acceptances per unit of raw score at that depth (1.0 before any data)."""
        if depth > len(self.scores_by_depth) or self.scores_by_depth[depth - 1] <= 0:
            return 1.0 if not self.scores_by_depth else self.depth_factor(len(self.scores_by_depth))
        return self.observed_by_depth[depth - 1] / self.scores_by_depth[depth - 1]

    def request_factor(self, request_id: str) -> float:
        """m_r: the request's observed over predicted accepted tokens, shrunk toward 1."""
        cal = self.requests.get(request_id)
        if cal is None:
            return 1.0
        return (cal.observed + self.prior) / (cal.predicted + self.prior)

    def node_estimates(self, request_id: str, tree: DraftTree, per_request: bool = True) -> list[float]:
        """P(node accepted) for every node of the tree (the root: 1.0)."""
        scores = tree.scores or [1.0] * tree.size
        m = self.request_factor(request_id) if per_request else 1.0
        est = [1.0] * tree.size
        for i in range(1, tree.size):
            d = tree.depths[i]
            est[i] = min(est[tree.parents[i]], self.depth_factor(d) * scores[i] * m, 1.0)
        return est

    def expected_accepted(self, request_id: str, tree: DraftTree) -> float:
        """Expected accepted draft tokens if the whole tree is verified."""
        return sum(self.node_estimates(request_id, tree)[1:])

    def observe(self, request_id: str, tree: DraftTree, num_accepted: int) -> None:
        """Learn from one verified tree: `num_accepted` draft tokens of it were accepted."""
        scores = tree.scores or [1.0] * tree.size
        predicted = self.expected_accepted(request_id, tree)
        globally = sum(self.node_estimates(request_id, tree, per_request=False)[1:])
        depth = tree.depth
        raw = [0.0] * depth
        for i in range(1, tree.size):
            raw[tree.depths[i] - 1] += scores[i]
        while len(self.scores_by_depth) < depth:  # a new depth starts from its first tree
            self.scores_by_depth.append(0.0)
            self.observed_by_depth.append(0.0)
        for d, s in enumerate(raw, 1):
            hit = 1.0 if num_accepted >= d else 0.0
            if self.scores_by_depth[d - 1] == 0.0:  # prior: the scores are calibrated (k_d = 1)
                self.scores_by_depth[d - 1] = self.observed_by_depth[d - 1] = s
            a = self.decay
            self.scores_by_depth[d - 1] = (1 - a) * self.scores_by_depth[d - 1] + a * s
            self.observed_by_depth[d - 1] = (1 - a) * self.observed_by_depth[d - 1] + a * hit
        cal = self.requests.setdefault(request_id, _RequestCalibration())
        r = 1 - self.request_decay
        cal.observed, cal.predicted = r * cal.observed + num_accepted, r * cal.predicted + globally
        a = self.decay
        self.predicted_mean = (1 - a) * self.predicted_mean + a * predicted
        self.observed_mean = (1 - a) * self.observed_mean + a * num_accepted

    def age(self, request_id: str) -> None:
        """A step in which the request verified nothing: its evidence fades toward the prior, so a
        multiplier that fell on a short bad stretch recovers and the request is tried again."""
        cal = self.requests.get(request_id)
        if cal is not None:
            r = 1 - self.request_decay
            cal.observed, cal.predicted = r * cal.observed, r * cal.predicted

    def forget(self, request_id: str) -> None:
        """Drop a finished request's multiplier."""
        self.requests.pop(request_id, None)
