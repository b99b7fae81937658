"""Lyanna's Algorithm 1 and 2 on hand-made examples modelled on the paper's Figure 6."""

from __future__ import annotations

import math

import pytest
import torch

from engines.drafters.token_info import TokenInfoTable
from engines.drafters.token_info_sampling import (
    build_subtree,
    build_subtrees,
    next_frontier,
    resample_tree,
    token_info_tree,
    top_candidates,
)

# A toy vocabulary in the spirit of Figure 6.
VOCAB = ["model", "training", "inference", "server", "speed", "optimization", "quantization", "accuracy", "method"]
T = {w: i for i, w in enumerate(VOCAB)}
V = len(VOCAB)


def logits_for(probs: dict[str, float]) -> torch.Tensor:
    """Logits whose softmax puts the given mass on the named tokens and spreads the rest."""
    rest = (1.0 - sum(probs.values())) / (V - len(probs))
    return torch.tensor([math.log(probs.get(w, rest)) for w in VOCAB])


def table_info(rows: dict[str, dict[str, float]]) -> callable:
    """Token info as a lookup table: row t shifts the logits towards the continuation of t."""
    table = torch.zeros(V, V)
    for w, probs in rows.items():
        table[T[w]] = logits_for(probs)
    return lambda toks: table[toks]


def build_one(logits, root, token_info, k, d2t=None):
    """The batched Algorithm 1 on one request."""
    return build_subtrees([logits], [root], token_info, [k], d2t)[0]


@pytest.mark.parametrize("build", [build_subtree, build_one], ids=["reference", "batched"])
def test_algorithm_1_builds_the_figure_6_tree(build):
    # Depth 1: from "model", token info puts training at 0.6 and inference at 0.3 (Figure 6b).
    # Depth 2: training -> server 0.7 (joint 0.42) / speed 0.25 (0.15); inference -> optimization 0.3
    # (0.09) / accuracy 0.25 (0.075). As in the paper, server and speed have the highest joint
    # probabilities, so only they expand at depth 3.
    info = table_info(
        {
            "model": {"training": 0.6, "inference": 0.3},
            "training": {"server": 0.7, "speed": 0.25},
            "inference": {"optimization": 0.3, "accuracy": 0.25},
            "server": {"quantization": 0.7, "method": 0.2},
            "speed": {"quantization": 0.6, "server": 0.3},
        }
    )
    logits = torch.zeros(3, V)  # raw per-depth logits carry no preference: token info decides
    tree = build(logits, T["model"], info, k=2)
    words = [VOCAB[t] for t in tree.tokens]
    assert words == [
        "model",
        "training",
        "inference",
        "server",
        "speed",
        "optimization",
        "accuracy",
        "quantization",
        "method",
        "quantization",
        "server",
    ]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    want = [1.0, 0.6, 0.3, 0.42, 0.15, 0.09, 0.075, 0.294, 0.084, 0.09, 0.045]
    assert all(abs(a - b) < 1e-5 for a, b in zip(tree.scores, want, strict=True)), tree.scores
    assert tree.depths == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]  # k + (N - 1) k^2 draft nodes


def test_pruning_to_the_budget_keeps_the_most_probable_nodes():
    info = table_info({"model": {"training": 0.6, "inference": 0.3}, "training": {"server": 0.7, "speed": 0.2}})
    tree = token_info_tree(torch.zeros(2, V), T["model"], info, k=2, budget=3)
    assert [VOCAB[t] for t in tree.tokens] == ["model", "training", "inference", "server"]
    assert tree.parents == [-1, 0, 0, 1]


def test_without_token_info_every_branch_sees_the_same_logits():
    logits = torch.stack([logits_for({"training": 0.6, "inference": 0.3}), logits_for({"server": 0.5, "speed": 0.4})])
    tree = build_subtree(logits, T["model"], lambda toks: torch.zeros(len(toks), V), k=2)
    # Both depth-1 nodes get the same children: the token-agnostic trees the paper improves on.
    children = {VOCAB[tree.tokens[p]]: [VOCAB[tree.tokens[i]] for i in tree.children(p)] for p in (1, 2)}
    assert children == {"training": ["server", "speed"], "inference": ["server", "speed"]}


