"""The suffix drafter (SuffixDecoding) and the policy's choice between text drafts and the model drafter."""

from __future__ import annotations

import itertools

import pytest

from engines.draft_tree import DraftTree
from engines.drafters.ngram import NgramIndex
from engines.drafters.suffix import SuffixDrafter, longest_match, tree_from_match
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_decode.cost_model import TargetCostModel
from engines.spec_decode.policy import AdaptivePolicy, AdaptiveSettings, FixedPolicy
from engines.spec_params import SpecParams

SPEC = SpecParams(depth=16, width=2, budget=16)


def request(rid: str, prompt: list[int], output: list[int] = (), seed: int | None = None) -> Request:
    req = Request(rid, list(prompt), SamplingParams(seed=seed), 64, frozenset(), None, None)
    req.output_token_ids = list(output)
    return req


def index(tokens: list[int]) -> NgramIndex:
    idx = NgramIndex(max_n=4)
    idx.extend(tokens)
    return idx


def test_the_longest_match_extends_past_the_indexed_n_grams_and_keeps_its_occurrences():
    text = [9, 1, 2, 3, 4, 5, 6, 50, 7, 7, 1, 2, 3, 4, 5, 6, 60, 8, 3, 4, 5, 6]
    match = longest_match(index(text), text, max_length=32, max_occurrences=8)
    # the suffix "8 3 4 5 6" matches its two earlier occurrences in 4 tokens: both kept, most recent first
    assert match.length == 4 and match.ends == [16, 7]
    query = [*text, 70, 1, 2, 3, 4, 5, 6]
    longer = longest_match(index(query), query, max_length=32, max_occurrences=8)
    assert longer.length == 6 and longer.ends == [16, 7]  # past the index's 4-grams
    assert longest_match(index(text), [99], 32, 8) is None


def test_a_match_s_continuations_become_a_tree_scored_by_how_often_each_followed():
    text = [1, 2, 3, 10, 11, 1, 2, 3, 10, 12, 1, 2, 3, 20, 21, 1, 2, 3]
    idx = index(text)
    match = longest_match(idx, text, 32, 8)
    assert match.length == 3 and len(match.ends) == 3
    tree = tree_from_match(idx, match, root=3, depth=2, width=2, budget=8, min_score=0.1)
    nodes = {(tree.parents[i], tree.tokens[i]): tree.scores[i] for i in range(1, tree.size)}
    assert nodes[(0, 10)] == pytest.approx(2 / 3) and nodes[(0, 20)] == pytest.approx(1 / 3)
    ten = tree.tokens.index(10)
    assert nodes[(ten, 11)] == pytest.approx(1 / 3) and nodes[(ten, 12)] == pytest.approx(1 / 3)
    sure = tree_from_match(idx, match, root=3, depth=2, width=2, budget=8, min_score=0.5)
    assert sure.tokens == [3, 10]  # nodes below the score floor are left out


def test_a_request_drafts_what_its_prompt_continued_with_longer_for_longer_matches():
    quote = list(range(100, 130))
    drafter = SuffixDrafter(length_factor=1.0)
    req = request("a", [5, *quote, 6, 7], output=quote[:3])
    tree = drafter.propose([req], [SPEC])[0]
    assert tree.is_chain and tree.tokens == quote[2:6]  # matched 3 tokens: speculates 3
    req.output_token_ids = quote[:12]
    tree = drafter.propose([req], [SPEC])[0]
    assert tree.tokens == quote[11:24] and tree.num_draft == 12
    assert drafter.propose([request("b", [1, 2, 3])], [SPEC]) == [None]


def test_recent_outputs_are_shared_with_unseeded_requests_only_and_bounded():
    drafter = SuffixDrafter(shared_tokens=50)
    answer = list(range(200, 220))
    done = request("done", [1, 2], output=answer)
    drafter.propose([done], [SPEC])
    drafter.on_finished(done)
    assert drafter.shared_size == len(answer) + 1
    unseeded = request("u", [3, 4], output=answer[:5])
    assert drafter.propose([unseeded], [SPEC])[0].tokens[:3] == answer[4:7]
    seeded = request("s", [3, 4], output=answer[:5], seed=1)
    assert drafter.propose([seeded], [SPEC]) == [None]  # never depends on other traffic
    for i in range(20):
        other = request(f"o{i}", [1], output=list(range(300 + 10 * i, 310 + 10 * i)))
        drafter.propose([other], [SPEC])
        drafter.on_finished(other)
    assert drafter.shared_size <= 2 * 50 + 11


