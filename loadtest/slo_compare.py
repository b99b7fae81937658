"""Two SLO classes under load: adaptive speculation + the load-aware router vs fixed speculation +
Ray Serve's default router, same workload, same machine, one after the other (`--rounds` alternates).

    python -m loadtest.slo_compare --replicas 2 --stages 90@1.2 --slo-mix interactive:1,batch:1 --out-dir /tmp/slo

Starts Ray Serve in-process on loopback, deploys the application once per variant (fixed replica
count, so only speculation and routing differ), runs the same seeded load test against each, and
prints a table plus one JSON object (per variant: goodput per class and latency percentiles).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.runner import LoadTestConfig, parse_stages, run_load_test


@dataclass(frozen=True)
class Variant:
    """One server set-up: speculation policy and tree (caps under adaptive), and the request router."""

    name: str
    spec_policy: str
    tree: tuple[int, int, int]
    router: str | None  # import path; None = Ray Serve's default (power of two choices)


VARIANTS = (
    Variant("fixed+pow2", "fixed", (3, 2, 6), None),
    Variant("adaptive+load-aware", "adaptive", (4, 4, 16), "policies.routing:LoadAwareRouter"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(variant: Variant, replicas: int, engine: dict[str, Any]) -> None:
    """Replace the `llm` application with this variant."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from serve_app.ingress import Ingress
    from serve_app.replica import LLMReplica

    depth, width, budget = variant.tree
    settings = engine | {"spec_policy": variant.spec_policy, "spec_depth": depth, "spec_width": width}
    settings |= {"spec_budget": budget}
    options: dict[str, Any] = {"num_replicas": replicas}
    if variant.router:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=variant.router, request_routing_stats_period_s=1
        )
    llm = LLMReplica.options(**options).bind(settings, None, None)
    serve.run(Ingress.bind(llm, settings.get("served_model_name", "smollm2-135m-instruct"), "lyanna"), name="llm")


def main(argv: list[str] | None = None) -> None:
    """Run every variant `--rounds` times, alternating; print the table and the JSON."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.slo_compare", description=__doc__)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--stages", default="90@1.2")
    ap.add_argument("--slo-mix", default="interactive:1,batch:1")
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out-dir", default="/tmp/slo-compare")
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = LoadTestConfig(
        url=f"http://127.0.0.1:{port}",
        stages=parse_stages(args.stages),
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        slo_mix=args.slo_mix,
    )
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            for v in VARIANTS:
                deploy(v, args.replicas, {"num_kv_blocks": 1024})
                out = str(Path(args.out_dir) / f"{v.name}-{r}")
                summary = asyncio.run(run_load_test(replace(base, out_dir=out)))
                runs[v.name].append(summary)
                serve.delete("llm")
    finally:
        serve.shutdown()
        ray.shutdown()
    table = {}
    for name, summaries in runs.items():
        table[name] = {
            "goodput": _mean(s["goodput"] for s in summaries),
            "errors": sum(s["errors"] for s in summaries),
            "error_kinds": dict(sum((Counter(s.get("error_kinds", {})) for s in summaries), Counter())),
            "accepted_tokens_per_step": _mean(s.get("mean_accepted_tokens_per_step") or 0 for s in summaries),
            "classes": {
                c: {
                    "goodput": _mean(s["classes"][c]["goodput"] for s in summaries),
                    "slo_attainment": _mean(s["classes"][c]["slo_attainment"] for s in summaries),
                    "ttft_p90_s": _mean(s["classes"][c]["ttft_s"]["p90"] or 0 for s in summaries),
                    "tpot_p50_s": _mean(s["classes"][c]["tpot_s"]["p50"] or 0 for s in summaries),
                    "tpot_p90_s": _mean(s["classes"][c]["tpot_s"]["p90"] or 0 for s in summaries),
                }
                for c in summaries[0]["classes"]
            },
        }
    for name, row in table.items():
        print(
            f"{name:22s} goodput {row['goodput']:.3f} req/s  errors {row['errors']} {row['error_kinds'] or ''}  "
            f"accepted/step {row['accepted_tokens_per_step']:.2f}"
        )
        for c, cr in row["classes"].items():
            print(
                f"    {c:12s} goodput {cr['goodput']:.3f}  attainment {cr['slo_attainment']:.2f}  "
                f"TTFT p90 {cr['ttft_p90_s']:.2f}s  TPOT p50/p90 {cr['tpot_p50_s'] * 1e3:.0f}/"
                f"{cr['tpot_p90_s'] * 1e3:.0f} ms"
            )
    print(json.dumps({"args": vars(args), "variants": table}))


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


if __name__ == "__main__":
    main()
