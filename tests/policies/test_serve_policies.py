"""The request router and the autoscaling policy inside real Ray Serve (loopback HTTP)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray.serve.config import RequestRouterConfig

from policies.autoscaling import SLOAutoscalingPolicy
from policies.routing import LoadAwareRouter
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
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    router = RequestRouterConfig(request_router_class=LoadAwareRouter, request_routing_stats_period_s=1)
    routed = LLMReplica.options(num_replicas=2, request_router_config=router).bind(ENGINE, None, SLO)
    serve.run(Ingress.bind(routed, MODEL, "lyanna", None, SLO), name="routed", route_prefix="/routed")
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 16,  # the load alone never asks for a second replica
        "upscale_delay_s": 1,
        "downscale_delay_s": 600,
        "look_back_period_s": 2,
        "policy": {"policy_function": SLOAutoscalingPolicy, "policy_kwargs": {"min_requests": 2}},
    }
    scaled = LLMReplica.options(autoscaling_config=autoscaling).bind(ENGINE, None, SLO)
    serve.run(Ingress.bind(scaled, MODEL, "lyanna", None, SLO), name="scaled", route_prefix="/scaled")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def chat(url: str, content: str, slo: str | None = None, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if slo:
        body["slo"] = {"class": slo}
    res = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    res.raise_for_status()
    return res


def test_router_keeps_prefix_affinity_and_sends_tight_requests_to_the_least_loaded(base_url):
    url = f"{base_url}/routed"
    first = chat(url, "warm-up", slo="interactive").headers["x-lyanna-replica"]  # idle: the first in id order
    busy = threading.Thread(target=chat, args=(url, "Tell me a long story.", "interactive", 160))
    busy.start()
    time.sleep(1.5)  # the long request runs on `first` (both idle: id order)
    other = chat(url, "What is the capital of France?").headers["x-lyanna-replica"]
    assert other != first  # `first` is busy: a new prefix goes to the least loaded
    busy.join()
    time.sleep(2.5)  # routing stats refresh: both idle again
    again = [chat(url, "What is the capital of France?").headers["x-lyanna-replica"] for _ in range(3)]
    assert again == [other] * 3  # prefix affinity, though `first` is as idle and ranks first by id
    assert chat(url, "What is the capital of France?", slo="interactive").headers["x-lyanna-replica"] == first


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