def cheap_verification_policy() -> AdaptivePolicy:
    """Plain steps of 10 ms however many tokens; a tree adds 1 ms and a draft token 0.1 ms."""
    policy = AdaptivePolicy(AdaptiveSettings(profile=False))
    for tokens in (1, 2, 4, 8, 16, 32):
        policy.target_cost.observe(tokens, 0.010)
    for k in (1, 2, 4, 8) * 10:
        policy.target_cost.observe(1 + k, 0.010 + 0.001 + 0.0001 * k, 1, k)
    return policy


def test_the_policy_keeps_text_drafts_that_pay_and_drops_those_that_do_not():
    policy = cheap_verification_policy()
    sure = DraftTree.chain(0, [1, 2, 3, 4], [1.0, 0.9, 0.8, 0.7, 0.6])
    unlikely = DraftTree.chain(0, [1, 2], [1.0, 0.05, 0.01])
    reqs = [request("a", [1]), request("b", [1])]
    kept = policy.choose_text_drafts(reqs, [sure, unlikely], other_tokens=0)
    assert kept == [sure, None]
    # plain decoding that runs four steps a call at a fifth of a step's price leaves no draft worth it
    policy.target_cost.observe_multi_step(2, 4, 4 * 0.002)
    assert policy.choose_text_drafts(reqs, [sure, unlikely], other_tokens=0, plain_steps=4) == [None, None]
    assert FixedPolicy().choose_text_drafts(reqs, [sure, unlikely], 0) == [sure, unlikely]


def test_plain_decoding_is_priced_as_it_runs_several_steps_a_call():
    m = TargetCostModel()
    for tokens, seconds in ((1, 0.010), (2, 0.011), (8, 0.016)):
        m.observe(tokens, seconds)
    assert m.plain_decode_step(1, steps=4) == pytest.approx(0.010)  # nothing measured yet: the curve
    for _ in range(30):
        m.observe_multi_step(1, 4, 4 * 0.007)
    assert m.plain_decode_step(1, steps=4) == pytest.approx(0.007)
    assert m.plain_decode_step(1, steps=1) == pytest.approx(0.010)  # one step a call: the curve
    assert m.plain_decode_step(2, steps=4) == pytest.approx(0.011 * 0.7)  # the nearest batch's ratio


def test_the_adaptive_policy_does_not_draft_where_only_one_step_plain_decoding_would_lose():
    """A tree that beats one plain step a call but not plain decoding's several steps a call is not drafted."""
    policy = cheap_verification_policy()
    policy.shapes.observe(1, 1, DraftTree.chain(0, [1], [1.0, 0.5]), [0, 1])  # 1:1 drafts accept half the time
    for _ in range(50):
        policy.shapes.observe(1, 1, DraftTree.chain(0, [1], [1.0, 0.5]), [0, 1])
        policy.shapes.observe(1, 1, DraftTree.chain(0, [1], [1.0, 0.5]), [0])
    reqs = [request("a", [1])]
    caps = [SpecParams(depth=1, width=1, budget=1)]
    policy.settings.idle_probe_every = policy.settings.shape_probe_every = 10**9
    policy.settings.probe_cost = 0.0
    assert policy.plan(reqs, caps, 0, plain_steps=1) != [None]  # 1.5 tokens for 11.1 ms beats 10 ms a token
    policy._search = None
    for _ in range(30):
        policy.target_cost.observe_multi_step(1, 4, 4 * 0.006)
    assert policy.plan(reqs, caps, 0, plain_steps=4) == [None]  # plain decoding runs at 6 ms a token


def test_text_drafts_are_cut_where_their_depth_s_acceptance_says_the_rest_does_not_pay():
    """Chains scored 1.0 all along whose third token is never accepted: the calibration learns it per depth, and
    the policy verifies two tokens of such a chain, not eight."""
    policy = cheap_verification_policy()
    long = DraftTree.chain(0, list(range(1, 9)), [1.0] * 9)
    assert policy.choose_text_drafts([request("a", [1])], [long], 0)[0].num_draft == 8  # uncalibrated: all
    for _ in range(200):
        policy.observe_text(long, [0, 1, 2])
    assert policy.text_calibration.factor(1) > 0.95 and policy.text_calibration.factor(3) < 0.05
    assert policy.choose_text_drafts([request("a", [1])], [long], 0)[0].tokens == [0, 1, 2]


