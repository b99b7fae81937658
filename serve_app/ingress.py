"""The ingress deployment: FastAPI speaking OpenAI's chat-completions API in front of LLM replicas.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at runtime.)
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Span, SpanKind, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from engines.errors import InvalidRequestError
from policies.slo import SLOSettings, SLOTarget
from serve_app import tracing
from serve_app.metrics import ServeMetrics
from serve_app.schemas import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChunkChoice,
    DeltaMessage,
    SpeculationStats,
    Usage,
)
from serve_app.tracing import TracingSettings

# A child of Ray Serve's logger: with `logging_config.encoding: JSON` its lines carry Serve's request_id
# and the `extra` fields as JSON keys.
log = logging.getLogger("ray.serve.lyanna.ingress")
app = FastAPI(title="lyanna-serve")
RETRY_AFTER_S = 1  # seconds a shed client should wait (Retry-After)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body with an HTTP status."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "server_overloaded"}.get(status, "error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _replica_header(first: dict[str, Any]) -> dict[str, str]:
    """`x-lyanna-replica`: which LLM replica served the request (routing is visible to clients)."""
    return {"x-lyanna-replica": str(first.get("replica", ""))}


def _usage(item: dict[str, Any]) -> Usage:
    return Usage(
        prompt_tokens=item["prompt_tokens"],
        completion_tokens=item["completion_tokens"],
        total_tokens=item["prompt_tokens"] + item["completion_tokens"],
    )


def _spec_stats(item: dict[str, Any]) -> SpeculationStats:
    return SpeculationStats(
        target_forwards=item["target_forwards"],
        draft_tokens=item["draft_tokens"],
        accepted_tokens=item["accepted_tokens"],
        accepted_tokens_per_step=item["tokens_per_step"],
    )


def _request_attributes(span: Span, req: ChatCompletionRequest, rid: str) -> None:
    """The request's fields on its ingress span (OpenTelemetry GenAI names where they exist)."""
    span.set_attribute("gen_ai.request.model", req.model)
    span.set_attribute("gen_ai.response.id", rid)
    span.set_attribute("lyanna.stream", bool(req.stream))
    for key, value in (
        ("gen_ai.request.max_tokens", req.max_completion_tokens or req.max_tokens),
        ("gen_ai.request.temperature", req.temperature),
        ("gen_ai.request.top_p", req.top_p),
        ("gen_ai.request.seed", req.seed),
    ):
        if value is not None:
            span.set_attribute(key, value)


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
    ):
        self.llm = llm.options(stream=True)
        self.slo = SLOSettings.model_validate(slo_settings or {})
        self.tracer = tracing.make_tracer(TracingSettings.model_validate(tracing_settings or {}), "ingress")
        self.llm_unary = llm
        self.model_name = served_model_name
        self.metrics = ServeMetrics(served_model_name, drafter)
        self.created = int(time.time())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 once the replicas are up (Ray Serve only routes to replicas that passed their checks)."""
        return JSONResponse({"status": "ok"})

    @app.get("/debug/engine")
    async def engine_stats(self) -> dict[str, Any]:
        """One replica's load: running and waiting requests, free KV blocks."""
        return await self.llm_unary.stats.remote()

    @app.get("/debug/replicas")
    async def replica_counts(self) -> dict[str, int]:
        """Running replicas per deployment of this application (load tests plot them over time)."""
        app_name = serve.get_replica_context().app_name
        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[app_name].deployments
        return {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        """Prometheus metrics (engine gauges refreshed from one replica)."""
        self.metrics.observe_engine(await self.llm_unary.stats.remote())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The served model."""
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lyanna-serve"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions, streaming (SSE) or not."""
        start = time.perf_counter()
        span = self.tracer.start_span(f"chat {self.model_name}", kind=SpanKind.SERVER)
        span.set_attribute("gen_ai.operation.name", "chat")
        try:
            response = await self._chat(request, start, span)
        except BaseException as e:
            span.record_exception(e)
            span.end()
            raise
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

    async def _chat(self, request: Request, start: float, span: Span):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return error_response(400, f"request body is not valid JSON: {e}")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            return error_response(400, f"{param}: {first['msg']}", param=param, code="invalid_request")
        if req.model != self.model_name:
            return error_response(404, f"model {req.model!r} does not exist; serving {self.model_name!r}", "model")
        try:
            target = req.slo_target(self.slo)
        except InvalidRequestError as e:
            return error_response(400, e.message, e.param, e.code)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        _request_attributes(span, req, rid)
        stream = self.llm.generate.remote(body, rid, tracing.inject(span))
        try:
            first = await anext(stream)
        except BackPressureError:  # every replica busy and its queue full: shed load, ask to retry
            response = error_response(503, "all replicas are saturated; retry later", code="server_overloaded")
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        if "error" in first:
            stream.cancel()
            err = first["error"]
            return error_response(first["status"], err["message"], err["param"], err["code"])
        first_time = time.perf_counter() if first["completion_tokens"] else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._sse(rid, first, stream, include_usage, start, first_time, span, target)
            return StreamingResponse(events, media_type="text/event-stream", headers=_replica_header(first))
        text, last = first["text"], first
        async for item in stream:
            if first_time is None and item["completion_tokens"]:
                first_time = time.perf_counter()
            text += item["text"]
            last = item
        self._finished(span, rid, last, start, first_time, target, stream=False)
        body = ChatCompletionResponse(
            id=rid,
            model=self.model_name,
            choices=[Choice(message=AssistantMessage(content=text), finish_reason=last["finish_reason"])],
            usage=_usage(last),
            speculation=_spec_stats(last),
        )
        return JSONResponse(body.model_dump(), headers=_replica_header(first))

    def _finished(
        self,
        span: Span,
        rid: str,
        last: dict[str, Any],
        start: float,
        first_time: float | None,
        target: SLOTarget,
        stream: bool,
    ) -> None:
        """Record a completed request: metrics (SLO attainment included), span attributes, one log line."""
        end = time.perf_counter()
        met = self.metrics.observe_finished(last, start, first_time, end, target)
        stats = _spec_stats(last)
        fields = {
            "chat_id": rid,
            "stream": stream,
            "finish_reason": last["finish_reason"],
            "prompt_tokens": last["prompt_tokens"],
            "completion_tokens": last["completion_tokens"],
            "accepted_tokens_per_step": round(stats.accepted_tokens_per_step, 3),
            "ttft_ms": round((first_time - start) * 1e3, 3) if first_time is not None else None,
            "e2e_ms": round((end - start) * 1e3, 3),
            "slo_class": target.slo_class,
            "slo_met": met,
        }
        span.set_attribute("gen_ai.response.finish_reasons", [last["finish_reason"]])
        span.set_attribute("gen_ai.usage.input_tokens", last["prompt_tokens"])
        span.set_attribute("gen_ai.usage.output_tokens", last["completion_tokens"])
        span.set_attribute("lyanna.accepted_tokens_per_step", stats.accepted_tokens_per_step)
        log.info("chat completion finished", extra=fields)

    async def _sse(
        self,
        rid: str,
        first: dict[str, Any],
        stream,
        include_usage: bool,
        start: float,
        first_time: float | None,
        span: Span,
        target: SLOTarget,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            chunk = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        item, completed = first, False
        try:
            yield event([ChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
            while True:
                if item["text"]:
                    yield event([ChunkChoice(delta=DeltaMessage(content=item["text"]))])
                if item["finish_reason"] is not None:
                    yield event([ChunkChoice(delta=DeltaMessage(), finish_reason=item["finish_reason"])])
                    if include_usage:
                        yield event([], _usage(item))
                    break
                item = await anext(stream)
                if first_time is None and item["completion_tokens"]:
                    first_time = time.perf_counter()
            self._finished(span, rid, item, start, first_time, target, stream=True)
            completed = True
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # a client that went away: the replica aborts the request and frees its blocks
            if not completed:  # the client went away (or the replica failed) before the last token
                span.set_attribute("lyanna.stream_aborted", True)
                log.info("stream ended early; request aborted", extra={"chat_id": rid})
            span.end()
