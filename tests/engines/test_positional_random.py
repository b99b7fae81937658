"""The counter-based Gumbel noise: a pure function of (seed, position, token), with the right law."""

from __future__ import annotations

import math

import pytest
import torch

from engines.positional_random import MASK32, gumbel_for, gumbel_noise, seed_to_int64, uniform_bits
from engines.sampling import gumbel_argmax

EULER_GAMMA = 0.5772156649015329


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def reference_bits(seed: int, position: int, token: int) -> int:
    """The hash in plain Python integers (no overflow possible): what the tensor code must reproduce."""
    s = seed & (2**64 - 1)
    h = _fmix32((s & MASK32) ^ 0x7F4A7C15)
    h = _fmix32(h ^ (s >> 32))
    h = _fmix32(h ^ (position & MASK32))
    h = _fmix32(h ^ (position >> 32))
    return _fmix32(h ^ _fmix32(_fmix32((token + 0x9E3779B9) & MASK32)))


def bits(seeds: list[int], positions: list[int], vocab: int, device: str = "cpu") -> torch.Tensor:
    return uniform_bits(
        torch.tensor([seed_to_int64(s) for s in seeds], device=device), torch.tensor(positions, device=device), vocab
    )


def test_hash_matches_the_plain_python_reference():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, -987654321]
    positions = [0, 1, 7, 4095, 2**31 + 5, 2**40, 3]
    vocab = 300
    got = bits(seeds, positions, vocab)
    for r, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        for t in (0, 1, 2, 150, 299):
            assert got[r, t].item() == reference_bits(s, p, t), (s, p, t)
    assert got.min() >= 0 and got.max() <= MASK32


def test_negative_seeds_are_their_64_bit_twos_complement():
    assert seed_to_int64(2**64 - 1) == -1 and seed_to_int64(-5) == -5 and seed_to_int64(2**63) == -(2**63)
    with pytest.raises(ValueError):
        seed_to_int64(2**64)
    with pytest.raises(ValueError):
        seed_to_int64(-(2**63) - 1)
    assert torch.equal(gumbel_for([-1], [3], 50, "cpu"), gumbel_for([2**64 - 1], [3], 50, "cpu"))


def test_noise_is_deterministic_and_differs_across_seeds_positions_and_tokens():
    vocab = 1000
    a = gumbel_for([1, 1, 2, -1], [0, 1, 0, 0], vocab, "cpu")
    b = gumbel_for([1, 1, 2, -1], [0, 1, 0, 0], vocab, "cpu")
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.shape == (4, vocab)
    for i in range(4):
        for j in range(i + 1, 4):
            assert (a[i] != a[j]).float().mean() > 0.99, (i, j)
    assert a[0].unique().numel() > 0.99 * vocab  # tokens of a row get different noise
    assert torch.isfinite(a).all()


def test_rows_do_not_depend_on_their_neighbours():
    seeds, positions = [11, -3, 2**62, 11], [5, 0, 9, 6]
    together = gumbel_for(seeds, positions, 777, "cpu")
    for r in range(4):
        assert torch.equal(together[r], gumbel_for([seeds[r]], [positions[r]], 777, "cpu")[0])
    shuffled = gumbel_for(seeds[::-1], positions[::-1], 777, "cpu")
    assert torch.equal(shuffled, together.flip(0))


def test_gumbel_moments_and_uniform_bits():
    g = gumbel_for(list(range(40)), [s % 7 for s in range(40)], 25000, "cpu").double()  # 1M draws
    n = g.numel()
    sd = math.pi / math.sqrt(6)
    assert abs(g.mean().item() - EULER_GAMMA) < 5 * sd / math.sqrt(n)
    assert abs(g.var().item() - sd**2) < 0.02
    # The top 4 bits of the hash: 16 equally likely cells (chi-square, 15 degrees of freedom).
    top = bits(list(range(40)), [0] * 40, 25000) >> 28
    counts = torch.bincount(top.flatten(), minlength=16).double()
    expected = top.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 50  # p < 1e-5 under uniformity


def test_adjacent_positions_are_uncorrelated():
    a = gumbel_for([9] * 64, list(range(64)), 4096, "cpu").double()
    x, y = a[:-1].flatten(), a[1:].flatten()
    corr = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(x.numel())


def test_gumbel_max_samples_a_small_categorical():
    probs = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
    logprobs = probs.log()[None].expand(20000, -1)
    n = logprobs.shape[0]
    tokens = gumbel_argmax(logprobs, list(range(-(n // 2), n - n // 2)), [3] * n)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0  # a -inf token never wins
    expected = probs[:5].double() * n
    chi2 = ((counts[:5] - expected) ** 2 / expected).sum().item()
    assert chi2 < 25  # 4 degrees of freedom: p < 1e-4 under the right law
    # Positions of one seed are draws as good as seeds are.
    tokens = gumbel_argmax(logprobs, [42] * n, list(range(n)))
    counts = torch.bincount(tokens, minlength=6).double()
    assert ((counts[:5] - expected) ** 2 / expected).sum().item() < 25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_same_bits_as_cpu():
    seeds, positions = [0, -1, 2**63 - 1, 77], [0, 3, 2**33, 12]
    assert torch.equal(bits(seeds, positions, 49152, "cuda").cpu(), bits(seeds, positions, 49152))
    cpu = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), 49152)
    cuda = gumbel_noise(torch.tensor(seeds, device="cuda"), torch.tensor(positions, device="cuda"), 49152).cpu()
    torch.testing.assert_close(cuda, cpu, rtol=0, atol=2e-6)
