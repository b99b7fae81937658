"""`python -m loadtest.chaos --url http://127.0.0.1:8000 --duration-s 90 --concurrency 16 --kill-at 30,60`:
a bounded load with LLM replicas killed at chosen times, and what the clients saw.

It runs `--concurrency` closed-loop streams of held-out prompts for `--duration-s` against a running
server (greedy, and a `--seeded-share` of them sampled with a seed), kills an LLM replica's process at
each `--kill-at` second, or as soon after as the server is healthy again (`--kill rank`: the
tensor-parallel rank 1 of a replica instead; it joins the server's Ray cluster to do so), waits for the
server to be healthy again, then sends every completed request once more, alone (one at a time; `--calm-concurrency`
for more), with the same body. It reports the requests sent, completed, failed (by kind) and resumed (the server's
`lyanna_resumptions_total`), how many answers equal the same request re-sent alone (all, and those in flight at a
kill), and the extra latency of the requests that were in flight at a kill (p50/p99 over their latency alone).
Its last line is the JSON summary; it exits 1 if a request failed or an answer differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.client import RequestResult, run_chat
from loadtest.report import failures, percentiles
from loadtest.runner import check_target
from loadtest.workload import ChatJob, load_prompts


@dataclass
class ChaosConfig:
    """One chaos run."""

    url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    app: str = "llm"  # the Serve application whose LLM replicas are killed
    duration_s: float = 90.0
    concurrency: int = 16
    kill_at: list[float] = field(default_factory=lambda: [30.0, 60.0])
    kill: str = "replica"  # replica (its process) or rank (a tensor-parallel replica's rank 1)
    prompts: str = "sharegpt"
    num_prompts: int = 200
    max_tokens: int = 64
    seeded_share: float = 0.5  # of requests sampled (temperature 0.8) with a seed; the rest greedy
    seed: int = 0
    ray_address: str = "auto"
    calm_concurrency: int = 1  # requests at once when they are re-sent afterwards (1: each alone)
    recover_timeout_s: float = 240.0
    request_timeout_s: float = 300.0


MAX_JOBS = 20_000  # more than a bounded run sends


def jobs(cfg: ChaosConfig) -> list[ChatJob]:
    """The requests in the order they are sent: prompts in turn, greedy or seeded (seed = the job's index)."""
    prompts = load_prompts(cfg.prompts, cfg.num_prompts, cfg.seed)
    rng = random.Random(cfg.seed)
    out = []
    for i in range(MAX_JOBS):
        sampled = rng.random() < cfg.seeded_share
        temperature, seed = (0.8, i) if sampled else (0.0, None)
        out.append(ChatJob(prompts[i % len(prompts)], cfg.max_tokens, temperature=temperature, seed=seed))
    return out


def kill_one(app: str, what: str) -> str:
    """Kill one live LLM replica process of `app` (or a tensor-parallel rank actor); its actor name."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    if what == "rank":
        names = sorted((a["name"], a["namespace"]) for a in actors if a["name"].startswith("lyanna-tp::"))
    else:
        prefix = f"SERVE_REPLICA::{app}#LLMReplica#"
        names = sorted((a["name"], a["namespace"]) for a in actors if a["name"].startswith(prefix))
    for name, namespace in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            return name
        except ValueError:  # already gone
            continue
    raise RuntimeError(f"no live {what} of application {app!r} to kill")


async def resumptions(client: httpx.AsyncClient, url: str) -> float:
    """The server's `lyanna_resumptions_total`, summed over reasons."""
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("lyanna_resumptions_total"))


