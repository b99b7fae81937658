"""The adaptive speculation policy's models and optimizer on synthetic costs and acceptance."""

from __future__ import annotations

import itertools
import random

import pytest

from engines.draft_tree import DraftTree
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_decode.acceptance_model import AcceptanceModel
from engines.spec_decode.cost_model import DraftCostModel, TargetCostModel
from engines.spec_decode.policy import (
    AdaptivePolicy,
    AdaptiveSettings,
    FixedPolicy,
    ShapeTable,
    StepRecord,
    _Ema,
    _RequestState,
)
from engines.spec_params import SpecParams


def request(rid: str, tpot: float | None = None) -> Request:
    """A bare decoding request (the policy reads only its id and TPOT target)."""
    return Request(rid, [1, 2, 3], SamplingParams(), 16, frozenset(), None, None, tpot_target_s=tpot)


def chain(scores: list[float]) -> DraftTree:
    return DraftTree.chain(0, list(range(1, len(scores) + 1)), [1.0, *scores])


def test_target_cost_model_interpolates_and_learns_tree_overhead():
    m = TargetCostModel()
    for tokens, seconds in ((1, 0.010), (8, 0.010), (64, 0.050)):
        m.observe(tokens, seconds)
    assert m.predict(4) == pytest.approx(0.010)
    assert m.predict(36) == pytest.approx(0.030)  # halfway between 8 and 64 tokens
    assert m.predict(128) == pytest.approx(0.050 + 64 * 0.04 / 56)  # the last segment's slope
    for _ in range(200):  # steps that verify 4 trees take 8 ms more than a plain step of 8 tokens
        m.observe(8, 0.018, num_trees=4)
    assert m.overhead(8) == pytest.approx((0.002, 0.0), rel=1e-3)
    assert m.predict(8, num_trees=4) == pytest.approx(0.018, rel=1e-3)


def test_tree_overhead_separates_per_tree_and_per_draft_token_costs():
    m = TargetCostModel()
    m.observe(64, 0.010)  # plain steps cost 10 ms up to 64 tokens
    m.observe(1, 0.010)
    for trees, tokens in ((1, 2), (1, 8), (4, 8), (4, 32), (3, 16)) * 20:  # 3 ms a tree, 0.5 ms a draft token
        m.observe(4 + tokens, 0.010 + 0.003 * trees + 0.0005 * tokens, trees, tokens)  # 4 decoding requests
    assert m.overhead(4) == pytest.approx((0.003, 0.0005), rel=1e-6)
    assert m.predict(4 + 18, num_trees=2, num_draft_tokens=18) == pytest.approx(0.010 + 0.006 + 0.009)


def test_a_reweighed_tree_fit_keeps_its_costs_and_yields_to_the_steps_that_follow():
    """The profile's tree steps weigh a couple of steps: its prices hold until real tree steps come."""

    def fitted(reweigh: bool) -> tuple[float, float]:
        m = TargetCostModel()
        m.observe(1, 0.030)
        for tokens in (1, 4) * 10:  # the profile: 6 ms a tree, 1 ms a draft token
            m.observe(1 + tokens, 0.030 + 0.006 + 0.001 * tokens, 1, tokens)
        before = m.overhead(1)
        if reweigh:
            m.trees[1].reweigh(2.0)
            assert m.trees[1].coefficients() == pytest.approx(before)
        for tokens in (1, 4) * 3:  # online: 1 ms a tree
            m.observe(1 + tokens, 0.030 + 0.001 + 0.001 * tokens, 1, tokens)
        return m.overhead(1)

    assert fitted(reweigh=True)[0] < 0.0025 < 0.004 < fitted(reweigh=False)[0]


def test_tree_overhead_is_measured_against_the_plain_step_of_the_same_batch():
    """The profile's points above one token can be stale (a batch size the engine never runs plain):
    a verified draft token costs what tree steps cost over the plain steps the engine does run, and
    a large batch has its own overhead (there a draft token costs a forward's worth of compute)."""
    m = TargetCostModel()
    for tokens, seconds in ((1, 0.030), (2, 0.036), (4, 0.036), (8, 0.036), (32, 0.050), (64, 0.080)):
        m.observe(tokens, seconds)
    for k in (1, 2, 3, 4) * 30:  # batch 1: 0.5 ms a draft token over the 30 ms plain step
        m.observe(1 + k, 0.030 + 0.0005 * k, 1, k)
    assert m.predict(1 + 3, 1, 3) == pytest.approx(0.0315, rel=1e-6)  # not the stale 36 ms of 4 tokens
    for k in (1, 2, 4, 8) * 30:  # batch 32: 1 ms a draft token
        m.observe(32 + k, 0.050 + 0.001 * k, 1, k)
    # (its fit started from batch 1's, weighing two steps: forgotten by now, all but a trace)
    assert m.predict(32 + 4, 1, 4) == pytest.approx(0.054, rel=1e-3)
    assert m.predict(1 + 4, 1, 4) == pytest.approx(0.032, rel=1e-6)  # batch 1 keeps its own
    assert m.predict(16 + 4, 1, 4) == pytest.approx(m._plain(16) + 0.004, rel=1e-3)  # unmeasured: the nearest
    two_points = TargetCostModel(points={8: (8.0, 0.01, 0.0), 16: (16.0, 0.02, 0.0)})
    assert two_points.predict(12, 1, 4) == pytest.approx(0.015)


