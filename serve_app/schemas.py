"""OpenAI chat-completions and completions request and response bodies (pydantic), and their mapping
onto the engine.

Requests are validated strictly, as OpenAI does: no type coercion (`"10"` is not an integer, `"yes"`
not a boolean), OpenAI's ranges (temperature in [0, 2], top_p in (0, 1], at most 4 stop strings, a
seed that fits 64 bits), unknown fields rejected. The fields current OpenAI clients send are either
honoured or, where this server cannot honour a value (penalties, logit_bias, a completion's suffix),
rejected with a 400 that names the field; a neutral value (`presence_penalty: 0`, `suffix: null`) is
accepted, since it asks for nothing. This is the one validation of a request's fields: the ingress
turns a valid body into a typed `ChatRequest` (serve_app/messages.py), which the replica and the
engine take as it is; the engine's admission checks only what needs the model (the prompt's length
in tokens against the context, a grammar the library must compile).
Extensions beyond OpenAI's fields: `top_k`, `min_p`, `ignore_eos`, vLLM's structured outputs
(`guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`, `structured_outputs`), `speculation`
(drafter on/off, tree overrides, the speculation policy) and `slo` (a latency class or explicit
targets for the policy layer).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from engines.errors import InvalidRequestError
from engines.request import GenerationRequest
from engines.sampling import MAX_LOGPROBS, SamplingParams
from engines.spec_params import SpecParams
from engines.structured_params import StructuredOutputParams
from policies.slo import SLOSettings, SLOTarget
from serve_app.messages import ChatRequest
from serve_app.tools import tool_choice_grammar

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16  # choices per request (each is one engine request; they share the prompt's KV blocks)
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One text part of a message's content list (the only part type a text model takes)."""

    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], Field(description="The text, or a list of text parts")]


class FunctionCall(_Strict):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str = Field(description="The arguments as a JSON object's text")


class ToolCall(_Strict):
    """A function call the assistant made (in a response, or replayed in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A message of the conversation. `developer` is OpenAI's newer name for `system` instructions;
    `name` is honoured where the model's chat template renders speaker names, else a 400. An
    assistant message may carry `tool_calls` (its content then may be null); a `tool` message is the
    result of the call named by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = Field(default=None, min_length=1, description="The speaker's name")
    tool_calls: list[ToolCall] | None = Field(default=None, description="Assistant messages: the calls made")
    tool_call_id: str | None = Field(
        default=None, validate_default=True, description="Tool messages: the call this result answers"
    )
    content: Content | None = Field(default=None, validate_default=True)
    # What the openai client's `message.model_dump()` carries when an assistant turn is replayed:
    # accepted when empty, since they say nothing.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_the_assistant(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_results_name_their_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if (v is None) == (info.data.get("role") == "tool"):
            raise ValueError("tool messages, and only they, carry tool_call_id (the call they answer)")
        return v

    @field_validator("content")
    @classmethod
    def _content_unless_calls(cls, v: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        if v is None and not info.data.get("tool_calls"):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return v

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
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


class ResponseFormatText(_Strict):
    """Plain text (the default)."""

    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    """JSON mode: the output is one JSON object."""

    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    """A named JSON schema the output must follow."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="null: any JSON object")
    strict: bool | None = Field(default=None, description="Accepted; the schema is always enforced")


class ResponseFormatJSONSchema(_Strict):
    """Structured outputs: the output follows `json_schema.schema`."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


def _format_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if not isinstance(kind, str):
        return None
    return {"text": "ResponseFormatText", "json_object": "ResponseFormatJSONObject"}.get(
        kind, "ResponseFormatJSONSchema" if kind == "json_schema" else None
    )


# Tagged by class name, so an error's location never holds a value that reads like a field name.
ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("ResponseFormatText")]
    | Annotated[ResponseFormatJSONObject, Tag("ResponseFormatJSONObject")]
    | Annotated[ResponseFormatJSONSchema, Tag("ResponseFormatJSONSchema")],
    Discriminator(_format_tag),
]
JSONSpec = dict[str, Any] | str  # a JSON schema, as an object or as its JSON text


class StructuredOutputsOptions(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: JSONSpec | None = Field(default=None, alias="json", description="A JSON schema")
    json_object: bool | None = Field(default=None, description="Any JSON object")
    regex: str | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1, description="An EBNF (GBNF) grammar")
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None


class FunctionDefinition(_Strict):
    """A function the model may call."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments object")
    strict: bool | None = Field(default=None, description="Accepted; required and named calls are always enforced")


