"""The typed messages between the ingress and the LLM replicas (through a DeploymentHandle).

The ingress validates an HTTP request (chat or text completion) once and sends a `ChatRequest`; the
replica hands its `GenerationRequest` to the engine as it is, or, for `n` > 1 choices, the `n`
requests `generations()` fans it out to. The replica streams back `StreamDelta`s (each naming its
choice by `index`, with its tokens' log-probabilities as `LogprobEntry`s when asked), or a single
`StreamError` when the engine refuses the request (what only the engine can check, such as the
prompt's length in tokens). Counters keep the engine's names (`RequestOutput`) in the stream, the logs
and the span attributes; only the edges whose names are contracts rename them: OpenAI's `usage` and
`speculation` fields of a response, and the Prometheus series.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from engines.errors import InvalidRequestError
from engines.request import FinishReason, GenerationRequest, RequestOutput
from policies.slo import SLOTarget, latencies

INT64_MIN = -(2**63)


def seed_of_choice(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request with `n` > 1 samples with: `seed + index`, wrapped to 64 bits
    (None stays None: every choice draws its own seed)."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass(frozen=True)
class ChoiceProgress:
    """How far a client has one choice of a request: its tokens and the characters of its text it has
    received, and whether it had its last delta (what a resumption continues from)."""

    token_ids: tuple[int, ...] = ()
    text_sent: int = 0
    finished: bool = False

    def after(self, delta: StreamDelta) -> ChoiceProgress:
        """The progress once `delta` has reached the client."""
        return ChoiceProgress(
            self.token_ids + delta.new_token_ids, self.text_sent + len(delta.new_text), delta.finished
        )


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat or text-completion request: what the engine generates, and the SLO target it is
    measured against. `n` choices are generated (`generations`); `echo` (completions) asks the replica
    for the prompt's text (and its tokens' log-probabilities when the request asked for any)."""

    generation: GenerationRequest
    slo: SLOTarget = field(default_factory=SLOTarget)
    n: int = 1
    echo: bool = False
    resume: tuple[ChoiceProgress, ...] | None = None  # per choice, when a replica failed mid-request

    def choices(self) -> list[tuple[int, GenerationRequest]]:
        """(choice index, engine request) of every choice to run: all `n`, or on a resumption the
        unfinished ones, each continuing after the tokens its client has."""
        generations = list(enumerate(self.generations()))
        if self.resume is None:
            return generations
        return [
            (i, dataclasses.replace(g, resume_token_ids=list(p.token_ids), resume_text_sent=p.text_sent))
            for (i, g), p in zip(generations, self.resume, strict=True)
            if not p.finished
        ]

    def resumed(self, progress: list[ChoiceProgress], attempt: int) -> ChatRequest:
        """This request continued from `progress` (one per choice) on another replica: its engine requests
        get ids of their own (`<id>-r<attempt>`), and an echoed prompt is not sent again."""
        base = self.request_id if self.resume is None else self.request_id.rsplit("-r", 1)[0]
        request_id = f"{base}-r{attempt}"
        generation = dataclasses.replace(self.generation, request_id=request_id)
        return dataclasses.replace(self, generation=generation, resume=tuple(progress), echo=False)

    def with_fixed_seed(self) -> ChatRequest:
        """A sampled request without a seed gets one drawn now, so that a resumption draws as the first
        replica would have (greedy requests and seeded ones are returned as they are)."""
        params = self.generation.params
        if params.seed is not None or params.greedy:
            return self
        seeded = dataclasses.replace(params, seed=random.getrandbits(63))
        return dataclasses.replace(self, generation=dataclasses.replace(self.generation, params=seeded))

    def generations(self) -> list[GenerationRequest]:
        """The engine requests of the `n` choices: the request itself for one choice; else choice i is
        `<id>-<i>`, sampling with `seed + i` when the request has a seed."""
        if self.n == 1:
            return [self.generation]
        g = self.generation
        return [
            dataclasses.replace(
                g,
                request_id=f"{g.request_id}-{i}",
                params=dataclasses.replace(g.params, seed=seed_of_choice(g.params.seed, i)),
            )
            for i in range(self.n)
        ]

    @property
    def request_id(self) -> str:
        """The response's id (`chatcmpl-...`), also the engine's request id."""
        return self.generation.request_id

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The conversation (the request router hashes its prefix)."""
        return self.generation.messages

    @property
    def prompt(self) -> str | None:
        """A text completion's prompt (None for chat)."""
        return self.generation.prompt

    @property
    def slo_class(self) -> str | None:
        """The request's SLO class (the request router sends tight classes to the least-loaded replica)."""
        return self.slo.slo_class