def test_a_bucket_measured_by_one_kind_of_tree_splits_its_cost_like_its_neighbour():
    """Idle probes verify the same 16-token tree every time: their cost is divided between tree and
    token as the nearest bucket with varied trees divides it, so a 1-token tree is not priced as a
    16-token one."""
    m = TargetCostModel()
    for tokens, seconds in ((1, 0.030), (16, 0.032), (32, 0.050), (64, 0.080)):
        m.observe(tokens, seconds)
    for k in (1, 4, 8, 16) * 10:  # batch 1: 2 ms a tree, 0.5 ms a draft token
        m.observe(1 + k, 0.030 + 0.002 + 0.0005 * k, 1, k)
    m.observe(32 + 16, 0.050 + 0.020, 1, 16)  # batch 32: only the probe, 1 tree of 16 tokens, 20 ms
    # its first step alone does not set the bucket: it starts from two such steps priced as at batch 1
    assert sum(m.overhead(32)[i] * (1, 16)[i] for i in (0, 1)) == pytest.approx(
        ((0.99**2 + 0.99) * 0.010 + 0.020) / (0.99**2 + 0.99 + 1)
    )
    for _ in range(300):
        m.observe(32 + 16, 0.050 + 0.020, 1, 16)
    per_tree, per_token = m.overhead(32)
    assert per_tree + 16 * per_token == pytest.approx(0.020, rel=1e-3)  # what was measured holds
    assert per_tree / per_token == pytest.approx(0.002 / 0.0005)  # split as at batch 1
    expected = 0.050 + 0.020 * (0.002 + 0.0005) / (0.002 + 16 * 0.0005)
    assert m.predict(33, 1, 1) == pytest.approx(expected, rel=1e-3)
    alone = TargetCostModel(points={32: (32.0, 0.05, 0.0)})
    alone.observe(48, 0.070, 1, 16)  # nothing to split by: all on the tree
    assert alone.overhead(32) == pytest.approx((0.020, 0.0))


def test_a_rarely_seen_batch_size_does_not_raise_the_plain_step_of_the_batch_that_runs():
    """Plain steps of 4 requests run all the time at 32 ms; the tail of a wave left 2 requests a few
    times, slowly (35 ms). More tokens never cost less, but the well-measured 4-request step moves
    little (the buckets pool by their steps), so drafting is not credited with the 2-request
    bucket's slowness."""
    m = TargetCostModel()
    for _ in range(5):
        m.observe(2, 0.035)
    for _ in range(40):
        m.observe(4, 0.032)
    pooled = (5 * 0.035 + 20 * 0.032) / 25  # a bucket weighs at most 1/decay = 20 steps
    assert m.predict(4) == pytest.approx(pooled)
    assert m.predict(2) == pytest.approx(pooled)
    assert m.predict(4) < 0.033


def test_a_plain_step_is_priced_by_its_context_and_so_is_what_trees_add():
    """Steps of 4 requests cost 30 ms + 20 us per attention key: waves of short prompts (400 keys)
    and of one long prompt (1,800 keys, padded) alternate. The model learns the slope, prices each
    step by its context, and measures a tree's overhead against the plain step of that context (2 ms
    in either wave), not against the average step, which would call the long wave's trees free and
    the short wave's dear."""
    m = TargetCostModel()
    m.observe(4, 0.030, context=4)  # the profile: one prefill, little context
    for wave in range(8):
        context = 400 if wave % 2 else 1800
        for step in range(40):
            m.observe(4, 0.030 + 2e-5 * (context + step * 4), context=context + step * 4)
    assert m.context_slope == pytest.approx(2e-5, rel=0.05)
    assert m.predict(4, context=500) == pytest.approx(0.040, rel=0.03)
    assert m.predict(4, context=2000) == pytest.approx(0.070, rel=0.03)
    for context in (400, 2000) * 20:
        m.observe(4 + 4, 0.030 + 2e-5 * context + 0.002, 1, 4, context=context)
    assert m.overhead(4)[0] + 4 * m.overhead(4)[1] == pytest.approx(0.002, rel=0.1)
    assert m.predict(4 + 4, 1, 4, context=2000) == pytest.approx(0.072, rel=0.03)
    unknown = m.predict(4)  # no context given: the recent mean's
    assert m.predict(4, context=400) < unknown < m.predict(4, context=2000)


def test_a_seeded_context_slope_prices_steps_until_online_steps_take_over():
    """The profile measures seconds per attention key; plain steps then price by it from the start."""
    m = TargetCostModel()
    m.observe(8, 0.030, context=500)
    assert m.predict(8, context=2000) == pytest.approx(0.030)  # no slope yet: context is not priced
    m.seed_context_slope(2e-5, 1500, 20)
    assert m.context_slope == pytest.approx(2e-5)
    assert m.predict(8, context=2000) == pytest.approx(0.060)
    for step in range(400):  # the engine's steps say 4e-5 a key
        context = 500 + 1500 * (step % 2)
        m.observe(8, 0.030 + 4e-5 * (context - 500), context=context)
    assert m.context_slope == pytest.approx(4e-5, rel=0.1)


def test_a_profiled_point_weighs_one_step():
    """A start-up profile taken on a busy machine (180 ms) gives way to the steps the engine runs."""
    m = TargetCostModel()
    m.observe(1, 0.180)
    for _ in range(30):
        m.observe(1, 0.056)
    assert m.predict(1) == pytest.approx(0.056, rel=0.08)


def test_draft_cost_model_fits_a_line_and_scales_unseen_shapes_cheap():
    m = DraftCostModel()
    for n in (1, 2, 4, 8) * 5:
        m.observe(2, 2, n, 0.004 + 0.001 * n)
    assert m.predict(2, 2, 16) == pytest.approx(0.020, rel=1e-6)
    assert m.predict(4, 2, 16) == pytest.approx(0.040, rel=1e-6)  # twice as deep: twice the rounds
    assert m.predict(2, 1, 16) == pytest.approx(0.010, rel=1e-6)  # half as wide: no dearer than half
    assert m.predict(2, 4, 16) == pytest.approx(0.020, rel=1e-6)  # wider: not dearer until measured
    m.observe(2, 1, 16, 0.018)  # one round of the narrow shape and it is priced by what it cost
    assert m.predict(2, 1, 16) == pytest.approx(0.018, rel=1e-6)
    assert m.predict(2, 2, 0) == 0.0


def test_calibration_converges_to_observed_acceptance_by_depth():
    """Scores say 0.8 / 0.64; the target accepts depth 1 with p = 0.5 and depth 2 with p = 0.25."""
    rng = random.Random(0)
    model = AcceptanceModel(decay=0.01)
    tree = chain([0.8, 0.64])
    for i in range(4000):
        u = rng.random()
        model.observe(f"r{i % 50}", tree, 2 if u < 0.25 else 1 if u < 0.5 else 0)
    est = model.node_estimates("fresh", tree)
    assert est[1] == pytest.approx(0.5, abs=0.06) and est[2] == pytest.approx(0.25, abs=0.06)
    assert model.observed_mean == pytest.approx(0.75, abs=0.1)


def test_a_request_whose_drafts_fail_loses_its_estimates():
    model = AcceptanceModel()
    tree = chain([0.9, 0.8, 0.7])
    for _ in range(30):
        model.observe("good", tree, 3)
        model.observe("bad", tree, 0)
    assert model.request_factor("bad") < 0.2 < 1.0 <= model.request_factor("good")
    assert model.expected_accepted("bad", tree) < 0.3 * model.expected_accepted("good", tree)
    for _ in range(60):  # steps without a verified tree: the evidence fades toward the prior
        model.age("bad")
    assert 0.9 < model.request_factor("bad") <= 1.0


def test_a_request_the_plan_skips_is_tried_again():
    """A request whose multiplier fell on a bad stretch is not drafted for; while it waits its
    evidence fades and the plan drafts for it again well before the every-`probe_every` probe."""
    p = flat_policy(0.010, 0.002, 0.003)  # plain 12 ms; a draft of one token 1 ms, verifying it 2 ms
    p.shapes = shape_table({(1, 1): (0.3, 1.0)})  # pays at a multiplier above ~0.8
    p.shapes.reach[(1, 1)].count = 10**6  # no probe of the full shape in this test
    p.settings.probe_every = 10**6
    tree = chain([0.3])
    for _ in range(30):
        p.acceptance.observe("warm", tree, 1)  # the population accepts depth 1 ...
        p.acceptance.observe("a", tree, 0)  # ... this request has failed lately
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    drafted = [p.plan(reqs, caps, 0)[0] is not None for _ in range(40)]
    assert drafted[0] is False and any(drafted)


def flat_policy(step_s: float, per_token_s: float, draft_s: float) -> AdaptivePolicy:
    """A policy whose target costs step_s + per_token_s per token and whose drafter costs draft_s."""
    p = AdaptivePolicy()
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        p.target_cost.observe(tokens, step_s + per_token_s * tokens)
    for n in (1, 2, 4, 8, 16, 32):
        p.draft_cost.observe(3, 1, n, draft_s)  # narrowest: wider shapes are not priced dearer
    return p


def test_allocation_picks_the_goodput_optimum():
    """One request, a chain with estimates 0.9, 0.8, 0.3 on a 10 ms step: at 1 ms per token all three
    nodes pay, at 10 ms the third does not (2.7 tokens / 40 ms > 3 / 50 ms), at 30 ms only the first."""
    tree = chain([0.9, 0.8, 0.3])
    for per_token, expected in ((0.001, 3), (0.010, 2), (0.030, 1)):
        p = flat_policy(0.010, per_token, 0.0)
        p.acceptance = AcceptanceModel()  # uncalibrated: estimates = scores (capped by parents)
        reqs, specs = [request("a")], [SpecParams(3, 2, 6)]
        p.plan(reqs, specs, 0)
        (kept,) = p.allocate(reqs, specs, [tree], 0)
        # brute force over the prefix lengths
        gains = [0.0, 0.9, 1.7, 2.0]
        best = max(range(4), key=lambda k: (1 + gains[k]) / p.target_cost.predict(1 + k, 1 if k else 0))
        assert best == expected and (kept.num_draft if kept else 0) == expected


def test_allocation_prefers_likely_nodes_across_requests():
    p = flat_policy(0.010, 0.004, 0.0)
    reqs = [request("likely"), request("unlikely")]
    specs = [SpecParams(3, 2, 6)] * 2
    p.plan(reqs, specs, 0)
    likely, unlikely = p.allocate(reqs, specs, [chain([0.95, 0.9, 0.85]), chain([0.05, 0.01, 0.001])], 0)
    assert likely is not None and likely.num_draft == 3
    assert unlikely is None


def test_allocation_prunes_each_tree_by_its_own_estimates():
    """Two requests whose trees differ in size and order both keep their own best nodes (at 2 ms a
    verified token, nodes estimated 0.2 and below do not pay)."""
    p = flat_policy(0.010, 0.002, 0.0)
    reqs = [request("short"), request("wide")]
    specs = [SpecParams(3, 3, 6)] * 2
    p.plan(reqs, specs, 0)
    wide = DraftTree([0, 11, 12, 13, 14], [-1, 0, 0, 0, 1], [1.0, 0.2, 0.9, 0.5, 0.1])
    short, kept_wide = p.allocate(reqs, specs, [chain([0.95]), wide], 0)
    assert short is not None and short.tokens == [0, 1]
    assert kept_wide is not None and kept_wide.tokens == [0, 12, 13]


def test_tpot_target_limits_the_verified_tokens():
    """Verifying costs 5 ms a token; a 12 ms TPOT target allows only what keeps the step fast enough."""
    p = flat_policy(0.010, 0.005, 0.0)
    tree = chain([0.99, 0.98, 0.97])
    specs = [SpecParams(3, 2, 6)]
    free = [request("free")]
    p.plan(free, specs, 0)
    (unconstrained,) = p.allocate(free, specs, [tree], 0)
    tight = [request("tight", tpot=0.0085)]
    p.plan(tight, specs, 0)
    (constrained,) = p.allocate(tight, specs, [tree], 0)
    assert unconstrained.num_draft == 3
    # k nodes: step 10 + 5 (1 + k) ms over 1 + ~k tokens: k = 3 gives 30/3.94 = 7.6 ms, k = 0 gives 15 ms.
    assert constrained is not None
    step = p.target_cost.predict(1 + constrained.num_draft, 1)
    assert step / (1 + sum(constrained.scores[1:])) <= 0.0085


