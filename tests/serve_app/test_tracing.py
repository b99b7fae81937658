"""Request traces: the ingress span and the replica's queue/prefill/decode children form one tree.

Ray Serve's local testing mode runs the ingress and the LLM replica (the real engine and drafter) in
this process, so one in-memory exporter sees both components' spans; the context still crosses the
ingress -> replica call as a W3C carrier, as it does between processes.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.requests import Request

from serve_app import tracing
from serve_app.app import build_app
from serve_app.tracing import TracingSettings

MODEL = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exporter():
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another global tracer provider was installed first"
    return exp


@pytest.fixture(scope="module")
def ingress(exporter):
    from ray import serve

    app = build_app({"engine": {"dtype": "float32", "num_kv_blocks": 64}, "tracing": {"exporter": "global"}})
    yield serve.run(app, name="traced", _local_testing_mode=True)
    serve.shutdown()


def chat_request(**fields) -> Request:
    """A starlette request for /v1/chat/completions, as the HTTP proxy would hand it over."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    return Request(scope, receive)


def spans_of_trace(exporter, root_name: str):
    """The finished spans of the newest trace whose root is `root_name`, by name; checks the tree."""
    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.name == root_name and s.parent is None][-1]
    tree = {s.name: s for s in spans if s.context.trace_id == root.context.trace_id}
    assert set(tree) == {root_name, "generate", "queue", "prefill", "decode"}
    assert tree["generate"].parent.span_id == root.context.span_id
    for phase in ("queue", "prefill", "decode"):
        assert tree[phase].parent.span_id == tree["generate"].context.span_id
    # The phases tile the request in order, inside the replica's span, inside the ingress span.
    assert root.start_time <= tree["generate"].start_time <= tree["queue"].start_time + 1_000_000
    assert tree["queue"].end_time == tree["prefill"].start_time
    assert tree["prefill"].end_time == tree["decode"].start_time
    assert tree["decode"].end_time <= tree["generate"].end_time <= root.end_time
    return tree


def test_non_streaming_request_records_the_span_tree(ingress, exporter):
    response = ingress.chat_completions.remote(chat_request(max_tokens=12, temperature=0)).result()
    body = json.loads(response.body)
    tree = spans_of_trace(exporter, f"chat {MODEL}")
    root, gen = tree[f"chat {MODEL}"].attributes, tree["generate"].attributes
    assert root["http.response.status_code"] == 200 and root["gen_ai.response.id"] == body["id"]
    assert root["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert root["gen_ai.request.max_tokens"] == 12
    assert root["gen_ai.response.finish_reasons"] == (body["choices"][0]["finish_reason"],)
    assert gen["lyanna.chat_id"] == body["id"] and gen["lyanna.aborted"] is False
    assert gen["lyanna.num_accepted_tokens"] == body["speculation"]["accepted_tokens"]
    assert gen["lyanna.num_forwards"] == body["speculation"]["target_forwards"]
    assert gen["lyanna.num_output_tokens"] == body["usage"]["completion_tokens"]
    assert tree["prefill"].attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert tree["decode"].attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]


def test_streaming_request_span_ends_with_the_stream(ingress, exporter):
    exporter.clear()
    response = ingress.chat_completions.remote(chat_request(max_tokens=8, temperature=0, stream=True)).result()
    assert not [s for s in exporter.get_finished_spans() if s.name == f"chat {MODEL}"], "ended before the stream"

    async def read() -> list[str]:
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(read())
    assert chunks[-1] == "data: [DONE]\n\n"
    tree = spans_of_trace(exporter, f"chat {MODEL}")
    root = tree[f"chat {MODEL}"].attributes
    assert root["lyanna.stream"] is True and 0 < root["gen_ai.usage.output_tokens"] <= 8
    assert "lyanna.stream_aborted" not in root


def test_a_bad_request_is_an_error_span_without_phases(ingress, exporter):
    exporter.clear()
    response = ingress.chat_completions.remote(chat_request(max_tokens=10**6)).result()  # over the context
    assert response.status_code == 400
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {f"chat {MODEL}", "generate"}  # the engine's admission rejected it: no phases
    assert all(s.status.status_code == trace.StatusCode.ERROR for s in spans.values())
    assert spans[f"chat {MODEL}"].attributes["http.response.status_code"] == 400
    assert "context length" in spans["generate"].status.description


def test_carrier_round_trip_and_disabled_tracing():
    tracer = tracing.make_tracer(TracingSettings(exporter="global"), "test")
    with tracer.start_as_current_span("parent") as parent:
        carrier = tracing.inject(parent)
    assert carrier["traceparent"].split("-")[1] == format(parent.get_span_context().trace_id, "032x")
    child = tracer.start_span("child", context=tracing.extract(carrier))
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    child.end()
    noop = tracing.make_tracer(TracingSettings(), "test")
    assert not noop.start_span("x").get_span_context().is_valid


def test_a_stream_closed_early_marks_both_spans_aborted(ingress, exporter):
    exporter.clear()
    response = ingress.chat_completions.remote(chat_request(max_tokens=200, stream=True)).result()

    async def read_one_then_leave() -> None:
        await anext(response.body_iterator)
        await response.body_iterator.aclose()  # what starlette does when the client goes away
        for _ in range(100):  # the replica notices the cancellation on its next delta
            if any(s.name == "generate" for s in exporter.get_finished_spans()):
                return
            await asyncio.sleep(0.05)

    asyncio.run(read_one_then_leave())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans[f"chat {MODEL}"].attributes["lyanna.stream_aborted"] is True
    assert spans["generate"].attributes["lyanna.aborted"] is True
    assert spans["generate"].attributes["lyanna.num_output_tokens"] < 200
