"""The request router and the autoscaling policy inside real Ray Serve (loopback HTTP)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

import httpx
import pytest
from ray.serve.config import RequestRouterConfig

from policies.autoscaling import SLOAutoscalingPolicy
from policies.routing import LoadAwareRouter
from serve_app.app import SERVE_RUNTIME_ENV
from serve_app.ingress import Ingress
from serve_app.replica import LLMReplica
from tests.serve_app.test_server import ENGINE, MODEL, free_port

pytestmark = pytest.mark.slow
SLO = {"classes": {"interactive": {"ttft_ms": 60000, "tpot_ms": 60000}, "impossible": {"ttft_ms": 1, "tpot_ms": 0.01}}}


@pytest.fixture(scope="module")
def base_url():
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    router = RequestRouterConfig(request_router_class=LoadAwareRouter, request_routing_stats_period_s=1)
    adaptive = ENGINE | {"spec_policy": "adaptive"}
    routed = LLMReplica.options(num_replicas=2, request_router_config=router).bind(adaptive)
    ingress = Ingress.bind(routed, MODEL, "lyanna", None, SLO, None, None, "adaptive")
    serve.run(ingress, name="routed", route_prefix="/routed")
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 16,  # the load alone never asks for a second replica
        "upscale_delay_s": 1,
        "downscale_delay_s": 600,
        "look_back_period_s": 2,
        "policy": {"policy_function": SLOAutoscalingPolicy, "policy_kwargs": {"min_requests": 2}},
    }
    scaled = LLMReplica.options(autoscaling_config=autoscaling).bind(ENGINE)
    serve.run(Ingress.bind(scaled, MODEL, "lyanna", None, SLO), name="scaled", route_prefix="/scaled")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


SYSTEM = "You are the support assistant of a bicycle shop. " * 12  # a shared prefix (> 512 characters)


def chat(url: str, content: str, slo: str | None = None, max_tokens: int = 8, system: str | None = None):
    messages = [{"role": "user", "content": content}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    if slo:
        body["slo"] = {"class": slo}
    res = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    res.raise_for_status()
    return res


def test_router_keeps_prefix_affinity_within_the_imbalance_and_sends_tight_classes_to_the_least_loaded(base_url):
    url = f"{base_url}/routed"
    home = chat(url, "Hello!", system=SYSTEM).headers["x-lyanna-replica"]
    asks = ["Write a long story about a red bicycle.", "Describe every part of a bicycle.", "Write a long poem."]
    with contextlib.ExitStack() as stack:
        streams = []
        for ask in asks:  # three long requests with the shared prefix: all go home (3/32 < the 0.25 imbalance)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
            stream = httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120)
            streams.append(stack.enter_context(stream))
        assert [s.headers["x-lyanna-replica"] for s in streams] == [home] * 3
        relaxed = chat(url, "What is 2 + 2?", system=SYSTEM).headers["x-lyanna-replica"]
        tight = chat(url, "What is 2 + 2?", slo="interactive", system=SYSTEM).headers["x-lyanna-replica"]
    assert relaxed == home  # affinity holds while the imbalance is small (the least loaded is the other one)
    assert tight != home  # a tight class takes the least-loaded replica
    # the adaptive policy's decisions and model checks, per replica, on /metrics
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    observed = [line for line in metrics.splitlines() if line.startswith("lyanna_spec_policy_observed_step_s{")]
    assert observed and all('replica="' in line for line in observed)
    # the home replica stepped the long streams; the other may have run too little to have observed a step
    assert max(float(line.split()[-1]) for line in observed) > 0, observed


def wait_until_idle(url: str, timeout_s: float = 60) -> None:
    """Wait until both replicas report no running or waiting requests and an empty KV cache (/metrics), so a
    burst is ranked by its own load, not by what an earlier test left in the stats."""
    gauges = ("lyanna_batch_size{", "lyanna_queue_length{", "lyanna_kv_cache_usage{")
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines() if line.startswith(gauges)]
        if len(lines) == 2 * len(gauges) and all(float(line.split()[-1]) == 0 for line in lines):
            return
        assert time.monotonic() < deadline, lines
        time.sleep(0.5)


def test_router_spreads_requests_that_arrive_together(base_url):
    url = f"{base_url}/routed/v1/chat/completions"

    async def burst(n: int) -> list[str]:  # n requests at once, no shared prefix: load decides
        async with httpx.AsyncClient(timeout=120) as client:
            messages = [[{"role": "user", "content": f"Count to {i + 3}."}] for i in range(n)]
            bodies = [{"model": MODEL, "messages": m, "max_tokens": 16} for m in messages]
            replies = await asyncio.gather(*(client.post(url, json=body) for body in bodies))
        return [r.raise_for_status().headers["x-lyanna-replica"] for r in replies]

    for wait in (0, 11):  # 11 s: past Serve's queue-length cache timeout (10 s), so the burst finds them expired
        time.sleep(wait)
        wait_until_idle(f"{base_url}/routed")
        counts = collections.Counter(asyncio.run(burst(12)))
        assert len(counts) == 2 and max(counts.values()) <= 8, counts  # not all on the replica ranked first


def replicas(app: str) -> int:
    from ray import serve

    return serve.status().applications[app].deployments["LLMReplica"].replica_states.get("RUNNING", 0)


def test_autoscaler_adds_a_replica_when_requests_miss_their_slo(base_url):
    url = f"{base_url}/scaled"
    assert replicas("scaled") == 1
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            chat(url, "Count to five.", slo="impossible", max_tokens=16)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 90
    try:
        while replicas("scaled") < 2 and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert replicas("scaled") == 2  # 2 ongoing requests, target 16: only the missed SLOs ask for it
