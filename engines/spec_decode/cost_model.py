"""Step-time models: what a target forward over N tokens costs, and what a drafting round costs.

The target's step time is a piecewise-linear curve over the step's token count (flat while the
device is memory-bound, rising once it saturates compute) for a plain step, plus what verifying
trees adds to the plain step of the same batch: a cost per tree and per draft token (the draft
tokens' forward, tree masks, verification, KV commits), fitted per power-of-two bucket of the plain
step's tokens, since a draft token costs little while the device is memory-bound and much once it
is not (a bucket without tree steps yet borrows the nearest measured bucket's; one measured only by
one kind of tree, such as the idle probe of a batch where drafting does not pay, divides that tree's
cost between tree and token as the nearest bucket with both does). The engine runs
plain steps of its batch sizes all the time, so the overhead is measured against a current
baseline, not against profiled points it may never revisit (a prefill of N tokens is not a decode
step of N requests). A plain step is also moved by its attention context (the keys its attention
reads), at a slope per key fitted from how plain steps of one token count differ in context: a
decode step of four requests, one of them 900 tokens deep, costs twice what four short ones do, and
an average over contexts would misprice both the step and what trees add to it. The curve is seeded
by a start-up profile; both follow the times observed
online (exponential moving averages), so a model that was profiled cold or on a busy machine
corrects itself. The drafter's time is a line in the number of requests it drafts for, one line per
(depth, width), fitted online by least squares with forgetting, plus its reading of the context
those requests gained since they last drafted: a line in the tokens read, timed apart.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _TreeOverhead:
    """Extra seconds of a step that verifies trees over the plain step of its batch, as
    a·trees + b·draft tokens: least squares through the origin with exponential forgetting (one
    coefficient alone when the two move together)."""

    forget: float = 0.99
    stt: float = 0.0
    stk: float = 0.0
    skk: float = 0.0
    str_: float = 0.0
    skr: float = 0.0

    def add(self, trees: int, tokens: int, residual: float) -> None:
        f = self.forget
        self.stt, self.stk, self.skk = (
            f * self.stt + trees * trees,
            f * self.stk + trees * tokens,
            f * self.skk + tokens * tokens,
        )
        self.str_, self.skr = f * self.str_ + trees * residual, f * self.skr + tokens * residual

    def reweigh(self, trees: float) -> None:
        """Keep the fitted coefficients but let the evidence behind them count as `trees` tree steps."""
        if self.stt > 0:
            scale = trees / self.stt
            self.stt, self.stk, self.skk = scale * self.stt, scale * self.stk, scale * self.skk
            self.str_, self.skr = scale * self.str_, scale * self.skr

    def _det(self) -> float:
        return self.stt * self.skk - self.stk * self.stk

    def separable(self) -> bool:
        """Whether its steps varied in draft tokens per tree, so that both coefficients are determined."""
        return self._det() > 1e-9 * max(1.0, self.stt * self.skk)

    def coefficients(self, split: tuple[float, float] | None = None) -> tuple[float, float]:
        """(seconds per tree, seconds per draft token). Where every step had the same draft tokens per
        tree (the same probe over and over), what they cost is divided between the two as `split`
        (another bucket's coefficients) divides it, or else put all on the tree."""
        if self.separable():
            det = self._det()
            a = (self.str_ * self.skk - self.skr * self.stk) / det
            b = (self.skr * self.stt - self.str_ * self.stk) / det
            if a >= 0 and b >= 0:
                return a, b
            if a < 0 and self.skk > 0:
                return 0.0, max(0.0, self.skr / self.skk)
        if self.stt <= 0:
            return 0.0, 0.0
        per_tree = max(0.0, self.str_ / self.stt)  # tokens per tree are fixed: a cost per such tree
        if split is not None and split[0] + split[1] * self.stk / self.stt > 0:
            scale = per_tree / (split[0] + split[1] * self.stk / self.stt)
            return split[0] * scale, split[1] * scale
        return per_tree, 0.0


@dataclass
class TargetCostModel:
    """Predicted seconds of one target forward (with sampling and verification) over `tokens` tokens."""

    # power-of-two bucket of the token count -> (mean tokens, mean seconds, mean context), moving averages
    points: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # observations per bucket
    decay: float = 0.05  # weight of a new observation once a bucket has 1/decay of them (a running mean before)
    # seconds per context key: a plain step's time over its bucket's mean against its context over the
    # bucket's mean context, least squares through the origin with forgetting
    context_forget: float = 0.995
    _sxx: float = 0.0
    _sxy: float = 0.0
    # power-of-two bucket of a tree step's plain tokens -> what its trees add
    trees: dict[int, _TreeOverhead] = field(default_factory=dict)
    prior_tree_steps: int = 2  # tree steps a new bucket's fit starts with, priced by the nearest bucket
    _curve: tuple[list[float], list[float], list[float]] | None = field(default=None, repr=False)
    # bucket -> its overhead coefficients (or the nearest measured bucket's), until a tree step changes them
    _overheads: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)
    # decode batch size -> (a decode step's seconds when plain decoding runs several steps in one call, its
    # attention keys, observations): moving averages. Plain decoding as it runs, which a draft has to beat.
    multi_steps: dict[int, tuple[float, float, int]] = field(default_factory=dict)

    @staticmethod
    def bucket(tokens: int) -> int:
        """Observations are pooled in power-of-two buckets of the token count."""
        return 1 << max(0, (max(1, tokens) - 1).bit_length())

    def observe(
        self, tokens: int, seconds: float, num_trees: int = 0, num_draft_tokens: int = 0, context: int | None = None
    ) -> None:
        """Fold one measured step in: plain steps into their bucket, steps that verified trees into the
        tree overhead (what they cost beyond the plain step of the same batch and context). `context`
        is the step's attention keys (None: unknown, taken as its bucket's mean)."""
        if num_trees:
            if self.points:
                base = tokens - num_draft_tokens
                b = self.bucket(base)
                if b not in self.trees:
                    self._new_overhead(b, num_trees, num_draft_tokens)
                overhead = self.trees[b]
                overhead.add(num_trees, num_draft_tokens, seconds - self._plain(base, context))
                self._overheads.clear()
            return
        self._curve = None
        b = self.bucket(tokens)
        old = self.points.get(b)
        if context is None:
            context = round(old[2]) if old else 0
        if old is not None and self.counts[b] >= 1 / self.decay:  # a settled bucket: its spread in context
            f, dx = self.context_forget, context - old[2]
            self._sxx, self._sxy = f * self._sxx + dx * dx, f * self._sxy + dx * (seconds - old[1])
        old = old or (0.0, 0.0, 0.0)
        self.counts[b] = self.counts.get(b, 0) + 1
        d = max(self.decay, 1 / self.counts[b])  # a profiled point weighs one step: online data soon rules
        self.points[b] = tuple((1 - d) * o + d * x for o, x in zip(old, (tokens, seconds, context), strict=True))

    def observe_multi_step(self, num_seqs: int, steps: int, seconds: float, context: int | None = None) -> None:
        """Fold in one call that ran `steps` plain decode steps of `num_seqs` requests in `seconds` (over
        `context` attention keys at its first step)."""
        if steps < 1:
            return
        keys = float(context if context is not None else 0)
        old_s, old_keys, count = self.multi_steps.get(num_seqs, (0.0, 0.0, 0))
        d = max(self.decay, 1 / (count + 1))
        self.multi_steps[num_seqs] = ((1 - d) * old_s + d * seconds / steps, (1 - d) * old_keys + d * keys, count + 1)

    def plain_decode_step(self, num_seqs: int, context: int | None = None, steps: int = 1) -> float:
        """Seconds a plain decode step of `num_seqs` requests takes as plain decoding runs it: one step a call
        (the curve), or (`steps` > 1) several a call: as measured for that batch size, moved by the context
        slope for another context; an unmeasured batch size as the nearest measured one, scaled by the curve."""
        if steps < 2 or not self.multi_steps:
            return self._plain(num_seqs, context)
        near = min(self.multi_steps, key=lambda n: (abs(n.bit_length() - num_seqs.bit_length()), n))
        seconds, keys, _ = self.multi_steps[near]
        if near != num_seqs and self.points:
            seconds *= self._plain(num_seqs) / self._plain(near)
        if context is not None:
            seconds = max(0.25 * seconds, seconds + self.context_slope * (context - keys * num_seqs / near))
        return seconds

    def _new_overhead(self, bucket: int, num_trees: int, num_draft_tokens: int) -> None:
        """A bucket's fit, at its first tree step (`num_trees` trees, `num_draft_tokens` tokens): it
        starts with `prior_tree_steps` such steps as the nearest measured bucket prices them (one
        noisy step alone can price its trees at nothing, and the next step then verifies every draft
        token it has)."""
        near = self.overhead(bucket)
        fit = self.trees[bucket] = _TreeOverhead()
        if near is not None:
            for _ in range(self.prior_tree_steps):
                fit.add(num_trees, num_draft_tokens, near[0] * num_trees + near[1] * num_draft_tokens)

    @property
    def context_slope(self) -> float:
        """Seconds a plain step costs per attention key beyond its bucket's mean context (0 until plain
        steps of one token count have differed in context)."""
        return max(0.0, self._sxy / self._sxx) if self._sxx > 0 else 0.0

    def seed_context_slope(self, seconds_per_key: float, keys_apart: float, steps: float) -> None:
        """Start the context slope at a measured value, weighing as much as `steps` plain steps
        `keys_apart` keys from their bucket's mean context (online steps then take over)."""
        self._sxx = steps * keys_apart * keys_apart
        self._sxy = self._sxx * max(0.0, seconds_per_key)

    def reset(self) -> None:
        """Forget every measurement (a fresh profile follows)."""
        self.points.clear()
        self.counts.clear()
        self._sxx = self._sxy = 0.0
        self.trees.clear()
        self._curve = None
        self._overheads.clear()
        self.multi_steps.clear()

    def predict(self, tokens: int, num_trees: int = 0, num_draft_tokens: int = 0, context: int | None = None) -> float:
        """Seconds for a step of `tokens` tokens in which `num_trees` requests verify trees holding
        `num_draft_tokens` draft tokens, over `context` attention keys of its plain step (None: the
        context plain steps of that size had lately)."""
        base = tokens - num_draft_tokens
        overhead = self.overhead(base) if num_trees else None
        if overhead is None:  # no tree step measured yet: draft tokens cost what the curve says
            return self._plain(tokens, context)
        per_tree, per_token = overhead
        return self._plain(base, context) + per_tree * num_trees + per_token * num_draft_tokens

    def tree_step(self, base_tokens: int, context: int | None = None) -> tuple[float, float, float] | None:
        """(seconds of the plain step over `base_tokens` tokens, seconds per tree, seconds per draft token):
        for one tree or more, `predict(base_tokens + k, trees, k, context)` is the plain step plus trees
        and k draft tokens at those prices (with none, the plain step alone), so an optimizer pricing
        many options of one batch asks once. None before any tree step, while draft tokens cost what
        the plain curve says."""
        overhead = self.overhead(base_tokens)
        if overhead is None:
            return None
        return self._plain(base_tokens, context), overhead[0], overhead[1]

    def pricer(self, base_tokens: int, context: int | None = None) -> Callable[[int, int], float]:
        """`predict` for the steps of one batch: price(trees, draft_tokens) is the seconds of a step over
        `base_tokens` plain tokens plus those trees and draft tokens, with the batch's prices
        (`tree_step`) looked up once."""
        line = self.tree_step(base_tokens, context)
        if line is None:
            return lambda trees, tokens: self.predict(base_tokens + tokens, trees, tokens, context)
        plain, per_tree, per_token = line
        return lambda trees, tokens: plain + per_tree * trees + per_token * tokens

    def overhead(self, base_tokens: int) -> tuple[float, float] | None:
        """(seconds per tree, seconds per draft token) that verifying adds to a plain step of
        `base_tokens` tokens: measured in its bucket, else in the nearest measured one (None before
        any tree step)."""
        if not self.trees:
            return None
        b = self.bucket(base_tokens)
        if b not in self._overheads:  # asked for many times per plan: solved once per tree step

            def distance(k: int) -> tuple[int, int]:
                return abs(k.bit_length() - b.bit_length()), k

            fit = self.trees[min(self.trees, key=distance)]
            separable = [k for k, f in self.trees.items() if f.separable()]
            split = None
            if separable and not fit.separable():
                split = self.trees[min(separable, key=distance)].coefficients()
            self._overheads[b] = fit.coefficients(split)
        return self._overheads[b]

    def _plain(self, tokens: int, context: int | None = None) -> float:
        """A plain step: interpolated between the buckets' means (made non-decreasing), extrapolated
        along the last segment past them, flat below the smallest; then moved by the context slope for
        a context other than those buckets' mean (at most down to a quarter)."""
        if not self.points:
            raise ValueError("the target cost model has no measurements; profile it first")
        if self._curve is None:  # rebuilt after each new measurement, not on every prediction
            buckets = sorted(self.points)
            xs = [self.points[b][0] for b in buckets]
            # each bucket's mean weighs as many steps as it averages (at most 1/decay)
            weights = [min(self.counts.get(b, 1), 1 / self.decay) for b in buckets]
            ys = _non_decreasing([self.points[b][1] for b in buckets], weights)
            self._curve = (xs, ys, [self.points[b][2] for b in buckets])
        xs, ys, contexts = self._curve
        seconds = _interpolate(xs, ys, tokens)
        slope = self.context_slope
        if context is None or slope == 0:
            return seconds
        shift = slope * (context - _interpolate(xs, contexts, tokens, extend=False))
        return max(0.25 * seconds, seconds + shift)

    @property
    def ready(self) -> bool:
        """Whether it has any measurement."""
        return bool(self.points)


