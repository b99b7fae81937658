"""Sampling parameters (validated at the API edge of the engine) and the batched sampler.

The target's distribution is processed in the order transformers applies its warpers: temperature,
then top-k, top-p and min-p. Temperature 0 means greedy. At temperature > 0 the token at output index
i of a request is the Gumbel-max `argmax(logp_i + G(seed, i))`, with G a hash of (seed, i, token)
(positional_random.py): it does not depend on the batch, on speculation, or on how many random numbers
anything drew before. Only stochastic chain drafts (the draft-model drafter) still draw from the
request's torch.Generator (`make_generator`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.errors import InvalidRequestError
from engines.positional_random import gumbel_for
from engines.structured_params import StructuredOutputParams
from lyanna_kernels import integer_dot

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is any int64
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per position (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    """How one request samples and when it stops."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None = up to the context limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities: None returns none; k >= 0 returns each emitted token's log-probability and the
    # k most likely alternatives at its position (k <= MAX_LOGPROBS). See `logprobs_mode` in EngineConfig.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (completions' echo)
    structured: StructuredOutputParams | None = None  # a grammar the output must follow (None: free text)

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the argmax."""
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> SamplingParams:
        """Raise InvalidRequestError naming the first impossible field; return self when all are fine."""

        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, f"{name} must be a finite number, got {value!r}")
            return float(value)

        if number("temperature", self.temperature) < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= number("min_p", self.min_p) <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), got {self.seed}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.structured is not None:
            self.structured.validate()
        return self

    def make_generator(self, device: torch.device | str = "cpu", seed: int | None = None) -> torch.Generator:
        """A torch.Generator for the draws that stay sequential (stochastic chain drafts and their
        verification): seeded with `seed`, else this request's `seed`, else fresh entropy."""
        g = torch.Generator(device=device)
        seed = seed if seed is not None else self.seed
        g.manual_seed(seed if seed is not None else random.getrandbits(63))
        return g

    def resolve_seed(self) -> int:
        """The seed a request samples with: its own, or a fresh random one (drawn once, at admission)."""
        return self.seed if self.seed is not None else random.getrandbits(63)


def processed_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities of the processed distribution per row (temperature, top-k, top-p, min-p).

    logits: [N, vocab] fp32 for N rows, params: one per row. Greedy rows come back as the
    temperature-1 log-softmax (callers take their argmax). Filtered tokens get -inf.
    """
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        drop |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= ks.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the line is kept).
        mass_before = probs.cumsum(-1) - probs
        # top_p = 1 never cuts: fp32 cumsums can reach 1.0 before the tail, which would drop tail
        # tokens of a top_p = 1 row only when it is batched with a top-p row.
        ps = torch.tensor([p if p < 1.0 else math.inf for p in top_p], device=logits.device).unsqueeze(1)
        drop |= mass_before >= ps
        drop[:, 0] = False
        logits = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits.masked_fill(drop, -math.inf))
    logprobs = logits.log_softmax(-1)
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=logits.device).unsqueeze(1)
        floor = logprobs.max(-1, keepdim=True).values + torch.log(mp)
        renormed = logprobs.masked_fill(logprobs < floor, -math.inf).log_softmax(-1)
        # Rows without min-p keep their values bit for bit (a second log_softmax would shift them by
        # rounding), so a row's result does not depend on what it is batched with.
        logprobs = torch.where(mp > 0, renormed, logprobs)
    return logprobs


def vocab_argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value over the last dimension (the first on ties; a NaN wins), as
    argmax gives it: on CPUs our AVX2 kernel (lyanna_kernels/csrc/argmax.c: 2-3x torch's row max over a batch of
    vocabularies), elsewhere torch's row max (several times faster than argmax over a vocabulary)."""
    fast = integer_dot.row_argmax(values)
    return fast if fast is not None else values.max(-1).indices


def gumbel_argmax(logprobs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Gumbel-max over processed log-probabilities [N, vocab]: row r's token is
    argmax(logprobs[r] + G(seeds[r], positions[r])), a draw from exp(logprobs[r]). Filtered tokens
    (-inf) stay -inf and never win. Returns [N] int64."""
    noise = gumbel_for(seeds, positions, logprobs.shape[-1], logprobs.device)
    return vocab_argmax(logprobs + noise)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One token per row of logits [N, vocab]: argmax for greedy rows; for the others the Gumbel-max
    draw from the processed distribution with the noise of (seeds[r], positions[r]), where a position
    is the output index of the token being produced (len(output_token_ids) before it is appended).
    All sampled rows are drawn by one tensor op. Returns [N] int64."""
    tokens = vocab_argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        logprobs = processed_logprobs(logits[rows], [params[i] for i in rows])
        drawn = gumbel_argmax(logprobs, [seeds[i] for i in rows], [positions[i] for i in rows])
        tokens[torch.tensor(rows, device=tokens.device)] = drawn
    return tokens