def shape_table(shapes: dict[tuple[int, int], tuple[float, float]], drafts: int = 10**6) -> ShapeTable:
    """A shape table predicting the given (expected accepted tokens, verified nodes) per (depth, width)
    from `drafts` drafts (by default so many that the search's optimism adds nothing): each depth level
    holds the difference to the level above."""
    table = ShapeTable()
    for (d, w), (gain, nodes) in shapes.items():
        above = shapes.get((d - 1, w), (0.0, 0.0))
        table.reach[(d, w)] = _Ema(gain - above[0], count=drafts)
        table.nodes[(d, w)] = _Ema(nodes - above[1], count=drafts)
    return table


def test_plan_stops_drafting_when_the_drafter_costs_more_than_it_gains():
    cheap, dear = flat_policy(0.010, 0.0001, 0.001), flat_policy(0.010, 0.0001, 0.050)
    reqs = [request(f"r{i}") for i in range(8)]
    caps = [SpecParams(3, 2, 6)] * 8
    for p in (cheap, dear):  # 0.5 accepted tokens of 2 verified whatever the shape
        p.shapes = shape_table({(d, w): (0.5, 2.0) for d in (1, 2, 3) for w in (1, 2)})
    assert all(s is not None for s in cheap.plan(reqs, caps, 0))
    assert all(s is None for s in dear.plan(reqs, caps, 0))


def test_plan_picks_the_goodput_optimal_shape():
    """The target costs 10 ms + 1 ms a token, the drafter 2 ms (width 1) or 3 ms (width 2) a depth
    level; by the shape table below depth 2 at width 2 has the best goodput (2.6 tokens / 21 ms)."""
    p = flat_policy(0.010, 0.001, 0.0)
    p.draft_cost = DraftCostModel()
    p.draft_cost.observe(1, 1, 1, 0.002)
    p.draft_cost.observe(1, 2, 1, 0.003)
    table = {(1, 1): (0.7, 1), (2, 1): (1.0, 2), (3, 1): (1.1, 3), (1, 2): (0.8, 2), (2, 2): (1.6, 4), (3, 2): (1.7, 6)}
    p.shapes = shape_table(table)

    def goodput(shape: tuple[int, int]) -> float:
        if shape == (0, 0):
            return 1 / p.target_cost.predict(1)
        gain, nodes = table[shape]
        step = p.target_cost.predict(1 + nodes, 1, nodes) + p.draft_cost.predict(*shape, 1)
        return (1 + gain) / step

    assert max([(0, 0), *table], key=goodput) == (2, 2)
    (spec,) = p.plan([request("a")], [SpecParams(3, 2, 6)], 0)
    assert spec is not None and (spec.depth, spec.width) == (2, 2)
    (spec,) = p.plan([request("b")], [SpecParams(3, 1, 6)], 0)  # a width cap of 1: the best shape within it
    assert spec is not None and (spec.depth, spec.width) == (1, 1)


def test_shape_table_learns_what_drafts_of_each_shape_realised():
    """Per width and depth level: how often drafts reached that many accepted tokens and how many of
    their nodes there were verified; a wide draft counts for narrower widths by its cut (nodes within
    that sibling rank); a dropped draft counts as nothing; the prior weighs `prior_drafts` drafts."""
    # root -> a (0.8), b (0.3); a -> c (0.6), d (0.2); b -> e (0.25). Width 1: a, c; width 2: all.
    tree = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [1.0, 0.8, 0.3, 0.6, 0.2, 0.25])
    table = ShapeTable(weight=0.01, prior_drafts=1)
    assert table.predict(2, 2) == pytest.approx((0.6 + 0.36, 4.0))  # never drafted: the prior
    for path in ([0, 1, 3], [0, 2, 5], [0, 1, 4]):  # a-c, b-e, a-d accepted
        table.observe(2, 2, tree, path)
    table.observe(2, 2, None, [0])  # the allocation dropped this one
    # width 2: every path is inside; level 1 and 2: prior + 1, 1, 1, 0 over five
    assert table.predict(1, 2) == pytest.approx((3.6 / 5, (2 + 3 * 2) / 5))
    assert table.predict(2, 2) == pytest.approx(((3.6 + 3.36) / 5, (2 + 3 * 2) / 5 + (2 + 3 * 3) / 5))
    # width 1: a-c reaches 2, b-e 0 (b is second), a-d 1 (d is second)
    assert table.predict(2, 1) == pytest.approx(((2.6 + 1.36) / 5, (1 + 3) / 5 + (1 + 3) / 5))
    assert table.predict(2, 3) == pytest.approx((0.96, 6.0))  # never drafted that wide: the prior
    for _ in range(2000):  # after the warm-up, a moving average that follows the recent drafts
        table.observe(1, 2, tree, [0, 1])
    assert table.predict(1, 2)[0] == pytest.approx(1.0, abs=1e-6)
    assert table.predict(2, 2)[0] == pytest.approx(1.0 + 3.36 / 5, abs=1e-6)  # level 2 unchanged


def test_the_policy_learns_its_shapes_from_its_own_drafts():
    """A verified draft updates its shape's levels with what was accepted; a draft the allocation
    drops (verification costs more than its estimates promise) counts as a draft that gained nothing."""
    p = flat_policy(0.010, 0.0001, 0.0)
    p.shapes = shape_table({(d, w): (0.5, 2.0) for d in (1, 2, 3) for w in (1, 2)})
    reqs, caps = [request("a")], [SpecParams(3, 2, 6)]
    (spec,) = p.plan(reqs, caps, 0)
    assert spec is not None and spec.budget == 6  # the allocation decides how much of the cap to verify
    (kept,) = p.allocate(reqs, [spec], [chain([0.9, 0.8, 0.7][: spec.depth])], 0)
    level1 = p.shapes.reach[(1, spec.width)]
    before = level1.count
    p.observe_verified(reqs[0], kept, [0, 1])
    assert level1.count == before + 1 and level1.value > 0.5
    dear = flat_policy(0.010, 0.050, 0.0)  # 50 ms a verified token: nothing is worth verifying
    dear.shapes = shape_table({(1, 1): (0.9, 1.0)})
    dear.plan(reqs, [SpecParams(1, 1, 1)], 0)
    (kept,) = dear.allocate(reqs, [SpecParams(1, 1, 1)], [chain([0.3])], 0)
    assert kept is None
    assert dear.shapes.reach[(1, 1)].value < 0.9 and dear.shapes.nodes[(1, 1)].value < 1.0


