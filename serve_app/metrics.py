"""Prometheus metrics of the served API, labelled by model and drafter (`GET /metrics`).

Request-level metrics are observed at the ingress from each request's stream: counts by status,
TTFT, TPOT, inter-token latency, queue time, end-to-end latency, prompt/generated tokens,
preemptions, accepted tokens per step, draft tokens proposed and accepted, streams that ended early,
and requests by SLO class and whether they met their targets (goodput). TTFT, TPOT, queue time and
SLO attainment come from the engine's timestamps in the last stream item, so they agree with the
replica's SLO tracker (`StreamDelta.slo_met`); end-to-end and inter-token latency are the ingress's
own clock (what a client sees, the hop to the replica included).
Replica gauges (batch size, queue length, KV-cache use, SLO attainment, prefix-cache hit rate and
blocks, and the speculation policy's latest choices with its predicted vs observed acceptance and step
time) are set at scrape time from the stats every running replica last reported, one series per replica
(`replica` label); a replica that is gone loses its series. The prefix cache's cumulative counters
(prompt tokens looked up at admission, and those served from cached blocks) are exported as counters
per replica from the same stats.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from policies.slo import SLOTarget
from serve_app.messages import StreamDelta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ReplicaCounters:
    """Counters a replica keeps itself (its stats carry their running totals), exported per replica at
    scrape time: `lyanna_prefix_cache_queries_total` and `lyanna_prefix_cache_hits_total`."""

    COUNTERS = (
        ("prefix_cache_queries", "Prompt tokens looked up in a replica's prefix cache at admission"),
        ("prefix_cache_hits", "Prompt tokens a replica served from its prefix cache (hits / queries: the hit rate)"),
    )

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.replicas: list[dict[str, Any]] = []

    def describe(self) -> list[Metric]:
        """The metric families, without samples (for the registry's name checks)."""
        return [CounterMetricFamily(f"lyanna_{key}", doc, labels=[]) for key, doc in self.COUNTERS]

    def collect(self) -> list[Metric]:
        """One sample per replica of each counter, from the stats last observed."""
        families = []
        for key, doc in self.COUNTERS:
            family = CounterMetricFamily(f"lyanna_{key}", doc, labels=[*self.labels, "replica"])
            for stats in self.replicas:
                if key in stats:
                    family.add_metric([*self.labels.values(), stats["replica"]], stats[key])
            families.append(family)
        return families


class ServeMetrics:
    """One registry per ingress replica; `observe_*` record, `render` exports."""

    def __init__(self, model: str, drafter: str):
        self.labels = {"model": model, "drafter": drafter}
        names = list(self.labels)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lyanna_requests", "Chat requests by HTTP status", [*names, "status"], registry=r)
        self.ttft = Histogram(
            "lyanna_ttft_seconds",
            "Time to first token: from the request's arrival at the engine (tokenizing included) to its first token",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "lyanna_tpot_seconds",
            "Time per output token after the first, in the engine",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lyanna_e2e_seconds", "End-to-end latency at the ingress", names, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "lyanna_itl_seconds",
            "Inter-token latency: time between successive deltas carrying tokens (a verified draft's tokens arrive"
            " together)",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "lyanna_queue_time_seconds",
            "Time a request waited in a replica's queue before its first step",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "lyanna_preemptions", "Times requests were preempted (KV blocks reclaimed, recomputed)", names, registry=r
        )
        self.stream_errors = Counter(
            "lyanna_stream_errors",
            "Streams that ended early, by reason (client_disconnected, replica_failed)",
            [*names, "reason"],
            registry=r,
        )
        self.resumptions = Counter(
            "lyanna_resumptions",
            "Requests resumed on another replica after the one serving them failed, by reason "
            "(replica_died, replica_unavailable, engine_failed)",
            [*names, "reason"],
            registry=r,
        )
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
        per_replica = [*names, "replica"]
        self.batch_size = Gauge("lyanna_batch_size", "Running requests on a replica", per_replica, registry=r)
        self.queue_length = Gauge("lyanna_queue_length", "Waiting requests on a replica", per_replica, registry=r)
        self.kv_usage = Gauge(
            "lyanna_kv_cache_usage", "Fraction of KV blocks in use on a replica", per_replica, registry=r
        )
        self.replicas = Gauge("lyanna_replicas", "LLM replicas running and reporting stats", names, registry=r)
        self.slo_requests = Counter(
            "lyanna_slo_requests",
            "Finished requests with SLO targets, by class and outcome",
            [*names, "slo_class", "met"],
            registry=r,
        )
        self.slo_attainment = Gauge(
            "lyanna_slo_attainment", "Share of a replica's recent requests meeting targets", per_replica, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "lyanna_prefix_cache_hit_rate",
            "Share of prompt tokens a replica served from its prefix cache since it started",
            per_replica,
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "lyanna_prefix_cache_blocks",
            "KV blocks a replica's prefix cache holds (in use or free)",
            per_replica,
            registry=r,
        )
        self.replica_counters = ReplicaCounters(self.labels)
        r.register(self.replica_counters)
        self.policy = {
            key: Gauge(f"lyanna_spec_policy_{key}", doc, per_replica, registry=r)
            for key, doc in (
                ("drafted_requests", "Requests the speculation policy drafted for in its latest step"),
                ("depth", "Mean verified tree depth in the policy's latest step"),
                ("width", "Mean verified tree width in the policy's latest step"),
                ("budget", "Mean draft tokens verified per drafted request in the policy's latest step"),
                ("predicted_accepted", "Accepted draft tokens per verified tree: the policy's prediction (average)"),
                ("observed_accepted", "Accepted draft tokens per verified tree: observed (average)"),
                ("predicted_step_s", "Target step seconds: the policy's prediction (average)"),
                ("observed_step_s", "Target step seconds: observed (average)"),
            )
        }

    def observe_status(self, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(**self.labels, status=str(status)).inc()

    def observe_finished(self, item: StreamDelta, e2e_s: float, target: SLOTarget) -> bool | None:
        """Record a finished request from its last stream item and the end-to-end seconds the ingress
        measured; returns whether it met its SLO targets (None without targets)."""
        lb = self.labels
        self.e2e.labels(**lb).observe(e2e_s)
        if item.ttft_s is not None:
            self.ttft.labels(**lb).observe(item.ttft_s)
        if item.tpot_s is not None:
            self.tpot.labels(**lb).observe(item.tpot_s)
        if item.queue_s is not None:
            self.queue_time.labels(**lb).observe(item.queue_s)
        self.preemptions.labels(**lb).inc(item.num_preemptions)
        met = item.slo_met(target)
        if met is not None:
            self.slo_requests.labels(**lb, slo_class=target.slo_class or "custom", met=str(met).lower()).inc()
        self.prompt_tokens.labels(**lb).inc(item.num_prompt_tokens)
        self.generated_tokens.labels(**lb).inc(item.num_output_tokens)
        self.draft_tokens.labels(**lb).inc(item.num_draft_tokens)
        self.accepted_tokens.labels(**lb).inc(item.num_accepted_tokens)
        if item.num_spec_steps:
            self.accepted_per_step.labels(**lb).observe(item.tokens_per_step)
        return met

    def observe_itl(self, gap_s: float) -> None:
        """One gap between successive token-carrying deltas of a request."""
        self.itl.labels(**self.labels).observe(gap_s)

    def observe_stream_error(self, reason: str) -> None:
        """A stream that ended before its last token."""
        self.stream_errors.labels(**self.labels, reason=reason).inc()

    def observe_resumption(self, reason: str) -> None:
        """A request sent to another replica after the one serving it failed."""
        self.resumptions.labels(**self.labels, reason=reason).inc()

    def observe_replicas(self, replicas: list[dict[str, Any]]) -> None:
        """Set the engine gauges from every running replica's latest stats; drop the series of gone ones."""
        gauges = [self.batch_size, self.queue_length, self.kv_usage, self.slo_attainment, *self.policy.values()]
        gauges += [self.prefix_hit_rate, self.prefix_blocks]
        self.replica_counters.replicas = list(replicas)
        for gauge in gauges:
            gauge.clear()
        self.replicas.labels(**self.labels).set(len(replicas))
        for stats in replicas:
            replica = {**self.labels, "replica": stats["replica"]}
            self.batch_size.labels(**replica).set(stats["num_running"])
            self.queue_length.labels(**replica).set(stats["num_waiting"])
            self.kv_usage.labels(**replica).set(stats["kv_cache_usage"])
            if stats["slo_attainment"] is not None:
                self.slo_attainment.labels(**replica).set(stats["slo_attainment"])
            if "prefix_cache_hit_rate" in stats:
                self.prefix_hit_rate.labels(**replica).set(stats["prefix_cache_hit_rate"])
                self.prefix_blocks.labels(**replica).set(stats["prefix_cache_blocks"])
            for key, value in stats["policy"].items():
                if key in self.policy:
                    self.policy[key].labels(**replica).set(value)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
