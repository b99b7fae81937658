"""Prometheus metrics of the served API, labelled by model and drafter (`GET /metrics`).

Request-level metrics are observed at the ingress from each request's stream: counts by status,
TTFT, TPOT, end-to-end latency, prompt/generated tokens, accepted tokens per step, draft tokens
proposed and accepted. Engine gauges (batch size, queue length, KV-cache use) are refreshed from an
LLM replica at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """One registry per ingress replica; `observe_*` record, `render` exports."""

    def __init__(self, model: str, drafter: str):
        self.labels = {"model": model, "drafter": drafter}
        names = list(self.labels)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lyanna_requests", "Chat requests by HTTP status", [*names, "status"], registry=r)
        self.ttft = Histogram("lyanna_ttft_seconds", "Time to first token", names, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lyanna_tpot_seconds", "Per output token", names, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lyanna_e2e_seconds", "End-to-end latency", names, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lyanna_prompt_tokens", "Prompt tokens", names, registry=r)
        self.generated_tokens = Counter("lyanna_generated_tokens", "Generated tokens", names, registry=r)
        self.accepted_per_step = Histogram(
            "lyanna_accepted_tokens_per_step",
            "Tokens emitted per target forward (accepted drafts + bonus), per request",
            names,
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0),
            registry=r,
        )
        self.draft_tokens = Counter("lyanna_draft_tokens", "Draft tokens proposed", names, registry=r)
        self.accepted_tokens = Counter("lyanna_draft_tokens_accepted", "Draft tokens accepted", names, registry=r)
        self.batch_size = Gauge("lyanna_batch_size", "Running requests on a replica", names, registry=r)
        self.queue_length = Gauge("lyanna_queue_length", "Waiting requests on a replica", names, registry=r)
        self.kv_usage = Gauge("lyanna_kv_cache_usage", "Fraction of KV blocks in use on a replica", names, registry=r)

    def observe_status(self, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(**self.labels, status=str(status)).inc()

    def observe_finished(self, item: dict[str, Any], start: float, first: float | None, end: float) -> None:
        """Record a finished request from its last stream item and its timestamps (perf_counter)."""
        lb = self.labels
        self.e2e.labels(**lb).observe(end - start)
        if first is not None:
            self.ttft.labels(**lb).observe(first - start)
            if item["completion_tokens"] > 1:
                self.tpot.labels(**lb).observe((end - first) / (item["completion_tokens"] - 1))
        self.prompt_tokens.labels(**lb).inc(item["prompt_tokens"])
        self.generated_tokens.labels(**lb).inc(item["completion_tokens"])
        self.draft_tokens.labels(**lb).inc(item["draft_tokens"])
        self.accepted_tokens.labels(**lb).inc(item["accepted_tokens"])
        if item["spec_steps"]:
            self.accepted_per_step.labels(**lb).observe(item["tokens_per_step"])

    def observe_engine(self, stats: dict[str, Any]) -> None:
        """Refresh the engine gauges from a replica's stats."""
        self.batch_size.labels(**self.labels).set(stats["num_running"])
        self.queue_length.labels(**self.labels).set(stats["num_waiting"])
        self.kv_usage.labels(**self.labels).set(stats["kv_cache_usage"])

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