def test_drafting_has_to_beat_plain_decoding_by_the_minimum_advantage_for_requests_it_has_not_read():
    """A draft predicted to gain 2% over plain decoding is not worth its risk at the default 3%
    minimum advantage for a request new to drafting (or idle for a while); one predicted to gain 6%
    is, and so is the 2% one with no minimum, or for a request that drafted in the step before."""
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    chosen = {}
    for draft_s, min_advantage, warm in (
        (0.0140, 0.03, False),
        (0.0122, 0.03, False),
        (0.0140, 0.0, False),
        (0.0140, 0.03, True),
    ):
        p = flat_policy(0.010, 0.0001, draft_s)  # a depth-1 round costs a third of draft_s
        p.settings.min_advantage = min_advantage
        p.shapes = shape_table({(1, 1): (0.5, 1.0)})
        if warm:
            p.requests["a"] = _RequestState(idle_steps=0, history=True)
        advantage = 1.5 / (p.target_cost.predict(2, 1, 1) + p.draft_cost.predict(1, 1, 1)) * p.target_cost.predict(1)
        chosen[(round(advantage, 2), min_advantage, warm)] = p.plan(reqs, caps, 0)[0] is not None
    assert chosen == {
        (1.02, 0.03, False): False,
        (1.06, 0.03, False): True,
        (1.02, 0.0, False): True,
        (1.02, 0.03, True): True,
    }


def test_an_option_that_nearly_pays_is_tried_often_one_far_from_paying_seldom():
    """While drafting pays for no request, the best option is still tried at a rate that costs about
    `probe_cost` of throughput by its predicted loss against the minimum advantage drafting has to
    reach, in streaks of `probe_streak` plans: at a 3.5% shortfall (5% of a plain step per plan: the
    draft's 1.5 tokens fall short) one plan in twenty (a table stuck just below break-even gets
    re-measured), at a 75% loss hardly beyond the idle probes."""
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    plans, settings = 1024, AdaptiveSettings()
    drafted = {}
    for name, draft_s, loss in (("near", 0.0151, (0.0, 0.01)), ("far", 0.150, (0.7, 0.8))):
        p = flat_policy(0.010, 0.0001, draft_s)  # a depth-1 round costs a third of draft_s
        p.shapes = shape_table({(1, 1): (0.5, 1.0)})
        plain = 1 / p.target_cost.predict(1)
        option = 1.5 / (p.target_cost.predict(2, 1, 1) + p.draft_cost.predict(1, 1, 1))
        assert loss[0] < 1 - option / plain < loss[1]
        drafted[name] = [i for i in range(plans) if p.plan(reqs, caps, 0)[0] is not None]
    idle_probes = plans // settings.idle_probe_every
    near = drafted["near"]
    assert plans // 20 < len(near) < plans // 12
    assert near[: settings.probe_streak] == list(range(near[0], near[0] + settings.probe_streak))
    assert idle_probes <= len(drafted["far"]) <= idle_probes + 2


def near_and_far_policies() -> dict[str, AdaptivePolicy]:
    """Policies for one request where drafting does not pay: nearly (a 0.5% shortfall) or far from it."""
    policies = {}
    for name, draft_s in (("near", 0.0151), ("far", 0.150)):
        p = policies[name] = flat_policy(0.010, 0.0001, draft_s)
        p.shapes = shape_table({(1, 1): (0.5, 1.0)})
    return policies


def test_while_nothing_pays_the_search_is_reused_for_growing_stretches_of_an_unchanged_batch():
    """A shape search that finds nothing paying stands for the next 1, 2, 4, ... up to
    `idle_search_every` plans of the same batch: the decisions are those of searching every plan,
    with far fewer searches. A changed batch is searched at once; one where drafting pays, every
    `search_every` plans."""
    for name, p in near_and_far_policies().items():
        every_plan = near_and_far_policies()[name]
        every_plan.settings.idle_search_every = 1
        searches = 0

        def counted(*args, search=p._shape_search, **kwargs):
            nonlocal searches
            searches += 1
            return search(*args, **kwargs)

        p._shape_search = counted
        reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
        drafted = [p.plan(reqs, caps, 0)[0] is not None for _ in range(256)]
        assert drafted == [every_plan.plan(reqs, caps, 0)[0] is not None for _ in range(256)]
        if name == "far":  # only the idle probes draft: a search after each, else every 16 plans at most
            assert searches <= 5 + 256 // 16 + 2 * sum(drafted)
            before = searches
            p.plan([request("b")], caps, 0)  # another request: searched at once
            assert searches == before + 1
    paying = flat_policy(0.010, 0.0001, 0.0001)
    paying.shapes = shape_table({(1, 1): (0.9, 1.0)})
    searches = 0
    search = paying._shape_search

    def counted_paying(*args, **kwargs):
        nonlocal searches
        searches += 1
        return search(*args, **kwargs)

    paying._shape_search = counted_paying
    for _ in range(32):
        assert paying.plan([request("a")], [SpecParams(1, 1, 1)], 0)[0] is not None
    assert searches == 32 // paying.settings.search_every
    paying.plan([request("b")], [SpecParams(1, 1, 1)], 0)
    assert searches == 32 // paying.settings.search_every + 1


