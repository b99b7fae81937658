"""The processed distribution (temperature, top-k, top-p, min-p) and draws from it."""

from __future__ import annotations

import math

import pytest
import torch

from engines.sampling import SamplingParams, processed_logprobs, sample, vocab_argmax
from lyanna_kernels import integer_dot


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straight-line version for one row: sort, cut, renormalise."""
    x = logits.double() / (p.temperature or 1.0)
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k:
        keep &= x >= x.topk(p.top_k).values[-1]
    probs = torch.where(keep, x, -math.inf).softmax(-1)
    if p.top_p < 1:
        order = probs.argsort(descending=True)
        cum = 0.0
        cut = torch.zeros_like(keep)
        for i in order.tolist():
            if cum >= p.top_p:
                cut[i] = True
            cum += probs[i].item()
        keep &= ~cut
        probs = torch.where(keep, x, -math.inf).softmax(-1)
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
        probs = torch.where(keep, x, -math.inf).softmax(-1)
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.8, min_p=0.2),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_processed_distribution_matches_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    got = processed_logprobs(logits, [params] * 3).exp()
    for row in range(3):
        torch.testing.assert_close(got[row].double(), reference_probs(logits[row], params), atol=1e-6, rtol=1e-5)


def test_mixed_rows_are_processed_independently():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    ps = [SamplingParams(top_k=3), SamplingParams(top_p=0.5, temperature=0.3)]
    got = processed_logprobs(logits, ps).exp()
    for row, p in enumerate(ps):
        torch.testing.assert_close(got[row].double(), reference_probs(logits[row], p), atol=1e-6, rtol=1e-5)


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0], [0, 0]).tolist() == [1, 0]


def test_sample_frequencies_follow_processed_distribution():
    """Gumbel-max over many seeds (one draw each) samples the processed distribution."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    want = processed_logprobs(logits, [params]).exp()[0]
    n = 20000
    tokens = sample(logits.expand(n, -1), [params] * n, list(range(n)), [0] * n)
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert freq[4:].sum() == 0  # cut tokens never appear
    # 5 standard errors: fails only if the sampler is biased.
    assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-9)


def test_seeded_sampling_is_a_function_of_seed_and_position():
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=5)
    a = [sample(logits, [p], [5], [i])[0].item() for i in range(20)]
    b = [sample(logits, [p], [5], [i])[0].item() for i in range(20)]
    assert a == b
    assert len(set(a)) > 1  # positions draw differently
    assert [sample(logits, [p], [6], [i])[0].item() for i in range(20)] != a


def test_sample_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(2)
    logits = torch.randn(5, 300) * 2
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.1, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=20),
    ]
    seeds, positions = [3, 4, -5, 2**63 - 1, -(2**63)], [0, 7, 7, 100, 1]
    together = sample(logits, params, seeds, positions).tolist()
    alone = [sample(logits[i : i + 1], [params[i]], [seeds[i]], [positions[i]]).item() for i in range(5)]
    assert together == alone


def test_top_p_one_keeps_the_tail_when_batched_with_top_p():
    """A top_p = 1 row is processed bit for bit the same alone or beside a top-p row."""
    torch.manual_seed(4)
    logits = torch.randn(2, 49152) * 4
    ps = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1)]
    assert torch.equal(processed_logprobs(logits, ps)[0], processed_logprobs(logits[:1], ps[:1])[0])


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seed_outside_int64_is_invalid(seed):
    from engines.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(seed=seed).validate(100)
    assert err.value.param == "seed"


def test_int64_extreme_seeds_are_valid():
    for seed in (2**63 - 1, -(2**63), -1, 0):
        p = SamplingParams(seed=seed).validate(100)
        p.make_generator()  # torch accepts every int64 seed


def test_vocab_argmax_is_argmax_with_its_ties_and_nans():
    """The greedy token of every row is argmax's: the first of tied maxima, a NaN's index where there is one,
    in fp32 and bf16, over a vocabulary's width and a short row."""
    torch.manual_seed(0)
    rows = torch.randn(6, 49152)
    rows[0, 7] = rows[0, 40000] = 50.0  # tied maxima
    rows[1, 100] = float("nan")
    rows[2, -1] = rows[2, 3] = 50.0
    rows[3] = 0.0  # every value tied
    for values in (rows, rows.bfloat16(), rows[:, :5]):
        assert torch.equal(vocab_argmax(values), values.argmax(-1))
    assert vocab_argmax(rows).tolist()[:4] == [7, 100, 3, 0]


@pytest.mark.parametrize("width", [1, 7, 8, 9, 31, 32, 33, 40, 8192, 49152])
def test_the_argmax_kernel_is_argmax_at_every_width(width):
    """Contiguous fp32 rows take the C kernel (where the machine has it): rows of integers full of ties,
    rows of infinities, signed zeros and NaNs in the vector part and in the tail."""
    g = torch.Generator().manual_seed(width)
    rows = torch.randint(-3, 3, (16, width), generator=g).float()
    rows[1] = float("-inf")
    rows[2, width // 2] = float("inf")
    rows[3] = -0.0
    rows[3, width - 1] = 0.0
    rows[4, width - 1] = float("nan")
    rows[5, width // 3] = float("nan")
    rows[5, width - 1] = float("nan")
    rows[6] = float("-inf")
    rows[6, width - 1] = float("nan")
    if integer_dot.available():
        assert integer_dot.row_argmax(rows) is not None
    assert torch.equal(vocab_argmax(rows), rows.argmax(-1))
    assert torch.equal(vocab_argmax(rows[0]), rows[0].argmax(-1))  # one row, no batch dimension
