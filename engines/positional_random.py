"""Counter-based random numbers for sampling: Gumbel noise as a pure function of (seed, position, token).

A torch.Generator hands out numbers in call order, so what a request samples would depend on how
many draws drafting and verification took before, which depends on speculation. Here the noise for
the token produced at output index `position` of a request with `seed` is a hash of
(seed, position, token id), so the token at output index i is `argmax(logp_i + G(seed, i))` however
the engine got there: plain decoding, any draft tree, any batch, after a preemption.

The hash is MurmurHash3's 32-bit finaliser (fmix32), chained over the words seed_lo, seed_hi,
position, and (xor) a per-token hash. All arithmetic stays in [0, 2**32) inside int64 tensors: a
32-bit product is split in 16-bit halves so nothing ever exceeds 2**48, and every right shift acts on
a non-negative value (the only signed input, the seed, is masked after its shift). The integer bits
are therefore identical on CPU and CUDA; the Gumbel transform runs in float64 and is then rounded to
float32, so the two devices agree up to (rare) last-ulp rounding of `log`.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_TOKEN_SALT = 0x9E3779B9  # golden-ratio constant: token ids 0.. do not hash the raw small integers
_SEED_SALT = 0x7F4A7C15
_token_hash_cache: dict[tuple[int, str], torch.Tensor] = {}


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> None:
    """x := (x * c) mod 2**32 in place, for x in [0, 2**32) and a 32-bit constant c, without int64
    overflow: x times either 16-bit half of c stays below 2**48. `tmp` is scratch shaped like x."""
    lo, hi = c & 0xFFFF, c >> 16
    torch.mul(x, hi, out=tmp).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(lo).add_(tmp).bitwise_and_(MASK32)


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser in place (in-place ops: the [rows, vocab] hash is memory-bound)."""
    tmp = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    _mul32_(x, 0x85EBCA6B, tmp)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 13, out=tmp))
    _mul32_(x, 0xC2B2AE35, tmp)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection of [0, 2**32) with full avalanche (int64 in, int64 out)."""
    return _fmix32_(x.to(torch.int64, copy=True))


def seed_to_int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with the same 64 bits (negative seeds are their two's complement)."""
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed {seed} does not fit in 64 bits")
    return seed - 2**64 if seed >= 2**63 else seed


def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """fmix32 of every token id (salted), [vocab] int64, cached per device: the only per-vocab work
    that does not depend on the row."""
    key = (vocab, str(device))
    cached = _token_hash_cache.get(key)
    if cached is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=device)
        cached = _token_hash_cache[key] = fmix32(fmix32((ids + _TOKEN_SALT) & MASK32))
    return cached


def row_states(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash state of each (seed, position) row, [rows] int64 in [0, 2**32)."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    seed_lo = seeds & MASK32  # two's complement bits of a negative seed: & on int64 is bitwise
    seed_hi = (seeds >> 32) & MASK32  # arithmetic shift keeps the sign bits; the mask drops them
    h = fmix32(seed_lo ^ _SEED_SALT)
    h = fmix32(h ^ seed_hi)
    h = fmix32(h ^ (positions & MASK32))
    return fmix32(h ^ ((positions >> 32) & MASK32))


def uniform_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The raw 32-bit hash of (seed, position, token) for every row and token, [rows, vocab] int64."""
    states = row_states(seeds, positions)
    return _fmix32_(states[:, None] ^ _token_hashes(vocab, states.device)[None, :])


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms (h + 0.5) / 2**32, strictly inside (0, 1), for every row and token: [rows, vocab] float64."""
    return uniform_bits(seeds, positions, vocab).to(torch.float64).add_(0.5).mul_(1.0 / 2**32)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise for rows of (seed, output position): [rows, vocab] float32.

    seeds: [rows] int64 (any int64; see `seed_to_int64`), positions: [rows] int64, on the device
    the noise is wanted on. Row r's noise depends only on (seeds[r], positions[r]): the same row gives
    the same noise whatever rows sit beside it. The uniform is (h + 0.5) / 2**32, strictly inside
    (0, 1), so the noise is finite, within [-3.2, 22.9].
    """
    # float64: (h + 0.5) / 2**32 is exact there, and -log(u) keeps its precision next to u = 1.
    return uniform_noise(seeds, positions, vocab).log_().neg_().log_().neg_().to(torch.float32)


def gumbel_for(seeds: list[int], positions: list[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """`gumbel_noise` from Python seeds and positions (one per row)."""
    return gumbel_noise(
        torch.tensor([seed_to_int64(s) for s in seeds], dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        vocab,
    )
