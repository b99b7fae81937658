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
    error_kind: str | None = None  # http_<status>, transport, or a `stream_problem` kind
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


def stream_problem(
    done: bool, error: str | None, usage_tokens: int | None, finish_reason: str | None, max_tokens: int
) -> tuple[str, str] | None:
    """What makes a 200 stream fail as its client sees it, as (kind, message), or None: an error event
    (`stream_error`), no `[DONE]` (`no_done`), no usage chunk (`no_usage`), no finish reason
    (`no_finish_reason`), or fewer tokens than `max_tokens` without a stop (`short_answer`)."""
    if error is not None:
        return "stream_error", f"stream error: {error}"
    if not done:
        return "no_done", "stream ended without [DONE]"
    if usage_tokens is None:
        return "no_usage", "the stream had no usage chunk"
    if finish_reason is None:
        return "no_finish_reason", "no choice had a finish reason"
    if finish_reason == "length" and usage_tokens < max_tokens:
        return "short_answer", f"{usage_tokens} of {max_tokens} tokens, finish reason length"
    return None


def request_body(job: ChatJob, model: str) -> dict:
    """The chat-completions body for a job (streaming, with usage in the last chunk)."""
    body = {
        "model": model,
        "messages": job.messages,
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if job.seed is not None:
        body["seed"] = job.seed
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
                res.error_kind = f"http_{resp.status_code}"
                return res
            done, error, usage, finish = False, None, None, None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if (event := stream_error(chunk)) is not None:
                    error = error or event  # a cut answer is not a success
                    continue
                if chunk.get("usage"):
                    usage = res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    if choice.get("delta", {}).get("content"):
                        res.text += choice["delta"]["content"]
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
            problem = stream_problem(done, error, usage, finish, job.max_tokens)
            if problem is None:
                res.e2e = time.perf_counter() - start
            else:
                res.error_kind, res.error = problem
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error, res.error_kind = f"{type(e).__name__}: {e}", "transport"
    return res
