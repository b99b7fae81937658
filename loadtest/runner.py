"""The headless load-test runner: drives the endpoint, samples the server, writes summary and plots."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.client import RequestResult, run_chat
from loadtest.report import ScrapedMetrics, ServerSample, plot, summarize
from loadtest.workload import Workload, load_prompts, parse_mix
from policies.slo import SLOSettings


@dataclass
class Stage:
    """A stretch of the test: `duration_s` seconds at `concurrency` closed-loop users, or at `rate`
    requests per second arriving as a Poisson process (open loop) when rate is set."""

    duration_s: float
    concurrency: int = 0
    rate: float | None = None


@dataclass
class LoadTestConfig:
    """One bounded load test."""

    url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    stages: list[Stage] = field(default_factory=lambda: [Stage(30.0, 4)])
    max_requests: int | None = None  # stop starting requests after this many
    prompts: str = "sharegpt"  # sharegpt, synthetic or a JSON Lines prompt file
    num_prompts: int = 200
    input_words: int = 64  # synthetic prompts' length
    max_tokens: int = 64
    slo_mix: str | None = None  # e.g. interactive:0.5,batch:0.5
    seed: int = 0
    request_timeout_s: float = 300.0
    sample_interval_s: float = 5.0
    allow_remote: bool = False
    out_dir: str | None = None
    slo: SLOSettings = field(default_factory=SLOSettings)  # the server's classes, for goodput


def slo_settings(path: str | None) -> SLOSettings:
    """SLO classes from a serve config (its first application's `args.slo`), or the defaults."""
    if path is None:
        return SLOSettings()
    doc = yaml.safe_load(Path(path).read_text())
    slo = doc["applications"][0].get("args", {}).get("slo", {}) if "applications" in doc else doc
    return SLOSettings.model_validate(slo)


def parse_stages(spec: str) -> list[Stage]:
    """`30x4,60x8` (seconds x users) or `60@2.5` (seconds @ requests/s), comma-separated."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if "@" in part:
            d, r = part.split("@")
            out.append(Stage(float(d), rate=float(r)))
        else:
            d, _, c = part.partition("x")
            out.append(Stage(float(d), int(c or 1)))
    if not out or any(s.duration_s <= 0 or s.concurrency < 0 or (s.rate is not None and s.rate <= 0) for s in out):
        raise ValueError(f"bad stages {spec!r}: durations must be > 0, users >= 0, rates > 0")
    return out


def check_target(url: str, allow_remote: bool) -> None:
    """Refuse anything but a loopback target unless told otherwise (a load test is an attack elsewhere)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"refusing to load-test {host!r}: not a loopback address (pass --allow-remote to do it)")


async def _scrape(client: httpx.AsyncClient, url: str) -> ScrapedMetrics | None:
    try:
        res = await client.get(f"{url}/metrics", timeout=30)
        return ScrapedMetrics.parse(res.text) if res.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _replicas(client: httpx.AsyncClient, url: str) -> int | None:
    try:
        res = await client.get(f"{url}/debug/replicas", timeout=10)
        return int(res.json()["LLMReplica"]) if res.status_code == 200 else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


async def run_load_test(cfg: LoadTestConfig) -> dict[str, Any]:
    """Run the stages; return the summary (and write summary.json + plots to `out_dir` if given)."""
    check_target(cfg.url, cfg.allow_remote)
    prompts = load_prompts(cfg.prompts, cfg.num_prompts, cfg.seed, cfg.input_words)
    workload = Workload(prompts, cfg.max_tokens, parse_mix(cfg.slo_mix), cfg.seed)
    results: list[RequestResult] = []
    samples: list[ServerSample] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        before = await _scrape(client, cfg.url)
        t0 = time.perf_counter()
        started = 0
        running = True

        def may_start() -> bool:
            return cfg.max_requests is None or started < cfg.max_requests

        async def one() -> None:
            nonlocal started
            started += 1
            results.append(await run_chat(client, cfg.url, cfg.model, workload.next_job(), t0))

        async def user(until: float) -> None:
            while time.perf_counter() < until and may_start():
                await one()

        async def sampler() -> None:
            while running:
                samples.append(ServerSample(time.perf_counter() - t0, await _replicas(client, cfg.url)))
                await asyncio.sleep(cfg.sample_interval_s)

        sampling = asyncio.create_task(sampler())
        pending: list[asyncio.Task] = []
        for stage in cfg.stages:
            until = time.perf_counter() + stage.duration_s
            if stage.rate is None:
                users = [asyncio.create_task(user(until)) for _ in range(stage.concurrency)]
                pending += users
                await asyncio.sleep(max(0.0, until - time.perf_counter()))
            else:
                while may_start():
                    await asyncio.sleep(workload.interarrival_s(stage.rate))
                    if time.perf_counter() >= until:
                        break
                    pending.append(asyncio.create_task(one()))
        await asyncio.gather(*pending)
        duration = time.perf_counter() - t0
        running = False
        await sampling
        after = await _scrape(client, cfg.url)
    config = asdict(cfg) | {"slo": cfg.slo.model_dump()}
    summary = summarize(results, duration, cfg.slo, before, after, samples, config)
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary["plots"] = [str(p) for p in plot(results, samples, duration, out)]
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        with open(out / "requests.jsonl", "w") as f:
            for r in results:
                f.write(json.dumps(asdict(r) | {"tpot": r.tpot}) + "\n")
    return summary
