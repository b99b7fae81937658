"""The load-test runner: its pieces on synthetic data, and a short headless run against a live server."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.__main__ import main
from loadtest.chaos import ChaosConfig, jobs, run_chaos
from loadtest.client import RequestResult, run_chat
from loadtest.multiturn import MultiTurnConfig, TurnResult, held_out_conversations, run_multiturn, shared_prefix_share
from loadtest.multiturn import summarize as multiturn_summary
from loadtest.report import ScrapedMetrics, percentiles, summarize
from loadtest.runner import LoadTestConfig, Stage, check_target, parse_stages, run_load_test
from loadtest.workload import ChatJob, Workload, load_prompts, parse_mix
from policies.prefix_affinity import conversation_keys
from policies.slo import SLOSettings

ROOT = Path(__file__).resolve().parents[2]


def test_only_loopback_targets_unless_allowed():
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "http://127.9.9.9"):
        check_target(url, allow_remote=False)
    for url in ("http://10.0.0.5:8000", "https://api.example.com", "http://192.168.1.2"):
        with pytest.raises(ValueError, match="not a loopback address"):
            check_target(url, allow_remote=False)
        check_target(url, allow_remote=True)


def test_cli_refuses_a_remote_target_before_sending_anything(capsys):
    assert main(["--url", "http://10.1.2.3:8000", "--stages", "1x1"]) == 2
    assert "refusing to load-test '10.1.2.3'" in capsys.readouterr().err


def test_stages_mix_and_workload():
    assert parse_stages("20x1,60x8,30x0,10@2.5") == [Stage(20, 1), Stage(60, 8), Stage(30, 0), Stage(10, 0, 2.5)]
    with pytest.raises(ValueError):
        parse_stages("0x4")
    assert parse_mix("interactive:3,batch:1") == [("interactive", 3.0), ("batch", 1.0)]
    w = Workload(load_prompts("synthetic", 3, input_words=5), 16, parse_mix("a:1,b:1"), seed=1)
    jobs = [w.next_job() for _ in range(200)]
    assert jobs[0].messages == jobs[3].messages and len(jobs[0].messages[0]["content"].split()) == 5
    assert 70 < sum(j.slo_class == "a" for j in jobs) < 130


def test_summary_percentiles_goodput_and_acceptance():
    assert percentiles([3.0, 1.0, 2.0, 4.0]) == {"p50": 2.0, "p90": 4.0, "p99": 4.0, "mean": 2.5}
    slo = SLOSettings()  # interactive: TTFT 2 s, TPOT 0.1 s
    fast = RequestResult(0.0, "interactive", 200, ttft=0.5, e2e=1.5, output_tokens=11, itl=[0.1] * 10)
    slow = RequestResult(0.0, "interactive", 200, ttft=0.5, e2e=3.5, output_tokens=11, itl=[0.3] * 10)
    failed = RequestResult(0.0, "batch", 503, error="saturated")
    before = ScrapedMetrics(10.0, 5.0)
    after = ScrapedMetrics.parse(
        "# TYPE lyanna_accepted_tokens_per_step histogram\n"
        'lyanna_accepted_tokens_per_step_sum{model="m"} 16.0\n'
        'lyanna_accepted_tokens_per_step_count{model="m"} 8.0\n'
    )
    s = summarize([fast, slow, failed], 10.0, slo, before, after)
    assert s["requests"] == 3 and s["completed"] == 2 and s["error_rate"] == pytest.approx(1 / 3)
    assert s["goodput"] == pytest.approx(0.1) and s["classes"]["interactive"]["slo_attainment"] == 0.5
    assert s["output_token_throughput"] == pytest.approx(2.2)
    assert s["tpot_s"]["p90"] == pytest.approx(0.3) and s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["mean_accepted_tokens_per_step"] == pytest.approx(2.0)  # (16 - 10) / (8 - 5)
    json.dumps(s)


CONTENT = 'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
STOP = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
LENGTH = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
CUT = 'data: {"error":{"message":"the model replica failed","type":"server_error","code":"replica_failed"}}\n\n'
USAGE = 'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
DONE = "data: [DONE]\n\n"
# (what a 200 stream carries, the error kind the client records; None: a success)
STREAMS = {
    "whole": (CONTENT + STOP + USAGE + DONE, None),
    "cut by an error event": (CONTENT + CUT + DONE, "stream_error"),
    "no [DONE]": (CONTENT + STOP + USAGE, "no_done"),
    "no usage": (CONTENT + STOP + DONE, "no_usage"),
    "no finish reason": (CONTENT + USAGE + DONE, "no_finish_reason"),
    "1 of 8 tokens, finish reason length": (CONTENT + LENGTH + USAGE + DONE, "short_answer"),
}


def test_the_client_counts_what_it_sees_cut_and_short_streams_are_errors():
    """A 200 stream that was cut (an error event: its replica died and it could not be resumed), ended
    without [DONE], usage or a finish reason, or stopped short of max_tokens without a stop is a failed
    request in the summary, by kind; a whole stream next to them completes."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = STREAMS[json.loads(request.content)["messages"][0]["content"]][0]
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def send(name: str) -> RequestResult:
        job = ChatJob([{"role": "user", "content": name}], max_tokens=8)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_chat(client, "http://127.0.0.1:8000", "m", job, 0.0)

    results = {name: asyncio.run(send(name)) for name in STREAMS}
    for name, (_, kind) in STREAMS.items():
        assert results[name].text == "Hel" and results[name].error_kind == kind, name
        assert results[name].ok == (kind is None), name
    assert "the model replica failed" in results["cut by an error event"].error
    s = summarize(list(results.values()), 1.0, SLOSettings())
    assert s["requests"] == 6 and s["completed"] == 1 and s["error_rate"] == pytest.approx(5 / 6)
    assert s["error_kinds"] == {k: 1 for _, k in STREAMS.values() if k is not None}