def _interpolate(xs: list[float], ys: list[float], x: float, extend: bool = True) -> float:
    """Piecewise-linear through (xs, ys), flat below the first point; past the last, along the last
    segment (rising only: a step never gets cheaper with more tokens) or, with `extend` off, flat."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        if not extend:
            return ys[-1]
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (x - xs[-1])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _non_decreasing(ys: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit to `ys` (pool adjacent violators): more tokens
    never cost less, and where two buckets disagree the one with more steps behind it moves less (a
    few slow steps of a batch size seen rarely do not raise the estimate of the batch that runs)."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, points pooled), means non-decreasing
    for y, w in zip(ys, weights, strict=True):
        mean, weight, count = y, w, 1
        while blocks and blocks[-1][0] > mean:  # pool with the block before until the order holds
            m0, w0, c0 = blocks.pop()
            mean, weight, count = (m0 * w0 + mean * weight) / (w0 + weight), w0 + weight, c0 + count
        blocks.append((mean, weight, count))
    return [mean for mean, _, count in blocks for _ in range(count)]


@dataclass
class _Line:
    """Online least squares of y = a + b·x with exponential forgetting."""

    forget: float = 0.95
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        f = self.forget
        self.n, self.sx, self.sy = f * self.n + 1, f * self.sx + x, f * self.sy + y
        self.sxx, self.sxy = f * self.sxx + x * x, f * self.sxy + x * y

    def predict(self, x: float) -> float:
        if self.n == 0:
            raise ValueError("no observations")
        var = self.sxx - self.sx * self.sx / self.n
        if var < 1e-9:  # one distinct x so far: proportional to x through that point
            mean_x, mean_y = self.sx / self.n, self.sy / self.n
            return mean_y * x / mean_x if mean_x > 0 else mean_y
        b = max(0.0, (self.sxy - self.sx * self.sy / self.n) / var)
        a = self.sy / self.n - b * self.sx / self.n
        return max(0.0, a + b * x)


@dataclass
class DraftCostModel:
    """Predicted seconds of one drafting round for `num_requests` requests with trees `depth` x `width`,
    and of the drafter reading `tokens` of context before it (the tokens since a request last drafted;
    a request new to drafting reads its whole prompt). The two are timed apart: a round's time does
    not depend on how much context came before it, and a shape first drafted for requests with long
    unread prompts must not look dear for good."""

    lines: dict[tuple[int, int], _Line] = field(default_factory=dict)
    reading: _Line = field(default_factory=lambda: _Line(forget=0.99))

    def observe(self, depth: int, width: int, num_requests: int, seconds: float) -> None:
        """Fold one measured drafting round in."""
        self.lines.setdefault((depth, width), _Line()).add(num_requests, seconds)

    def observe_reading(self, tokens: int, seconds: float) -> None:
        """Fold one measured context reading in (all drafted requests' unread tokens at once)."""
        self.reading.add(tokens, seconds)

    def predict_reading(self, tokens: float) -> float:
        """Seconds to read that many context tokens (0 for none, or before any reading was measured)."""
        return self.reading.predict(tokens) if tokens > 0 and self.reading.n else 0.0

    def predict(self, depth: int, width: int, num_requests: int) -> float:
        """Seconds for a round. An unmeasured shape is priced from the nearest measured one: per depth
        level (a drafter forward and a tree level each), and by its share of the width where it is
        narrower. That errs cheap, never dear: a shape priced too cheap is drafted once and then
        measured, one priced too dear would never be (the allocation only drafts what looks worth it)."""
        if num_requests == 0:
            return 0.0
        line = self.lines.get((depth, width))
        if line is not None:
            return line.predict(num_requests)
        if not self.lines:
            return 0.0
        (d, w), near = min(self.lines.items(), key=lambda kv: (abs(kv[0][0] - depth), abs(kv[0][1] - width)))
        return near.predict(num_requests) * depth / d * min(1.0, width / w)

    @property
    def ready(self) -> bool:
        """Whether any shape was measured."""
        return bool(self.lines)
