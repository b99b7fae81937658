"""Locust users for the OpenAI-compatible endpoint (`locust -f loadtest/locustfile.py --host URL`).

Each user streams chat completions and reports, besides the request itself, these locust metrics
(request type `METRIC`, "response time" = the value in ms): `ttft`, `itl` (every gap between content
chunks), `tpot`, `e2e`, and `output_tokens` (the count, as its "response time"); `slo/<class>` succeeds
when the request met its class's TTFT and TPOT targets, so its success rate is SLO attainment and its
successes per second are goodput.

Settings (environment): LOADTEST_PROMPTS (sharegpt | synthetic | a JSON Lines file), LOADTEST_NUM_PROMPTS,
LOADTEST_MAX_TOKENS, LOADTEST_SLO_MIX (e.g. interactive:1,batch:1), LOADTEST_SLO_CONFIG (a serve config
whose args.slo defines the classes' targets), LOADTEST_MODEL, LOADTEST_ARRIVAL
(`closed`: back-to-back requests, concurrency = users; `poisson`: exponential think times at
LOADTEST_RATE_PER_USER requests/s per user). Headless, bounded, e.g.:

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 60s
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, constant, events, task

from loadtest.client import request_body, stream_error, stream_problem
from loadtest.runner import slo_settings
from loadtest.workload import Workload, load_prompts, parse_mix

SLO = slo_settings(os.environ.get("LOADTEST_SLO_CONFIG"))  # a serve config's args.slo, else the defaults
_WORKLOAD = Workload(
    load_prompts(os.environ.get("LOADTEST_PROMPTS", "sharegpt"), int(os.environ.get("LOADTEST_NUM_PROMPTS", "200"))),
    int(os.environ.get("LOADTEST_MAX_TOKENS", "64")),
    parse_mix(os.environ.get("LOADTEST_SLO_MIX")),
)
_RATE = float(os.environ.get("LOADTEST_RATE_PER_USER", "0.5"))


def _metric(name: str, value_ms: float, length: int = 0, exception: Exception | None = None) -> None:
    events.request.fire(
        request_type="METRIC", name=name, response_time=value_ms, response_length=length, exception=exception
    )


class ChatUser(HttpUser):
    """Streams chat completions and reports their latencies as locust metrics."""

    wait_time = (
        (lambda self: random.expovariate(_RATE)) if os.environ.get("LOADTEST_ARRIVAL") == "poisson" else constant(0)
    )

    @task
    def chat(self) -> None:
        """One streamed completion."""
        job = _WORKLOAD.next_job()
        body = request_body(job, os.environ.get("LOADTEST_MODEL", "smollm2-135m-instruct"))
        start = last = time.perf_counter()
        ttft = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, stream=True, catch_response=True, name="/v1/chat/completions"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            done, error, usage, finish = False, None, None, None
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                error = error or stream_error(chunk)
                if chunk.get("usage"):
                    tokens = usage = chunk["usage"]["completion_tokens"]
                finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                        _metric("ttft", ttft * 1e3)
                    else:
                        _metric("itl", (now - last) * 1e3)
                    last = now
            problem = stream_problem(done, error, usage, finish, job.max_tokens)
            if problem is not None:  # a cut or short answer is not a success
                resp.failure(f"{problem[0]}: {problem[1]}")
                return
            resp.success()
        e2e = time.perf_counter() - start
        tpot = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
        _metric("e2e", e2e * 1e3)
        _metric("output_tokens", tokens, length=tokens)
        if tpot is not None:
            _metric("tpot", tpot * 1e3)
        if job.slo_class is not None:
            met = SLO.target(job.slo_class, None, None).met(ttft, tpot)
            _metric(f"slo/{job.slo_class}", e2e * 1e3, exception=None if met else RuntimeError("SLO missed"))
