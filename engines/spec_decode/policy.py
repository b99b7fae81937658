"""Speculation policies: per step and per request, how much to draft and how much of it to verify.

The step executor (executor.py) asks its policy twice per step, after the scheduler has granted
each speculating decoding request its draft budget:

1. `plan`: the drafting shape (depth, width) per granted request, within its grant, or None;
2. `allocate`: given the drafted trees, the subtree of each to verify (or None).

and reports back what happened (`observe_step`, `observe_verified`). `FixedPolicy` verifies every
request's configured tree. `AdaptivePolicy` maximises goodput, expected emitted tokens over predicted
step time, subject to each request's time-per-output-token target:

    G(k) = (n + sum of the k best calibrated node estimates) / T_target(base tokens + k)

over k, the number of draft tokens verified in the step, taking nodes across all requests in
order of their estimates (so a request whose drafts are unlikely gets fewer or none). The plan
picks the drafting shape (depth, width) and the requests to draft for the same way, with the
drafter's cost in the step time: a request's expected gain at a shape is its calibration multiplier
times what drafts of that shape realised lately (`ShapeTable`: accepted tokens and verified nodes
per depth level and width), its cost the nodes they had verified and the drafter's time: its
round, and its reading of the context each request gained since it last drafted (a request new to
drafting reads its whole prompt, once: that reading is spread over the steps it can expect to draft
in, its remaining steps times the share of requests drafted for lately). Drafting
for a request new to drafting or idle for a few steps has to beat plain decoding's goodput by
`min_advantage` (3%: near break-even such a draft has nothing to win and, its reading's share a
guess, something to lose);
drafting for requests that drafted just before has to beat it at all; a request whose own
multiplier fell is re-probed every `probe_every` steps as if average, and every `shape_probe_every`
plans the drafts go to the full shape, so the table stays measured (large batches on a
compute-bound device stop drafting altogether but for one such probe every `idle_probe_every`
plans, and the best option that does not pay for streaks of `probe_streak` plans at a rate
costing `probe_cost` of throughput, as measured after each probe); where every step drafts, every
`plain_every`-th step does not, so the plain step time the verification overhead is measured
against stays current. The first level of a shape's acceptance is priced at an upper confidence
bound (`optimism`), so an option that a few unlucky drafts put just below break-even is drafted
until it is measured well. A search's answer is reused for `search_every` plans of an unchanged
batch while it drafts, and for up to `idle_search_every` while drafting pays for no request.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from engines.draft_tree import DraftTree
from engines.request import Request
from engines.spec_decode.acceptance_model import AcceptanceModel
from engines.spec_decode.cost_model import DraftCostModel, TargetCostModel
from engines.spec_params import SpecParams


@dataclass
class StepRecord:
    """What one engine step cost: the target forward over `num_tokens`, and the drafting round."""

    num_tokens: int
    target_s: float
    draft_s: float = 0.0  # the drafting rounds (`propose`)
    read_s: float = 0.0  # the drafter reading the drafted requests' unread context (`catch_up`)
    num_read: int = 0  # context tokens it read
    draft_depth: int = 0
    draft_width: int = 0
    num_drafted: int = 0  # requests the drafter drafted for
    num_trees: int = 0  # requests that verified a tree in the target forward
    num_draft_tokens: int = 0  # draft tokens in those trees
    num_context: int | None = None  # attention keys the target forward read (None: not known)
    policy_s: float = 0.0  # the policy's own planning and allocation
    forward_s: float = 0.0  # the target forward alone (within target_s)
    text_s: float = 0.0  # the text drafter's round and the policy's choice of its drafts
    commit_s: float = 0.0  # the accepted paths' KV commit and the drafter's bookkeeping (within target_s)
    rounds_depth: int = 0  # the step runs native rounds of chains this deep instead (0: it does not)


class SpeculationPolicy(ABC):
    """Chooses each step's drafts and verification budgets."""

    name: str = "policy"

    @abstractmethod
    def plan(
        self,
        requests: list[Request],
        caps: list[SpecParams],
        other_tokens: int,
        context: int | None = None,
        plain_steps: int = 1,
    ) -> list[SpecParams | None]:
        """Per granted decoding request: the tree to draft (within its caps: its limit and its grant),
        or None for no draft this step. `other_tokens` are the step's scheduled tokens besides these
        requests' roots (prefill chunks, decodes that do not speculate);
        `context` the attention keys its plain forward would read (None: not known); `plain_steps` the
        decode steps plain decoding would run in this step's one call (several greedy steps a call)."""

    @abstractmethod
    def allocate(
        self, requests: list[Request], specs: list[SpecParams], trees: list[DraftTree | None], other_tokens: int
    ) -> list[DraftTree | None]:
        """Per drafted request: the subtree to verify this step, or None."""

    def choose_text_drafts(
        self,
        requests: list[Request],
        trees: list[DraftTree | None],
        other_tokens: int,
        context: int | None = None,
        plain_steps: int = 1,
    ) -> list[DraftTree | None]:
        """Per granted decoding request, the text drafter's tree to verify this step instead of a model
        drafter's (None: leave the request to the model drafter); all of them unless a policy prices them."""
        return list(trees)

    def observe_text(self, tree: DraftTree, path: list[int]) -> None:  # noqa: B027 - optional hook
        """A verified text-drafter tree and its accepted path (node indices, root first)."""

    def wants_text_drafts(self, num_seqs: int) -> bool:
        """Whether this step of `num_seqs` requests should ask the text drafter at all (it costs tens of
        microseconds a request)."""
        return True

    def probes_plain(self, num_seqs: int) -> bool:
        """Whether this step of `num_seqs` requests drafts nothing at all, so that plain steps at its batch size
        are measured beside steps that verify text drafts (`observe_outcome`)."""
        return False

    def observe_step(self, record: StepRecord) -> None:  # noqa: B027 - optional hook
        """Measured costs of the step that just ran."""

    def observe_multi_step(  # noqa: B027 - optional hook
        self, num_seqs: int, steps: int, seconds: float, context: int | None = None
    ) -> None:
        """A call that ran `steps` plain decode steps of `num_seqs` requests (no drafts) took `seconds`."""

    def observe_host(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """An engine step's time outside the executor (scheduling, applying results)."""

    def observe_outcome(self, kind: str, num_seqs: int, tokens: int, seconds: float) -> None:  # noqa: B027
        """An engine step of decoding requests only, `num_seqs` of them, emitted `tokens` in `seconds` all told:
        `kind` "text" where it verified the text drafter's trees, "plain" where it verified none."""

    def observe_verified(self, request: Request, tree: DraftTree, path: list[int]) -> None:  # noqa: B027
        """A verified tree and its accepted path (node indices, root first)."""

    def choose_rounds(self, num_seqs: int, depths: list[int], behind: bool = False) -> int:
        """For a step of `num_seqs` greedy decoding requests that may run as native rounds of width-1 chains (the
        executor's spec rounds) and that verifies no text draft: the chain depth among `depths` to run them at, or 0
        to take the step as the policy plans it otherwise. `behind`: the drafter has many of their tokens left to
        read first (after text drafts), which rounds pay for. Never, unless a policy measures them."""
        return 0

    def observe_rounds(  # noqa: B027
        self, num_seqs: int, depth: int, tokens: int, seconds: float, behind: bool = False
    ) -> None:
        """An engine step that `choose_rounds` decided (`depth`, 0: otherwise) emitted `tokens` in `seconds` all
        told."""

    def on_finished(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Drop per-request state."""

    def stats(self) -> dict[str, Any]:
        """Decision and model statistics for metrics."""
        return {}


class FixedPolicy(SpeculationPolicy):
    """Every decoding request drafts and verifies its configured tree."""

    name = "fixed"

    def plan(
        self,
        requests: list[Request],
        caps: list[SpecParams],
        other_tokens: int,
        context: int | None = None,
        plain_steps: int = 1,
    ) -> list[SpecParams | None]:
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
    # plans between drafts at the full shape while drafting pays (the shape table's deeper and wider
    # entries stay measured), and the most plans in a row that draft before one plain step (the
    # plain step time the trees' overhead is measured against stays current); each costs a few
    # percent at batch 1 when run every 16 plans (greedy 2:2:4 over adaptive: 0.973 at 16, 0.997 at 64)
    shape_probe_every: int = 64
    plain_every: int = 64
    idle_probe_every: int = 64  # plans between full-shape probes while drafting pays for no request
    # while drafting pays for no request, the best drafting option is still tried at a rate that
    # costs about this share of throughput, predicted and then measured (the idle probes included):
    # often where it nearly pays (a table stuck just below break-even recovers), seldom where it is
    # far from paying
    probe_cost: float = 0.003
    idle_search_every: int = 16  # most plans one shape search's "nothing pays" stands for an unchanged batch
    search_every: int = 4  # plans one shape search's choice stands for while it drafts for an unchanged batch
    # plans a credit probe goes on for (its requests' best option each plan, charged as a probe): drafts
    # now and then read the context in large pieces on cold caches and cost more than drafting every
    # step does, so a probe drafts for a streak, which measures drafting as it runs once chosen
    probe_streak: int = 16
    min_gain: float = 0.05  # expected accepted tokens below which a request's draft is not worth verifying
    # drafting for a request whose context the drafter has not read lately (new, or idle for a few
    # steps) must beat plain decoding's predicted goodput by this share: a draft predicted to break
    # even gains nothing when the prediction is right, and for such a request the prediction spreads
    # the reading over steps it may not draft in, so it tends to be optimistic
    min_advantage: float = 0.03
    # steps of each kind at a batch size (`text_outcomes`) before text drafts are judged by what they delivered
    # there, and steps without asking the text drafter, while its drafts delivered less, between two that ask
    outcome_samples: int = 8
    text_recheck_every: int = 32
    text_lead: float = 1.25
    # native rounds of width-1 chains (`choose_rounds`): the most requests a step of them takes (on the 2-core Zen 4
    # they pay at batch 1 and 2; at 4 and 8 a round's verification costs what its tokens save, and trying them cost
    # 7% there), the depths tried, the steps of each option measured at a batch size before the best is taken, and
    # the steps between two that re-measure another option
    rounds_max_seqs: int = 2
    rounds_depths: tuple[int, ...] = (1, 2, 3)
    rounds_samples: int = 8
    rounds_recheck_every: int = 16
    # an option below `rounds_drop` times the best one's rate after `rounds_min_samples` steps counts as measured (on
    # an AVX2 CPU a round call costs twice a plain one's time, so measuring what clearly loses costs 5-7%)
    rounds_min_samples: int = 3
    rounds_drop: float = 0.8
    # rounds are taken only where they lead the policy's own plan by this much: within it, the noise of a few steps
    # could pick them where they lose (at batch 2 on AVX2, 176 round calls at 4.44 ms a token against 4.04 plain)
    rounds_margin: float = 1.05
    warm_steps: int = 2  # a request that drafted within this many plans has (almost) no unread context
    # standard errors of the shape table's first-level acceptance (over every draft behind it) added in
    # the search, an upper confidence bound: an option that a few unlucky first drafts put just below
    # break-even is drafted until it is measured well
    optimism: float = 1.0
    explore_bonus: float = 0.0  # accepted tokens added to a probe's or new request's estimate (optimism)
    profile: bool = True  # measure the target's step time at start-up (a few forwards)
    # reuse the start-up profile of an engine of the same settings on this machine (the cache folder)
    profile_cache: bool = True


_PRIOR_ACCEPT = 0.6  # assumed acceptance per depth level of a shape never drafted (optimism: it gets tried)
_CREDIT_FLOOR = -3.0  # plain steps of probe debt at most: an idle probe at least every ~1,000 plans
_TOKENS_PER_DRAFT_STEP = 2.0  # tokens a drafted step emits, for spreading a cold request's reading over its steps


@dataclass
class DepthCalibration:
    """How often a drafter's nodes at each depth are accepted against what their scores say: per depth, accepted
    nodes over the sum of the nodes' scores (moving sums, starting at one prior node accepted as scored)."""

    forget: float = 0.995
    prior: float = 1.0
    accepted: list[float] = field(default_factory=list)  # [d - 1]: at depth d
    estimated: list[float] = field(default_factory=list)

    def factor(self, depth: int) -> float:
        """Accepted over estimated at `depth` (1 before any node of that depth was verified)."""
        if depth > len(self.accepted):
            return self.factor(len(self.accepted)) if self.accepted else 1.0  # deeper: as the deepest seen
        return (self.accepted[depth - 1] + self.prior) / (self.estimated[depth - 1] + self.prior)

    def estimates(self, tree: DraftTree) -> list[float]:
        """Per node, its calibrated chance to be accepted (never above its parent's; the root 1)."""
        out = [1.0] * tree.size
        scores = tree.scores or [1.0] * tree.size
        depths = tree.depths
        for i in range(1, tree.size):
            out[i] = min(out[tree.parents[i]], scores[i] * self.factor(depths[i]))
        return out

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """A verified tree and its accepted path (node indices, root first)."""
        scores = tree.scores or [1.0] * tree.size
        on_path = set(path)
        depths = tree.depths
        while len(self.accepted) < tree.depth:
            self.accepted.append(0.0)
            self.estimated.append(0.0)
        self.accepted = [a * self.forget for a in self.accepted]
        self.estimated = [e * self.forget for e in self.estimated]
        for i in range(1, tree.size):
            d = depths[i] - 1
            self.estimated[d] += scores[i]
            self.accepted[d] += i in on_path


@dataclass
class _RequestState:
    idle_steps: int = 0  # steps since it last drafted
    history: bool = False  # whether it has been allocated at least once
    read_upto: int = 1  # its tokens when it last drafted: the drafter has read the context before the last


def _batch_class(num_seqs: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ...: 0, 1, 2, 3, 4, ..."""
    return max(num_seqs - 1, 0).bit_length()


@dataclass
class _Ema:
    """A running mean over the first 1/weight samples (a starting value counts as one), then a
    moving average with that weight."""

    value: float = 0.0
    weight: float = 0.05
    count: int = 0

    def add(self, x: float) -> None:
        w = max(self.weight, 1 / (self.count + 1))
        self.value = (1 - w) * self.value + w * x
        self.count += 1


@dataclass
class _Rate:
    """Tokens a second over recent steps: moving averages of their tokens and of their seconds (the rate of the
    means, which steps of a few tokens and steps of many weigh by their time, not one step one vote)."""

    tokens: _Ema = field(default_factory=lambda: _Ema(weight=0.1))
    seconds: _Ema = field(default_factory=lambda: _Ema(weight=0.1))

    @property
    def count(self) -> int:
        return self.tokens.count

    @property
    def value(self) -> float:
        return self.tokens.value / self.seconds.value if self.seconds.value > 0 else 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens.add(tokens)
        self.seconds.add(seconds)


@dataclass
class _Search:
    """A shape search's outcome: the best option that pays (no requests: none pays) and the best
    drafting option, paying or not (its score: goodput over the goodput it has to reach)."""

    best_shape: tuple[int, int]
    best_chosen: list[int]  # indices into the plan's requests
    near_shape: tuple[int, int]
    near_chosen: list[int]
    near_score: float
    near_tokens: float  # tokens the best drafting option is expected to emit
    plain_goodput: float  # predicted tokens per second of the step without drafts
    # per request index: (context tokens the drafter reads, the share of their reading priced into this
    # step: a cold request's whole reading is spread over the steps it can expect to draft in)
    reads: dict[int, tuple[int, float]] = field(default_factory=dict)
    probed: frozenset[int] = frozenset()  # requests priced as if average again (a one-plan probe)
    key: tuple = ()  # the batch it was made for: request ids, caps, other tokens
    until: int = 0  # reused while the policy has made fewer plans than this


@dataclass
class ShapeTable:
    """What drafting at each (depth, width) realised. Per width w and depth level k, moving averages
    over drafts of width w or wider, at least k deep: whether k or more of its tokens were accepted
    (`reach`), and how many of its nodes at depth k were verified (`nodes`). A wider draft counts for
    each narrower width by its cut to that width (the nodes whose sibling rank by score, and their
    ancestors', is within it; the drafters' trees of one width contain the narrower ones), and a
    draft the allocation dropped counts as nothing verified and nothing accepted. A draft of shape
    (d, w) is expected to gain the sum of reach over levels 1..d and to verify the sum of nodes.
    These are outcomes of real drafts, re-sampled trees fused in and the allocation's pruning
    included, so no calibration of the drafter's scores enters them. A level starts from an
    optimistic prior that counts as `prior_drafts` drafts, so it gets tried and a few unlucky first
    drafts do not rule it out. It is a population average over ~1/weight drafts: at batch 1 that
    spans several requests, so one request's bad stretch does not stop drafting for the next (that
    request's own multiplier in the acceptance model answers for it)."""

    weight: float = 0.01
    prior_drafts: int = 4
    reach: dict[tuple[int, int], _Ema] = field(default_factory=dict)
    nodes: dict[tuple[int, int], _Ema] = field(default_factory=dict)

    def observe(self, depth: int, width: int, tree: DraftTree | None, path: list[int]) -> None:
        """Fold in one draft of shape (depth, width): the subtree verified (None: dropped) and its
        accepted path (node indices, root first)."""
        rank = _sibling_ranks(tree) if tree is not None else []
        for w in range(1, width + 1):
            per_level = [0] * (depth + 1)
            inside = [True] * len(rank)
            for i in range(1, len(rank)):  # parents come before children
                inside[i] = inside[tree.parents[i]] and rank[i] <= w
                if inside[i] and tree.depths[i] <= depth:
                    per_level[tree.depths[i]] += 1
            accepted = next((n for n, i in enumerate(path[1:]) if not inside[i]), len(path) - 1) if rank else 0
            for k in range(1, depth + 1):
                if (k, w) not in self.reach:
                    self.reach[(k, w)] = _Ema(_PRIOR_ACCEPT**k, self.weight, count=self.prior_drafts)
                    self.nodes[(k, w)] = _Ema(float(w), self.weight, count=self.prior_drafts)
                self.reach[(k, w)].add(1.0 if accepted >= k else 0.0)
                self.nodes[(k, w)].add(float(per_level[k]))

    def predict(self, depth: int, width: int, optimism: float = 0.0) -> tuple[float, float]:
        """(expected accepted tokens, verified nodes) of a draft of that shape; with `optimism`, the
        first level's reach raised by that many standard errors of a mean over all the drafts behind it
        (an upper confidence bound on whether drafting gains at all, which fades as drafts accrue; the
        deeper levels get none, so it does not favour deeper shapes)."""
        gain = nodes = 0.0
        for k in range(1, depth + 1):
            reach = self.reach.get((k, width))
            if reach is None:
                gain, nodes = gain + _PRIOR_ACCEPT**k, nodes + width
            else:
                p = reach.value
                if k == 1 and optimism:
                    p = min(1.0, p + optimism * math.sqrt(max(0.0, p * (1 - p)) / max(1, reach.count)))
                gain += p
                nodes += self.nodes[(k, width)].value
        return gain, nodes


def _sibling_ranks(tree: DraftTree) -> list[int]:
    """Each node's rank among its siblings by drafter score (1: the best; the root: 0)."""
    scores = tree.scores or [1.0] * tree.size
    rank = [0] * tree.size
    for kids in tree.child_lists():
        for r, i in enumerate(sorted(kids, key=lambda i: (-scores[i], i)), 1):
            rank[i] = r
    return rank


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
    # the policy's own time in steps that drafted and in steps that did not: a drafting step searches
    # and allocates, which at batch 1 on a CPU is a few percent of a step, so options are priced with it
    policy_drafting_s: _Ema = field(default_factory=_Ema)
    policy_plain_s: _Ema = field(default_factory=_Ema)
    observed_step_s: _Ema = field(default_factory=_Ema)
    host_s: _Ema = field(default_factory=_Ema)  # an engine step's time outside the executor
    text_calibration: DepthCalibration = field(default_factory=lambda: DepthCalibration())  # text drafts' scores
    shapes: ShapeTable = field(default_factory=lambda: ShapeTable())
    # the share of adaptive requests drafted for per plan, lately (starting at all of them): how many of
    # its remaining steps a request that starts drafting now can expect to draft in, which its reading
    # of the context is spread over
    drafting_share: _Ema = field(default_factory=lambda: _Ema(value=1.0, weight=1 / 32, count=1))
    _pending_prediction: float | None = None
    _step_decoders: int = 0  # this step's decoding requests, tokens besides theirs, TPOT targets (from `plan`)
    _step_other_tokens: int = 0
    _step_context: int | None = None
    _step_tpot: dict[str, float] = field(default_factory=dict)
    _num_plans: int = 0
    _plans_since_plain: int = 0
    _text_plans_since_plain: int = 0  # text-draft plans in a row that kept a draft
    _text_idle: int = 0  # text-draft plans in a row that kept none
    _text_skipped: int = 0  # steps since the text drafter was last asked
    # per batch-size class (`_batch_class`): tokens per second that steps which verified text drafts delivered, and
    # steps which verified nothing; steps not asking the text drafter in a row where the former fell below the latter
    text_outcomes: dict[int, tuple[_Ema, _Ema]] = field(default_factory=dict)
    _text_refused: int = 0
    # per ((batch-size class, drafter behind), option): tokens per second of steps `choose_rounds` decided (option 0:
    # the policy's own plan, d: rounds of depth-d chains), and how many such decisions were made
    rounds_outcomes: dict[tuple[tuple[int, bool], int], _Rate] = field(default_factory=dict)
    _rounds_plans: int = 0
    _plain_probes: int = 0  # steps that might have verified text drafts while they delivered more than plain steps
    _probe_credit: float = 0.0  # plain steps' time saved up for probes (`probe_cost` per plan that drafts for none)
    _drafted: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> shape it verifies this step
    _search: _Search | None = None  # the last shape search, while it may be reused
    _idle_searches: int = 0  # searches in a row in which drafting paid for no request
    _streak_left: int = 0  # plans the current credit probe's streak goes on for
    _streak_key: tuple = ()  # the batch it probes
    # this step's probe: (loss charged to the credit when chosen, plain decoding's goodput, the share
    # of its reading time priced into the step); the draft tokens its verification accepted
    _probe: tuple[float, float, float] | None = None
    _step_accepted: int = 0
    _probing: frozenset[str] = frozenset()  # this step's probed requests: their drafts are verified whole
    # plans by decision: drafting that pays, the full-shape probes (`shape_probe_every` and
    # `idle_probe_every`), the best option that does not pay on probe credit, and no draft
    decisions: dict[str, int] = field(
        default_factory=lambda: {"pays": 0, "shape_probe": 0, "idle_probe": 0, "credit_probe": 0, "plain": 0}
    )

    # ---- drafting ---------------------------------------------------------------------------------
    def plan(
        self,
        requests: list[Request],
        caps: list[SpecParams],
        other_tokens: int,
        context: int | None = None,
        plain_steps: int = 1,
    ) -> list[SpecParams | None]:
        n = len(requests)
        self._step_decoders, self._step_other_tokens, self._step_context = n, other_tokens, context
        self._step_tpot = {r.request_id: r.tpot_target_s for r in requests if r.tpot_target_s}
        self._probe, self._step_accepted, self._probing = None, 0, frozenset()
        if not self.target_cost.ready:
            return list(caps)
        out: list[SpecParams | None] = [cap if cap.fixed else None for cap in caps]
        fixed_tokens = sum(c.budget for c in caps if c.fixed)
        fixed_trees = sum(c.fixed for c in caps)
        adaptive = [i for i, cap in enumerate(caps) if not cap.fixed]
        if not adaptive:
            return out
        states = {}
        for i in adaptive:
            st = states[i] = self.requests.setdefault(requests[i].request_id, _RequestState())
            st.idle_steps += 1
        # The search's answer is reused for a few plans of an unchanged batch: while drafting pays for no
        # request, for 1, 2, 4, ... up to `idle_search_every` plans (where it stays until drafting pays
        # again); while it drafts, for `search_every` plans (unless a request it chose was probed as if
        # average, which is for one plan), and so in a probe's streak. The models move little from one
        # step to the next, and at batch 1 a search costs a few percent of a step.
        key = (
            tuple(r.request_id for r in requests),
            tuple((c.depth, c.width, c.budget, c.fixed) for c in caps),
            other_tokens,
            plain_steps > 1,
        )
        search = self._search
        if search is None or search.key != key or self._num_plans >= search.until:
            base = n + other_tokens + fixed_tokens
            search = self._search = self._shape_search(
                requests, caps, adaptive, states, base, fixed_trees, fixed_tokens, context, plain_steps
            )
            search.key = key
            if search.best_chosen:
                self._idle_searches = 0
                probed = search.probed.intersection(search.best_chosen)
                search.until = self._num_plans + (1 if probed else self.settings.search_every)
            else:
                gap = 1 << min(self._idle_searches, 30)  # doubling, bounded (a server runs for days)
                search.until = self._num_plans + min(self.settings.idle_search_every, gap)
                self._idle_searches += 1
        # Every `shape_probe_every` plans (and until the table has data) the chosen requests draft at the
        # full shape, so every entry of the shape table keeps being measured; while none is chosen,
        # one request does so every `idle_probe_every` plans, so a table that says "never draft" is
        # re-tested without taxing the batches where drafting does not pay, and the best option that
        # does not pay is tried at a rate costing `probe_cost` of throughput (against the goodput it
        # has to reach: what it lacks to be chosen), each for a streak of `probe_streak` plans (cut
        # short where a probe puts the credit at its floor), so it is measured drafting steadily.
        # Losses are time beyond what plain decoding would have taken for the tokens, in plain steps
        # (linear in the tokens: a lucky and an unlucky step average out). A probe is charged its
        # predicted loss when chosen and its realised loss once its step ran (`observe_step`): a
        # probe whose draft the allocation drops costs its drafting for nothing, and the probes slow
        # down to match; an idle probe waits while the credit is spent. A probe that gains pays the
        # credit back, so an option that pays in steady drafting (where the models, fed by sporadic
        # drafts, thought it would not) keeps being drafted until they learn it.
        # Likewise, after `plain_every` plans in a row that drafted, one plain step: the tree steps'
        # overhead is measured against the plain step, which must not go stale.
        best_shape, best_chosen = search.best_shape, search.best_chosen
        self._num_plans += 1
        every = self.settings.shape_probe_every if best_chosen else self.settings.idle_probe_every
        if not best_chosen:
            self._probe_credit = min(1.0, self._probe_credit + self.settings.probe_cost)
        # the time the best drafting option is predicted to lose against plain decoding, in plain steps
        loss = search.near_tokens / n * (1 / search.near_score - 1) if search.near_score > 0 else math.inf
        decision = "pays" if best_chosen else "plain"
        if best_chosen or self._streak_key != key:  # a streak probes one batch while nothing pays
            self._streak_left = 0
        if not self.shapes.reach or (self._num_plans % every == 0 and (best_chosen or self._probe_credit >= 0)):
            decision = "shape_probe" if best_chosen else "idle_probe"
            best_shape = (max(caps[i].depth for i in adaptive), max(caps[i].width for i in adaptive))
            best_chosen = best_chosen or adaptive[:1]
        elif not best_chosen and search.near_chosen and (self._streak_left > 0 or self._probe_credit >= loss):
            decision = "credit_probe"
            if self._streak_left <= 0:
                self._streak_left, self._streak_key = self.settings.probe_streak, key
            self._probe_credit -= loss
            best_shape, best_chosen = search.near_shape, search.near_chosen
        elif best_chosen and self._plans_since_plain >= self.settings.plain_every and not fixed_trees:
            decision = "plain"
            best_chosen = []
        self._streak_left = max(0, self._streak_left - 1)
        self.decisions[decision] += 1
        self.drafting_share.add(len(best_chosen) / len(adaptive))
        if decision == "credit_probe" or (decision == "idle_probe" and self.shapes.reach):
            # a probe measures drafting where the models say it does not pay, so the allocation (which
            # prices by the same models) does not get to drop it: its draft is verified whole
            self._probing = frozenset(requests[i].request_id for i in best_chosen)
            tokens = sum(search.reads[i][0] for i in best_chosen)
            priced = sum(search.reads[i][0] * search.reads[i][1] for i in best_chosen)
            charged = loss if decision == "credit_probe" else 0.0
            self._probe = (charged, search.plain_goodput, priced / tokens if tokens else 1.0)
            if decision == "credit_probe":  # its streak goes on with this search for a few plans
                search.until = min(search.until, self._num_plans + self.settings.search_every)
            else:
                self._search = None  # the probe's step brings new measurements
        self._plans_since_plain = self._plans_since_plain + 1 if best_chosen or fixed_trees else 0
        for i in set(adaptive) - set(best_chosen):
            self.acceptance.age(requests[i].request_id)
        for i in best_chosen:
            states[i].idle_steps, states[i].read_upto = 0, requests[i].num_tokens
            depth, width = min(caps[i].depth, best_shape[0]), min(caps[i].width, best_shape[1])
            # The whole budget cap: the allocation decides how much of the draft to verify.
            out[i] = SpecParams(depth=depth, width=width, budget=caps[i].budget)
        return out

    def _shape_search(
        self,
        requests: list[Request],
        caps: list[SpecParams],
        adaptive: list[int],
        states: dict[int, _RequestState],
        base: int,
        fixed_trees: int,
        fixed_tokens: int,
        context: int | None,
        plain_steps: int = 1,
    ) -> _Search:
        """For each drafting shape, the requests worth drafting for (best expected gain per verified
        token first) and the goodput of drafting for them, drafter time included: the best option that
        pays and the best drafting option, paying or not. Plain decoding is priced as it runs: where
        it would take `plain_steps` steps in one call, a step costs what such calls take a step, and the
        engine's time outside the executor (`host_s`) is shared by those steps."""
        n = len(requests)
        max_depth = max(caps[i].depth for i in adaptive)
        max_width = max(caps[i].width for i in adaptive)
        host = self.host_s.value
        plain_goodput = n / self._plain_step_s(n, base, context, plain_steps, fixed_trees, fixed_tokens)
        policy_s = max(0.0, self.policy_drafting_s.value - self.policy_plain_s.value)  # what drafting adds
        policy_s += host  # a drafting step runs alone: the engine's own time is all its own
        # (shape, its options ordered, how many of them draft); the request lists are built once, after
        # the search
        best: tuple[tuple[int, int], list[tuple[float, int, int]], int] = ((0, 0), [], 0)
        # options are scored by goodput over the goodput they have to reach: plain decoding's, raised
        # by `min_advantage` for the share of their requests whose context the drafter has not read
        # lately (a request new to drafting reads its whole prompt, one idle for a while what it
        # generated since: costs priced only by their share per remaining step)
        best_score, near_score, near, near_tokens = 1.0, 0.0, best, float(n)
        factors = {}
        cold = {}
        # per request: the context tokens the drafter reads, and the share of their reading priced into
        # this step (a cold request's whole reading is spread over the steps it can expect to draft in)
        reads: dict[int, tuple[int, float]] = {}
        probed = set()
        for i in adaptive:
            st, req = states[i], requests[i]
            cold[i] = not st.history or st.idle_steps > self.settings.warm_steps
            unread = max(0, req.num_tokens - st.read_upto)
            share = 1.0
            if cold[i]:  # its reading pays for the drafts it gets from now on: as many as drafting lately gives
                left = max(1, req.max_tokens - len(req.output_token_ids))
                share = 1 / max(1.0, left * self.drafting_share.value / _TOKENS_PER_DRAFT_STEP)
            reads[i] = (unread, share)
            factor = self.acceptance.request_factor(requests[i].request_id)
            probe = st.idle_steps >= self.settings.probe_every
            if st.history and probe:
                # A probe: the request is assumed at least average again, so a multiplier that fell on
                # a bad stretch can recover; drafting still has to pay at the population's acceptance.
                factor = max(factor, 1.0)
            factors[i] = (factor, self.settings.explore_bonus if probe or not st.history else 0.0)
            if (st.history and probe) or factors[i][1]:
                probed.add(i)
        shape_cache: dict[tuple[int, int], tuple[float, float]] = {}  # requests mostly share their caps
        price = self.target_cost.pricer(base - fixed_tokens, context)  # the batch's prices, looked up once
        for depth in range(1, max_depth + 1):
            for width in range(1, max_width + 1):
                options: list[tuple[float, int, int]] = []  # (gain, budget, index)
                for i in adaptive:
                    cap = caps[i]
                    shape = (min(cap.depth, depth), min(cap.width, width))
                    if shape not in shape_cache:
                        shape_cache[shape] = self.shapes.predict(*shape, optimism=self.settings.optimism)
                    shape_gain, shape_nodes = shape_cache[shape]
                    gain = factors[i][0] * shape_gain + factors[i][1]
                    if gain >= self.settings.min_gain:
                        options.append((gain, min(cap.budget, max(1, round(shape_nodes))), i))
                options.sort(key=lambda o: (-o[0] / o[1], o[2]))
                gain = budget = num_cold = 0
                previous = read = 0.0
                for m, (g, b, i) in enumerate(options, 1):
                    gain, budget, num_cold = gain + g, budget + b, num_cold + cold[i]
                    read += reads[i][0] * reads[i][1]
                    step = price(fixed_trees + m, fixed_tokens + budget)
                    step += self.draft_cost.predict(depth, width, m) + self.draft_cost.predict_reading(read) + policy_s
                    goodput = (n + gain) / step
                    score = goodput / (plain_goodput * (1 + self.settings.min_advantage * num_cold / m))
                    if score > near_score:
                        near_score, near, near_tokens = score, ((depth, width), options, m), n + gain
                    if score > best_score:
                        best_score, best = score, near
                    if goodput < previous:  # past the peak: requests come in falling gain per token
                        break
                    previous = goodput
        return _Search(
            best_shape=best[0],
            best_chosen=[i for _, _, i in best[1][: best[2]]],
            near_shape=near[0],
            near_chosen=[i for _, _, i in near[1][: near[2]]],
            near_score=near_score,
            near_tokens=near_tokens,
            plain_goodput=plain_goodput,
            reads=reads,
            probed=frozenset(probed),
        )

    def _plain_step_s(
        self, n: int, base: int, context: int | None, plain_steps: int, fixed_trees: int = 0, fixed_tokens: int = 0
    ) -> float:
        """Seconds of the step without drafts for `n` decoding requests among `base` tokens, plus the engine's own
        time: where only these requests decode and plain decoding takes `plain_steps` > 1 steps a call, a step of
        such calls, the engine's time shared by its steps."""
        host = self.host_s.value
        if plain_steps > 1 and base == n:
            return self.target_cost.plain_decode_step(n, context, plain_steps) + host / plain_steps
        return self.target_cost.predict(base, fixed_trees, fixed_tokens, context) + host

    def choose_text_drafts(
        self,
        requests: list[Request],
        trees: list[DraftTree | None],
        other_tokens: int,
        context: int | None = None,
        plain_steps: int = 1,
    ) -> list[DraftTree | None]:
        """The parts of the text drafts that raise the step's goodput most over plain decoding as it runs: every
        node's estimate is its score calibrated for its depth (`text_calibration`), nodes are taken across the
        trees best estimate first, and the count kept maximises expected tokens over the step's price (the
        target's for its trees and draft tokens, plus the engine's own time); none where that does not beat
        plain decoding."""
        if not self.target_cost.ready:
            return list(trees)
        n = len(requests)
        if self._text_plans_since_plain >= self.settings.plain_every:  # a plain step: its price stays measured
            self._text_plans_since_plain = 0
            return [None] * n
        base = n + other_tokens
        host = self.host_s.value
        plain_s = self._plain_step_s(n, base, context, plain_steps)
        estimates: dict[int, list[float]] = {}
        nodes: list[tuple[float, int, int]] = []  # (estimate, tree index, node)
        for j, tree in enumerate(trees):
            if tree is not None and tree.num_draft:
                est = estimates[j] = self.text_calibration.estimates(tree)
                nodes.extend((est[i], j, i) for i in range(1, tree.size))
        nodes.sort(key=lambda x: (-x[0], x[1], x[2]))  # a parent before its children (never a lower estimate)
        price = self.target_cost.pricer(base, context)
        # to be kept, drafts have to beat plain decoding by `min_advantage`: near break-even they have nothing to
        # win, and their prices at a batch size rarely run plain (its curve seldom measured) are the least sure
        best_k, best_goodput = 0, n / plain_s * (1 + self.settings.min_advantage)
        gain, counted = 0.0, set()
        for k, (est, j, _) in enumerate(nodes, 1):
            gain += est
            counted.add(j)
            goodput = (n + gain) / (price(len(counted), k) + host)
            if goodput > best_goodput:
                best_k, best_goodput = k, goodput
        counts: dict[int, int] = {}
        for _, j, _ in nodes[:best_k]:
            counts[j] = counts.get(j, 0) + 1
        out: list[DraftTree | None] = [None] * n
        for j, c in counts.items():
            out[j] = trees[j].prune(c + 1, ranking=estimates[j])
        self._text_plans_since_plain = self._text_plans_since_plain + 1 if counts else 0
        self._text_idle = 0 if counts else self._text_idle + 1
        return out

    def _text_losing(self, num_seqs: int) -> bool:
        """Whether, at this batch size, steps that verified text drafts have lately delivered fewer tokens a second
        (their whole time: drafting, the target, verification, the engine's own) than steps that verified none."""
        outcome = self.text_outcomes.get(_batch_class(num_seqs))
        if outcome is None:
            return False
        text, plain = outcome
        enough = min(text.count, plain.count) >= self.settings.outcome_samples
        return enough and text.value < plain.value

    def observe_outcome(self, kind: str, num_seqs: int, tokens: int, seconds: float) -> None:
        if kind not in ("text", "plain") or seconds <= 0:
            return
        text, plain = self.text_outcomes.setdefault(_batch_class(num_seqs), (_Ema(weight=0.1), _Ema(weight=0.05)))
        (text if kind == "text" else plain).add(tokens / seconds)
        if kind == "text" and not self._text_losing(num_seqs):
            self._text_refused = 0

    def probes_plain(self, num_seqs: int) -> bool:
        """At a batch size where steps have verified text drafts: while fewer than `outcome_samples` plain steps were
        measured there, every step after a text step; then, while text drafts deliver more, one step in
        `text_recheck_every` (4 times as many while they deliver `text_lead` times plain steps' tokens a second; where
        they deliver less, most steps there are plain already)."""
        outcome = self.text_outcomes.get(_batch_class(num_seqs))
        if outcome is None:
            return False
        text, plain = outcome
        if plain.count < self.settings.outcome_samples:
            return text.count > plain.count
        if self._text_losing(num_seqs):
            return False
        self._plain_probes += 1
        every = self.settings.text_recheck_every
        if text.value > self.settings.text_lead * plain.value:  # a probe costs more the further text drafts lead
            every *= 4
        return self._plain_probes % every == 0

    def wants_text_drafts(self, num_seqs: int) -> bool:
        """Not at a batch size where steps that verified text drafts have lately delivered fewer tokens a second than
        plain steps (`_text_losing`; every `text_recheck_every`-th step there, so that stays measured); and after plans
        in a row that kept no text draft, only every 2, 4, ... up to `idle_search_every` plans (drafting from the text
        costs every request's lookup each time)."""
        if self._text_losing(num_seqs):
            self._text_refused += 1
            return self._text_refused % self.settings.text_recheck_every == 0
        self._text_skipped += 1
        gap = min(self.settings.idle_search_every, 1 << min(self._text_idle, 30))
        if self._text_skipped >= gap:
            self._text_skipped = 0
            return True
        return False

    def observe_text(self, tree: DraftTree, path: list[int]) -> None:
        self.text_calibration.observe(tree, path)

    # ---- verification budget ----------------------------------------------------------------------
    def allocate(
        self, requests: list[Request], specs: list[SpecParams], trees: list[DraftTree | None], other_tokens: int
    ) -> list[DraftTree | None]:
        out: list[DraftTree | None] = [None] * len(trees)
        if not self.target_cost.ready:
            return [fixed_subtree(t, s) for t, s in zip(trees, specs, strict=True)]
        base = self._step_decoders + self._step_other_tokens
        # trees verified whatever they are predicted to gain (fixed requests' and probes'), their tokens
        fixed_trees = fixed_tokens = 0
        nodes: list[tuple[float, int, int]] = []  # (estimate, request index, node)
        estimates: dict[int, list[float]] = {}
        cut: dict[int, DraftTree] = {}
        counts: dict[int, int] = {}  # nodes verified per adaptive request
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
            # Each request keeps at most its budget; its best nodes come first.
            best = sorted(range(1, tree.size), key=lambda i: (-est[i], i))[: spec.budget]
            if req.request_id in self._probing:
                counts[j] = len(best)
                fixed_trees, fixed_tokens, base = fixed_trees + 1, fixed_tokens + len(best), base + len(best)
                continue
            nodes.extend((est[i], j, i) for i in best)
        nodes.sort(key=lambda x: (-x[0], x[1], x[2]))
        k = self._best_count(requests, nodes, base, fixed_trees, fixed_tokens)
        for _, j, _ in nodes[:k]:
            counts[j] = counts.get(j, 0) + 1
        depths, widths, budgets = [], [], []
        self._drafted = {}
        for j, est in estimates.items():
            req, tree, c = requests[j], cut[j], counts.get(j, 0)
            st = self.requests.setdefault(req.request_id, _RequestState())
            st.history = True
            if c == 0:  # drafted for nothing: the shape table learns that too
                self.shapes.observe(specs[j].depth, specs[j].width, None, [0])
                continue
            self._drafted[req.request_id] = (specs[j].depth, specs[j].width)
            kept = out[j] = tree.prune(c + 1, ranking=est)  # the drafter's scores stay: calibration reads them
            depths.append(kept.depth)
            widths.append(max(kept.depths.count(d) for d in range(1, kept.depth + 1)))
            budgets.append(kept.num_draft)
        self.last_drafted = len(budgets)
        self.last_depth = sum(depths) / len(depths) if depths else 0.0
        self.last_width = sum(widths) / len(widths) if widths else 0.0
        self.last_budget = sum(budgets) / len(budgets) if budgets else 0.0
        self._pending_prediction = self.target_cost.predict(
            base + k, sum(t is not None for t in out), fixed_tokens + k, self._step_context
        )
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
        price = self.target_cost.pricer(base - fixed_tokens, self._step_context)
        for k in range(len(nodes) + 1):
            if k:
                est, j, _ = nodes[k - 1]
                total += est
                gains[j] += est
                if j not in counted:
                    counted.add(j)
                    trees += 1
            t = price(trees, fixed_tokens + k)
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
            self.target_cost.observe(
                record.num_tokens, record.target_s, record.num_trees, record.num_draft_tokens, record.num_context
            )
            if self._pending_prediction is not None:  # a step the policy sized: prediction vs outcome
                self.predicted_step_s.add(self._pending_prediction)
                self.observed_step_s.add(record.target_s)
        self._pending_prediction = None
        if self._probe is not None:  # charge the probe what it really cost (it was charged its prediction)
            # a cold request's reading is charged as the search priced it: its share per remaining step
            charged, plain_goodput, read_share = self._probe
            seconds = record.target_s + record.draft_s + record.read_s * read_share
            seconds += max(0.0, record.policy_s - self.policy_plain_s.value)  # what drafting added to it
            if seconds > 0 and plain_goodput > 0:
                # time beyond what plain decoding takes for the tokens it emitted, in plain steps: linear
                # in the tokens, so a lucky and an unlucky step average to what the draft is worth
                n = self._step_decoders
                loss = (seconds * plain_goodput - n - self._step_accepted) / n - charged
                # at most `_CREDIT_FLOOR` in debt: one outlier step cannot silence the idle probes for long;
                # a streak that reaches it ends
                self._probe_credit = min(1.0, self._probe_credit - loss)
                if self._probe_credit <= _CREDIT_FLOOR:
                    self._probe_credit, self._streak_left = _CREDIT_FLOOR, 0
            self._probe = None
        self._step_accepted = 0
        if record.policy_s:
            (self.policy_drafting_s if record.num_drafted else self.policy_plain_s).add(record.policy_s)
        if record.num_drafted:
            self.draft_cost.observe(record.draft_depth, record.draft_width, record.num_drafted, record.draft_s)
        if record.num_read:
            self.draft_cost.observe_reading(record.num_read, record.read_s)

    def observe_multi_step(self, num_seqs: int, steps: int, seconds: float, context: int | None = None) -> None:
        self.target_cost.observe_multi_step(num_seqs, steps, seconds, context)

    def observe_host(self, seconds: float) -> None:
        self.host_s.add(seconds)

    def choose_rounds(self, num_seqs: int, depths: list[int], behind: bool = False) -> int:
        """The option (0, or a depth among `depths` and `rounds_depths`) that has delivered the most tokens a second
        at this batch size (`rounds_outcomes`), once every option has `rounds_samples` steps there or clearly loses
        (`rounds_drop`): until then the least measured; rounds only where they lead the plan by `rounds_margin`; and
        every `rounds_recheck_every` steps the least measured other option, so what changes with the text and the
        context is followed."""
        options = [0, *(d for d in depths if d in self.settings.rounds_depths)]
        if len(options) == 1:
            return 0
        size = (_batch_class(num_seqs), behind)  # measured apart: a drafter behind costs the rounds its reading
        outcomes = [self.rounds_outcomes.get((size, o)) for o in options]
        counts = [0 if e is None else e.count for e in outcomes]
        settings = self.settings
        self._rounds_plans += 1
        least = min(settings.rounds_samples, settings.rounds_min_samples)
        measured = [i for i in range(len(options)) if counts[i] >= least]
        top = max((outcomes[i].value for i in measured), default=0.0)  # type: ignore[union-attr]
        short = [
            i for i in range(len(options))
            if counts[i] < settings.rounds_samples
            and not (i in measured and outcomes[i].value < settings.rounds_drop * top)  # type: ignore[union-attr]
        ]  # fmt: skip
        if short:
            return options[min(short, key=lambda i: counts[i])]
        scores = [outcomes[i].value * (settings.rounds_margin if options[i] == 0 else 1.0) for i in range(len(options))]  # type: ignore[union-attr]
        best = max(range(len(options)), key=lambda i: scores[i])
        if self._rounds_plans % settings.rounds_recheck_every == 0:
            others = [i for i in range(len(options)) if i != best]
            return options[min(others, key=lambda i: counts[i])]
        return options[best]

    def observe_rounds(self, num_seqs: int, depth: int, tokens: int, seconds: float, behind: bool = False) -> None:
        if seconds > 0:
            self.rounds_outcomes.setdefault(((_batch_class(num_seqs), behind), depth), _Rate()).add(tokens, seconds)

    def observe_verified(self, request: Request, tree: DraftTree, path: list[int]) -> None:
        self.acceptance.observe(request.request_id, tree, len(path) - 1)
        self._step_accepted += len(path) - 1
        shape = self._drafted.pop(request.request_id, None)
        if shape is not None:
            self.shapes.observe(*shape, tree, path)

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
            "plans": dict(self.decisions),
        }


def make_policy(name: str, settings: AdaptiveSettings | None = None) -> SpeculationPolicy:
    """The policy a config names: `fixed` or `adaptive`."""
    if name == "fixed":
        return FixedPolicy()
    if name == "adaptive":
        return AdaptivePolicy(settings or AdaptiveSettings())
    raise ValueError(f"unknown speculation policy {name!r}; use 'fixed' or 'adaptive'")
