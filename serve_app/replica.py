"""The LLM replica deployment: one engine (target + drafter) with its continuous-batching loop.

The loop runs in a background thread (`AsyncEngine`); `generate` is a streaming method the ingress
calls through a DeploymentHandle with a `ChatRequest` it has validated (serve_app/messages.py). Its
first item is either a `StreamError` (a request the engine refused) or the request's first
`StreamDelta`, so the ingress can answer with the right status before it starts a stream. Cancelling
the call (a client that went away) aborts the request in the engine and frees its KV blocks.

The replica reports its load to the request router (`record_routing_stats`) and its SLO attainment
to the autoscaler (`record_autoscaling_stats`); see policies/routing.py and policies/autoscaling.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode
from pydantic import Field
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException

from engines.async_engine import AsyncEngine
from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import FinishReason, RequestOutput, TokenLogprob
from engines.tokenizer import Tokenizer
from policies.prefix_affinity import HeldPrefixes, remember_served, request_messages
from policies.slo import SLOTracker
from serve_app import tracing
from serve_app.messages import ChatRequest, LogprobEntry, StreamDelta, StreamError, StreamItem
from serve_app.tracing import TracingSettings

# A child of Ray Serve's logger: with `logging_config.encoding: JSON` its lines carry Serve's request_id
# and this module's `extra` fields as JSON keys.
log = logging.getLogger("ray.serve.lyanna.replica")


class EngineSettings(EngineConfig):
    """The replica's `engine:` block in serve_config.yaml: the engine's settings plus the replica's own."""

    served_model_name: str = Field("smollm2-135m-instruct", description="The model name clients send and see")
    cpus_per_rank: float = Field(
        1.0, gt=0, description="CPUs each tensor-parallel rank's bundle reserves (its threads); a GPU too on cuda"
    )

    def placement_bundles(self) -> list[dict[str, float]]:
        """One resource bundle per tensor-parallel rank: the replica runs in the first, its ranks 1..N-1
        in the others (packed on one node)."""
        bundle = {"CPU": self.cpus_per_rank} | ({"GPU": 1.0} if self.device.startswith("cuda") else {})
        return [dict(bundle) for _ in range(self.tensor_parallel_size)]

    def engine_config(self) -> EngineConfig:
        """The engine's own config: these settings less the replica's own."""
        return EngineConfig(**self.model_dump(exclude={"served_model_name", "cpus_per_rank"}))


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # outside a Serve replica
        return "local"


def entry(tokenizer: Tokenizer, lp: TokenLogprob) -> LogprobEntry:
    """A token's log-probability with its text and bytes (and its position's most likely tokens)."""

    def one(token_id: int, logprob: float | None) -> LogprobEntry:
        raw = tokenizer.token_bytes(token_id)
        return LogprobEntry(token_id, raw.decode(errors="replace"), raw, logprob)

    top = tuple(one(t, p) for t, p in lp.top)
    return dataclasses.replace(one(lp.token_id, lp.logprob), top=top)


def logprob_entries(tokenizer: Tokenizer, items: list[TokenLogprob]) -> tuple[LogprobEntry, ...]:
    """The engine's log-probabilities as clients see tokens."""
    return tuple(entry(tokenizer, lp) for lp in items)


def prompt_entries(tokenizer: Tokenizer, ids: list[int], scored: list[TokenLogprob | None]) -> tuple[LogprobEntry, ...]:
    """A prompt's tokens with their log-probabilities (`scored`, aligned with `ids`, from the engine's
    first delta); the first token, which nothing predicts, has none."""
    out = []
    for k, token_id in enumerate(ids):
        lp = scored[k] if 0 < k < len(scored) else None
        if lp is None:
            raw = tokenizer.token_bytes(token_id)
            out.append(LogprobEntry(token_id, raw.decode(errors="replace"), raw, None))
        else:
            out.append(entry(tokenizer, lp))
    return tuple(out)


def _ms(begin: float | None, end: float | None) -> float | None:
    return None if begin is None or end is None else round((end - begin) * 1e3, 3)


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

    def __init__(self, settings: dict[str, Any] | None = None, tracing_settings: dict[str, Any] | None = None):
        self.settings = EngineSettings.model_validate(settings or {})
        self.slo_tracker = SLOTracker()
        self.tracer = tracing.make_tracer(TracingSettings.model_validate(tracing_settings or {}), "replica")
        config = self.settings.engine_config()
        # built in the loop thread that steps it: one OpenMP thread team in the process (async_engine.py)
        self.async_engine = AsyncEngine(lambda: LLMEngine(config))
        self.engine = self.async_engine.engine
        self.replica_id = _replica_id()
        self.held_prefixes = HeldPrefixes()  # conversation prefixes it served, for the router's affinity

    async def generate(
        self, request: ChatRequest, trace_context: dict[str, str] | None = None
    ) -> AsyncIterator[StreamItem]:
        """The deltas of one chat or text completion (the first names the replica), or one `StreamError`
        when the engine refuses the request. `request` was validated by the ingress and goes to the
        engine as it is; any other object is a caller's bug: TypeError, before anything is queued.

        With `n` > 1 the request fans out into `n` engine requests (`ChatRequest.generations`), admitted
        together so they share the prompt's KV blocks; their deltas interleave, each naming its choice
        (`index`). Closing the stream aborts every choice still running.

        `trace_context` is the ingress span's W3C carrier; this request's spans become its children.
        """
        if not isinstance(request, ChatRequest):
            raise TypeError(
                f"LLMReplica.generate takes a serve_app.messages.ChatRequest (ChatCompletionRequest.chat_request "
                f"builds one), got {type(request).__name__}"
            )
        start = time.monotonic()
        span = self.tracer.start_span("generate", context=tracing.extract(trace_context))
        lasts: dict[int, StreamDelta] = {}
        error: str | None = None
        choices = request.choices()  # (all of them, or the unfinished ones of a resumed request)
        streams = [self.async_engine.generate(g) for _, g in choices]
        # stream i's next delta is pending[future] == i; the first ones are awaited together
        pending: dict[asyncio.Future[RequestOutput], int] = {
            asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)
        }
        try:
            await asyncio.wait(pending)
            firsts = [(i, f.exception()) for f, i in pending.items()]
            refused = next((e for _, e in firsts if isinstance(e, InvalidRequestError)), None)
            if refused is not None:  # what only the engine checks: the prompt's length in tokens, a grammar
                error = refused.message
                yield StreamError.of(refused)
                return
            ready, pending = sorted((i, f.result()) for f, i in pending.items()), {}
            for i, out in ready:
                replica = self.replica_id if i == 0 else None
                lasts[i] = self._delta(request, choices[i][0], out, first=True, replica=replica)
                yield lasts[i]
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    i = pending.pop(future)
                    out = future.result()
                    lasts[i] = self._delta(request, choices[i][0], out)
                    yield lasts[i]
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(streams[i]))] = i
        finally:
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # a choice still running is aborted and frees its blocks
            last = StreamDelta.combined([lasts[i] for i in sorted(lasts)]) if len(lasts) == len(choices) else None
            self._record(span, request, start, last, error)
            self._remember_prefix(request)

    def _delta(
        self, request: ChatRequest, index: int, out: RequestOutput, first: bool = False, replica: str | None = None
    ) -> StreamDelta:
        """The stream item of choice `index`'s engine delta: log-probabilities as token text, and on the
        first delta of an echoed completion the prompt's text (and tokens' log-probabilities)."""
        tokenizer = self.engine.tokenizer
        logprobs = None
        if out.logprobs is not None:
            items = out.logprobs
            # the token that ended the turn has no text: it is not listed (usage still counts it)
            if items and out.finish_reason is FinishReason.STOP and out.new_token_ids[-1] in tokenizer.stop_token_ids:
                items = items[:-1]
            logprobs = logprob_entries(tokenizer, items)
        prompt_text = prompt_logprobs = None
        if first and request.echo:
            gen = request.generation
            ids = gen.prompt_token_ids if gen.prompt is None else tokenizer.encode_prompt(gen.prompt)
            prompt_text = gen.prompt if gen.prompt is not None else tokenizer.decode(ids or [])
            if gen.params.prompt_logprobs is not None:
                prompt_logprobs = prompt_entries(tokenizer, ids or [], out.prompt_logprobs or [])
        return StreamDelta.of(
            out, replica, index, logprobs=logprobs, prompt_text=prompt_text, prompt_logprobs=prompt_logprobs
        )

    def _record(
        self, span: Span, request: ChatRequest, start: float, last: StreamDelta | None, error: str | None
    ) -> None:
        """End the request's span with its queue/prefill/decode children; log one line for it; count
        a finished request with targets toward SLO attainment."""
        if error is not None:
            span.set_status(StatusCode.ERROR, error)
            span.end()
            log.info("request rejected: %s", error, extra={"chat_id": request.request_id})
            return
        item = last
        end = time.monotonic() if item is None or item.finish_time is None else item.finish_time
        ctx = trace.set_span_in_context(span)
        epoch_ns = tracing.epoch_clock()
        arrival = item.arrival_time if item else start
        scheduled = item.first_scheduled_time if item else None
        first_token = item.first_token_time if item else None
        phases = (("queue", arrival, scheduled), ("prefill", scheduled, first_token), ("decode", first_token, end))
        for name, begin, stop in phases:
            if begin is None:
                break
            child = self.tracer.start_span(name, context=ctx, start_time=epoch_ns(begin))
            if name == "prefill" and item is not None:
                child.set_attribute("gen_ai.usage.input_tokens", item.num_prompt_tokens)
            if name == "decode" and item is not None:
                child.set_attribute("gen_ai.usage.output_tokens", item.num_output_tokens)
            child.end(end_time=epoch_ns(stop if stop is not None else end))
            if stop is None:
                break
        fields: dict[str, Any] = {"chat_id": request.request_id, "aborted": item is None or not item.finished}
        if item is not None:
            fields |= item.counters() | {
                "queue_ms": _ms(arrival, scheduled),
                "prefill_ms": _ms(scheduled, first_token),
                "decode_ms": _ms(first_token, end),
            }
            met = item.slo_met(request.slo)
            if met is not None:
                self.slo_tracker.record(end, met)
                fields |= {"slo_class": request.slo_class, "slo_met": met}
        for key, value in fields.items():
            if value is not None:
                span.set_attribute(f"lyanna.{key}", value)
        span.end()
        log.info("request %s", "aborted" if fields["aborted"] else "finished", extra=fields)

    def _remember_prefix(self, request: ChatRequest) -> None:
        """Record the conversation prefixes the request left in the prefix cache (its prompt; with the
        answer of its first choice, a chat's next turn), which `stats` reports to the router."""
        finished = [self.engine.pop_finished_prefix(g.request_id) for g in request.generations()]
        first = finished[0]
        if first is not None:
            answer = first.output_text if request.messages else None
            anchors = (first.prompt_anchor, first.full_anchor)
            remember_served(self.held_prefixes, request_messages(request), answer, anchors)

    def stats(self) -> dict[str, Any]:
        """Engine load (running/waiting requests, KV blocks), SLO attainment and the speculation
        policy's latest decisions and predictions (metrics, tests and debugging)."""
        s = self.engine.stats()
        now = time.monotonic()
        return {
            "replica": self.replica_id,
            "threads": torch.get_num_threads(),  # the engine's CPU threads (Ray caps them at num_cpus by default)
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_free_blocks": s.kv_free_blocks,
            "kv_cache_usage": s.kv_cache_usage,
            "num_forwards": s.num_forwards,
            "busy_seconds": s.busy_seconds,
            "slo_attainment": self.slo_tracker.attainment(now),
            "slo_requests": self.slo_tracker.count(now),
            "spec_policy": s.spec_policy,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "tensor_parallel_group": None if self.engine.workers is None else self.engine.workers.group_id,
            "policy": s.policy,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "prefix_cache_blocks": s.prefix_cache_blocks,
            # keys of the conversation prefixes whose KV it holds (policies/prefix_affinity.py)
            "prefix_keys": self.held_prefixes.report(self.engine.kv_cache.is_cached),
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
