"""Sampling parameters (validated at the API edge of the engine) and the batched sampler.

The target's distribution is processed in the order transformers applies its warpers: temperature,
then top-k, top-p and min-p. Temperature 0 means greedy. Every request has its own torch.Generator,
seeded when the request gives a seed, so its random draws do not depend on what it is batched with.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.errors import InvalidRequestError


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
        return self

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """This request's random source: seeded when `seed` is given, else from fresh entropy."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else random.getrandbits(63))
        return g


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
        ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
        drop |= mass_before >= ps
        drop[:, 0] = False
        logits = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits.masked_fill(drop, -math.inf))
    logprobs = logits.log_softmax(-1)
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=logits.device).unsqueeze(1)
        floor = logprobs.max(-1, keepdim=True).values + torch.log(mp)
        logprobs = logprobs.masked_fill(logprobs < floor, -math.inf).log_softmax(-1)
    return logprobs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of logits [N, vocab]: argmax for greedy rows, a draw from the processed
    distribution with the row's own generator otherwise. Returns [N] int64."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_logprobs(logits[rows], [params[i] for i in rows]).exp()
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens
