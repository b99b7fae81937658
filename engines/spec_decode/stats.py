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
        last = result.path[-1]
        # Depth d could be accepted if depth d-1 was and that node had children to try.
        reachable = result.num_accepted + (1 if any(p == last for p in tree.parents) else 0)
        self._count(tree.num_draft, result.num_accepted, reachable)

    def record_chain(self, depth: int, accepted: int) -> None:
        """Count one verified chain of `depth` drafts whose first `accepted` were accepted."""
        self._count(depth, accepted, accepted + (accepted < depth))

    def _count(self, num_draft: int, accepted: int, reachable: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += accepted
        for d in range(1, reachable + 1):
            while len(self.reached_depth) < d:
                self.reached_depth.append(0)
                self.accepted_depth.append(0)
            self.reached_depth[d - 1] += 1
            if d <= accepted:
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


PHASES = ("policy", "catch_up", "draft", "launch", "forward", "verify", "commit", "host")


@dataclass
class StepProfile:
    """Where engine steps' time went, by kind of step: "tree" (a step that verified drafts), "plain" (one
    decode or prompt step without drafts) and "multi" (several plain decode steps in one call). Per kind:
    steps, tokens emitted, and seconds per phase: the policy's planning and allocation, the drafter's
    catch-up (reading new context) and drafting, the launch of the target forward (the step's plan, its attention
    metadata, the Python around the model's native calls), the target forward (where the fused CPU decoder ran
    it, its native calls alone), sampling and verification (with the step's host copy), the accepted paths' KV
    commit and the drafter's bookkeeping, and `host`: the engine's time outside the executor (scheduling, applying
    results) plus the executor's own glue."""

    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def add_step(self, kind: str, tokens: int, phases: dict[str, float], total_s: float) -> None:
        """One step of `kind` that emitted `tokens` tokens in `total_s` seconds, split into `phases`
        (what they leave of the total counts as `host`)."""
        self.steps[kind] = self.steps.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + tokens
        mine = self.seconds.setdefault(kind, dict.fromkeys(PHASES, 0.0))
        for phase, s in phases.items():
            mine[phase] += s
        mine["host"] += max(0.0, total_s - sum(phases.values()))

    def add(self, other: StepProfile) -> None:
        """Accumulate another profile into this one."""
        for kind, n in other.steps.items():
            self.steps[kind] = self.steps.get(kind, 0) + n
            self.tokens[kind] = self.tokens.get(kind, 0) + other.tokens[kind]
            mine = self.seconds.setdefault(kind, dict.fromkeys(PHASES, 0.0))
            for phase, s in other.seconds[kind].items():
                mine[phase] += s

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Per kind of step: its count, tokens per step, milliseconds per step of each phase and in all,
        and milliseconds per emitted token."""
        out = {}
        for kind, n in self.steps.items():
            ms = {phase: 1000 * s / n for phase, s in self.seconds[kind].items()}
            total = sum(ms.values())
            tokens = self.tokens[kind] / n
            out[kind] = {"steps": n, "tokens_per_step": tokens, **ms, "total": total}
            out[kind]["per_token"] = total / tokens if tokens else 0.0
        return out
