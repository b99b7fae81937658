"""A load test's summary (JSON) and plots (PNG) from its per-request results and server samples."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import RequestResult
from policies.slo import SLOSettings


@dataclass
class ServerSample:
    """What the server said at one moment of the test: LLM replicas running (None if unknown)."""

    t: float
    replicas: int | None


@dataclass
class ScrapedMetrics:
    """Counters read from the server's /metrics at the start and end of the test."""

    accepted_per_step_sum: float = 0.0
    accepted_per_step_count: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> ScrapedMetrics:
        """From Prometheus' text format (the histogram lyanna_accepted_tokens_per_step)."""
        out = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "lyanna_accepted_tokens_per_step_sum":
                    out.accepted_per_step_sum += s.value
                elif s.name == "lyanna_accepted_tokens_per_step_count":
                    out.accepted_per_step_count += s.value
        return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean (nearest-rank), None for an empty list."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    xs = sorted(values)

    def rank(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "mean": sum(xs) / len(xs)}


def _latencies(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def failures(results: list[RequestResult]) -> dict[str, Any]:
    """The failed requests by kind (most frequent first), and up to five distinct error messages."""
    failed = [r for r in results if not r.ok]
    return {
        "error_kinds": dict(Counter(r.error_kind or "unknown" for r in failed).most_common()),
        "error_examples": sorted({(r.error or str(r.status))[:200] for r in failed})[:5],
    }


def summarize(
    results: list[RequestResult],
    duration_s: float,
    slo: SLOSettings,
    before: ScrapedMetrics | None = None,
    after: ScrapedMetrics | None = None,
    samples: list[ServerSample] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The test's numbers: throughput, latency percentiles, goodput (requests meeting their class's
    targets per second; requests without a class count when they finished), errors, acceptance."""
    ok = [r for r in results if r.ok]
    met = [r for r in ok if _met(r, slo)]
    out: dict[str, Any] = {
        "config": config or {},
        "duration_s": duration_s,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
        **failures(results),
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration_s,
        "goodput": len(met) / duration_s,
        "slo_attainment": len(met) / len(results) if results else None,
        **_latencies(results),
    }
    classes: dict[str, Any] = {}
    for name in sorted({r.slo_class or "none" for r in results}):
        group = [r for r in results if (r.slo_class or "none") == name]
        good = [r for r in group if r.ok and _met(r, slo)]
        classes[name] = {
            "requests": len(group),
            "goodput": len(good) / duration_s,
            "slo_attainment": len(good) / len(group),
            **_latencies(group),
        }
    out["classes"] = classes
    if before is not None and after is not None:
        count = after.accepted_per_step_count - before.accepted_per_step_count
        total = after.accepted_per_step_sum - before.accepted_per_step_sum
        out["mean_accepted_tokens_per_step"] = total / count if count > 0 else None
    if samples:
        out["replicas_over_time"] = [[round(s.t, 2), s.replicas] for s in samples]
        seen = [s.replicas for s in samples if s.replicas is not None]
        out["replicas_max"] = max(seen) if seen else None
    return out


def _met(r: RequestResult, slo: SLOSettings) -> bool:
    if r.slo_class is None:
        return r.ok
    target = slo.target(r.slo_class, None, None)
    return r.ok and target.met(r.ttft, r.tpot)


def plot(results: list[RequestResult], samples: list[ServerSample], duration_s: float, out_dir: Path) -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, e2e per class) and timeline.png (throughput and replicas)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, get) in zip(
        axes,
        (("TTFT (s)", lambda r: r.ttft), ("TPOT (s)", lambda r: r.tpot), ("end-to-end (s)", lambda r: r.e2e)),
        strict=True,
    ):
        for cls in sorted({r.slo_class or "none" for r in ok}):
            xs = sorted(v for r in ok if (r.slo_class or "none") == cls and (v := get(r)) is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{cls} (n={len(xs)})")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    bin_s = max(1.0, duration_s / 60)
    bins = max(1, math.ceil(duration_s / bin_s))
    tokens, done = [0.0] * bins, [0.0] * bins
    for r in ok:
        end = r.start + (r.e2e or 0)
        done[min(bins - 1, int(end / bin_s))] += 1 / bin_s
        # a request's tokens are spread over its decode time, so the curve is a rate, not a histogram of ends
        begin = r.start + (r.ttft or 0)
        span = max(end - begin, 1e-9)
        for i in range(int(begin / bin_s), min(bins - 1, int(end / bin_s)) + 1):
            overlap = min(end, (i + 1) * bin_s) - max(begin, i * bin_s)
            tokens[i] += r.output_tokens * max(0.0, overlap) / span / bin_s
    centers = [(i + 0.5) * bin_s for i in range(bins)]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.plot(centers, tokens, label="output tokens/s", color="tab:blue")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(centers, done, label="requests/s", color="tab:green", alpha=0.6)
    known = [s for s in samples if s.replicas is not None]
    if known:
        ax2.step([s.t for s in known], [s.replicas for s in known], where="post", color="tab:red", label="LLM replicas")
    ax2.set_ylabel("requests/s, replicas")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left")
    ax.grid(alpha=0.3)
    fig.suptitle("Throughput and replicas over time")
    fig.tight_layout()
    paths.append(out_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
