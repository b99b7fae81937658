"""OpenTelemetry request traces: a span per request at the ingress, child spans on the replica.

Each Serve component (ingress, LLM replica) runs in its own process and builds its own tracer from
`TracingSettings`. The ingress passes its span's context to the replica as a W3C `traceparent`
carrier, so both halves land in one trace:

    chat <model>                      (ingress: request fields, status, usage)
    └── generate                      (replica: tokens, speculation stats)
        ├── queue                     (arrival -> first scheduled)
        ├── prefill                   (first scheduled -> first token)
        └── decode                    (first token -> finish)

Exporters: `none` (no tracing), `console` (spans as JSON on stdout), `otlp` (an OpenTelemetry
collector over HTTP; needs the `otlp` extra), `global` (the process's already installed tracer
provider, e.g. from `opentelemetry-instrument` or a test's in-memory exporter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field

TRACER_NAME = "lyanna-serve"
_propagator = TraceContextTextMapPropagator()


class TracingSettings(BaseModel):
    """Where request traces go (`args.tracing` in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    exporter: Literal["none", "console", "otlp", "global"] = "none"
    otlp_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or localhost:4318
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # of root spans; children follow their parent
    service_name: str = "lyanna-serve"


def _exporter(settings: TracingSettings) -> SpanExporter:
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise RuntimeError("tracing.exporter 'otlp' needs the OTLP exporter: pip install 'lyanna-serve[otlp]'") from e
    return OTLPSpanExporter(endpoint=settings.otlp_endpoint) if settings.otlp_endpoint else OTLPSpanExporter()


def make_tracer(settings: TracingSettings, component: str) -> Tracer:
    """The tracer one Serve component (`ingress`, `replica`) records its spans with."""
    if settings.exporter == "none":
        return trace.NoOpTracer()
    if settings.exporter == "global":
        return trace.get_tracer(TRACER_NAME)
    resource = Resource.create({"service.name": settings.service_name, "lyanna.component": component})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
    return provider.get_tracer(TRACER_NAME)


def inject(span: Span) -> dict[str, str]:
    """The span's context as a W3C `traceparent` carrier (crosses the ingress -> replica call)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None) -> Any:
    """The parent context a carrier names (an empty context when there is none)."""
    return _propagator.extract(carrier or {})


def epoch_clock() -> Callable[[float], int]:
    """Converts `time.monotonic()` readings (the engine's clock) to epoch nanoseconds (OTel's).

    One offset for every reading it converts, so phases that share an instant share a timestamp.
    """
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda monotonic_s: offset_ns + int(monotonic_s * 1e9)