def test_resampling_roots_a_new_tree_at_the_bonus_token():
    info = table_info({"quantization": {"accuracy": 0.6, "method": 0.3}, "accuracy": {"server": 0.9}})
    remaining = torch.zeros(2, V)  # logits of depths 2 and 3, reused after a rejection at depth 1
    tree = resample_tree(remaining, T["quantization"], info, k=2, threshold=1)
    assert VOCAB[tree.tokens[0]] == "quantization"
    assert [VOCAB[tree.tokens[i]] for i in tree.children(0)] == ["accuracy", "method"]
    assert tree.depth == 2 and abs(tree.scores[1] - 0.6) < 1e-5
    # With too few steps left the new tree is just its root.
    assert resample_tree(remaining, T["quantization"], info, k=2, threshold=2).size == 1


def test_trees_over_a_hot_vocabulary_hold_target_token_ids():
    d2t = torch.tensor([T["server"], T["training"], T["inference"]])  # draft column -> target token
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]))
    tree = build_subtree(logits, T["model"], None, k=2, d2t=d2t)
    assert [VOCAB[t] for t in tree.tokens[:3]] == ["model", "training", "inference"]
    assert VOCAB[tree.tokens[3]] == "server"


def test_next_frontier_is_top_candidates_row_by_row():
    torch.manual_seed(0)
    joint = torch.randint(0, 4, (50, 9)).float() / 4  # many ties: the first listed wins
    for k in (1, 3, 9):
        got = next_frontier(joint, k).tolist()
        assert got == [top_candidates(row, k) for row in joint.tolist()]


def random_table(vocab: int, hot: int) -> TokenInfoTable:
    """A collapsed token-info table over the first `hot` tokens (the rest: zero rows, so ties)."""
    row_of = torch.full((vocab + 100,), -1)
    row_of[:hot] = torch.arange(hot)
    return TokenInfoTable(torch.cat([torch.randn(hot, vocab), torch.zeros(1, vocab)]), row_of)


@pytest.mark.parametrize("info", ["none", "table"])
@pytest.mark.parametrize("hot_vocab", [False, True])
@pytest.mark.parametrize("quantised", [False, True])
def test_batched_subtrees_equal_the_per_request_reference(info, hot_vocab, quantised):
    torch.manual_seed(0)
    vocab = 64
    steps = [3, 1, 4, 0, 2, 3, 5, 4, 4, 3, 0]  # a request with no steps keeps just its root
    widths = [2, 3, 2, 2, 1, 3, 4, 2, 1, 1, 1]  # width 1: chains, grown without the frontier's selection
    logits = [torch.randn(n, vocab) * 3 for n in steps]
    if quantised:  # equal logits and equal joint probabilities: every tie rule is exercised
        logits = [torch.randint(0, 3, (n, vocab)).float() for n in steps]
    token_info = random_table(vocab, hot=40) if info == "table" else None
    d2t = torch.randperm(vocab + 100)[:vocab] if hot_vocab else None
    roots = torch.randint(0, vocab, (len(steps),)).tolist()
    got = build_subtrees(logits, roots, token_info, widths, d2t)
    for lg, root, k, tree in zip(logits, roots, widths, got, strict=True):
        want = build_subtree(lg, root, token_info, k, d2t)
        assert tree.tokens == want.tokens and tree.parents == want.parents
        assert tree.scores == pytest.approx(want.scores, abs=1e-6)


def test_batched_subtrees_of_no_requests_and_of_roots_only():
    assert build_subtrees([], [], None, []) == []
    (tree,) = build_subtrees([torch.zeros(0, V)], [T["model"]], None, [2])
    assert tree.tokens == [T["model"]] and tree.parents == [-1] and tree.scores == [1.0]