async def healthy(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    """Wait for /health to answer 200."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        try:
            if (await client.get(f"{url}/health")).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    return False


async def closed_loop(
    client: httpx.AsyncClient, cfg: ChaosConfig, todo: list[tuple[int, ChatJob]], until: float | None,
    concurrency: int,
) -> dict[int, RequestResult]:  # fmt: skip
    """`concurrency` streams working through `todo` (until the clock passes `until`, if given)."""
    queue = list(reversed(todo))
    results: dict[int, RequestResult] = {}
    t0 = time.perf_counter()

    async def stream() -> None:
        while queue and (until is None or time.perf_counter() < until):
            i, job = queue.pop()
            results[i] = await run_chat(client, cfg.url, cfg.model, job, t0)

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return results


async def run_chaos(cfg: ChaosConfig, kill=kill_one) -> dict[str, Any]:
    """The chaos pass, the undisturbed pass, and the comparison."""
    check_target(cfg.url, allow_remote=False)
    all_jobs = list(enumerate(jobs(cfg)))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        if not await healthy(client, cfg.url, cfg.recover_timeout_s):
            raise RuntimeError(f"{cfg.url}/health is not 200")
        before = await resumptions(client, cfg.url)
        start = time.perf_counter()
        kills: list[tuple[float, str]] = []

        async def killer() -> None:
            for at in sorted(cfg.kill_at):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                await healthy(client, cfg.url, cfg.recover_timeout_s)  # not a replica still starting
                until = time.perf_counter() + cfg.recover_timeout_s
                while True:  # the replica killed last may not be replaced yet: wait for a live one
                    try:
                        name = await asyncio.to_thread(kill, cfg.app, cfg.kill)
                        break
                    except RuntimeError:
                        if time.perf_counter() > until:
                            raise
                        await asyncio.sleep(1.0)
                kills.append((time.perf_counter() - start, name))

        killing = asyncio.create_task(killer())
        chaos = await closed_loop(client, cfg, all_jobs, start + cfg.duration_s, cfg.concurrency)
        await killing
        duration = time.perf_counter() - start
        recovered = await healthy(client, cfg.url, cfg.recover_timeout_s)
        resumed = await resumptions(client, cfg.url) - before
        done = [(i, job) for i, job in all_jobs if i in chaos and chaos[i].ok]
        calm = await closed_loop(client, cfg, done, None, cfg.calm_concurrency)
    failed = [r for r in chaos.values() if not r.ok]
    same = [i for i, _ in done if calm[i].ok and calm[i].text == chaos[i].text]
    differing = [i for i, _ in done if calm[i].ok and calm[i].text != chaos[i].text]
    # in flight at a kill: started before it, finished after it (their start is relative to the pass's start)
    in_flight = [
        i for i, _ in done if calm[i].ok and any(chaos[i].start < at < chaos[i].start + chaos[i].e2e for at, _ in kills)
    ]
    hit = [chaos[i].e2e - calm[i].e2e for i in in_flight]
    return {
        "config": cfg.__dict__,
        "duration_s": duration,
        "kills": [{"at_s": round(at, 2), "actor": name} for at, name in kills],
        "recovered": recovered,
        "sent": len(chaos),
        "completed": len(chaos) - len(failed),
        "failed": len(failed),
        **failures(list(chaos.values())),
        "resumed": resumed,
        "compared": len(same) + len(differing),
        "identical": len(same),
        "differing_jobs": differing[:10],
        "in_flight_at_kills": len(hit),
        "in_flight_identical": sum(calm[i].text == chaos[i].text for i in in_flight),
        "extra_latency_s": percentiles(hit),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the summary."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__)
    defaults = ChaosConfig()
    ap.add_argument("--url", default=defaults.url)
    ap.add_argument("--model", default=defaults.model)
    ap.add_argument("--app", default=defaults.app, help="the Serve application (serve_config.yaml's name)")
    ap.add_argument("--duration-s", type=float, default=defaults.duration_s)
    ap.add_argument("--concurrency", type=int, default=defaults.concurrency)
    ap.add_argument("--kill-at", default="30,60", help="seconds into the run, comma-separated")
    ap.add_argument("--kill", choices=["replica", "rank"], default=defaults.kill)
    ap.add_argument("--prompts", default=defaults.prompts, help="sharegpt, synthetic, or a JSON Lines prompt file")
    ap.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    ap.add_argument("--seeded-share", type=float, default=defaults.seeded_share)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--calm-concurrency", type=int, default=defaults.calm_concurrency,
                    help="requests at once when every completed one is re-sent afterwards (1: each alone)")  # fmt: skip
    ap.add_argument("--ray-address", default=defaults.ray_address, help="the server's Ray cluster")
    args = ap.parse_args(argv)
    cfg = ChaosConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        app=args.app,
        duration_s=args.duration_s,
        concurrency=args.concurrency,
        kill_at=[float(x) for x in args.kill_at.split(",") if x],
        kill=args.kill,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        seeded_share=args.seeded_share,
        seed=args.seed,
        calm_concurrency=args.calm_concurrency,
        ray_address=args.ray_address,
    )
    import ray

    ray.init(address=cfg.ray_address, logging_level="ERROR", log_to_driver=False)
    summary = asyncio.run(run_chaos(cfg))
    s = summary
    print(
        f"sent {s['sent']}, completed {s['completed']}, failed {s['failed']} {s['error_kinds'] or ''}, "
        f"resumed {s['resumed']:.0f}; answers identical to the same request re-sent alone: {s['identical']}/"
        f"{s['compared']}; {s['in_flight_at_kills']} in flight at a kill ({s['in_flight_identical']} identical), "
        f"extra latency p50 {s['extra_latency_s']['p50']} s, "
        f"p99 {s['extra_latency_s']['p99']} s",
        file=sys.stderr,
    )
    print(json.dumps(summary))
    return 0 if s["failed"] == 0 and s["identical"] == s["compared"] else 1


if __name__ == "__main__":
    sys.exit(main())