@pytest.mark.slow
def test_headless_run_against_a_live_server(base_url, tmp_path):
    cfg = LoadTestConfig(
        url=base_url,
        stages=[Stage(6.0, 2)],
        prompts="synthetic",
        num_prompts=8,
        input_words=16,
        max_tokens=12,
        slo_mix="interactive:1,batch:1",
        sample_interval_s=0.5,
        out_dir=str(tmp_path),
    )
    summary = asyncio.run(run_load_test(cfg))
    assert summary["errors"] == 0 and summary["completed"] >= 2
    assert summary["output_token_throughput"] > 0 and summary["request_throughput"] > 0
    assert summary["ttft_s"]["p50"] > 0 and summary["e2e_s"]["p99"] >= summary["e2e_s"]["p50"]
    assert set(summary["classes"]) <= {"interactive", "batch"}
    assert summary["mean_accepted_tokens_per_step"] >= 1.0  # scraped from /metrics
    assert summary["replicas_max"] == 1 and len(summary["replicas_over_time"]) >= 3
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["completed"] == summary["completed"]
    for name in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_locust_file_reports_the_latency_metrics(base_url, tmp_path):
    env = os.environ | {"LOADTEST_PROMPTS": "synthetic", "LOADTEST_MAX_TOKENS": "8", "LOADTEST_SLO_MIX": "batch:1"}
    cmd = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--host", base_url, "--headless"]
    # Locust exits 1 when any entry failed, and a missed SLO is one (`slo/batch`): on a busy machine the
    # batch class's TPOT target can be missed. The requests themselves must not fail.
    cmd += ["-u", "2", "-r", "2", "-t", "8s", "--csv", str(tmp_path / "run"), "--only-summary"]
    cmd += ["--exit-code-on-error", "0"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    chat = rows[("POST", "/v1/chat/completions")]
    with open(tmp_path / "run_failures.csv") as f:
        failures = list(csv.DictReader(f))  # which requests failed, and why
    assert int(chat["Request Count"]) >= 2 and int(chat["Failure Count"]) == 0, failures
    for name in ("ttft", "itl", "tpot", "e2e", "output_tokens", "slo/batch"):
        assert int(rows[("METRIC", name)]["Request Count"]) >= 1, name
    assert float(rows[("METRIC", "ttft")]["Median Response Time"]) > 0


def turn(conversation: int, k: int, messages, text: str, sent: float, done: float, ttft: float = 0.1) -> TurnResult:
    res = RequestResult(sent, None, 200, ttft=ttft, e2e=ttft + 0.5, output_tokens=4, text=text)
    return TurnResult(conversation, k, messages, res, sent, done)


def test_multiturn_conversations_and_shared_prefix_share():
    convs = held_out_conversations(3, 4, 100)
    assert len(convs) == 3 and all(len(c) == 4 and all(8 <= len(u.strip()) and len(u) <= 100 for u in c) for c in convs)
    assert held_out_conversations(2, 4, 100, skip=1) == convs[1:]
    first = [{"role": "user", "content": "Tell me about the moon. " * 4}]
    second = [*first, {"role": "assistant", "content": "It orbits the earth."}, {"role": "user", "content": "And?"}]
    turns = [turn(0, 1, first, "It orbits the earth.", 0.0, 1.0), turn(0, 2, second, "Tides.", 1.0, 2.0, ttft=0.3)]
    share = shared_prefix_share(turns)
    # turn 2 repeats turn 1's prompt and answer (about half of both prompts' tokens); whole blocks, less
    assert 0.3 < share["blocks"] < share["tokens"] < 0.6
    alone = shared_prefix_share([turn(0, 2, second, "Tides.", 1.0, 2.0)])
    assert alone["tokens"] == 0.0
    cfg = MultiTurnConfig(turns=2)
    s = multiturn_summary(cfg, turns, 2.0, (100.0, 10.0), (200.0, 80.0))
    assert s["ttft_median_s_by_turn"] == {"1": 0.1, "2": 0.3} and s["ttft_median_s_turns_2_plus"] == 0.3
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.7) and s["output_tokens_per_s"] == 4.0
    json.dumps(s)


