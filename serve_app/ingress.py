"""The ingress deployment: FastAPI speaking OpenAI's chat-completions and completions APIs in front of
LLM replicas.

Every answer that is not a success is OpenAI's error body (`{"error": {message, type, param, code}}`)
with its HTTP status, and every generation response's status (chat and completions) is counted in
`lyanna_requests_total`:
400 for a body that is not JSON or breaks the schema (strict types and OpenAI's ranges), 404 for an
unknown model or path, 405 for a wrong method, 413 for a body over `max_request_body_bytes`, 415 for a
body that is not JSON by its content type, 503 when every replica is saturated or the replica serving
the request failed and it could not be resumed on another (serve_app/resumption.py; with `Retry-After`),
500 for anything unforeseen. A stream whose replica fails is resumed; when it cannot be, it ends with
an error event and `[DONE]`, never a cut connection.

`/health` is readiness: 200 only while at least one LLM replica has loaded its model and answers;
`/v1/models` lists the model only once a replica has loaded it (503 with Retry-After before);
`/metrics` and `/debug/engine` read the stats every running replica last reported (through the
request router of this process's handle), so they never wait on a dead or busy replica.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at runtime.)
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Span, SpanKind, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engines.errors import EngineDeadError, InvalidRequestError
from engines.spec_params import SpecParams
from policies import live_routers
from policies.slo import SLOSettings
from serve_app import tracing
from serve_app.choices import ChatChoiceState, CompletionChoiceState
from serve_app.messages import ChatRequest, StreamDelta, StreamError
from serve_app.metrics import ServeMetrics
from serve_app.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculationStats,
    Usage,
)
from serve_app.resumption import ResumableStream
from serve_app.schemas import ChatCompletionRequest, CompletionRequest, error_param
from serve_app.tracing import TracingSettings

# A child of Ray Serve's logger: with `logging_config.encoding: JSON` its lines carry Serve's request_id
# and the `extra` fields as JSON keys.
log = logging.getLogger("ray.serve.lyanna.ingress")
app = FastAPI(
    title="lyanna-serve",
    summary="OpenAI-compatible chat completions with speculative decoding (Lyanna), on Ray Serve",
)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH)
RETRY_AFTER_S = 1  # seconds a shed client should wait (Retry-After)
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class HealthStatus(BaseModel):
    """GET /health when ready."""

    status: str = "ok"
    ready_replicas: int = Field(description="LLM replicas that have loaded their model and answered the probe")


class IngressSettings(BaseModel):
    """HTTP limits of the ingress (`args.ingress` in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    max_request_body_bytes: int = Field(
        default=2 * 2**20, ge=1024, description="Larger chat request bodies get 413 before they are parsed"
    )
    health_timeout_s: float = Field(
        default=2.0, gt=0, description="How long /health waits for a replica to answer before it reports 503"
    )
    max_resumptions: int = Field(
        default=2,
        ge=0,
        description="Times a request whose replica fails is resumed on another (0: it fails with replica_failed)",
    )
    resume_wait_s: float = Field(
        default=120.0, gt=0, description="How long a resumed request may wait for a live replica to take and answer it"
    )


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body with an HTTP status."""
    error = {"message": message, "type": kind or ERROR_TYPES.get(status, "error"), "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def _retry_later(message: str, code: str) -> JSONResponse:
    """503 with Retry-After."""
    return error_response(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _count(request: Request, status: int) -> None:
    """Count a generation-route answer given outside the handler (wrong method, framework errors)."""
    metrics: ServeMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.url.path.endswith(GENERATION_PATHS):
        metrics.observe_status(status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) in OpenAI's error body."""
    _count(request, exc.status_code)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return error_response(exc.status_code, message, code=str(exc.detail).lower().replace(" ", "_"), headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Query or path parameters that do not validate (the chat body is validated by the handler)."""
    _count(request, 400)
    first = exc.errors()[0]
    return error_response(400, first["msg"], param=error_param(first), code="invalid_request")


def _replica_header(first: StreamDelta) -> dict[str, str]:
    """`x-lyanna-replica`: which LLM replica served the request (routing is visible to clients)."""
    return {"x-lyanna-replica": first.replica or ""}


def _usage(item: StreamDelta) -> Usage:
    """OpenAI's names for the engine's token counts (of `StreamDelta.combined` over the choices: the
    prompt once, every choice's completion tokens)."""
    return Usage(
        prompt_tokens=item.num_prompt_tokens,
        completion_tokens=item.num_output_tokens,
        total_tokens=item.num_prompt_tokens + item.num_output_tokens,
    )


def _spec_stats(item: StreamDelta) -> SpeculationStats:
    """The response's `speculation` extension: its names for the engine's counters."""
    return SpeculationStats(
        target_forwards=item.num_forwards,
        draft_tokens=item.num_draft_tokens,
        accepted_tokens=item.num_accepted_tokens,
        accepted_tokens_per_step=item.tokens_per_step,
    )


def _request_attributes(span: Span, req: ChatCompletionRequest | CompletionRequest, rid: str) -> None:
    """The request's fields on its ingress span (OpenTelemetry GenAI names where they exist)."""
    span.set_attribute("gen_ai.request.model", req.model)
    span.set_attribute("gen_ai.response.id", rid)
    span.set_attribute("lyanna.stream", bool(req.stream))
    limit = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
    for key, value in (
        ("gen_ai.request.max_tokens", limit or req.max_tokens),
        ("gen_ai.request.choice.count", req.n),
        ("gen_ai.request.temperature", req.temperature),
        ("gen_ai.request.top_p", req.top_p),
        ("gen_ai.request.seed", req.seed),
        ("enduser.id", req.user),
    ):
        if value is not None:
            span.set_attribute(key, value)


def _replica_failure(e: Exception, when: str) -> tuple[int, str, str]:
    """(status, code, message) for a replica call that raised: the replica process died or became
    unreachable or its engine stopped, e.g. a tensor-parallel rank died (retryable: 503), or it raised
    inside (a fault of ours: 500)."""
    if isinstance(e, RayActorError | ActorUnavailableError | EngineDeadError):
        return 503, "replica_failed", f"the model replica failed {when} ({type(e).__name__}); retry the request"
    return 500, "internal_error", f"the model replica raised {when} ({type(e).__name__})"


def _failed(e: Exception, when: str) -> JSONResponse:
    status, code, message = _replica_failure(e, when)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return error_response(status, message, code=code, headers=headers)


async def _started(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """`first` (already produced by `rest`), then the rest of `rest`, which is closed in any case."""
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """Await with a deadline; a Serve response left behind is cancelled."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except BaseException:
        cancel = getattr(awaitable, "cancel", None)
        if cancel is not None:
            cancel()
        raise


class _Timing:
    """A request's clock at the ingress (what a client sees): its start, for the end-to-end latency,
    and the gaps between deliveries of new tokens (inter-token latency)."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.tokens: dict[int, int] = {}  # per choice

    def delivered(self, item: StreamDelta) -> None:
        """A delta arrived; note the time if it carries new tokens."""
        if item.num_output_tokens <= self.tokens.get(item.index, 0):
            return
        now = time.perf_counter()
        if self.last is not None:
            self.metrics.observe_itl(now - self.last)
        self.last, self.tokens[item.index] = now, item.num_output_tokens


# The generation routes read their raw body themselves (to control limits and errors); the OpenAPI
# document spells out their bodies from the pydantic models: (request, response, stream chunk).
ROUTE_MODELS: dict[str, tuple[type[BaseModel], type[BaseModel], type[BaseModel]]] = {
    CHAT_PATH: (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
    COMPLETIONS_PATH: (CompletionRequest, CompletionResponse, CompletionChunk),
}


def _sse_event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 describes the event, as schemathesis reads it)."""
    data = f"A {chunk} as JSON, an ErrorResponse if the replica fails mid-stream, or [DONE] at the end"
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": data},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


def chat_openapi(model_name: str) -> dict[str, Any]:
    """The OpenAPI document, with the generation routes' request bodies, responses and errors spelled
    out from the pydantic models."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    ref = "#/components/schemas/{model}"
    models = [
        (m, "validation" if i == 0 else "serialization") for ms in ROUTE_MODELS.values() for i, m in enumerate(ms)
    ]
    for model, mode in [*models, (ErrorResponse, "serialization")]:
        schema = model.model_json_schema(ref_template=ref, mode=mode)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema

    def error(description: str) -> dict[str, Any]:
        content = {"application/json": {"schema": {"$ref": ref.format(model="ErrorResponse")}}}
        return {"description": description, "content": content}

    for path, (request_model, response_model, chunk_model) in ROUTE_MODELS.items():
        schemas[request_model.__name__]["properties"]["model"]["enum"] = [model_name]
        route = doc["paths"][path]["post"]
        route.pop("x-lyanna-generation", None)
        route["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": ref.format(model=request_model.__name__)}}},
        }
        route["responses"] = {
            "200": {
                "description": f"The completion (JSON), or with `stream: true` server-sent events: `data:` lines "
                f"each holding a {chunk_model.__name__} (or, if the replica fails mid-stream, an ErrorResponse), "
                "then `data: [DONE]`",
                "content": {
                    "application/json": {"schema": {"$ref": ref.format(model=response_model.__name__)}},
                    "text/event-stream": {"schema": _sse_event_schema(chunk_model.__name__)},
                },
            },
            "400": error("Not JSON, or the body breaks the schema or the model's limits"),
            "404": error("Unknown model"),
            "413": error("The body is larger than max_request_body_bytes"),
            "415": error("The body is not JSON"),
            "500": error("Internal error"),
            "503": error("Every replica is saturated, or the replica serving the request failed; see Retry-After"),
        }
    app.openapi_schema = doc
    return doc


class _Choices:
    """A request's choices as its deltas arrive (any order between choices): each choice's state
    (serve_app/choices.py), its last delta, and the response or stream chunks in the route's format."""

    def __init__(self, req: ChatCompletionRequest | CompletionRequest):
        self.chat = isinstance(req, ChatCompletionRequest)
        self.n = req.num_choices
        self.states: list[ChatChoiceState] | list[CompletionChoiceState]
        if isinstance(req, ChatCompletionRequest):
            names = {t.function.name for t in req.tools or []} if req.tools_active else None
            self.states = [ChatChoiceState(i, names, bool(req.logprobs)) for i in range(self.n)]
        else:
            self.states = [CompletionChoiceState(i, bool(req.echo), req.logprobs is not None) for i in range(self.n)]
        self.lasts: dict[int, StreamDelta] = {}

    def push(self, item: StreamDelta) -> list[Any]:
        """Take a delta; return its stream updates (chat ChunkChoices or CompletionChoices)."""
        self.lasts[item.index] = item
        update = self.states[item.index].push(item)
        return update if isinstance(update, list) else [] if update is None else [update]

    @property
    def finished(self) -> bool:
        """Whether every choice has had its last delta."""
        return len(self.lasts) == self.n and all(d.finished for d in self.lasts.values())

    def outcome(self) -> StreamDelta:
        """The request's counters over its choices (usage, metrics, logs)."""
        return StreamDelta.combined([self.lasts[i] for i in sorted(self.lasts)])

    def chunk(self, rid: str, created: int, model: str, updates: list[Any], usage: Usage | None) -> str:
        """One stream event's JSON (chat chunks leave out what is null, as OpenAI's do)."""
        if self.chat:
            return ChatCompletionChunk(
                id=rid, created=created, model=model, choices=updates, usage=usage
            ).model_dump_json(exclude_none=True)
        return CompletionChunk(id=rid, created=created, model=model, choices=updates, usage=usage).model_dump_json()

    def response(
        self, rid: str, model: str, usage: Usage, spec: SpeculationStats
    ) -> ChatCompletionResponse | CompletionResponse:
        """The whole response (after every choice's last delta)."""
        if self.chat:
            chat_choices = [s.choice() for s in self.states if isinstance(s, ChatChoiceState)]
            return ChatCompletionResponse(id=rid, model=model, choices=chat_choices, usage=usage, speculation=spec)
        text_choices = [s.choice() for s in self.states if isinstance(s, CompletionChoiceState)]
        return CompletionResponse(id=rid, model=model, choices=text_choices, usage=usage, speculation=spec)


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(app)
class Ingress:
    """Validates requests, streams from an LLM replica, answers in OpenAI's formats."""

    def __init__(
        self,
        llm: DeploymentHandle,
        served_model_name: str = "smollm2-135m-instruct",
        drafter: str = "none",
        tracing_settings: dict[str, Any] | None = None,
        slo_settings: dict[str, Any] | None = None,
        ingress_settings: dict[str, Any] | None = None,
        spec_default: SpecParams | None = None,
        spec_policy: str = "fixed",
    ):
        """`spec_default` and `spec_policy` are the replicas' engine settings (the app builds both from
        one `EngineSettings`): a request's speculation overrides are completed and checked against them."""
        # Streams come over gRPC straight from the replica (Serve's by-value transport) rather than as
        # one Ray object per delta: less CPU per token at the ingress (docs/serving.md, "Served under load").
        self.llm = llm.options(stream=True, _by_reference=False)
        self.llm_unary = llm
        self.slo = SLOSettings.model_validate(slo_settings or {})
        self.spec_default = spec_default or SpecParams()
        self.spec_policy = spec_policy
        self.settings = IngressSettings.model_validate(ingress_settings or {})
        self.tracer = tracing.make_tracer(TracingSettings.model_validate(tracing_settings or {}), "ingress")
        self.model_name = served_model_name
        self.metrics = ServeMetrics(served_model_name, drafter)
        app.state.metrics = self.metrics
        app.openapi = lambda: chat_openapi(served_model_name)
        self.created = int(time.time())

    # ---- the LLM replicas, as this process's request router sees them -----------------------------
    def _router(self) -> Any | None:
        return live_routers.router_of(self.llm_unary.app_name, self.llm_unary.deployment_name)

    async def _replica_stats(self) -> list[dict[str, Any]]:
        """The stats each running replica last reported (period: `request_routing_stats_period_s`).

        Before this process has routed anything (no router yet) one replica is asked directly, with a
        deadline, which also starts the router."""
        router = self._router()
        if router is not None:
            return [r.routing_stats for r in router.replicas() if r.routing_stats]
        try:
            return [await _within(self.llm_unary.stats.remote(), self.settings.health_timeout_s)]
        except Exception:
            return []

    async def _ready_replicas(self) -> tuple[int, str]:
        """How many replicas have loaded their model and answer now, and why none do when so."""
        timeout = self.settings.health_timeout_s
        router = self._router()
        if router is None:
            try:
                await _within(self.llm_unary.ready.remote(), timeout)
                return 1, ""
            except Exception as e:
                return 0, f"no LLM replica answered within {timeout:g} s ({type(e).__name__})"
        replicas = router.replicas()
        if not replicas:
            return 0, "no LLM replica is running (loading its model, or being replaced)"
        # Serve's queue-length probe bypasses max_ongoing_requests: a busy replica answers, a dead one fails.
        probes = [_within(r.get_queue_len(deadline_s=timeout), timeout) for r in replicas]
        answers = await asyncio.gather(*probes, return_exceptions=True)
        alive = sum(not isinstance(a, BaseException) for a in answers)
        return alive, "" if alive else f"none of {len(replicas)} LLM replicas answered within {timeout:g} s"

    # ---- endpoints ----------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "No LLM replica is ready"}})
    async def health(self) -> HealthStatus:
        """Readiness: 200 while at least one LLM replica has loaded its model and answers, else 503."""
        alive, why = await self._ready_replicas()
        if not alive:
            return error_response(503, why, code="no_ready_replica")
        return HealthStatus(ready_replicas=alive)

    @app.get("/debug/engine")
    async def engine_stats(self) -> dict[str, Any]:
        """Load summed over the running replicas, and each replica's latest report (`replicas`)."""
        replicas = await self._replica_stats()
        usage = [r["kv_cache_usage"] for r in replicas]
        return {
            "num_replicas": len(replicas),
            "num_running": sum(r["num_running"] for r in replicas),
            "num_waiting": sum(r["num_waiting"] for r in replicas),
            "kv_free_blocks": sum(r["kv_free_blocks"] for r in replicas),
            "kv_cache_usage": sum(usage) / len(usage) if usage else 0.0,
            "replicas": replicas,
        }

    @app.get("/debug/replicas")
    async def replica_counts(self) -> dict[str, int]:
        """Running replicas per deployment of this application (load tests plot them over time)."""
        app_name = serve.get_replica_context().app_name
        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[app_name].deployments
        return {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus(self) -> Response:
        """Prometheus metrics; engine gauges one series per running replica."""
        self.metrics.observe_replicas(await self._replica_stats())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _serving(self) -> tuple[bool, str]:
        """Whether some LLM replica has loaded the model: once this process's router lists a running
        replica that is enough (no probe per call); before that, one replica is asked with a deadline."""
        router = self._router()
        if router is not None and router.replicas():
            return True, ""
        alive, why = await self._ready_replicas()
        return alive > 0, why

    @app.get("/v1/models", responses={503: {"model": ErrorResponse, "description": "No LLM replica is ready"}})
    async def models(self) -> ModelList:
        """The served model, once an LLM replica has loaded it (503 with Retry-After before: a client that
        waits for this list, as load generators and OpenAI clients' health checks do, waits for the model)."""
        serving, why = await self._serving()
        if not serving:
            return _retry_later(why, "no_ready_replica")
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    @app.post(CHAT_PATH, openapi_extra={"x-lyanna-generation": True})
    async def chat_completions(self, request: Request):
        """OpenAI chat completions, streaming (SSE) or not."""
        return await self._serve(request, ChatCompletionRequest)

    @app.post(COMPLETIONS_PATH, openapi_extra={"x-lyanna-generation": True})
    async def completions(self, request: Request):
        """OpenAI (legacy) text completions, streaming (SSE) or not."""
        return await self._serve(request, CompletionRequest)

    async def _serve(self, request: Request, kind: type[ChatCompletionRequest | CompletionRequest]):
        """One generation request, counted and traced whatever its outcome."""
        operation = "chat" if kind is ChatCompletionRequest else "text_completion"
        span = self.tracer.start_span(f"{operation} {self.model_name}", kind=SpanKind.SERVER)
        span.set_attribute("gen_ai.operation.name", operation)
        timing = _Timing(self.metrics)
        try:
            response = await self._generate(request, kind, timing, span)
        except asyncio.CancelledError:
            span.end()
            raise
        except Exception as e:  # a fault of ours: still OpenAI's body, still counted
            log.exception("%s failed", operation)
            span.record_exception(e)
            response = error_response(500, f"internal error: {type(e).__name__}", code="internal_error")
        self.metrics.observe_status(response.status_code)
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 400:
            span.set_status(StatusCode.ERROR)
            log.info(
                "chat completion rejected",
                extra={"status": response.status_code, "error": bytes(response.body).decode(errors="replace")},
            )
        if not isinstance(response, StreamingResponse):
            span.end()  # a stream's span ends with the stream
        return response

    async def _read_body(self, request: Request) -> bytes | JSONResponse:
        """The body, or 415/413 without reading (much of) it."""
        media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            return error_response(415, f"the body must be JSON (content-type: application/json), got {media!r}")
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = error_response(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            return too_big
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    return too_big
        except ClientDisconnect:  # nobody is left to answer; 499 is nginx's "client closed request"
            return error_response(499, "the client closed the connection while sending the body")
        return bytes(body)

    async def _generate(
        self, request: Request, kind: type[ChatCompletionRequest | CompletionRequest], timing: _Timing, span: Span
    ):
        raw = await self._read_body(request)
        if isinstance(raw, JSONResponse):
            return raw
        try:
            req = kind.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            if first["type"] == "json_invalid":
                return error_response(400, f"request body is not valid JSON: {first['msg']}", code="invalid_json")
            param = error_param(first)
            message = f"{param}: {first['msg']}" if param else first["msg"]
            return error_response(400, message, param=param, code="invalid_request")
        if req.model != self.model_name:
            return error_response(
                404, f"model {req.model!r} does not exist; serving {self.model_name!r}", "model", "model_not_found"
            )
        rid = f"chatcmpl-{uuid.uuid4().hex}" if kind is ChatCompletionRequest else f"cmpl-{uuid.uuid4().hex}"
        try:
            chat = req.chat_request(rid, self.slo, self.spec_default, self.spec_policy)
        except InvalidRequestError as e:
            return error_response(400, e.message, e.param, e.code)
        chat = chat.with_fixed_seed()  # a resumption must draw as the first replica would have
        _request_attributes(span, req, rid)
        carrier = tracing.inject(span)
        stream = ResumableStream(
            lambda c: self.llm.generate.remote(c, carrier),
            chat,
            self.settings.max_resumptions,
            self.settings.resume_wait_s,
            self.metrics.observe_resumption,
        )
        try:
            first = await stream.start()
        except BackPressureError:  # every replica busy and its queue full: shed load, ask to retry
            return _retry_later("all replicas are saturated; retry later", "server_overloaded")
        except Exception as e:  # the replica died or failed before answering
            log.warning("replica failed before the first delta: %r", e, extra={"chat_id": rid})
            return _failed(e, "before answering")
        if isinstance(first, StreamError):  # the engine refused the request
            stream.cancel()
            param = "prompt" if first.param == "prompt_token_ids" else first.param  # the field clients send
            return error_response(first.status, first.message, param, first.code, kind=first.type)
        timing.delivered(first)
        choices = _Choices(req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(chat, choices, first, stream, include_usage, timing, span, req.user)
            # Started here, so its clean-up (cancel the replica call, end the span) runs even if the
            # client leaves before starlette iterates it.
            first_event = await anext(events)
            body = _started(first_event, events)
            return StreamingResponse(body, media_type="text/event-stream", headers=_replica_header(first))
        item = first
        try:
            while True:
                choices.push(item)
                if choices.finished:
                    break
                item = await stream.next()
                timing.delivered(item)
        except Exception as e:  # the replica died mid-request, and the request could not be resumed
            stream.cancel()
            log.warning("replica failed mid-request: %r", e, extra={"chat_id": rid})
            return _failed(e, "mid-request")
        last = choices.outcome()
        self._finished(span, chat, last, timing, stream=False, user=req.user)
        body = choices.response(rid, self.model_name, _usage(last), _spec_stats(last))
        return JSONResponse(body.model_dump(), headers=_replica_header(first))

    def _finished(
        self, span: Span, chat: ChatRequest, last: StreamDelta, timing: _Timing, stream: bool, user: str | None
    ) -> None:
        """Record a completed request (its choices' outcome, `StreamDelta.combined`): metrics (SLO
        attainment included), span attributes, one log line."""
        e2e = time.perf_counter() - timing.start
        met = self.metrics.observe_finished(last, e2e, chat.slo)
        counters = last.counters()
        fields = {"chat_id": chat.request_id, "stream": stream, "user": user} | counters
        fields |= {
            "ttft_ms": None if last.ttft_s is None else round(last.ttft_s * 1e3, 3),
            "e2e_ms": round(e2e * 1e3, 3),
            "slo_class": chat.slo_class,
            "slo_met": met,
        }
        span.set_attribute("gen_ai.response.finish_reasons", [counters["finish_reason"]])
        span.set_attribute("gen_ai.usage.input_tokens", last.num_prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", last.num_output_tokens)
        span.set_attribute("lyanna.tokens_per_step", last.tokens_per_step)
        log.info("chat completion finished", extra=fields)

    async def _sse(
        self,
        chat: ChatRequest,
        choices: _Choices,
        first: StreamDelta,
        stream: ResumableStream,
        include_usage: bool,
        timing: _Timing,
        span: Span,
        user: str | None,
    ) -> AsyncIterator[str]:
        rid = chat.request_id
        created = int(time.time())

        def event(updates: list[Any], usage: Usage | None = None) -> str:
            return f"data: {choices.chunk(rid, created, self.model_name, updates, usage)}\n\n"

        item, completed, failed = first, False, False
        try:
            if choices.chat:  # OpenAI's first chunk of each choice: its role
                yield event(
                    [ChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(chat.n)]
                )
            while True:
                for update in choices.push(item):  # one choice's update per event, as OpenAI sends them
                    yield event([update])
                if choices.finished:
                    if include_usage:
                        yield event([], _usage(choices.outcome()))
                    break
                try:
                    item = await stream.next()
                except Exception as e:  # the replica died mid-stream and it could not be resumed: say so, end
                    failed = True
                    log.warning("replica failed mid-stream: %r", e, extra={"chat_id": rid})
                    _, code, message = _replica_failure(e, "mid-stream")
                    err = ErrorDetail(message=message, type="server_error", code=code)
                    yield f"data: {ErrorResponse(error=err).model_dump_json()}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                timing.delivered(item)
            self._finished(span, chat, choices.outcome(), timing, stream=True, user=user)
            completed = True
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # a client that went away: the replica aborts the request and frees its blocks
            if not completed:  # the client went away (or the replica failed) before the last token
                reason = "replica_failed" if failed else "client_disconnected"  # or the server raised
                self.metrics.observe_stream_error(reason)
                span.set_attribute("lyanna.stream_aborted", True)
                if failed:
                    span.set_status(StatusCode.ERROR, "replica failed mid-stream")
                log.info("stream ended early; request aborted", extra={"chat_id": rid, "reason": reason})
            span.end()