def test_a_probe_is_charged_what_it_really_cost():
    """A probe is priced by its prediction when chosen and by its step's measured time once it ran. A
    probe that cost a hundred plain steps (an outlier) and gained nothing puts the credit in debt:
    neither option probes nor idle probes follow for hundreds of plans, where probes that cost what
    they were predicted to go on every few plans. The debt is bounded (three plain steps), so an idle
    probe still comes within ~1,000 plans."""
    outcomes = {}
    for name, probe_s in (("as predicted", None), ("a hundred plain steps", 1.0)):
        p = near_and_far_policies()["near"]
        reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
        drafted = []
        for plan in range(1280):
            (spec,) = p.plan(reqs, caps, 0)
            if spec is None:
                p.observe_step(StepRecord(num_tokens=0, target_s=0.0))
                continue
            drafted.append(plan)
            if probe_s is None:  # a verified draft whose step took the predicted time, accepted every other time
                p.observe_verified(reqs[0], chain([0.5]), [0, 1] if len(drafted) % 2 else [0])
                seconds = p.target_cost.predict(2, 1, 1) + p.draft_cost.predict(1, 1, 1)
            else:  # nothing verified, a long read
                seconds = probe_s
            p.observe_step(StepRecord(num_tokens=0, target_s=seconds))
        outcomes[name] = drafted
    assert len(outcomes["as predicted"]) > 1280 // 20
    first, *later = outcomes["a hundred plain steps"]
    assert first < 32 and later and 900 < later[0] - first < 1100


def test_the_policys_own_time_in_drafting_steps_prices_drafting():
    """A drafting step also costs the policy's search and allocation: an option 15% ahead of plain
    decoding is drafted while the policy's time is the same in both kinds of steps, and not once its
    drafting steps are seen to take 3 ms more of it."""
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    p = flat_policy(0.010, 0.0001, 0.009)  # a depth-1 round costs 3 ms
    p.settings.search_every = 1  # every plan prices afresh
    p.shapes = shape_table({(1, 1): (0.5, 1.0)})
    assert 1.14 < 1.5 / (p.target_cost.predict(2, 1, 1) + 0.003) * p.target_cost.predict(1) < 1.16
    assert p.plan(reqs, caps, 0)[0] is not None
    p.observe_step(StepRecord(num_tokens=0, target_s=0.0, policy_s=0.00002))
    p.observe_step(StepRecord(num_tokens=0, target_s=0.0, policy_s=0.00002, num_drafted=1, draft_s=0.003,
                              draft_depth=1, draft_width=1))  # fmt: skip
    assert p.plan(reqs, caps, 0)[0] is not None
    for _ in range(20):
        p.observe_step(StepRecord(num_tokens=0, target_s=0.0, policy_s=0.00002))
        p.observe_step(StepRecord(num_tokens=0, target_s=0.0, policy_s=0.00302, num_drafted=1, draft_s=0.003,
                                  draft_depth=1, draft_width=1))  # fmt: skip
    assert p.plan(reqs, caps, 0)[0] is None


def test_where_every_step_drafts_one_in_plain_every_does_not():
    """Drafting always pays here, but the plain step time the overhead is measured against must stay
    current: after `plain_every` drafting plans in a row (the full-shape probes aside) one is plain."""
    p = flat_policy(0.010, 0.0001, 0.0001)
    p.shapes = shape_table({(d, w): (0.9, 1.0) for d in (1, 2, 3) for w in (1, 2)})
    reqs, caps = [request("a")], [SpecParams(3, 2, 6)]
    drafted = [p.plan(reqs, caps, 0)[0] is not None for _ in range(256)]
    plain = [i for i, d in enumerate(drafted) if not d]
    assert plain and len(plain) <= 256 // p.settings.plain_every + 1
    assert all(b - a > p.settings.plain_every for a, b in itertools.pairwise(plain))


def test_fixed_requests_keep_their_tree_and_fixed_policy_prunes_by_score():
    tree = DraftTree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [1.0, 0.6, 0.3, 0.5, 0.1])
    (kept,) = FixedPolicy().allocate([request("a")], [SpecParams(2, 2, 2)], [tree], 0)
    assert kept.tokens == [0, 1, 3]
    p = flat_policy(0.010, 0.05, 0.0)  # speculation never pays here ...
    fixed = SpecParams(2, 2, 2, fixed=True)
    assert p.plan([request("a")], [fixed], 0) == [fixed]  # ... but a fixed request keeps its tree
    (kept,) = p.allocate([request("a")], [fixed], [tree], 0)
    assert kept.tokens == [0, 1, 3]


def test_observed_steps_feed_the_cost_models():
    p = AdaptivePolicy()
    p.observe_step(
        StepRecord(
            num_tokens=4,
            target_s=0.02,
            draft_s=0.005,
            draft_depth=3,
            draft_width=2,
            num_drafted=1,
            read_s=0.003,
            num_read=40,
        )
    )
    assert p.target_cost.predict(4) == pytest.approx(0.02)
    assert p.draft_cost.predict(3, 2, 1) == pytest.approx(0.005)  # the round alone: the reading is apart
    assert p.draft_cost.predict_reading(40) == pytest.approx(0.003)


def test_draft_cost_model_prices_reading_by_the_tokens_read():
    """Reading the context is a line in tokens read, whatever shape drafts after it; nothing to read
    (or nothing measured yet) costs nothing."""
    m = DraftCostModel()
    assert m.predict_reading(50) == 0.0
    for tokens in (3, 40, 400, 10) * 5:
        m.observe_reading(tokens, 0.001 + 0.0001 * tokens)
    assert m.predict_reading(1000) == pytest.approx(0.101, rel=1e-6)
    assert m.predict_reading(0) == 0.0
    assert not m.lines  # no round was measured by it


def long_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(), max_tokens, frozenset(), None, None)