class Tool(_Strict):
    """A function tool."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    """The function a named tool_choice forces."""

    name: str


class NamedToolChoice(_Strict):
    """Force a call of this function."""

    type: Literal["function"]
    function: FunctionName


def _neutral(name: str, value: Any, neutral: tuple[Any, ...], why: str) -> Any:
    """Accept a field whose value asks for nothing; reject one this server cannot honour."""
    if value not in neutral:
        raise ValueError(f"{name}={value!r} is not supported: {why}")
    return value


def _json_schema_text(spec: JSONSpec, param: str) -> str:
    """A JSON schema's text; InvalidRequestError when JSON text is not a JSON object."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return json.dumps(spec)


class _GenerationRequest(_Strict):
    """The sampling, structured-output and extension fields chat and completions share."""

    model: str = Field(description="The served model's id (GET /v1/models)")
    # OpenAI's optional fields may also be sent as null (the openai client sends `temperature=None`
    # as null): null means the default.
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; null = 1")
    top_p: float | None = Field(default=None, gt=0, le=1, description="null = 1")
    top_k: int | None = Field(default=None, ge=0, description="Extension: 0 or null = off")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Extension: 0 or null = off")
    seed: int | None = Field(
        default=None,
        ge=INT64_MIN,
        le=INT64_MAX,
        description="Reproducible sampling, with speculation on or off; choice i of n samples with seed + i",
    )
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
        | None
    ) = None
    n: int | None = Field(default=None, ge=1, le=MAX_N, description="Choices to generate (they share the prompt)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, description="End-user id, recorded in the request's trace and logs")
    ignore_eos: bool | None = Field(default=None, description="Extension: keep generating past end-of-turn tokens")
    # OpenAI fields accepted only at their neutral value (see `_neutral`).
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="Only 0 is supported")
    logit_bias: dict[str, float] | None = Field(default=None, description="Only an empty map is supported")
    # Structured outputs: OpenAI's response_format and vLLM's names for the same constraints.
    response_format: ResponseFormat | None = None
    guided_json: JSONSpec | None = Field(default=None, description="Extension (vLLM): a JSON schema")
    guided_regex: str | None = Field(default=None, min_length=1, description="Extension (vLLM): a regex")
    guided_grammar: str | None = Field(default=None, min_length=1, description="Extension (vLLM): EBNF grammar")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = Field(
        default=None, description="Extension (vLLM): the output is one of these strings"
    )
    structured_outputs: StructuredOutputsOptions | None = Field(default=None, description="Extension (vLLM)")
    # Extensions.
    speculation: SpeculationOptions | None = None
    slo: SLOOptions | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        return _neutral(info.field_name, v, (None, 0), "only 0 (no penalty) is served")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # `stream` is declared, so validated, before
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def num_choices(self) -> int:
        """`n`, null meaning 1."""
        return self.n or 1

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            structured=self.structured_params(),
        )

    def structured_params(self) -> StructuredOutputParams | None:
        """The one output constraint asked for (response_format, guided_*, structured_outputs), or None;
        InvalidRequestError naming the second field when more than one is given."""
        found: list[StructuredOutputParams] = []
        fmt = self.response_format
        if isinstance(fmt, ResponseFormatJSONObject) or (
            isinstance(fmt, ResponseFormatJSONSchema) and fmt.json_schema.schema_ is None
        ):
            found.append(StructuredOutputParams(json_object=True, param="response_format"))
        elif isinstance(fmt, ResponseFormatJSONSchema):
            schema = _json_schema_text(fmt.json_schema.schema_ or {}, "response_format.json_schema.schema")
            found.append(StructuredOutputParams(json_schema=schema, param="response_format"))
        if self.guided_json is not None:
            schema = _json_schema_text(self.guided_json, "guided_json")
            found.append(StructuredOutputParams(json_schema=schema, param="guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutputParams(regex=self.guided_regex, param="guided_regex"))
        if self.guided_grammar is not None:
            found.append(StructuredOutputParams(grammar=self.guided_grammar, param="guided_grammar"))
        if self.guided_choice is not None:
            found.append(StructuredOutputParams(choice=tuple(self.guided_choice), param="guided_choice"))
        so = self.structured_outputs
        if so is not None:
            where = "structured_outputs"
            if so.json_ is not None:
                schema = _json_schema_text(so.json_, f"{where}.json")
                found.append(StructuredOutputParams(json_schema=schema, param=f"{where}.json"))
            if so.json_object:
                found.append(StructuredOutputParams(json_object=True, param=f"{where}.json_object"))
            for kind in ("regex", "grammar"):
                if getattr(so, kind) is not None:
                    found.append(StructuredOutputParams(**{kind: getattr(so, kind)}, param=f"{where}.{kind}"))
            if so.choice is not None:
                found.append(StructuredOutputParams(choice=tuple(so.choice), param=f"{where}.choice"))
            if not any(getattr(so, k) for k in ("json_", "json_object", "regex", "grammar", "choice")):
                raise InvalidRequestError("structured_outputs must set one constraint", param=where)
        if len(found) > 1:
            raise InvalidRequestError(
                f"only one output constraint per request: got {found[0].param} and {found[1].param}",
                param=found[1].param,
            )
        return found[0] if found else None

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

    def _typed(
        self,
        generation: GenerationRequest,
        slo: SLOSettings,
        spec_default: SpecParams,
        spec_policy: str,
        echo: bool = False,
    ) -> ChatRequest:
        target = self.slo_target(slo)
        generation = dataclasses.replace(
            generation,
            spec=self.spec_params(spec_default, spec_policy),
            tpot_target_s=target.tpot_s,
        )
        return ChatRequest(generation, target, n=self.num_choices, echo=echo)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, description="Return each output token's log-probability")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="With logprobs: the most likely tokens at each position"
    )
    tools: list[Tool] | None = Field(default=None, description="Functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="none, auto (the default with tools), required (one or more calls), or a named function "
        "(exactly one call of it)",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per answer")
    store: bool | None = Field(default=None, description="Only false is supported: nothing is stored")

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        return _neutral("store", v, (None, False), "completions are not stored")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # `logprobs` is declared, so validated, before
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if v not in (None, "none") and not tools:
            raise ValueError("tool_choice other than none needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {v.function.name!r}, which is not one of the tools")
        return v

    @property
    def tools_active(self) -> bool:
        """Whether the model is offered the tools (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_params(self) -> SamplingParams:
        """The engine's sampling settings (the schema has checked every value); a required or named
        tool_choice becomes the grammar the output follows."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self._sampling(limit, (self.top_logprobs or 0) if self.logprobs else None)
        if self.tools_active and self.tool_choice not in (None, "auto"):
            if params.structured is not None:
                raise InvalidRequestError(
                    f"tool_choice {self.tool_choice!r} cannot be combined with {params.structured.param}",
                    param="tool_choice",
                )
            tools = [t.function for t in self.tools or []]
            named = isinstance(self.tool_choice, NamedToolChoice)
            if isinstance(self.tool_choice, NamedToolChoice):  # exactly one call of that function
                tools = [f for f in tools if f.name == self.tool_choice.function.name]
            parallel = self.parallel_tool_calls is not False and not named
            grammar = tool_choice_grammar([(f.name, f.parameters) for f in tools], parallel=parallel)
            params.structured = StructuredOutputParams(grammar=grammar, param="tool_choice")
        return params

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (the engine maps `developer` to `system` and renders
        tool calls and results)."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text() if m.content is not None else None}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    def chat_request(
        self, request_id: str, slo: SLOSettings, spec_default: SpecParams, spec_policy: str = "fixed"
    ) -> ChatRequest:
        """The typed request the replica and the engine take as it is. `spec_default` and `spec_policy`
        are the engine's speculation settings; raises InvalidRequestError for an unknown SLO class, a
        speculation policy the server does not run, or conflicting output constraints."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] if self.tools_active else None
        generation = GenerationRequest(
            request_id=request_id, messages=self.conversation(), tools=tools, params=self.sampling_params()
        )
        return self._typed(generation, slo, spec_default, spec_policy)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions (OpenAI's legacy text completions)."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(description="Text, or token ids; a list holding one of them is accepted too")
    max_tokens: int | None = Field(default=16, ge=1, description="Tokens to generate (OpenAI's default: 16)")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="The sampled token's log-probability and this many most likely tokens at each position",
    )
    echo: bool | None = Field(default=None, description="Prepend the prompt (and, with logprobs, its logprobs)")
    suffix: str | None = Field(default=None, description="Not supported (insertion): only null or empty")
    best_of: int | None = Field(default=None, ge=1, description="Only equal to n is supported")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported: this server completes text, it does not insert it")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _neutral("best_of", v, (None, info.data.get("n") or 1), "only best_of equal to n is served")

    def prompt_input(self) -> tuple[str | None, list[int] | None]:
        """The prompt as (text, None) or (None, token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        first = p[0]
        if isinstance(first, str):
            return first, None
        if isinstance(first, list):
            return None, list(first)
        return None, list(p)  # type: ignore[arg-type]

    def chat_request(
        self, request_id: str, slo: SLOSettings, spec_default: SpecParams, spec_policy: str = "fixed"
    ) -> ChatRequest:
        """The typed request (a raw prompt, no chat template) the replica and the engine take as it is."""
        text, ids = self.prompt_input()
        params = self._sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        generation = GenerationRequest(request_id=request_id, prompt=text, prompt_token_ids=ids, params=params)
        return self._typed(generation, slo, spec_default, spec_policy, echo=bool(self.echo))


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ChatMessage,
    TextPart,
    ToolCall,
    FunctionCall,
    StreamOptions,
    SpeculationOptions,
    SLOOptions,
    ResponseFormatText,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    JSONSchemaFormat,
    StructuredOutputsOptions,
    Tool,
    FunctionDefinition,
    NamedToolChoice,
    FunctionName,
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
