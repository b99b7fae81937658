"""Speculation counters: draft tokens verified and accepted, and acceptance by tree depth."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.draft_tree import DraftTree
from engines.verification import VerifyResult


@dataclass
class SpecStats:
    """Speculation counters since start (or since `reset`)."""

    num_steps: int = 0  # request-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    reached_depth: list[int] = field(default_factory=list)  # [d-1]: steps that could accept depth d
    accepted_depth: list[int] = field(default_factory=list)  # [d-1]: steps that accepted depth d

    def record(self, tree: DraftTree, result: VerifyResult) -> None:
        """Count one verified draft."""
        self.num_steps += 1
        self.num_draft_tokens += tree.num_draft
        self.num_accepted_tokens += result.num_accepted
        last = result.path[-1]
        # Depth d could be accepted if depth d-1 was and that node had children to try.
        reachable = result.num_accepted + (1 if any(p == last for p in tree.parents) else 0)
        for d in range(1, reachable + 1):
            while len(self.reached_depth) < d:
                self.reached_depth.append(0)
                self.accepted_depth.append(0)
            self.reached_depth[d - 1] += 1
            if d <= result.num_accepted:
                self.accepted_depth[d - 1] += 1

    def add(self, other: SpecStats) -> None:
        """Accumulate another set of counters into this one."""
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for d, (r, a) in enumerate(zip(other.reached_depth, other.accepted_depth, strict=True)):
            if d == len(self.reached_depth):
                self.reached_depth.append(0)
                self.accepted_depth.append(0)
            self.reached_depth[d] += r
            self.accepted_depth[d] += a

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted draft tokens plus the bonus token, per verification step."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Conditional acceptance at depth 1, 2, ...: accepted at d given d-1 accepted and d tried."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_depth, self.reached_depth, strict=True)]
