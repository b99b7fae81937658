"""Serving overhead: tokens/s and TTFT through Ray Serve + HTTP vs the same engine offline.

    python -m serve_app.bench --prompts FILE.jsonl --num-prompts 16 --concurrency 1,8 --max-new-tokens 64

Starts the application on loopback in a Ray cluster set up as `make run`'s (HAProxy ingress), both sides on
the engine settings of `--config` (serve_config.yaml: what `make run` serves). `--layout config` (the
default) deploys the application as that file does, autoscaling held at each deployment's initial replica
count (serve_config.yaml: two LLM replicas of one CPU thread each, sized for a 2-core machine); `--layout
one` deploys one LLM replica with as many threads as the offline engine. The offline side is one engine in
this process with `--threads` threads (default: all the machine's cores, one engine as a user runs it offline;
on a 2-core machine two engines of one thread each, as the replicas run, decode 1.2-1.4x as much at 16 streams).
Then, per concurrency level, it alternates waves of `--concurrency` concurrent streaming requests through
the openai client (HTTP) and through an `AsyncEngine` in this process (offline), so machine noise hits both
alike. Reports tokens/s over all timed waves and the median over waves of the paired ratio (each wave run
both ways back to back), the noise-robust figure. Greedy decoding: both paths produce the same tokens. The
last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from pathlib import Path

import torch
import yaml

from engines.async_engine import AsyncEngine
from engines.datasets import read_prompt_file
from engines.engine import LLMEngine
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from serve_app.app import SERVE_RUNTIME_ENV, build_app_with_options, use_serve_cluster_env
from serve_app.ingress import Ingress
from serve_app.replica import EngineSettings, LLMReplica


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _http_one(client, model: str, messages, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    first, n = None, 0
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return n, (first or time.perf_counter()) - t0


async def _offline_one(engine: AsyncEngine, messages, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    first, n = None, 0
    request = GenerationRequest(messages=messages, params=SamplingParams(temperature=0, max_tokens=max_tokens))
    async for out in engine.generate(request):
        if out.new_token_ids and first is None:
            first = time.perf_counter()
        n = out.num_output_tokens
    return n, (first or time.perf_counter()) - t0


async def _wave(coros) -> tuple[int, float, list[float]]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*coros)
    return sum(n for n, _ in results), time.perf_counter() - t0, [t for _, t in results]


def _held_at_initial_replicas(deployment: dict) -> dict:
    """A config's deployment options with autoscaling held at its initial replica count (its policy still runs and
    its metrics are still collected), so that one concurrency level's load does not resize the deployment in the
    middle of the next."""
    options = {k: v for k, v in deployment.items() if k != "name"}
    scaling = deployment.get("autoscaling_config")
    if scaling:
        count = scaling.get("initial_replicas", scaling.get("min_replicas", 1))
        options["autoscaling_config"] = scaling | {
            "min_replicas": count,
            "initial_replicas": count,
            "max_replicas": count,
        }
    return options


def _layout_cpus(deployments: dict[str, dict]) -> float:
    """CPUs the deployments' replicas reserve."""
    total = 0.0
    for options in deployments.values():
        scaling = options.get("autoscaling_config") or {}
        count = scaling.get("initial_replicas", options.get("num_replicas", 1))
        total += count * options.get("ray_actor_options", {}).get("num_cpus", 1)
    return total


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and print the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--config", default="serve_config.yaml", help="serve config whose engine settings both sides run")
    ap.add_argument("--drafter", default=None, help="override the config's drafter (e.g. none)")
    ap.add_argument(
        "--layout",
        choices=["config", "one"],
        default="config",
        help="HTTP side: the config's deployments as they are, or one LLM replica of --threads threads",
    )
    args = ap.parse_args(argv)
    import openai
    import ray
    from ray import serve

    torch.set_num_threads(args.threads)
    application = yaml.safe_load(Path(args.config).read_text())["applications"][0]
    app_args = application["args"]
    app_args["engine"] = app_args.get("engine", {}) | ({"drafter": args.drafter} if args.drafter else {})
    settings = EngineSettings.model_validate(app_args["engine"])
    records = read_prompt_file(args.prompts)[: args.num_prompts]
    port = _free_port()
    # as `make run` runs the cluster and serve_config.yaml the replicas
    use_serve_cluster_env()
    cpus: float = args.threads
    if args.layout == "config":
        deployments = {d["name"]: _held_at_initial_replicas(d) for d in application["deployments"]}
        app = build_app_with_options(app_args, deployments)
        cpus = max(cpus, _layout_cpus(deployments))  # room for every replica, also when --threads is lower
    else:
        replica = LLMReplica.options(ray_actor_options={"num_cpus": args.threads}).bind(settings.model_dump())
        app = Ingress.bind(replica, settings.served_model_name, settings.drafter)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app, name="bench", route_prefix="/", logging_config=application.get("logging_config"))
    config = settings.engine_config()
    offline = AsyncEngine(lambda: LLMEngine(config))  # built in its loop thread, as the replica's (one OpenMP team)
    engine = settings.model_dump(include={"drafter", "spec_policy", "spec_depth", "spec_width", "spec_budget"})
    result: dict = {"threads": args.threads, "config": args.config, "layout": args.layout, "engine": engine}
    result["levels"] = {}

    async def run_level(c: int) -> dict:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            return await measure(client, c)

    async def measure(client: openai.AsyncOpenAI, c: int) -> dict:
        sides = {"http": [0, 0.0, []], "offline": [0, 0.0, []]}
        ratios = []  # per wave: HTTP tokens/s over offline tokens/s, the two measured back to back
        waves = [records[i : i + c] for i in range(0, len(records), c)]
        for k, wave in enumerate([waves[0], *waves]):  # the first wave warms both paths up, untimed
            order = ["http", "offline"] if k % 2 else ["offline", "http"]
            speed = {}
            for side in order:
                if side == "http":
                    name = settings.served_model_name
                    coros = [_http_one(client, name, r["messages"], args.max_new_tokens) for r in wave]
                else:
                    coros = [_offline_one(offline, r["messages"], args.max_new_tokens) for r in wave]
                tokens, wall, ttfts = await _wave(coros)
                speed[side] = tokens / wall
                if k:
                    sides[side][0] += tokens
                    sides[side][1] += wall
                    sides[side][2] += ttfts
            if k:
                ratios.append(speed["http"] / speed["offline"])
        out = {
            side: {"tokens": t, "tokens_per_s": t / w, "ttft_ms_median": statistics.median(f) * 1e3}
            for side, (t, w, f) in sides.items()
        }
        out["http_vs_offline_tokens_per_s"] = out["http"]["tokens_per_s"] / out["offline"]["tokens_per_s"]
        out["wave_ratios"] = ratios
        out["wave_ratio_median"] = statistics.median(ratios)
        return out

    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            level = asyncio.run(run_level(c))
            result["levels"][c] = level
            print(
                f"concurrency {c}: http {level['http']['tokens_per_s']:.1f} tok/s "
                f"(TTFT {level['http']['ttft_ms_median']:.0f} ms), offline {level['offline']['tokens_per_s']:.1f} "
                f"tok/s (TTFT {level['offline']['ttft_ms_median']:.0f} ms), "
                f"ratio {level['http_vs_offline_tokens_per_s']:.3f}, "
                f"median of {len(level['wave_ratios'])} paired waves {level['wave_ratio_median']:.3f}"
            )
    finally:
        offline.shutdown()
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