def test_a_drafter_forgets_recent_outputs_when_asked():
    drafter = SuffixDrafter()
    done = request("done", [1, 2], output=list(range(200, 220)))
    drafter.propose([done], [SPEC])
    drafter.on_finished(done)
    assert drafter.propose([request("u", [3], output=[200, 201, 202])], [SPEC])[0] is not None
    drafter.forget_recent()
    assert drafter.shared_size == 0 and drafter.propose([request("v", [3], output=[200, 201, 202])], [SPEC]) == [None]


def test_the_text_drafter_is_asked_less_often_while_its_drafts_do_not_pay():
    policy = cheap_verification_policy()
    unlikely = DraftTree.chain(0, [1, 2], [1.0, 0.01, 0.001])
    asked = []
    for step in range(64):
        if policy.wants_text_drafts(1):
            asked.append(step)
            assert policy.choose_text_drafts([request("a", [1])], [unlikely], 0) == [None]
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert gaps[:4] == [2, 4, 8, 16] and set(gaps[4:]) == {16}  # doubling, up to idle_search_every
    sure = DraftTree.chain(0, [1, 2], [1.0, 1.0, 1.0])
    while not policy.wants_text_drafts(1):
        pass
    assert policy.choose_text_drafts([request("a", [1])], [sure], 0) == [sure]
    assert policy.wants_text_drafts(1)  # kept one: asked every step again


def test_text_drafts_are_not_asked_for_where_they_delivered_less_than_plain_steps():
    """Drafts the cost model prices as paying are not even proposed at a batch size where steps that verified text
    drafts have delivered fewer tokens a second than plain steps, one step in 32 asking to measure them again;
    another batch size keeps asking, and text steps that deliver again end it."""
    policy = cheap_verification_policy()
    sure = DraftTree.chain(0, list(range(1, 9)), [1.0] * 9)
    batch = [request(f"r{i}", [1]) for i in range(32)]
    assert policy.wants_text_drafts(32)
    assert policy.choose_text_drafts(batch, [sure] + [None] * 31, 0)[0] == sure  # priced: 8 tokens for 1.8 ms more
    for _ in range(10):  # as measured: text steps 34 tokens in 59 ms, plain steps 32 in 46 ms
        policy.observe_outcome("text", 32, 34, 0.059)
        policy.observe_outcome("plain", 32, 32, 0.046)
    assert [step for step in range(64) if policy.wants_text_drafts(32)] == [31, 63]
    assert policy.wants_text_drafts(2)  # batch 2: nothing measured there
    for _ in range(10):
        policy.observe_outcome("text", 32, 40, 0.046)
    assert policy.wants_text_drafts(32)


def test_plain_steps_are_measured_where_every_step_would_verify_text_drafts():
    """Where text drafts are kept every step, plain steps are measured too: every other step until `outcome_samples`
    of them were, then one in 32 while text steps deliver more; a batch size without text steps is never probed."""
    policy = cheap_verification_policy()
    samples, every = policy.settings.outcome_samples, policy.settings.text_recheck_every
    assert not policy.probes_plain(32)
    kinds = []
    for _ in range(2 * samples + 4):
        kind = "plain" if policy.probes_plain(32) else "text"
        kinds.append(kind)
        policy.observe_outcome(kind, 32, 32 if kind == "plain" else 36, 0.046)
    assert kinds[: 2 * samples] == ["text", "plain"] * samples  # alternating until plain steps were measured enough
    assert kinds[2 * samples :] == ["text"] * 4
    probes = [step for step in range(2 * every) if policy.probes_plain(32)]
    assert len(probes) == 2 and probes[1] - probes[0] == every
    for _ in range(4 * samples):  # far ahead (twice plain steps' tokens a second): probed a quarter as often
        policy.observe_outcome("text", 32, 64, 0.046)
    probes = [step for step in range(8 * every) if policy.probes_plain(32)]
    assert len(probes) == 2 and probes[1] - probes[0] == 4 * every
    assert not policy.probes_plain(2)
    for _ in range(4 * samples):  # text steps now deliver less: they are refused, not probed around
        policy.observe_outcome("text", 32, 33, 0.059)
    assert not any(policy.probes_plain(32) for _ in range(2 * every))
    assert not policy.wants_text_drafts(32)
