"""The LLM replica deployment: one engine (target + drafter) with its continuous-batching loop.

The loop runs in a background thread (`AsyncEngine`); `generate` is a streaming method the ingress
calls through a DeploymentHandle. Its first item is either an error (a dict with `error` and
`status`, for bad requests) or the request's first delta, so the ingress can answer with the right
status before it starts a stream. Cancelling the call (a client that went away) aborts the request
in the engine and frees its KV blocks.

The replica reports its load to the request router (`record_routing_stats`) and its SLO attainment
to the autoscaler (`record_autoscaling_stats`); see policies/routing.py and policies/autoscaling.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode
from pydantic import BaseModel, ConfigDict, ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException

from engines.async_engine import AsyncEngine
from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import RequestOutput
from engines.spec_params import SpecParams
from policies.slo import SLOSettings, SLOTarget, SLOTracker
from serve_app import tracing
from serve_app.schemas import ChatCompletionRequest, error_param
from serve_app.tracing import TracingSettings

# A child of Ray Serve's logger: with `logging_config.encoding: JSON` its lines carry Serve's request_id
# and this module's `extra` fields as JSON keys.
log = logging.getLogger("ray.serve.lyanna.replica")


class EngineSettings(BaseModel):
    """Engine settings as application arguments (serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    served_model_name: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    device: str = "cpu"
    tensor_parallel_size: int = 1  # ranks per replica: the replica reserves one bundle per rank (build_app)
    cpus_per_rank: float = 1.0  # CPUs each rank's bundle reserves (its threads); a GPU too on cuda
    drafter: str = "lyanna"
    draft_model: str | None = None
    num_kv_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int | None = None  # prompt tokens per step while others decode (None: 256 CPU, 2048 GPU)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype, fp32 on CPUs without bf16 arithmetic
    max_model_len: int | None = None
    spec_depth: int = SpecParams.depth
    spec_width: int = SpecParams.width
    spec_budget: int = SpecParams.budget
    spec_policy: Literal["fixed", "adaptive"] = "fixed"  # adaptive: the spec_* values are caps
    # Hot paths: Triton kernels on CUDA and PyTorch on CPU ("auto"), or forced ("triton", "torch")
    kernels: Literal["auto", "triton", "torch"] = "auto"
    # Target weights: auto = the GGUF's own int4 blocks for the embedded model in bf16 on CPU, else none
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = "auto"
    enforce_eager: bool = False  # the target's eager layers at every step (no fused CPU decoder)
    # The drafter's layer (Lyanna, EAGLE): auto = int8 in one call where the target runs its fused decoder; none = eager
    draft_quantization: Literal["auto", "none"] = "auto"

    def placement_bundles(self) -> list[dict[str, float]]:
        """One resource bundle per tensor-parallel rank: the replica runs in the first, its ranks 1..N-1
        in the others (packed on one node)."""
        bundle = {"CPU": self.cpus_per_rank} | ({"GPU": 1.0} if self.device.startswith("cuda") else {})
        return [dict(bundle) for _ in range(self.tensor_parallel_size)]

    def engine_config(self) -> EngineConfig:
        """The engine's own config."""
        spec = SpecParams(depth=self.spec_depth, width=self.spec_width, budget=self.spec_budget)
        fields = self.model_dump(
            exclude={"served_model_name", "spec_depth", "spec_width", "spec_budget", "cpus_per_rank"}
        )
        return EngineConfig(**fields, spec=spec)


def stream_item(out: RequestOutput) -> dict[str, Any]:
    """One engine delta as the stream item the ingress reads."""
    return {
        "text": out.new_text,
        "finish_reason": out.finish_reason.value if out.finish_reason else None,
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "target_forwards": out.num_forwards,
        "draft_tokens": out.num_draft_tokens,
        "accepted_tokens": out.num_accepted_tokens,
        "spec_steps": out.num_spec_steps,
        "tokens_per_step": out.tokens_per_step,
        "preemptions": out.num_preemptions,
        "queue_s": (
            None if out.first_scheduled_time is None else max(0.0, out.first_scheduled_time - out.arrival_time)
        ),
    }


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # outside a Serve replica
        return "local"


def _ms(begin: float | None, end: float | None) -> float | None:
    return None if begin is None or end is None else round((end - begin) * 1e3, 3)


def error_item(err: InvalidRequestError) -> dict[str, Any]:
    """A bad request as the stream's first item (OpenAI's error object plus the HTTP status)."""
    status = 400
    kind = "invalid_request_error"
    return {
        "status": status,
        "error": {"message": err.message, "type": kind, "param": err.param, "code": err.code},
    }


# Serve's default of 5 ongoing requests would starve continuous batching: the engine batches what it
# is given. serve_config.yaml sets the same values; keep them in step with `max_num_seqs`. The request
# router is ours by default (serve_config.yaml may set its kwargs): the ingress reads the replicas'
# reported stats through it, every `request_routing_stats_period_s`.
@serve.deployment(
    name="LLMReplica",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=32,
    max_queued_requests=64,
    request_router_config=RequestRouterConfig(
        request_router_class="policies.routing:LoadAwareRouter", request_routing_stats_period_s=1
    ),
)
class LLMReplica:
    """Hosts one engine; streams deltas for chat requests."""

    def __init__(
        self,
        settings: dict[str, Any] | None = None,
        tracing_settings: dict[str, Any] | None = None,
        slo_settings: dict[str, Any] | None = None,
    ):
        self.settings = EngineSettings.model_validate(settings or {})
        self.slo = SLOSettings.model_validate(slo_settings or {})
        self.slo_tracker = SLOTracker()
        self.tracer = tracing.make_tracer(TracingSettings.model_validate(tracing_settings or {}), "replica")
        self.engine = LLMEngine(self.settings.engine_config())
        self.async_engine = AsyncEngine(self.engine)
        self.replica_id = _replica_id()

    async def generate(
        self, body: dict[str, Any], request_id: str, trace_context: dict[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Deltas of one chat completion: {text, token_ids, finish_reason, usage, speculation}; the
        first also names the replica.

        `trace_context` is the ingress span's W3C carrier; this request's spans become its children.
        """
        start = time.monotonic()
        span = self.tracer.start_span("generate", context=tracing.extract(trace_context))
        last: RequestOutput | None = None
        error: str | None = None
        target = SLOTarget()
        try:
            try:
                req = ChatCompletionRequest.model_validate(body)
                params = req.sampling_params(self.engine.model_config.vocab_size)
                spec = req.spec_params(self.engine.config.spec, self.settings.spec_policy)
                target = req.slo_target(self.slo)
                stream = self.async_engine.generate(
                    req.conversation(), params, request_id, spec=spec, tpot_target_s=target.tpot_s
                )
                last = await anext(stream)
            except ValidationError as e:  # a caller other than our ingress (which validated already)
                first = e.errors(include_url=False)[0]
                param = error_param(first)
                err = InvalidRequestError(f"{param}: {first['msg']}" if param else first["msg"], param=param)
                error = err.message
                yield error_item(err)
                return
            except InvalidRequestError as e:
                error = e.message
                yield error_item(e)
                return
            yield stream_item(last) | {"replica": self.replica_id}  # the first item names the replica
            while not last.finished:
                last = await anext(stream)
                yield stream_item(last)
        finally:
            self._record(span, request_id, start, last, error, target)

    def _record(
        self,
        span: Span,
        request_id: str,
        start: float,
        last: RequestOutput | None,
        error: str | None,
        target: SLOTarget,
    ) -> None:
        """End the request's span with its queue/prefill/decode children; log one line for it; count
        a finished request with targets toward SLO attainment."""
        end = time.monotonic()
        if error is not None:
            span.set_status(StatusCode.ERROR, error)
            span.end()
            log.info("request rejected: %s", error, extra={"chat_id": request_id})
            return
        ctx = trace.set_span_in_context(span)
        epoch_ns = tracing.epoch_clock()
        arrival = last.arrival_time if last else start
        scheduled = last.first_scheduled_time if last else None
        first_token = last.first_token_time if last else None
        phases = (("queue", arrival, scheduled), ("prefill", scheduled, first_token), ("decode", first_token, end))
        for name, begin, stop in phases:
            if begin is None:
                break
            child = self.tracer.start_span(name, context=ctx, start_time=epoch_ns(begin))
            if name == "prefill" and last is not None:
                child.set_attribute("gen_ai.usage.input_tokens", last.num_prompt_tokens)
            if name == "decode" and last is not None:
                child.set_attribute("gen_ai.usage.output_tokens", last.num_output_tokens)
            child.end(end_time=epoch_ns(stop if stop is not None else end))
            if stop is None:
                break
        fields: dict[str, Any] = {"chat_id": request_id, "aborted": last is None or not last.finished}
        if last is not None:
            fields |= {
                "finish_reason": last.finish_reason.value if last.finish_reason else None,
                "prompt_tokens": last.num_prompt_tokens,
                "completion_tokens": last.num_output_tokens,
                "target_forwards": last.num_forwards,
                "draft_tokens": last.num_draft_tokens,
                "accepted_tokens": last.num_accepted_tokens,
                "accepted_tokens_per_step": last.tokens_per_step,
                "preemptions": last.num_preemptions,
                "queue_ms": _ms(arrival, scheduled),
                "prefill_ms": _ms(scheduled, first_token),
                "decode_ms": _ms(first_token, end),
            }
            if last.finished and target.has_target:
                ttft = None if first_token is None else first_token - arrival
                tokens = last.num_output_tokens
                tpot = (end - first_token) / (tokens - 1) if first_token is not None and tokens > 1 else None
                met = target.met(ttft, tpot)
                self.slo_tracker.record(end, met)
                fields |= {"slo_class": target.slo_class, "slo_met": met}
        for key, value in fields.items():
            if value is not None:
                span.set_attribute(f"lyanna.{key}", value)
        span.end()
        log.info("request %s", "aborted" if fields["aborted"] else "finished", extra=fields)

    def stats(self) -> dict[str, Any]:
        """Engine load (running/waiting requests, KV blocks), SLO attainment and the speculation
        policy's latest decisions and predictions (metrics, tests and debugging)."""
        s = self.engine.stats()
        now = time.monotonic()
        return {
            "replica": self.replica_id,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_free_blocks": s.kv_free_blocks,
            "kv_cache_usage": s.kv_cache_usage,
            "num_forwards": s.num_forwards,
            "busy_seconds": s.busy_seconds,
            "slo_attainment": self.slo_tracker.attainment(now),
            "slo_requests": self.slo_tracker.count(now),
            "spec_policy": self.engine.policy.name,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "tensor_parallel_group": None if self.engine.workers is None else self.engine.workers.group_id,
            "policy": self.engine.policy.stats(),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Load for the request router (policies/routing.py), polled every `request_routing_stats_period_s`
        by Serve; the same snapshot as `stats`, which the ingress exports per replica on /metrics."""
        return self.stats()

    def ready(self) -> bool:
        """True once the model is loaded and the engine loop runs (the constructor loads the model)."""
        self.check_health()
        return True

    def record_autoscaling_stats(self) -> dict[str, float]:
        """SLO attainment over the last window for the autoscaling policy (policies/autoscaling.py)."""
        now = time.monotonic()
        attainment = self.slo_tracker.attainment(now)
        return {
            "slo_attainment": 1.0 if attainment is None else attainment,
            "slo_requests": float(self.slo_tracker.count(now)),
        }

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop and every tensor-parallel rank must be alive."""
        if not self.async_engine.is_running:
            raise RuntimeError("engine loop is not running")
        self.engine.check_health()

    def __del__(self) -> None:
        """Serve stops the replica: stop the loop, then the tensor-parallel ranks."""
        async_engine = getattr(self, "async_engine", None)
        if async_engine is not None:
            async_engine.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
