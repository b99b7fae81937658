"""Multi-turn chat load test: `python -m loadtest.multiturn --url http://127.0.0.1:8000 --conversations 8`.

Conversations come from held-out ShareGPT (the drafter-training split's 'val' side): each keeps its first
`turns` user messages; turn k sends the history so far (turn k-1's messages and the server's own answer
to it) plus user message k, streamed at temperature 0, so every turn after the first re-sends a prefix
the server has just computed. `concurrency` users each run one conversation's turns one after another,
then take the next conversation. The summary (the last line of stdout, JSON) has each turn's median
TTFT, the median TTFT of turns 2..`turns`, output throughput, the prefix cache's hit rate over the run
from the server's /metrics (`lyanna_prefix_cache_hits_total` / `..._queries_total`), and the workload's
shared-prefix share: the prompt tokens (the embedded model's chat template and tokenizer) that repeat
a prefix of an earlier prompt, or of an earlier prompt and its answer, that the server had seen when the
request was sent. Run it against a server with `enable_prefix_caching` on and off to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engines.datasets import iter_sharegpt, sharegpt_messages, split_of
from loadtest.client import RequestResult, run_chat
from loadtest.runner import check_target
from loadtest.workload import ChatJob


@dataclass
class MultiTurnConfig:
    """One multi-turn run."""

    url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    conversations: int = 8
    turns: int = 4
    concurrency: int = 4
    max_tokens: int = 64
    max_user_chars: int = 600  # a longer user message is cut (ShareGPT has pasted documents)
    skip: int = 0  # held-out conversations to pass over first (another run's, for a cold cache)
    request_timeout_s: float = 300.0
    allow_remote: bool = False
    label: str = ""


@dataclass
class TurnResult:
    """One turn of one conversation as the client saw it."""

    conversation: int
    turn: int  # 1-based
    messages: list[dict[str, str]]
    result: RequestResult
    sent: float = 0.0  # seconds since the run started
    done: float = 0.0


def held_out_conversations(num: int, turns: int, max_user_chars: int, skip: int = 0) -> list[list[str]]:
    """The first `num` held-out ShareGPT conversations (after `skip`) with at least `turns` user messages of
    8 characters or more: their first `turns` user messages, each cut to `max_user_chars`."""
    out: list[list[str]] = []
    for rec in iter_sharegpt():
        if split_of(rec["id"]) != "val":
            continue
        users = [m["content"][:max_user_chars] for m in sharegpt_messages(rec) if m["role"] == "user"]
        users = [u for u in users if len(u.strip()) >= 8]
        if len(users) >= turns:
            if skip:
                skip -= 1
                continue
            out.append(users[:turns])
            if len(out) == num:
                break
    return out


async def _scrape_prefix(client: httpx.AsyncClient, url: str) -> tuple[float, float] | None:
    """(queries, hits) summed over replicas from /metrics, None if unreadable."""
    try:
        res = await client.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if res.status_code != 200:
        return None
    totals = {"lyanna_prefix_cache_queries_total": 0.0, "lyanna_prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(res.text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["lyanna_prefix_cache_queries_total"], totals["lyanna_prefix_cache_hits_total"]


async def run_multiturn(cfg: MultiTurnConfig) -> tuple[dict[str, Any], list[TurnResult]]:
    """Run the conversations; the summary and every turn's result."""
    check_target(cfg.url, cfg.allow_remote)
    convs = held_out_conversations(cfg.conversations, cfg.turns, cfg.max_user_chars, cfg.skip)
    todo = list(enumerate(convs))
    turns: list[TurnResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        # Ask for /metrics once so the ingress has seen its replicas before the counters are read.
        await _scrape_prefix(client, cfg.url)
        await asyncio.sleep(2.0)
        before = await _scrape_prefix(client, cfg.url)
        t0 = time.perf_counter()

        async def user() -> None:
            while todo:
                index, users = todo.pop(0)
                history: list[dict[str, str]] = []
                for k, text in enumerate(users, start=1):
                    messages = [*history, {"role": "user", "content": text}]
                    sent = time.perf_counter() - t0
                    res = await run_chat(client, cfg.url, cfg.model, ChatJob(messages, cfg.max_tokens), t0)
                    turns.append(TurnResult(index, k, messages, res, sent, time.perf_counter() - t0))
                    if not res.ok:
                        break
                    history = [*messages, {"role": "assistant", "content": res.text}]

        await asyncio.gather(*(user() for _ in range(cfg.concurrency)))
        duration = time.perf_counter() - t0
        await asyncio.sleep(2.5)  # the replicas' stats reach the ingress every second
        after = await _scrape_prefix(client, cfg.url)
    return summarize(cfg, turns, duration, before, after), turns


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_share(turns: list[TurnResult], block_size: int = 16) -> dict[str, float] | None:
    """Of all prompt tokens, the share that repeats a prefix the server had seen when the request was
    sent (an earlier prompt, or an earlier prompt and its answer, finished by then), by the embedded
    model's tokenizer; and the same in whole blocks of `block_size` (a hit covers whole blocks, and never
    a prompt's last token or, with a drafter keeping K/V in the blocks, the token after a block)."""
    try:
        from engines.loader import resolve_checkpoint
        from engines.tokenizer import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer(resolve_checkpoint())
    rows = []
    for t in turns:
        prompt = tok.apply_chat_template(t.messages)
        answered = tok.apply_chat_template([*t.messages, {"role": "assistant", "content": t.result.text}])
        rows.append((t, prompt, answered))
    total = shared = blocks = 0
    for t, prompt, _ in rows:
        seen = [p for u, p, _ in rows if u.sent < t.sent] + [a for u, _, a in rows if u.done <= t.sent and u.result.ok]
        n = max((_lcp(prompt, s) for s in seen), default=0)
        total += len(prompt)
        shared += n
        blocks += (min(n - 1, len(prompt) - 1) // block_size) * block_size if n > 0 else 0
    return {"tokens": shared / total if total else 0.0, "blocks": blocks / total if total else 0.0}


def summarize(
    cfg: MultiTurnConfig,
    turns: list[TurnResult],
    duration: float,
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
) -> dict[str, Any]:
    """The run's summary: TTFT by turn, throughput, the hit rate on /metrics and the workload's share."""
    ok = [t for t in turns if t.result.ok]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    by_turn = {
        str(k): median([t.result.ttft for t in ok if t.turn == k and t.result.ttft is not None])
        for k in range(1, cfg.turns + 1)
    }
    later = [t.result.ttft for t in ok if t.turn >= 2 and t.result.ttft is not None]
    output_tokens = sum(t.result.output_tokens for t in ok)
    hit_rate = None
    if before is not None and after is not None and after[0] > before[0]:
        hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    return {
        "label": cfg.label,
        "config": asdict(cfg),
        "requests": len(turns),
        "completed": len(ok),
        "errors": len(turns) - len(ok),
        "duration_s": duration,
        "ttft_median_s_by_turn": by_turn,
        "ttft_median_s_turns_2_plus": median(later),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "prefix_cache_hit_rate": hit_rate,
        "prefix_cache_queries": None if before is None or after is None else after[0] - before[0],
        "shared_prefix_share": shared_prefix_share(ok),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the summary as the last line."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.multiturn", description=__doc__.splitlines()[0])
    defaults = MultiTurnConfig()
    ap.add_argument("--url", default=defaults.url)
    ap.add_argument("--model", default=defaults.model)
    ap.add_argument("--conversations", type=int, default=defaults.conversations)
    ap.add_argument("--turns", type=int, default=defaults.turns)
    ap.add_argument("--concurrency", type=int, default=defaults.concurrency)
    ap.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    ap.add_argument("--max-user-chars", type=int, default=defaults.max_user_chars)
    ap.add_argument("--skip", type=int, default=0, help="held-out conversations to pass over first")
    ap.add_argument("--timeout-s", type=float, default=defaults.request_timeout_s)
    ap.add_argument("--allow-remote", action="store_true")
    ap.add_argument("--label", default="", help="a name for this run in the summary")
    ap.add_argument("--out", default=None, help="write the summary and every turn (JSON) here")
    args = ap.parse_args(argv)
    cfg = MultiTurnConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        conversations=args.conversations,
        turns=args.turns,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        max_user_chars=args.max_user_chars,
        skip=args.skip,
        request_timeout_s=args.timeout_s,
        allow_remote=args.allow_remote,
        label=args.label,
    )
    try:
        check_target(cfg.url, cfg.allow_remote)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary, turns = asyncio.run(run_multiturn(cfg))
    if args.out:
        record = summary | {"turns": [_turn_row(t) for t in turns]}
        Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps(summary))
    return 0 if summary["completed"] == summary["requests"] else 1


def _turn_row(t: TurnResult) -> dict[str, Any]:
    r = t.result
    return {"conversation": t.conversation, "turn": t.turn, "sent": t.sent, "done": t.done, "ttft": r.ttft,
            "e2e": r.e2e, "output_tokens": r.output_tokens, "status": r.status, "error": r.error}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