def test_plan_prices_the_context_the_drafter_has_not_read():
    """A draft pays 35% over plain decoding on a 10 ms step, and reading costs 0.1 ms a token. A new
    request with a 400-token prompt reads it once: spread over the 100 drafted steps its 200 tokens
    left take, 4 tokens a step, it drafts; with 2 tokens left the whole 40 ms falls on one step and
    it does not. A request that drafted a step ago reads only what that step added."""
    chosen = {}
    for name, prompt_len, max_tokens, warm in (
        ("new, long to go", 400, 200, False),
        ("new, nearly done", 400, 2, False),
        ("warm", 400, 2, True),
    ):
        p = flat_policy(0.010, 0.0, 0.003)  # a depth-1 round costs 1 ms
        p.draft_cost.observe_reading(10, 0.001)
        p.draft_cost.observe_reading(100, 0.010)
        p.shapes = shape_table({(1, 1): (0.5, 1.0)})
        req = long_request("a", prompt_len, max_tokens)
        if warm:
            p.requests["a"] = _RequestState(idle_steps=0, history=True, read_upto=req.num_tokens - 3)
        chosen[name] = p.plan([req], [SpecParams(1, 1, 1)], 0)[0] is not None
    assert chosen == {"new, long to go": True, "new, nearly done": False, "warm": True}


def test_a_new_requests_reading_is_spread_over_the_drafts_it_can_expect():
    """The same new request (400 prompt tokens, 200 to go, as above) drafts while the policy drafts
    for most requests; where it has lately drafted for few (at batch 32 on a CPU: none), its prompt's
    40 ms of reading would buy a draft or two, so it is priced whole and the request decodes plainly.
    The share follows the plans: a stretch of plans that draft for no request brings it down."""
    chosen = {}
    for share in (1.0, 0.5, 0.02):
        p = flat_policy(0.010, 0.0, 0.003)
        p.draft_cost.observe_reading(10, 0.001)
        p.draft_cost.observe_reading(100, 0.010)
        p.shapes = shape_table({(1, 1): (0.5, 1.0)})
        p.drafting_share = _Ema(share, weight=1 / 32, count=10**6)
        chosen[share] = p.plan([long_request("a", 400, 200)], [SpecParams(1, 1, 1)], 0)[0] is not None
    assert chosen == {1.0: True, 0.5: True, 0.02: False}

    p = flat_policy(0.010, 0.0, 0.050)  # drafting that never pays
    p.shapes = shape_table({(1, 1): (0.5, 1.0)})
    assert p.drafting_share.value == 1.0  # a fresh policy expects to draft
    reqs = [request(f"r{i}") for i in range(4)]
    plans = [p.plan(reqs, [SpecParams(1, 1, 1)] * 4, 0) for _ in range(200)]
    drafted = sum(s is not None for plan in plans for s in plan) / (4 * len(plans))
    assert p.drafting_share.value < 0.1 and drafted < 0.1


def test_verified_trees_keep_the_drafters_scores_for_calibration():
    """The allocation picks nodes by calibrated estimate, but the tree it hands back carries the
    drafter's own scores: calibrating on estimates would apply the depth factors twice."""
    p = flat_policy(0.010, 0.0001, 0.0)
    tree = chain([0.9, 0.8, 0.7])
    for _ in range(50):  # depth factors well below 1: estimates differ from scores
        p.acceptance.observe("warm", tree, 0)
    reqs, specs = [request("a")], [SpecParams(3, 2, 6)]
    p.plan(reqs, specs, 0)
    (kept,) = p.allocate(reqs, specs, [tree], 0)
    assert kept is not None and kept.scores == tree.scores[: kept.size]


def test_a_probe_that_gains_in_steady_drafting_keeps_drafting():
    """The models can price drafting below break-even from drafts made now and then (read in large
    pieces, on cold caches), while drafting every step pays. A credit probe drafts for a streak, and
    probes whose steps gain pay their credit back, so drafting goes on; probes whose steps cost what
    was predicted (once warm, 0.5% of a step short of plain decoding) come at the `probe_cost`
    rate, under half the plans."""
    outcomes = {}
    for name, step_share in (("gains", 0.5), ("as predicted", 1.0)):
        p = near_and_far_policies()["near"]
        reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
        predicted = p.target_cost.predict(2, 1, 1) + p.draft_cost.predict(1, 1, 1)
        drafted = 0
        for _ in range(512):
            (spec,) = p.plan(reqs, caps, 0)
            if spec is None:
                p.observe_step(StepRecord(num_tokens=0, target_s=0.0))
                continue
            drafted += 1
            p.observe_verified(reqs[0], chain([0.5]), [0, 1] if drafted % 2 else [0])
            p.observe_step(StepRecord(num_tokens=0, target_s=step_share * predicted))
        outcomes[name] = drafted
    assert outcomes["gains"] > 400
    assert outcomes["as predicted"] < 256


def test_a_probe_is_charged_time_linearly_in_the_tokens_it_emitted():
    """The realised loss is the step's time beyond what plain decoding takes for its tokens, in plain
    steps: one more accepted token is worth one plain step whatever the step cost, so lucky and
    unlucky probes average to what drafting is worth."""
    differences = []
    for seconds in (0.012, 0.030):
        credit = {}
        for accepted in (0, 1):
            p = near_and_far_policies()["near"]
            reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
            while p.plan(reqs, caps, 0)[0] is None:
                p.observe_step(StepRecord(num_tokens=0, target_s=0.0))
            p.observe_verified(reqs[0], chain([0.5]), [0, 1] if accepted else [0])
            p.observe_step(StepRecord(num_tokens=0, target_s=seconds))
            credit[accepted] = p._probe_credit
        differences.append(credit[1] - credit[0])
    assert differences == pytest.approx([1.0, 1.0])