@dataclass(frozen=True)
class LogprobEntry:
    """A token as clients see it (its text and bytes) with its log-probability, and the most likely
    tokens at its position (`top`, most likely first). `logprob` is None only for a prompt's first
    token, which nothing predicts."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float | None
    top: tuple[LogprobEntry, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StreamDelta:
    """One engine delta as the replica streams it: the new text, the request's counters so far and
    its engine timestamps (one monotonic clock, the replica's: only their differences are read)."""

    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_forwards: int  # target forwards the request took part in
    num_spec_steps: int  # of which verified a draft
    num_draft_tokens: int  # draft tokens verified
    num_accepted_tokens: int  # draft tokens accepted
    tokens_per_step: float  # tokens per verification step (accepted drafts + bonus)
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None  # set on the last delta
    replica: str | None = None  # the first delta names the replica serving the request
    index: int = 0  # the choice (of n) this delta belongs to
    new_token_ids: tuple[int, ...] = ()  # the new tokens (what a resumption continues after)
    logprobs: tuple[LogprobEntry, ...] | None = None  # the new tokens', when the request asked
    prompt_text: str | None = None  # echo: the prompt, on a choice's first delta
    prompt_logprobs: tuple[LogprobEntry, ...] | None = None  # echo with logprobs: the prompt's tokens

    @classmethod
    def of(
        cls,
        out: RequestOutput,
        replica: str | None = None,
        index: int = 0,
        logprobs: tuple[LogprobEntry, ...] | None = None,
        prompt_text: str | None = None,
        prompt_logprobs: tuple[LogprobEntry, ...] | None = None,
    ) -> StreamDelta:
        """The stream item of an engine delta (`logprobs` and the prompt's are the replica's text form
        of the delta's)."""
        return cls(
            new_text=out.new_text,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            num_forwards=out.num_forwards,
            num_spec_steps=out.num_spec_steps,
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_tokens=out.num_accepted_tokens,
            tokens_per_step=out.tokens_per_step,
            num_preemptions=out.num_preemptions,
            arrival_time=out.arrival_time,
            first_scheduled_time=out.first_scheduled_time,
            first_token_time=out.first_token_time,
            finish_time=out.finish_time,
            replica=replica,
            index=index,
            new_token_ids=tuple(out.new_token_ids),
            logprobs=logprobs,
            prompt_text=prompt_text,
            prompt_logprobs=prompt_logprobs,
        )

    @classmethod
    def combined(cls, lasts: list[StreamDelta]) -> StreamDelta:
        """The request's outcome over its choices' last deltas (metrics, logs, spans): the prompt once,
        output tokens and speculation counters summed, the first token's time the earliest, the finish
        the latest (the finish reason is the first choice's)."""
        if len(lasts) == 1:
            return lasts[0]
        first = lasts[0]
        spec_steps = sum(d.num_spec_steps for d in lasts)
        accepted = sum(d.num_accepted_tokens for d in lasts)
        token_times = [d.first_token_time for d in lasts if d.first_token_time is not None]
        scheduled = [d.first_scheduled_time for d in lasts if d.first_scheduled_time is not None]
        finishes = [d.finish_time for d in lasts]
        return dataclasses.replace(
            first,
            new_text="",
            new_token_ids=(),
            num_output_tokens=sum(d.num_output_tokens for d in lasts),
            num_forwards=max(d.num_forwards for d in lasts),
            num_spec_steps=spec_steps,
            num_draft_tokens=sum(d.num_draft_tokens for d in lasts),
            num_accepted_tokens=accepted,
            tokens_per_step=(accepted + spec_steps) / spec_steps if spec_steps else 1.0,
            num_preemptions=sum(d.num_preemptions for d in lasts),
            arrival_time=min(d.arrival_time for d in lasts),
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(token_times) if token_times else None,
            finish_time=None if None in finishes else max(f for f in finishes if f is not None),
            logprobs=None,
            prompt_text=None,
            prompt_logprobs=None,
        )

    @property
    def finished(self) -> bool:
        """Whether this is the request's last delta."""
        return self.finish_reason is not None

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to the request's first step (None before it)."""
        return None if self.first_scheduled_time is None else max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (None before it)."""
        return latencies(self.arrival_time, self.first_token_time, self.finish_time, self.num_output_tokens)[0]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None until finished with two tokens or more)."""
        return latencies(self.arrival_time, self.first_token_time, self.finish_time, self.num_output_tokens)[1]

    def slo_met(self, target: SLOTarget) -> bool | None:
        """Whether the finished request met `target` (None without targets or before the end): the
        replica's tracker and the ingress's metrics both decide with this, on the same last delta."""
        if self.finish_time is None:
            return None
        return target.attained(self.arrival_time, self.first_token_time, self.finish_time, self.num_output_tokens)

    def counters(self) -> dict[str, str | int | float | None]:
        """The outcome and counters under their one name each (log fields, span attributes)."""
        return {
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_forwards": self.num_forwards,
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "tokens_per_step": self.tokens_per_step,
            "num_preemptions": self.num_preemptions,
        }


@dataclass(frozen=True, kw_only=True)
class StreamError:
    """A request the engine refused, as the stream's first and only item: OpenAI's error fields and
    the HTTP status to answer with."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, err: InvalidRequestError) -> StreamError:
        """A bad request (400)."""
        return cls(status=400, message=err.message, param=err.param, code=err.code)


StreamItem = StreamDelta | StreamError