@pytest.mark.slow
def test_multiturn_run_reports_ttft_by_turn_and_the_prefix_cache_hit_rate(base_url):
    """Two 3-turn conversations on the live server: later turns re-send what the server just computed,
    and /metrics counts their prompt tokens as prefix-cache hits."""
    cfg = MultiTurnConfig(url=base_url, conversations=2, turns=3, concurrency=2, max_tokens=8, max_user_chars=200)
    summary, turns = asyncio.run(run_multiturn(cfg))
    assert summary["completed"] == summary["requests"] == 6
    assert all(summary["ttft_median_s_by_turn"][k] > 0 for k in ("1", "2", "3"))
    assert summary["prefix_cache_queries"] > 0
    share = summary["shared_prefix_share"]["blocks"]
    assert share > 0.3 and summary["prefix_cache_hit_rate"] == pytest.approx(share, abs=0.15)
    # the replica reports the finished conversations (history + answer) it holds, for the router
    last = turns[-1]
    key = conversation_keys([*last.messages, {"role": "assistant", "content": last.result.text}])[-1].key
    (replica,) = httpx.get(f"{base_url}/debug/engine", timeout=30).json()["replicas"]
    assert key in replica["prefix_keys"] and replica["prefix_cache_hits"] > 0


@pytest.mark.slow
def test_a_chaos_run_kills_the_replica_and_clients_lose_nothing(base_url):
    """`loadtest.chaos` against the live server: its only LLM replica is killed 5 s in; every request
    completes (resumed on the replacement), and every greedy and seeded answer, those in flight at the kill
    among them, equals the same request re-sent alone afterwards. The last test of this module: it leaves the
    replica replaced."""
    cfg = ChaosConfig(
        url=base_url,
        app="llm",
        duration_s=14.0,
        concurrency=4,
        kill_at=[5.0],
        prompts="synthetic",
        num_prompts=8,
        max_tokens=24,
        seeded_share=0.5,
    )
    s = asyncio.run(run_chaos(cfg))
    print({k: s[k] for k in ("sent", "completed", "failed", "resumed", "identical", "compared", "extra_latency_s")})
    assert len(s["kills"]) == 1 and s["kills"][0]["actor"].startswith("SERVE_REPLICA::llm#LLMReplica#")
    assert s["recovered"] and s["failed"] == 0 and s["sent"] == s["completed"] >= 4, s["error_examples"]
    assert s["resumed"] >= 1 and s["in_flight_at_kills"] >= 1
    assert s["compared"] == s["completed"] and s["identical"] == s["compared"], s["differing_jobs"]
    assert s["in_flight_identical"] == s["in_flight_at_kills"]
    assert {j.seed is None for j in jobs(cfg)[: s["sent"]]} == {True, False}  # greedy and seeded among them
