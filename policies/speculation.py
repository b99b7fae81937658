"""Speculation policies: per step and per request, how much to draft and how much of it to verify.

The engine asks its policy twice per step:

1. `plan`: the drafting shape (depth, width) per decoding request, or None (no draft this step);
2. `allocate`: given the drafted trees, the subtree of each to verify (or None).

and reports back what happened (`observe_step`, `observe_verified`). `FixedPolicy` verifies every
request's configured tree. `AdaptivePolicy` maximises goodput, expected emitted tokens over predicted
step time, subject to each request's time-per-output-token target:

    G(k) = (n + sum of the k best calibrated node estimates) / T_target(base tokens + k)

over k, the number of draft tokens verified in the step, taking nodes across all requests in
order of their estimates (so a request whose drafts are unlikely gets fewer or none). The plan
picks the drafting depth and the requests to draft for the same way, with the drafter's cost in the
step time: a request's expected gain at depth d is its calibration multiplier times the observed
probability of accepting to each depth up to d, its cost the nodes the allocation keeps per depth;
no request drafts when plain decoding has the better goodput (a request whose own multiplier fell
is re-probed every `probe_every` steps as if average; no probe drafts where drafting does not pay
at the global acceptance rate, so large batches on a compute-bound device stop drafting altogether).
Width follows the widest level the allocation recently kept, plus one, up to the request's cap.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from engines.draft_tree import DraftTree
from engines.request import Request
from engines.spec_params import SpecParams
from policies.acceptance import AcceptanceModel
from policies.cost_model import DraftCostModel, TargetCostModel


@dataclass
class StepRecord:
    """What one engine step cost: the target forward over `num_tokens`, and the drafting round."""

    num_tokens: int
    target_s: float
    draft_s: float = 0.0
    draft_depth: int = 0
    draft_width: int = 0
    num_drafted: int = 0  # requests the drafter drafted for
    num_trees: int = 0  # requests that verified a tree in the target forward
    num_draft_tokens: int = 0  # draft tokens in those trees


class SpeculationPolicy(ABC):
    """Chooses each step's drafts and verification budgets."""

    name: str = "policy"

    @abstractmethod
    def plan(self, requests: list[Request], caps: list[SpecParams], other_tokens: int) -> list[SpecParams | None]:
        """Per decoding request: the tree to draft (within its caps), or None for no draft this step.
        `other_tokens` are the step's tokens besides the decoding requests' roots (prefill chunks)."""

    @abstractmethod
    def allocate(
        self, requests: list[Request], specs: list[SpecParams], trees: list[DraftTree | None], other_tokens: int
    ) -> list[DraftTree | None]:
        """Per drafted request: the subtree to verify this step, or None."""

    def observe_step(self, record: StepRecord) -> None:  # noqa: B027 - optional hook
        """Measured costs of the step that just ran."""

    def observe_verified(self, request: Request, tree: DraftTree, num_accepted: int) -> None:  # noqa: B027
        """A verified tree and how many of its draft tokens were accepted."""

    def on_finished(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Drop per-request state."""

    def stats(self) -> dict[str, Any]:
        """Decision and model statistics for metrics."""
        return {}


class FixedPolicy(SpeculationPolicy):
    """Every decoding request drafts and verifies its configured tree."""

    name = "fixed"

    def plan(self, requests: list[Request], caps: list[SpecParams], other_tokens: int) -> list[SpecParams | None]:
        return list(caps)

    def allocate(
        self, requests: list[Request], specs: list[SpecParams], trees: list[DraftTree | None], other_tokens: int
    ) -> list[DraftTree | None]:
        return [fixed_subtree(t, s) for t, s in zip(trees, specs, strict=True)]


def fixed_subtree(tree: DraftTree | None, spec: SpecParams) -> DraftTree | None:
    """The configured tree: cut to the depth, pruned to the budget by path score."""
    if tree is None or tree.num_draft == 0:
        return None
    return tree.truncate_depth(spec.depth).prune(spec.budget + 1)


@dataclass
class AdaptiveSettings:
    """Knobs of the adaptive policy (`spec_policy: adaptive`)."""

    probe_every: int = 16  # steps between drafts for a request the policy stopped drafting for
    min_gain: float = 0.05  # expected accepted tokens below which a request's draft is not worth verifying
    explore_bonus: float = 0.0  # accepted tokens added to a probe's or new request's estimate (optimism)
    profile: bool = True  # measure the target's step time at start-up (a few forwards)


_PRIOR_ACCEPT = 0.6  # assumed acceptance per depth level of an unseen draft shape (optimism: it gets tried)
_MIN_NODE = 0.05  # nodes estimated below this are not counted in a shape's verification cost


@dataclass
class _RequestState:
    idle_steps: int = 0  # steps since it last drafted
    history: bool = False  # whether it has been allocated at least once


@dataclass
class _Ema:
    value: float = 0.0
    weight: float = 0.05
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else (1 - self.weight) * self.value + self.weight * x
        self.count += 1


@dataclass
class ShapeTable:
    """Expected accepted tokens and verified nodes of a draft cut to each (depth, width): its nodes
    within that depth whose rank among their siblings (and their ancestors') is within that width,
    from globally calibrated node estimates, averaged over recent drafts at the full shape (the same
    trees for every entry, so entries compare). Before any data, an optimistic prior."""

    weight: float = 0.05
    gain: dict[tuple[int, int], _Ema] = field(default_factory=dict)
    nodes: dict[tuple[int, int], _Ema] = field(default_factory=dict)

    def observe(self, tree: DraftTree, est: list[float], max_width: int, budget: int) -> None:
        """Fold in one tree drafted at the full shape (depth, `max_width`) and its node estimates; each
        shape's cut keeps its `budget` best nodes, as a draft of that shape pruned to the budget would."""
        children: dict[int, list[int]] = {}
        for i in range(1, tree.size):
            children.setdefault(tree.parents[i], []).append(i)
        rank = [0] * tree.size
        for kids in children.values():
            for r, i in enumerate(sorted(kids, key=lambda i: (-est[i], i)), 1):
                rank[i] = r
        width = min(max_width, max(rank, default=0))  # re-sampled trees fused in add more siblings
        for w in range(1, width + 1):
            inside = [True] + [False] * (tree.size - 1)
            for i in range(1, tree.size):  # parents come before children
                inside[i] = inside[tree.parents[i]] and rank[i] <= w
            for d in range(1, tree.depth + 1):
                # Estimates never exceed a parent's, so the best `budget` nodes form a subtree.
                cut = sorted((est[i] for i in range(1, tree.size) if inside[i] and tree.depths[i] <= d), reverse=True)
                kept = [e for e in cut[:budget] if e >= _MIN_NODE]
                self.gain.setdefault((d, w), _Ema(weight=self.weight)).add(sum(kept))
                self.nodes.setdefault((d, w), _Ema(weight=self.weight)).add(float(len(kept)))

    def predict(self, depth: int, width: int) -> tuple[float, float]:
        """(expected accepted tokens, verified nodes) of a draft of that shape."""
        if (depth, width) in self.gain:
            return self.gain[(depth, width)].value, self.nodes[(depth, width)].value
        gain = sum(_PRIOR_ACCEPT**d for d in range(1, depth + 1))
        return gain, float(depth * width)


@dataclass
class AdaptivePolicy(SpeculationPolicy):
    """Goodput-maximising trees and budgets from calibrated acceptance and measured step costs."""

    settings: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    target_cost: TargetCostModel = field(default_factory=TargetCostModel)
    draft_cost: DraftCostModel = field(default_factory=DraftCostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    requests: dict[str, _RequestState] = field(default_factory=dict)
    name: str = "adaptive"
    # For metrics: the last step's choices and the models' predictions against what happened.
    last_depth: float = 0.0
    last_width: float = 0.0
    last_budget: float = 0.0
    last_drafted: int = 0
    predicted_step_s: _Ema = field(default_factory=_Ema)
    observed_step_s: _Ema = field(default_factory=_Ema)
    shapes: ShapeTable = field(default_factory=lambda: ShapeTable())
    _pending_prediction: float | None = None
    _step_decoders: int = 0  # this step's decoding requests, tokens besides theirs, TPOT targets (from `plan`)
    _step_other_tokens: int = 0
    _step_tpot: dict[str, float] = field(default_factory=dict)
    _num_plans: int = 0
    _refresh: bool = False  # this step drafts at the full shape: its trees update the shape table
    _budget_caps: dict[str, int] = field(default_factory=dict)  # verification caps of full-shape drafts

    # ---- drafting ---------------------------------------------------------------------------------
    def plan(self, requests: list[Request], caps: list[SpecParams], other_tokens: int) -> list[SpecParams | None]:
        n = len(requests)
        self._step_decoders, self._step_other_tokens = n, other_tokens
        self._step_tpot = {r.request_id: r.tpot_target_s for r in requests if r.tpot_target_s}
        if not self.target_cost.ready:
            return list(caps)
        out: list[SpecParams | None] = [cap if cap.fixed else None for cap in caps]
        fixed_tokens = sum(c.budget for c in caps if c.fixed)
        fixed_trees = sum(c.fixed for c in caps)
        base = n + other_tokens + fixed_tokens
        adaptive = [i for i, cap in enumerate(caps) if not cap.fixed]
        if not adaptive:
            return out
        states = {}
        for i in adaptive:
            st = states[i] = self.requests.setdefault(requests[i].request_id, _RequestState())
            st.idle_steps += 1
        max_depth = max(caps[i].depth for i in adaptive)
        max_width = max(caps[i].width for i in adaptive)
        # For each drafting shape, the requests worth drafting for (best expected gain per verified
        # token first) and the goodput of drafting for them, drafter time included; keep the best.
        best_goodput = n / self.target_cost.predict(base, fixed_trees, fixed_tokens)
        best_shape, best_chosen = (0, 0), []
        factors = {}
        for i in adaptive:
            st = states[i]
            factor = self.acceptance.request_factor(requests[i].request_id)
            probe = st.idle_steps >= self.settings.probe_every
            if st.history and probe:
                # A probe: the request is assumed at least average again, so a multiplier that fell on
                # a bad stretch can recover; drafting still has to pay at the population's acceptance.
                factor = max(factor, 1.0)
            factors[i] = (factor, self.settings.explore_bonus if probe or not st.history else 0.0)
        shape_cache: dict[tuple[int, int], tuple[float, float]] = {}  # requests mostly share their caps
        for depth in range(1, max_depth + 1):
            for width in range(1, max_width + 1):
                options: list[tuple[float, int, int]] = []  # (gain, budget, index)
                for i in adaptive:
                    cap = caps[i]
                    shape = (min(cap.depth, depth), min(cap.width, width))
                    if shape not in shape_cache:
                        shape_cache[shape] = self.shapes.predict(*shape)
                    shape_gain, shape_nodes = shape_cache[shape]
                    gain = factors[i][0] * shape_gain + factors[i][1]
                    if gain >= self.settings.min_gain:
                        options.append((gain, min(cap.budget, max(1, round(shape_nodes))), i))
                options.sort(key=lambda o: (-o[0] / o[1], o[2]))
                gain = budget = 0
                previous = 0.0
                for m, (g, b, _) in enumerate(options, 1):
                    gain, budget = gain + g, budget + b
                    step = self.target_cost.predict(base + budget, fixed_trees + m, fixed_tokens + budget)
                    goodput = (n + gain) / (step + self.draft_cost.predict(depth, width, m))
                    if goodput > best_goodput:
                        best_goodput, best_shape, best_chosen = goodput, (depth, width), [i for _, _, i in options[:m]]
                    if goodput < previous:  # past the peak: requests come in falling gain per token
                        break
                    previous = goodput
        # Every `probe_every` plans (and until the table has data) the chosen requests, or one request
        # if none was chosen, draft at their full shape: every (depth, width) entry is then averaged
        # over the same trees (so entries compare), and a table that says "never draft" is re-tested.
        self._num_plans += 1
        self._refresh = self._num_plans % self.settings.probe_every == 0 or not self.shapes.gain
        if self._refresh:
            best_shape = (max_depth, max_width)
            best_chosen = best_chosen or adaptive[:1]
        self._budget_caps = {}
        for i in best_chosen:
            states[i].idle_steps = 0
            depth, width = min(caps[i].depth, best_shape[0]), min(caps[i].width, best_shape[1])
            budget = caps[i].budget
            if self._refresh:  # the whole shape, not pruned to the budget (the allocation still keeps to it)
                self._budget_caps[requests[i].request_id] = budget
                budget = min(64, sum(width**d for d in range(1, depth + 1)))
            out[i] = SpecParams(depth=depth, width=width, budget=budget)
        return out

    # ---- verification budget ----------------------------------------------------------------------
    def allocate(
        self, requests: list[Request], specs: list[SpecParams], trees: list[DraftTree | None], other_tokens: int
    ) -> list[DraftTree | None]:
        out: list[DraftTree | None] = [None] * len(trees)
        if not self.target_cost.ready:
            return [fixed_subtree(t, s) for t, s in zip(trees, specs, strict=True)]
        base = self._step_decoders + self._step_other_tokens
        fixed_trees = fixed_tokens = 0
        nodes: list[tuple[float, int, int]] = []  # (estimate, request index, node)
        estimates: dict[int, list[float]] = {}
        cut: dict[int, DraftTree] = {}
        for j, (req, spec, tree) in enumerate(zip(requests, specs, trees, strict=True)):
            if tree is None or tree.num_draft == 0:
                continue
            if spec.fixed:
                out[j] = fixed_subtree(tree, spec)
                if out[j] is not None:
                    fixed_trees, fixed_tokens = fixed_trees + 1, fixed_tokens + out[j].num_draft
                    base += out[j].num_draft
                continue
            tree = cut[j] = tree.truncate_depth(spec.depth)
            est = estimates[j] = self.acceptance.node_estimates(req.request_id, tree)
            # Each request keeps at most its budget cap; its best nodes come first.
            cap = self._budget_caps.get(req.request_id, spec.budget)
            best = sorted(range(1, tree.size), key=lambda i: (-est[i], i))[:cap]
            nodes.extend((est[i], j, i) for i in best)
        nodes.sort(key=lambda x: (-x[0], x[1], x[2]))
        k = self._best_count(requests, nodes, base, fixed_trees, fixed_tokens)
        counts: dict[int, int] = {}
        for _, j, _ in nodes[:k]:
            counts[j] = counts.get(j, 0) + 1
        depths, widths, budgets = [], [], []
        for j, est in estimates.items():
            req, tree, c = requests[j], cut[j], counts.get(j, 0)
            st = self.requests.setdefault(req.request_id, _RequestState())
            st.history = True
            if self._refresh:
                global_est = self.acceptance.node_estimates(req.request_id, tree, False)
                budget = self._budget_caps.get(req.request_id, specs[j].budget)
                self.shapes.observe(tree, global_est, specs[j].width, budget)
            if c == 0:
                continue
            kept = out[j] = tree.prune(c + 1, ranking=est)  # the drafter's scores stay: calibration reads them
            depths.append(kept.depth)
            widths.append(max(kept.depths.count(d) for d in range(1, kept.depth + 1)))
            budgets.append(kept.num_draft)
        self.last_drafted = len(budgets)
        self.last_depth = sum(depths) / len(depths) if depths else 0.0
        self.last_width = sum(widths) / len(widths) if widths else 0.0
        self.last_budget = sum(budgets) / len(budgets) if budgets else 0.0
        self._pending_prediction = self.target_cost.predict(base + k, fixed_trees + len(budgets), fixed_tokens + k)
        return out

    def _best_count(
        self,
        requests: list[Request],
        nodes: list[tuple[float, int, int]],
        base: int,
        fixed_trees: int,
        fixed_tokens: int,
    ) -> int:
        """How many of the ordered candidate nodes to verify: the goodput optimum among the counts
        that meet every request's TPOT target (or, if none does, the count closest to meeting them)."""
        n = self._step_decoders
        drafting = {r.request_id for r in requests}
        targets = {j: r.tpot_target_s for j, r in enumerate(requests) if r.tpot_target_s}
        # Requests that decode without a draft this step emit one token: their TPOT is the step time.
        plain_tpot = min((t for rid, t in self._step_tpot.items() if rid not in drafting), default=None)
        if plain_tpot is not None:
            targets[-1] = plain_tpot
        gains = [0.0] * (len(requests) + 1)  # index -1: the plain decoders
        best_k, best_g, best_violation, best_violating_k = 0, -1.0, math.inf, 0
        total, trees, counted = 0.0, fixed_trees, set()
        for k in range(len(nodes) + 1):
            if k:
                est, j, _ = nodes[k - 1]
                total += est
                gains[j] += est
                if j not in counted:
                    counted.add(j)
                    trees += 1
            t = self.target_cost.predict(base + k, trees, fixed_tokens + k)
            violation = max((t / (1 + gains[j]) / tpot for j, tpot in targets.items()), default=0.0)
            if violation <= 1.0:
                g = (n + total) / t
                if g > best_g:
                    best_k, best_g = k, g
            elif best_g < 0 and violation < best_violation:
                best_violation, best_violating_k = violation, k
        return best_k if best_g >= 0 else best_violating_k

    # ---- learning ---------------------------------------------------------------------------------
    def observe_step(self, record: StepRecord) -> None:
        if record.num_tokens:
            self.target_cost.observe(record.num_tokens, record.target_s, record.num_trees, record.num_draft_tokens)
            if self._pending_prediction is not None:  # a step the policy sized: prediction vs outcome
                self.predicted_step_s.add(self._pending_prediction)
                self.observed_step_s.add(record.target_s)
        self._pending_prediction = None
        if record.num_drafted:
            self.draft_cost.observe(record.draft_depth, record.draft_width, record.num_drafted, record.draft_s)

    def observe_verified(self, request: Request, tree: DraftTree, num_accepted: int) -> None:
        self.acceptance.observe(request.request_id, tree, num_accepted)

    def on_finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.acceptance.forget(request_id)

    def stats(self) -> dict[str, Any]:
        return {
            "drafted_requests": self.last_drafted,
            "depth": self.last_depth,
            "width": self.last_width,
            "budget": self.last_budget,
            "predicted_accepted": self.acceptance.predicted_mean,
            "observed_accepted": self.acceptance.observed_mean,
            "predicted_step_s": self.predicted_step_s.value,
            "observed_step_s": self.observed_step_s.value,
        }


def make_policy(name: str, settings: AdaptiveSettings | None = None) -> SpeculationPolicy:
    """The policy a config names: `fixed` or `adaptive`."""
    if name == "fixed":
        return FixedPolicy()
    if name == "adaptive":
        return AdaptivePolicy(settings or AdaptiveSettings())
    raise ValueError(f"unknown speculation policy {name!r}; use 'fixed' or 'adaptive'")
