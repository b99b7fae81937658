"""One streamed chat completion, timed the way users feel it: TTFT, inter-token gaps, TPOT, e2e."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from loadtest.workload import ChatJob


@dataclass
class RequestResult:
    """What one request measured (times in seconds since the test started, durations in seconds)."""

    start: float
    slo_class: str | None
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    replica: str | None = None
    text: str = ""  # the streamed content (a conversation's next turn appends it)

    @property
    def ok(self) -> bool:
        """Finished with a 200 and a complete stream."""
        return self.status == 200 and self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def stream_error(chunk: dict) -> str | None:
    """The message of an error event inside a stream (`data: {"error": ...}`, sent when a request fails
    after its 200: a replica died, the engine refused it), None for an ordinary chunk."""
    error = chunk.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error)[:500]
    return str(error)[:500]


def request_body(job: ChatJob, model: str) -> dict:
    """The chat-completions body for a job (streaming, with usage in the last chunk)."""
    body = {
        "model": model,
        "messages": job.messages,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if job.slo_class is not None:
        body["slo"] = {"class": job.slo_class}
    return body


async def run_chat(client: httpx.AsyncClient, url: str, model: str, job: ChatJob, t0: float) -> RequestResult:
    """Send one job and time its stream; errors are recorded, never raised."""
    start = time.perf_counter()
    res = RequestResult(start=start - t0, slo_class=job.slo_class)
    last = start
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=request_body(job, model)) as resp:
            res.status = resp.status_code
            res.replica = resp.headers.get("x-lyanna-replica")
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:500]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    res.e2e = time.perf_counter() - start
                    break
                chunk = json.loads(data)
                if (error := stream_error(chunk)) is not None:
                    res.error = res.error or f"stream error: {error}"  # a cut answer is not a success
                    continue
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        res.text += choice["delta"]["content"]
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
            if res.e2e is None and res.error is None:
                res.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
