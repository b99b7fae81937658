"""OpenAI's response bodies (pydantic): chat completions and their stream chunks, text completions and
theirs, log-probabilities in both formats, errors and the model list."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    """Token counts of one request: the prompt once, the completion tokens of every choice."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """Extension: how speculation went for this request (summed over its choices)."""

    target_forwards: int
    draft_tokens: int
    accepted_tokens: int
    accepted_tokens_per_step: float


# ---- log-probabilities -------------------------------------------------------------------------
class TopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's UTF-8 bytes (a token may hold part of a character)")


class ChatTokenLogprob(BaseModel):
    """An output token's log-probability, with the most likely tokens at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's log-probabilities (OpenAI's format)."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A text completion's log-probabilities (OpenAI's legacy format): per token its text, its
    log-probability, the most likely tokens there (the sampled one included) and its character offset.
    With echo the prompt's tokens come first; the first prompt token has no log-probability (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# ---- chat -------------------------------------------------------------------------------------
class FunctionCallOut(BaseModel):
    """A call's function and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A function call the model made."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated message: text, or (with tools) function calls and any text before them."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    """One completion of a chat request."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A whole (non-streaming) chat completion."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    speculation: SpeculationStats | None = None


class FunctionCallDelta(BaseModel):
    """A streamed piece of a call: the name first, then the arguments' text in pieces."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of the `index`-th call of a choice (id and type come with its first piece)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    """The new part of a streamed message."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    """One streamed choice update."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


# ---- text completions -------------------------------------------------------------------------
class CompletionChoice(BaseModel):
    """One choice of a text completion (whole, or the new part in a stream chunk)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole (non-streaming) text completion."""

    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: SpeculationStats | None = None


class CompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed text completion (OpenAI streams the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- errors and models ------------------------------------------------------------------------
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
