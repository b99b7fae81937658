"""OpenAI chat-completions request and response bodies (pydantic), and their mapping onto the engine.

Requests are validated strictly, as OpenAI does: no type coercion (`"10"` is not an integer, `"yes"`
not a boolean), OpenAI's ranges (temperature in [0, 2], top_p in (0, 1], at most 4 stop strings, a
seed that fits 64 bits), unknown fields rejected. The fields current OpenAI clients send are either
honoured or, where this server cannot honour a value (tools, logprobs, penalties, JSON mode), rejected
with a 400 that names the field; a neutral value (`presence_penalty: 0`, `logprobs: false`,
`response_format: {"type": "text"}`) is accepted, since it asks for nothing. This is the one
validation of a request's fields: the ingress turns a valid body into a typed `ChatRequest`
(serve_app/messages.py), which the replica and the engine take as it is; the engine's admission checks
only what needs the model (the prompt's length in tokens against the context).
Extensions beyond OpenAI's fields: `top_k`, `min_p`, `speculation` (drafter on/off, tree overrides,
the speculation policy) and `slo` (a latency class or explicit targets for the policy layer).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engines.errors import InvalidRequestError
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from policies.slo import SLOSettings, SLOTarget
from serve_app.messages import ChatRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One text part of a message's content list (the only part type a text model takes)."""

    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], Field(description="The text, or a list of text parts")]


class ChatMessage(_Strict):
    """A message of the conversation. `developer` is OpenAI's newer name for `system` instructions;
    `name` is honoured where the model's chat template renders speaker names, else a 400."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: str | None = Field(default=None, min_length=1, description="The speaker's name")
    # What the openai client's `message.model_dump()` carries when an assistant turn is replayed:
    # accepted when empty, since they say nothing (tool calls and audio are not served).
    refusal: None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """OpenAI's stream_options (only with `stream: true`)."""

    include_usage: bool = Field(default=False, description="A last chunk with the usage, and no choices")


class SpeculationOptions(_Strict):
    """Extension: per-request speculation (None fields keep the server's or policy's choice).

    Under the adaptive policy depth/width/budget are caps; `policy: fixed` verifies exactly that tree
    every step."""

    enabled: bool = True
    depth: int | None = Field(default=None, ge=1, le=64, description="Tree depth (draft tokens per path)")
    width: int | None = Field(default=None, ge=1, le=64, description="Children per tree node, at most")
    budget: int | None = Field(default=None, ge=1, le=64, description="Draft tokens verified per step, at most")
    policy: Literal["fixed", "adaptive"] | None = None


class SLOOptions(_Strict):
    """Extension: the request's latency class, or explicit targets, for the policy layer."""

    slo_class: str | None = Field(default=None, alias="class")
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)


class ResponseFormat(_Strict):
    """OpenAI's response_format: only plain text is served (no JSON mode or schemas)."""

    type: Literal["text"]


def _neutral(name: str, value: Any, neutral: tuple[Any, ...], why: str) -> Any:
    """Accept a field whose value asks for nothing; reject one this server cannot honour."""
    if value not in neutral:
        raise ValueError(f"{name}={value!r} is not supported: {why}")
    return value


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions."""

    model: str = Field(description="The served model's id (GET /v1/models)")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's optional fields may also be sent as null (the openai client sends `temperature=None`
    # as null): null means the default.
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; null = 1")
    top_p: float | None = Field(default=None, gt=0, le=1, description="null = 1")
    top_k: int | None = Field(default=None, ge=0, description="Extension: 0 or null = off")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Extension: 0 or null = off")
    seed: int | None = Field(
        default=None, ge=INT64_MIN, le=INT64_MAX, description="Reproducible sampling, with speculation on or off"
    )
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
        | None
    ) = None
    n: int | None = Field(default=None, ge=1, le=1, description="Only 1 completion per request")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, description="End-user id, recorded in the request's trace and logs")
    # OpenAI fields accepted only at their neutral value (see `_neutral`).
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported")
    logprobs: bool | None = Field(default=None, description="Only false is supported")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Only 0 is supported")
    logit_bias: dict[str, float] | None = Field(default=None, description="Only an empty map is supported")
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, description="Only an empty list is supported")
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted; there are no tools to call")
    store: bool | None = Field(default=None, description="Only false is supported: nothing is stored")
    # Extensions.
    speculation: SpeculationOptions | None = None
    slo: SLOOptions | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        return _neutral(info.field_name, v, (None, 0), "only 0 (no penalty) is served")

    @field_validator("logprobs", "store")
    @classmethod
    def _false_only(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        why = "log-probabilities are not returned" if info.field_name == "logprobs" else "completions are not stored"
        return _neutral(info.field_name, v, (None, False), why)

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        return _neutral("top_logprobs", v, (None, 0), "log-probabilities are not returned")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tools are not supported by this server")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # `stream` is declared, so validated, before
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def sampling_params(self) -> SamplingParams:
        """The engine's sampling settings (the schema has checked every value)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=limit,
            stop=stop,
        )

    def spec_params(self, default: SpecParams, server_policy: str = "fixed") -> SpecParams | None:
        """The request's speculation: the server default (`default`, the engine's) with the request's
        overrides; None when it has none (the engine applies its default)."""
        opts = self.speculation
        if opts is None:
            return None
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
        )

    def slo_target(self, settings: SLOSettings) -> SLOTarget:
        """The request's latency targets (its own, else its class's); an unknown class is a bad request."""
        slo = self.slo or SLOOptions()
        try:
            return settings.target(slo.slo_class, slo.ttft_ms, slo.tpot_ms)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="slo.class") from None

    def conversation(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (the engine maps `developer` to `system`)."""
        out = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.text()}
            out.append(msg if m.name is None else msg | {"name": m.name})
        return out

    def chat_request(
        self, request_id: str, slo: SLOSettings, spec_default: SpecParams, spec_policy: str = "fixed"
    ) -> ChatRequest:
        """The typed request the replica and the engine take as it is. `spec_default` and `spec_policy`
        are the engine's speculation settings; raises InvalidRequestError for an unknown SLO class or
        a speculation policy the server does not run."""
        target = self.slo_target(slo)
        generation = GenerationRequest(
            request_id=request_id,
            messages=self.conversation(),
            params=self.sampling_params(),
            spec=self.spec_params(spec_default, spec_policy),
            tpot_target_s=target.tpot_s,
        )
        return ChatRequest(generation, target)


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    ChatMessage,
    TextPart,
    StreamOptions,
    SpeculationOptions,
    SLOOptions,
    ResponseFormat,
)
_FIELD_NAMES = frozenset(
    name for model in REQUEST_MODELS for key, f in model.model_fields.items() for name in (key, f.alias) if name
)


def error_param(error: dict[str, Any]) -> str | None:
    """The request field a pydantic error is about, as `messages[0].content` (union branch tags such as
    `str` or `list[TextPart]` dropped; an unknown field keeps its own name)."""
    loc = error.get("loc", ())
    parts: list[str] = []
    for i, p in enumerate(loc):
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _FIELD_NAMES or (error.get("type") == "extra_forbidden" and i == len(loc) - 1):
            parts.append(f".{p}" if parts else p)
    return "".join(parts) or None


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


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lyanna-serve"


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
