"""SLO classes, the load-aware request router's ranking, and the SLO autoscaling policy's decisions."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from engines.request import GenerationRequest
from policies.autoscaling import SLOAutoscalingPolicy
from policies.prefix_affinity import HeldPrefixes, conversation_keys, remember_served
from policies.routing import LoadAwareRouter
from policies.slo import SLOSettings, SLOTarget, SLOTracker, latencies
from serve_app.messages import ChatRequest


def test_slo_targets_come_from_the_request_or_its_class():
    s = SLOSettings()
    assert s.target("interactive", None, None) == SLOTarget("interactive", 2.0, 0.1)
    assert s.target("interactive", None, 50) == SLOTarget("interactive", 2.0, 0.05)  # explicit wins
    assert s.target(None, None, None) == SLOTarget() and not SLOTarget().has_target
    with pytest.raises(ValueError, match="unknown SLO class 'gold'"):
        s.target("gold", None, None)
    with pytest.raises(ValueError, match="not among the classes"):
        SLOSettings(default_class="gold")
    assert SLOTarget(None, 1.0, 0.1).met(0.5, 0.1) and not SLOTarget(None, 1.0, 0.1).met(0.5, 0.11)


def test_attainment_is_decided_from_one_clocks_timestamps():
    """TTFT from arrival to the first token; TPOT over the tokens after the first, to the finish."""
    assert latencies(10.0, 10.5, 11.4, 10) == pytest.approx((0.5, 0.1))
    assert latencies(10.0, 10.5, 11.4, 1) == (0.5, None) and latencies(10.0, None, 11.0, 0) == (None, None)
    target = SLOTarget(None, 1.0, 0.1)
    assert target.attained(10.0, 10.5, 11.3, 10) is True
    assert target.attained(10.0, 10.5, 11.5, 10) is False  # TPOT 0.111 s
    assert target.attained(10.0, 11.5, 11.5, 1) is False  # TTFT 1.5 s, no TPOT with one token
    assert SLOTarget().attained(10.0, 11.5, 11.5, 1) is None  # nothing to meet


def test_slo_tracker_counts_a_sliding_window():
    t = SLOTracker(window_s=10)
    for now, met in ((0, True), (3, False), (5, True), (12, True)):
        t.record(now, met)
    assert t.attainment(12) == pytest.approx(2 / 3) and t.count(12) == 3  # the event at t=0 left the window
    assert t.attainment(30) is None


def replica(name: str, running: int, kv: float = 0.0, limit: int = 32):
    rid = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="LLMReplica", app_name="llm"))
    return SimpleNamespace(
        replica_id=rid,
        routing_stats={"num_running": running, "num_waiting": 0, "kv_cache_usage": kv},
        max_ongoing_requests=limit,
    )


def router() -> LoadAwareRouter:
    r = object.__new__(LoadAwareRouter)  # the ranking needs no Serve controller
    r._replica_queue_len_cache = ReplicaQueueLengthCache()
    r._deployment_id = DeploymentID(name="LLMReplica", app_name="llm")
    r._use_replica_queue_len_cache = False  # Serve's own count is set by hand where a test needs it
    r.initialize_state(tight_classes=["interactive"], imbalance=0.25)
    return r


async def route(r: LoadAwareRouter, candidates, request):
    """Serve's side of routing one request: the router's ranks, then the request sent to the first."""
    ranks = await r.choose_replicas(candidates, request)
    r.on_send_request(ranks[0][0].replica_id)
    return ranks


def pending(content: str, slo: str | None = None):
    """A pending `LLMReplica.generate(request, trace_context)` call, as the ingress makes it."""
    generation = GenerationRequest(request_id="id", messages=[{"role": "user", "content": content}])
    return SimpleNamespace(args=[ChatRequest(generation, SLOTarget(slo)), None])


def test_router_ranks_by_load_and_keeps_prefix_affinity_within_the_imbalance():
    asyncio.run(_router_ranking())


async def _router_ranking():
    r = router()
    a, b, c = replica("a", 8), replica("b", 2, kv=0.9), replica("c", 4)  # loads 0.25, 0.51, 0.125
    ranks = await route(r, [a, b, c], pending("hello"))
    assert [x[0].replica_id.unique_id for x in ranks] == ["c", "a", "b"]
    r.on_request_routed(pending("hello"), a.replica_id, None)
    ranks = await route(r, [a, b, c], pending("hello"))
    assert ranks[0][0] is a  # its prefix's replica, 0.125 above the least loaded
    untyped = SimpleNamespace(args=[{"messages": [{"role": "user", "content": "hello"}]}])  # not a ChatRequest
    assert (await route(r, [a, b, c], untyped))[0][0] is c  # no request to read: ranked by load alone
    ranks = await route(r, [a, b, c], pending("hello", slo="interactive"))
    assert ranks[0][0] is c  # a tight class always takes the least loaded
    r._replica_queue_len_cache.update(a.replica_id, 20)  # the router's own count is fresher than the stats
    ranks = await route(r, [a, b, c], pending("hello"))
    assert ranks[0][0] is c and ranks[-1][0] is a  # 0.625 is beyond the imbalance: affinity yields
    assert conversation_keys(pending("hello").args[0].messages) != conversation_keys(pending("hullo").args[0].messages)


def test_router_spreads_a_burst_that_serve_routes_before_sending_any_of_it():
    asyncio.run(_burst())


async def _burst():
    r = router()
    a, b = replica("a", 0), replica("b", 0)
    # Serve chooses a replica for every request of a burst before it sends one, so the stats and Serve's own
    # queue-length count stay where they were: the router counts the choices it has made
    firsts = [(await r.choose_replicas([a, b], pending(f"question {i}")))[0][0] for i in range(16)]
    assert sum(x is a for x in firsts) == 8 and sum(x is b for x in firsts) == 8
    cache = r._replica_queue_len_cache
    for x in firsts:  # then sends them: Serve's count takes each over from the router's
        cache.update(x.replica_id, (cache.get(x.replica_id) or 0) + 1)
        r.on_send_request(x.replica_id)
    assert r.load(a) == r.load(b) == 8 / 32
    # a choice Serve never sends (it took the next rank, or the caller went away) stops counting after unsent_s
    first = (await r.choose_replicas([a, b], pending("late")))[0][0]
    assert r.load(first) == 9 / 32 and r.load(first, now=time.monotonic() + 2 * r.unsent_s) == 8 / 32


def test_router_never_fails_on_a_body_it_cannot_read():
    asyncio.run(_unreadable_bodies())


async def _unreadable_bodies():
    r = router()
    a, c = replica("a", 8), replica("c", 4)
    surrogate = pending("\ud800 hi")  # valid JSON ("\ud800"), not encodable as UTF-8
    assert conversation_keys(surrogate.args[0].messages) != conversation_keys(pending("\ud801 hi").args[0].messages)
    r.on_request_routed(surrogate, a.replica_id, None)
    assert (await route(r, [a, c], surrogate))[0][0] is a  # affinity still works for it
    odd = SimpleNamespace(args=[SimpleNamespace(messages=[{"role": "user", "content": "x"}], slo_class=["unhashable"])])
    ranks = await route(r, [a, c], odd)  # the affinity step raises inside: ranked by load alone
    assert [x[0].replica_id.unique_id for x in ranks] == ["c", "a"]
    r.on_request_routed(odd, c.replica_id, None)


def conversation(*contents: str) -> list[dict[str, str]]:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return [{"role": roles[i], "content": c} for i, c in enumerate(contents)]


def pending_chat(messages):
    return SimpleNamespace(args=[ChatRequest(GenerationRequest(request_id="id", messages=messages)), None])


def test_conversation_keys_chain_over_whole_messages():
    turn1 = conversation("Be brief.", "Name a colour.")
    turn2 = conversation("Be brief.", "Name a colour.", "Red.", "Another?")
    k1, k2 = conversation_keys(turn1), conversation_keys(turn2)
    assert k2[:2] == k1 and [k.chars for k in k2] == [9, 23, 27, 35]  # a growing conversation keeps its keys
    assert conversation_keys(conversation("Be brief!", "Name a colour."))[1] != k1[1]  # every earlier message counts
    assert conversation_keys([{"role": "user", "content": "x"}]) != conversation_keys(
        [{"role": "system", "content": "x"}]
    )
    assert conversation_keys(None) == [] and conversation_keys([{"role": "user", "content": [{"a": 1}]}])


def test_a_replica_reports_the_prefixes_whose_blocks_it_still_holds():
    held = HeldPrefixes()
    messages = conversation("Be brief.", "Name a colour.")
    remember_served(held, messages, "Red.", (11, 22))  # prompt anchored at block 11, + answer at block 22
    next_turn = conversation_keys(
        [*messages, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "?"}]
    )
    assert set(held.report(lambda h: True)) == {k.key for k in next_turn[:3]}
    assert set(held.report(lambda h: h == 11)) == {k.key for k in next_turn[:2]}  # block 22 evicted: forgotten
    assert held.report(lambda h: h == 22) == []
    remember_served(held, messages, None, (None, None))  # nothing cached (prefix caching off): nothing held
    assert held.report(lambda h: True) == []


def test_the_router_scores_replicas_by_the_longest_prefix_they_hold():
    asyncio.run(_prefix_scores())


async def _prefix_scores():
    r = router()
    a, b, c = replica("a", 8), replica("b", 4), replica("c", 2)  # loads 0.25, 0.125, 0.0625
    turn1 = conversation("Be brief.", "Name a colour.")
    turn2 = [*turn1, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    keys = conversation_keys(turn2)
    a.routing_stats["prefix_keys"] = [keys[0].key]  # the system prompt only
    b.routing_stats["prefix_keys"] = [keys[2].key]  # the first turn and its answer
    assert [r.held_chars(x, keys) for x in (a, b, c)] == [keys[0].chars, keys[2].chars, 0]
    assert (await route(r, [a, b, c], pending_chat(turn2)))[0][0] is b  # longest held, though c is idler
    b.routing_stats["prefix_keys"] = []  # b evicted it: a holds the longest prefix, within the imbalance of c
    assert (await route(r, [a, b, c], pending_chat(turn2)))[0][0] is a
    a.routing_stats["prefix_keys"] = []
    assert (await route(r, [a, b, c], pending_chat(turn2)))[0][0] is c  # nobody holds it: least loaded
    # until a replica reports what it served, the router's own record of where a prefix went counts
    r.on_request_routed(pending_chat(turn1), b.replica_id, None)
    assert (await route(r, [a, b, c], pending_chat(turn2)))[0][0] is b
    r.memory_s = 0.0  # ... for memory_s only; then the replicas' reports rule
    assert (await route(r, [a, b, c], pending_chat(turn2)))[0][0] is c


def test_the_ingress_finds_the_router_of_its_process():
    from policies import live_routers

    r = router()
    assert live_routers.router_of("llm", "LLMReplica") is r


def context(n: int, ongoing: float, attainment: float | None, requests: float, state: dict, now: float):
    metrics = {}
    if attainment is not None:
        ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DeploymentID(name="LLMReplica")) for i in range(n)]
        metrics = {"slo_attainment": dict.fromkeys(ids, attainment), "slo_requests": dict.fromkeys(ids, requests / n)}
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=4, target_ongoing_requests=8, upscale_delay_s=10, downscale_delay_s=30
    )
    return AutoscalingContext(
        deployment_id=DeploymentID(name="LLMReplica"),
        deployment_name="LLMReplica",
        app_name="llm",
        current_num_replicas=n,
        target_num_replicas=n,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_autoscaling_policy_decisions():
    p = SLOAutoscalingPolicy()
    assert p(context(2, 4, 0.5, 20, {}, 0))[0] == 3  # SLOs missed under load: one more replica
    assert p(context(2, 40, 1.0, 20, {}, 0))[0] == 5  # more ongoing than 2 x 8: what the load needs
    assert p(context(2, 10, 0.95, 20, {}, 0))[0] == 2  # between the thresholds: hold
    assert p(context(2, 3, 1.0, 20, {}, 0))[0] == 1  # one replica would run at 3/8 < 0.5: scale down
    assert p(context(2, 3, 0.5, 2, {}, 0))[0] == 1  # too few requests to judge attainment
    assert p(context(2, 0, 0.2, 20, {}, 0))[0] == 2  # no growth without load, no shrinking on recent misses
    assert p(context(1, 0, None, 0, {}, 0))[0] == 1


def test_autoscaling_waits_out_the_delays_and_does_not_flap(monkeypatch):
    """Wrapped as Ray Serve wraps it: a wish must persist for upscale_delay_s (10 s) / downscale_delay_s
    (30 s); a load that swings every 5 s changes nothing."""
    clock = [0.0]
    monkeypatch.setattr("ray.serve.autoscaling_policy.time.time", lambda: clock[0])
    policy = _apply_autoscaling_config(SLOAutoscalingPolicy())
    state: dict = {}
    decisions = []
    for tick in range(12):  # swinging: SLOs missed, then idle, every 5 s
        clock[0] = tick * 5.0
        missed = tick % 2 == 0
        n, state = policy(context(2, 10 if missed else 1, 0.5 if missed else 1.0, 20, state, clock[0]))
        decisions.append(n)
    assert decisions == [2] * 12
    n = 2
    for tick in range(12, 16):  # sustained misses: up after 10 s
        clock[0] = tick * 5.0
        n, state = policy(context(n, 10, 0.5, 20, state, clock[0]))
        decisions.append(n)
    assert decisions[12:] == [2, 2, 3, 3]