def test_a_cold_probe_is_charged_its_reading_as_the_search_priced_it():
    """A request's first draft reads its whole prompt; the search spreads that reading over the steps
    the request has left, and the probe's charge does the same, so a long prompt does not put the
    probe credit in debt for a thousand plans."""
    p = near_and_far_policies()["near"]
    req = Request("a", list(range(500)), SamplingParams(), 2000, frozenset(), None, None)
    caps = [SpecParams(1, 1, 1)]
    while p.plan([req], caps, 0)[0] is None:
        p.observe_step(StepRecord(num_tokens=0, target_s=0.0))
    before = p._probe_credit
    step = p.target_cost.predict(2, 1, 1) + p.draft_cost.predict(1, 1, 1)
    plain = p.target_cost.predict(1)
    p.observe_verified(req, chain([0.5]), [0, 1])
    p.observe_step(StepRecord(num_tokens=0, target_s=step, read_s=20 * plain, num_read=499))
    # the reading was priced at 1 / 1,000 of it (2,000 tokens left at two a step): 0.02 plain steps
    assert before - p._probe_credit < 0.1


def test_optimism_drafts_an_option_measured_by_few_drafts_until_it_is_measured_well():
    """An option just below break-even by a table of few drafts is drafted (the upper confidence bound
    of its first level's acceptance pays), by a table of many it is not; with no optimism neither."""
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    chosen = {}
    for drafts, optimism in ((20, 1.0), (10**6, 1.0), (20, 0.0)):
        p = flat_policy(0.010, 0.0001, 0.0132)  # drafting 4.4 ms: 1.45 tokens break even
        p.settings.optimism = optimism
        p.shapes = shape_table({(1, 1): (0.42, 1.0)}, drafts=drafts)
        p.requests["a"] = _RequestState(idle_steps=0, history=True)
        chosen[(drafts, optimism)] = p.plan(reqs, caps, 0)[0] is not None
    assert chosen == {(20, 1.0): True, (10**6, 1.0): False, (20, 0.0): False}


def test_tree_step_prices_what_predict_does():
    """The step prices an optimizer looks up once give `predict`'s step time for every number of trees
    and draft tokens over a batch's plain tokens, fixed trees' tokens among them."""
    m = TargetCostModel()
    for tokens, seconds in ((1, 0.010), (4, 0.011), (16, 0.014), (64, 0.030)):
        m.observe(tokens, seconds)
    assert m.tree_step(4) is None  # no tree step yet: draft tokens cost what the plain curve says
    for trees, tokens in ((1, 2), (2, 6), (3, 3)) * 5:
        m.observe(4 + tokens, 0.011 + 0.002 * trees + 0.0007 * tokens, trees, tokens, context=40)
    for base, fixed_trees, fixed_tokens in ((4, 0, 0), (9, 1, 5), (20, 2, 12)):
        plain, per_tree, per_token = m.tree_step(base - fixed_tokens, context=300)
        for trees, k in ((1, 1), (2, 4), (3, 9)):
            predicted = m.predict(base + k, fixed_trees + trees, fixed_tokens + k, context=300)
            assert plain + per_tree * (fixed_trees + trees) + per_token * (fixed_tokens + k) == pytest.approx(predicted)


def test_a_probe_streak_ends_when_the_batch_changes():
    """A credit probe's streak probes one batch: a new batch whose option is far from paying is not
    drafted on the streak's account."""
    near = near_and_far_policies()["near"]
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    while near.plan(reqs, caps, 0)[0] is None:
        near.observe_step(StepRecord(num_tokens=0, target_s=0.0))
    assert near._streak_left > 0
    near.observe_step(StepRecord(num_tokens=0, target_s=0.0))
    near.draft_cost = near_and_far_policies()["far"].draft_cost  # the next batch's drafting costs 10x
    assert near.plan([request("b")], caps, 0)[0] is None
    assert near._streak_left == 0


def test_a_request_probed_as_if_average_drafts_for_one_plan_not_for_the_search_s_reuse():
    """A request idle for `probe_every` steps is priced as if its multiplier were average again; that
    probe is one draft, so a search that chose it is not reused for the next plans."""
    p = flat_policy(0.010, 0.004, 0.003)  # a draft token costs 4 ms, a depth-1 round 1 ms
    p.shapes = shape_table({(1, 1): (0.9, 1.0)})
    reqs, caps = [request("good"), request("bad")], [SpecParams(1, 1, 1)] * 2
    for _ in range(20):  # the second request's drafts all fail: its multiplier falls
        p.acceptance.observe("good", chain([0.9]), 1)
        p.acceptance.observe("bad", chain([0.9]), 0)
    assert p.acceptance.request_factor("bad") < 0.4
    p.requests["good"] = _RequestState(idle_steps=0, history=True)
    p.requests["bad"] = _RequestState(idle_steps=p.settings.probe_every, history=True)
    first = p.plan(reqs, caps, 0)
    assert first[0] is not None and first[1] is not None  # the probe
    assert p.plan(reqs, caps, 0)[1] is None  # searched again: its own multiplier prices it


def test_a_probes_draft_is_verified_whole_where_the_allocation_would_drop_it():
    """A probe drafts where the models say drafting does not pay; the allocation prices by the same
    models, so it would drop the draft and the probe would measure nothing but its drafting. A probe's
    draft is verified whole (up to its budget); outside a probe the same estimates verify nothing."""
    p = near_and_far_policies()["near"]
    reqs, caps = [request("a")], [SpecParams(1, 1, 1)]
    while (spec := p.plan(reqs, caps, 0)[0]) is None:
        p.observe_step(StepRecord(num_tokens=0, target_s=0.0))
    assert p.decisions["credit_probe"] + p.decisions["idle_probe"] == 1
    unlikely = chain([0.001])  # a node the allocation does not verify at 0.1 ms a token on a 10 ms step
    (kept,) = p.allocate(reqs, [spec], [unlikely], 0)
    assert kept is not None and kept.num_draft == 1
    paying = flat_policy(0.010, 0.0001, 0.0)
    paying.shapes = shape_table({(1, 1): (0.9, 1.0)})
    (spec,) = paying.plan(reqs, caps, 0)  # drafting pays here (no drafter cost): not a probe
    assert spec is not None and paying.decisions["pays"] == 1
    assert paying.allocate(reqs, [spec], [unlikely], 0) == [None]
