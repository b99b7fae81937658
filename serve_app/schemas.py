"""OpenAI chat-completions request and response bodies (pydantic), and their mapping onto the engine.

Structure and types are checked here (unknown fields, wrong types, empty message lists, n != 1);
value ranges (temperature, top_p, ...) are checked by the engine's own `SamplingParams.validate` and
`SpecParams.validate`, so the HTTP path and offline use share one set of rules and messages.
Extensions beyond OpenAI's fields: `top_k`, `min_p`, `speculation` (drafter on/off, tree
overrides, the speculation policy) and `slo` (a latency class or explicit targets for the policy layer).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.errors import InvalidRequestError
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from policies.slo import SLOSettings, SLOTarget


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """One text part of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A message of the conversation."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """OpenAI's stream_options."""

    include_usage: bool = False


class SpeculationOptions(_Strict):
    """Extension: per-request speculation (None fields keep the server's or policy's choice).

    Under the adaptive policy depth/width/budget are caps; `policy: fixed` verifies exactly that tree
    every step."""

    enabled: bool = True
    depth: int | None = None
    width: int | None = None
    budget: int | None = None
    policy: Literal["fixed", "adaptive"] | None = None


class SLOOptions(_Strict):
    """Extension: the request's latency class, or explicit targets, for the policy layer."""

    slo_class: str | None = Field(default=None, alias="class")
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: SpeculationOptions | None = None
    slo: SLOOptions | None = None

    def sampling_params(self, vocab_size: int) -> SamplingParams:
        """The engine's sampling settings; raises InvalidRequestError for impossible values."""
        if self.n != 1:
            raise InvalidRequestError(f"only n=1 is supported, got n={self.n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=limit,
            stop=stop,
        )
        return params.validate(vocab_size)

    def spec_params(self, default: SpecParams, server_policy: str = "fixed") -> SpecParams:
        """The request's speculation: the server default with the request's overrides."""
        opts = self.speculation
        if opts is None:
            return default
        if opts.policy == "adaptive" and server_policy != "adaptive":
            raise InvalidRequestError(
                f"speculation.policy 'adaptive' needs a server started with spec_policy: adaptive (this one: "
                f"{server_policy!r})",
                param="speculation.policy",
            )
        return SpecParams(
            depth=opts.depth if opts.depth is not None else default.depth,
            width=opts.width if opts.width is not None else default.width,
            budget=opts.budget if opts.budget is not None else default.budget,
            enabled=opts.enabled,
            fixed=opts.policy == "fixed",
        ).validate()

    def slo_target(self, settings: SLOSettings) -> SLOTarget:
        """The request's latency targets (its own, else its class's); an unknown class is a bad request."""
        slo = self.slo or SLOOptions()
        try:
            return settings.target(slo.slo_class, slo.ttft_ms, slo.tpot_ms)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="slo.class") from None

    def conversation(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class Usage(BaseModel):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """Extension: how speculation went for this request."""

    target_forwards: int
    draft_tokens: int
    accepted_tokens: int
    accepted_tokens_per_step: float


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    """One completion (n = 1)."""

    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A whole (non-streaming) completion."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    speculation: SpeculationStats | None = None


class DeltaMessage(BaseModel):
    """The new part of a streamed message."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """One streamed choice update."""

    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail
