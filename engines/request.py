"""What the engine admits (`GenerationRequest`), a request's state inside it (`Request`), and the
deltas it emits for it (`RequestOutput`)."""

from __future__ import annotations

import dataclasses
import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from engines.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from engines.structured_output import GrammarState


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why generation ended (OpenAI's finish_reason values)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One request as the engine admits it: a conversation or prompt token ids, and typed settings.

    Its maker has validated the fields (the serving ingress by its schema, or `LLMEngine.make_request`
    for hand-built settings); admission (`LLMEngine.admit`) checks only what needs the model: the
    tokenized prompt against the context length, token ids against the vocabulary.
    """

    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[dict[str, Any]] | None = None  # OpenAI-style chat messages, rendered by the chat template
    prompt_token_ids: list[int] | None = None  # or the prompt as token ids (no template)
    prompt: str | None = None  # or the prompt as text, tokenized without a template (completions)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, rendered with the messages
    params: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams | None = None  # None: the engine's default speculation
    tpot_target_s: float | None = None  # time-per-output-token target (SLO) the speculation policy honours
    # Resumption (a replica failed mid-request): the answer's tokens already produced, which the request
    # continues after as if uninterrupted (same seed: the positional noise goes on at their count), and
    # how many characters of their text the client already has (what was held back is sent again).
    resume_token_ids: list[int] | None = None
    resume_text_sent: int = 0


@dataclass(eq=False)  # identity semantics: queues look requests up with `in` / `remove`
class Request:
    """Tokens, progress and stopping state of one generation.

    `num_computed_tokens` counts the tokens (prompt then output) whose K/V are in the cache; the
    scheduler runs `num_tokens - num_computed_tokens` more of them (a prefill chunk or one decode
    token). After preemption it drops to 0 and the request recomputes from its full token list.
    `generator` serves only stochastic chain drafts (draft-model drafter); everything else samples
    with positional noise from `seed`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    # Sampling seed: params.seed, or drawn at admission. The token at output index i draws with the
    # noise of (seed, i) (positional_random.py), with or without speculation.
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_text: str = ""
    num_text_sent: int = 0  # chars of output_text already emitted
    num_tokens_sent: int = 0
    first_scheduled_time: float | None = None  # when it first left the waiting queue (monotonic)
    first_token_time: float | None = None
    num_forwards: int = 0  # target forward passes this request took part in
    num_preemptions: int = 0
    spec: SpecParams | None = None  # None: no speculation for this request
    tpot_target_s: float | None = None  # time-per-output-token target (SLO) the speculation policy honours
    num_spec_steps: int = 0  # verification forwards with a draft
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    # The grammar its output must follow (params.structured, compiled at admission), advanced with
    # every emitted token; None for free text.
    grammar: GrammarState | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token after the resumed ones
    num_resumed_tokens: int = 0  # output tokens it was admitted with (GenerationRequest.resume_token_ids)
    prompt_logprob_entries: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked
    prompt_logprobs_sent: bool = False

    def prompt_logprob_rows(self, start: int, num_tokens: int) -> list[int]:
        """Which of the tokens [start, start + num_tokens) being computed score a prompt token not yet
        scored (row r predicts token start + r + 1); [] unless the request asked for prompt logprobs."""
        if self.params.prompt_logprobs is None:
            return []
        done, end = len(self.prompt_logprob_entries), len(self.prompt_token_ids)
        return [r for r in range(num_tokens) if done < start + r + 1 < end]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def draft_limit(self) -> SpecParams | None:
        """The largest tree this request may draft now: its speculation settings with the depth cut so
        the bonus token stays within `max_tokens`; None when it does not speculate or has no room."""
        if self.spec is None:
            return None
        depth = min(self.spec.depth, self.max_tokens - len(self.output_token_ids) - 1)
        if depth < 1:
            return None
        return self.spec if depth == self.spec.depth else dataclasses.replace(self.spec, depth=depth)

    @property
    def multi_step_ok(self) -> bool:
        """Whether its next tokens may come several decode steps to one call (engines/spec_decode/executor.py):
        greedy, without log-probabilities or a grammar, past its prompt (its one token left to compute is a
        generated one: a prompt's last token is read as a prompt token, by other kernels)."""
        params, past_prompt = self.params, self.num_computed_tokens >= self.num_prompt_tokens
        return past_prompt and params.greedy and params.logprobs is None and self.grammar is None

    @property
    def finished(self) -> bool:
        """Whether the request has ended for any reason."""
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token there, its log-probability, and the most likely
    tokens at that position with theirs (most likely first; as many as the request asked for)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the new tokens and text since the last delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_forwards: int
    arrival_time: float
    first_token_time: float | None
    first_scheduled_time: float | None = None
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # One per new token when the request asked for `logprobs`; None otherwise.
    logprobs: list[TokenLogprob] | None = None
    # Per prompt token when it asked for `prompt_logprobs` (the first token has none): first delta only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # When the engine emitted this delta (monotonic, the clock of `arrival_time` and `first_token_time`).
    output_time: float = field(default_factory=time.monotonic)

    @property
    def finish_time(self) -> float | None:
        """When the request finished (the time of its last delta); None while it runs."""
        return self.output_time if self.finished else None

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step so far (accepted drafts + bonus); 1.0 before any."""
        steps = self.num_spec_steps
        return (self.num_accepted_tokens + steps) / steps if steps else 1.0

    def merged_with(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta."""
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            logprobs=None if self.logprobs is None else self.logprobs + (later.logprobs or []),
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )
