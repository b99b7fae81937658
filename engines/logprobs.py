"""Log-probabilities of emitted and prompt tokens, computed on the device for a step's rows and brought
to the host inside the step's one copy.

What a log-probability is follows vLLM's `logprobs_mode`:
- `raw_logprobs` (the default): log-softmax of the target's logits as the model computed them (after a
  structured-output mask, which removes tokens the grammar forbids; before temperature, top-k, top-p
  and min-p).
- `processed_logprobs`: log-probabilities of the distribution tokens are drawn from, after temperature,
  top-k, top-p and min-p (a greedy row: temperature 1 with its top-k/top-p/min-p); filtered tokens
  are -inf.

With speculation, an emitted token's log-probability comes from the verification row of the tree node
it follows, the same target distribution plain decoding samples it from, so the two agree to the
numerical tolerance of batching the rows differently.

Floats travel in the step's int64 host copy bit for bit: each fp32 is reinterpreted as int32 and
widened (`pack`), and read back by `unpack`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engines.request import TokenLogprob
from engines.sampling import SamplingParams, processed_logprobs

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "processed_logprobs")


def row_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], mode: LogprobsMode) -> torch.Tensor:
    """Log-probabilities [R, vocab] of the rows' distributions under `mode` (one SamplingParams per row)."""
    if mode == "processed_logprobs":
        return processed_logprobs(logits.float(), list(params))
    return logits.float().log_softmax(-1)


@dataclass
class LogprobRows:
    """The rows of a step whose log-probabilities are wanted: a logits row, the token whose
    log-probability is read there, how many alternatives to return and the row's sampling params."""

    rows: list[int]
    params: list[SamplingParams]
    num_top: list[int]
    tokens: list[torch.Tensor]  # [R] int64 on the device, in pieces to concatenate

    @classmethod
    def empty(cls) -> LogprobRows:
        """No rows yet."""
        return cls([], [], [], [])

    def add(self, rows: list[int], tokens: torch.Tensor, params: SamplingParams, num_top: int) -> None:
        """Rows of one request, with the tokens to score there ([len(rows)] int64 on the device)."""
        self.rows += rows
        self.params += [params] * len(rows)
        self.num_top += [num_top] * len(rows)
        self.tokens.append(tokens)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Alternatives gathered per row: the most any row asks for."""
        return max(self.num_top, default=0)

    def gather(self, logits: torch.Tensor, mode: LogprobsMode) -> torch.Tensor:
        """The packed payload [R * (2 + 2 * width)] int64 on the device: tokens, their log-probabilities,
        the top alternatives' ids and their log-probabilities (`unpack` reads it)."""
        index = torch.tensor(self.rows, dtype=torch.long).to(logits.device, non_blocking=True)
        logprobs = row_logprobs(logits.index_select(0, index), self.params, mode)
        tokens = torch.cat(self.tokens).to(torch.long)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        top_values, top_ids = (
            logprobs.topk(self.width, dim=-1) if self.width else (logprobs[:, :0], tokens[:, None][:, :0])
        )
        return torch.cat([tokens, pack(chosen), top_ids.flatten().long(), pack(top_values.flatten())])

    def unpack(self, host: list[int]) -> list[TokenLogprob]:
        """The `TokenLogprob` of every row from the host copy of `gather`'s payload."""
        n, k = len(self.rows), self.width
        tokens, chosen = host[:n], unpack(host[n : 2 * n])
        top_ids, top_values = host[2 * n : 2 * n + n * k], unpack(host[2 * n + n * k : 2 * n + 2 * n * k])
        return [
            TokenLogprob(
                tokens[r],
                chosen[r],
                [(top_ids[r * k + j], top_values[r * k + j]) for j in range(self.num_top[r])],
            )
            for r in range(n)
        ]

    def payload_size(self) -> int:
        """Length of `gather`'s payload."""
        return len(self.rows) * (2 + 2 * self.width)


def pack(values: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 holding their bits (for the step's int64 host copy)."""
    return values.float().contiguous().view(torch.int32).long()


def unpack(bits: list[int]) -> list[float]:
    """The fp32 values `pack` encoded, as Python floats."""
    return np.asarray(bits, dtype=np.int64).astype(np.int32).view(np.float32).astype(float).tolist()
