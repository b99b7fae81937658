"""The typed messages between ingress and replica: one name per counter, one SLO decision on the
engine's clock for the replica's tracker and the ingress's metrics, and a wrong object refused."""

from __future__ import annotations

import asyncio
import time

import pytest

from engines.request import FinishReason, GenerationRequest, RequestOutput
from policies.slo import SLOTarget, SLOTracker
from serve_app import tracing
from serve_app.messages import ChatRequest, StreamDelta, StreamError
from serve_app.metrics import ServeMetrics
from serve_app.replica import LLMReplica
from serve_app.tracing import TracingSettings


def output(finished: bool, tokens: int = 10, first_token: float = 100.5, finish: float = 101.4) -> RequestOutput:
    """An engine delta: arrival at 100.0 s, first step at 100.1 s (the engine's monotonic clock)."""
    return RequestOutput(
        request_id="chatcmpl-1",
        new_token_ids=[5, 6],
        new_text="hi",
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        num_prompt_tokens=7,
        num_output_tokens=tokens,
        num_forwards=6,
        arrival_time=100.0,
        first_token_time=first_token,
        first_scheduled_time=100.1,
        num_spec_steps=4,
        num_draft_tokens=12,
        num_accepted_tokens=5,
        num_preemptions=1,
        output_time=finish,
    )


def test_a_stream_item_keeps_the_engines_names_and_clock():
    item = StreamDelta.of(output(finished=True), replica="r1")
    assert item.counters() == {
        "finish_reason": "length",
        "num_prompt_tokens": 7,
        "num_output_tokens": 10,
        "num_forwards": 6,
        "num_spec_steps": 4,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 5,
        "tokens_per_step": (5 + 4) / 4,
        "num_preemptions": 1,
    }
    assert item.finished and item.replica == "r1" and item.finish_time == 101.4
    assert item.queue_s == pytest.approx(0.1) and item.ttft_s == pytest.approx(0.5)
    assert item.tpot_s == pytest.approx(0.9 / 9)
    running = StreamDelta.of(output(finished=False))
    assert not running.finished and running.finish_time is None and running.tpot_s is None
    assert running.slo_met(SLOTarget(None, 1.0, 0.1)) is None  # decided only at the end


@pytest.mark.parametrize(
    ("target", "first_token", "finish", "met"),
    [
        (SLOTarget("interactive", 1.0, 0.1), 100.5, 101.3, True),
        (SLOTarget("interactive", 1.0, 0.1), 100.5, 101.5, False),  # TPOT 0.111 s
        (SLOTarget("batch", 0.4, None), 100.5, 101.4, False),  # TTFT 0.5 s
        (SLOTarget(), 100.5, 101.4, None),  # no target: not counted
    ],
)
def test_the_replica_tracker_and_the_ingress_metrics_decide_alike(target, first_token, finish, met):
    """The replica records the last delta in its tracker (autoscaling); the ingress counts the same
    delta in lyanna_slo_requests_total; both read `StreamDelta.slo_met` on the engine's timestamps."""
    out = output(finished=True, first_token=first_token, finish=finish)
    replica = object.__new__(LLMReplica.func_or_class)  # its _record alone: no engine needed
    replica.tracer = tracing.make_tracer(TracingSettings(), "test")
    replica.slo_tracker = SLOTracker(window_s=1e9)
    chat = ChatRequest(GenerationRequest(request_id="chatcmpl-1"), target)
    replica._record(replica.tracer.start_span("generate"), chat, time.monotonic(), StreamDelta.of(out), None)
    metrics = ServeMetrics("m", "none")
    assert metrics.observe_finished(StreamDelta.of(out), e2e_s=2.0, target=target) is met
    counted = metrics.registry.get_sample_value(
        "lyanna_slo_requests_total",
        {"model": "m", "drafter": "none", "slo_class": target.slo_class or "custom", "met": str(met).lower()},
    )
    if met is None:
        assert replica.slo_tracker.count(finish) == 0 and counted is None
    else:
        assert replica.slo_tracker.attainment(finish) == float(met) and counted == 1.0
    ttft = metrics.registry.get_sample_value("lyanna_ttft_seconds_sum", {"model": "m", "drafter": "none"})
    assert ttft == pytest.approx(first_token - 100.0)  # the histogram reads the same clock


def test_the_replica_refuses_anything_but_a_chat_request():
    """A caller of the handle that sends a raw body gets a clear TypeError before anything is queued."""
    replica = object.__new__(LLMReplica.func_or_class)  # the check runs before the engine is touched
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(TypeError, match=r"takes a serve_app\.messages\.ChatRequest .* got dict"):
        asyncio.run(anext(replica.generate(body)))


def test_an_engine_refusal_is_openais_error_fields():
    from engines.errors import ContextLengthError

    err = StreamError.of(ContextLengthError("too long"))
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    )
