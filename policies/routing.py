"""Request router for the LLM replicas: load- and SLO-aware, with prefix affinity scored by what each
replica holds in its prefix cache (Ray Serve's custom request-router API; set on `LLMReplica` by
`request_router_config` in serve_config.yaml).

Every replica reports its engine load through `record_routing_stats` (running and waiting requests,
KV-cache use); the router adds the requests it has itself sent since (Serve's queue-length cache).
A replica's load is

    ongoing / max_ongoing_requests + kv_weight * KV-cache use

where ongoing also counts the requests this router has chosen the replica for that Serve has not sent yet:
Serve chooses replicas for every request of a burst before it sends any, so without them a burst of
requests arriving together would all rank the same replica first.

Requests of a tight SLO class go to the least-loaded replica. Other requests go to the replica holding
the longest prefix of their conversation in its KV cache (its prefill then starts past it, and its
drafter reads the prefix from the same cache), unless that replica's load exceeds the least-loaded
one's by more than `imbalance`; otherwise they too go to the least loaded. What a replica holds comes
from two sources (policies/prefix_affinity.py): the conversation-prefix keys it reports, those whose
last KV block is still in its prefix cache (so evictions count), and, for `memory_s` after routing, the
router's own record of where it sent each prefix (a report lags a request by its run time plus the
stats period). Longer held prefixes win; equal ones go to the less loaded. Serve's default router
instead probes two random replicas and takes the shorter queue.

Routing never fails a request: a request the router cannot read (a lone surrogate in a message, a
malformed field) is ranked by load alone, since a router that raises leaves the caller waiting
forever. The router also answers, read-only, which replicas its process routes to and their latest
reported stats (`policies.live_routers`): the ingress builds its readiness and replica metrics on that.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Protocol, runtime_checkable

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from policies import live_routers
from policies.prefix_affinity import PrefixKey, conversation_keys, request_messages


@runtime_checkable
class RoutedRequest(Protocol):
    """What the router reads of the request in a pending `LLMReplica.generate(request, ...)` call
    (serve_app.messages.ChatRequest; the policies do not import the serving layer)."""

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The conversation, OpenAI-style."""
        ...

    @property
    def slo_class(self) -> str | None:
        """The request's SLO class, if it names one."""
        ...


def routed_request(pending: PendingRequest | None) -> RoutedRequest | None:
    """The request of a pending `LLMReplica.generate` call (None for other calls)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], RoutedRequest):
        return None
    return pending.args[0]


log = logging.getLogger("ray.serve.lyanna.routing")


class LoadAwareRouter(RequestRouter):
    """Ranks replicas by engine load; tight SLO classes get the least loaded, others prefix affinity."""

    def replicas(self) -> list[RunningReplica]:
        """The replicas Serve reports running (model loaded, health checks passed), with their stats."""
        return list(self.curr_replicas.values())

    def initialize_state(
        self,
        tight_classes: list[str] | None = None,
        imbalance: float = 0.25,
        kv_weight: float = 0.5,
        max_prefixes: int = 10_000,
        memory_s: float = 60.0,
        unsent_s: float = 1.0,
    ) -> None:
        """Settings from `request_router_kwargs`."""
        self.tight_classes = set(tight_classes if tight_classes is not None else ["interactive"])
        self.imbalance = imbalance
        self.kv_weight = kv_weight
        self.max_prefixes = max_prefixes
        self.memory_s = memory_s
        # conversation-prefix key -> (replica it was routed to, when); oldest first
        self.affinity: collections.OrderedDict[int, tuple[ReplicaID, float]] = collections.OrderedDict()
        self._reported: dict[ReplicaID, tuple[Any, set[int]]] = {}  # each replica's latest reported keys
        # replica -> when this router chose it for requests Serve has not sent yet (oldest first); a choice not
        # sent within `unsent_s` is dropped (Serve took another rank, or the request was cancelled)
        self._unsent: dict[ReplicaID, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.unsent_s = unsent_s
        live_routers.register(self._deployment_id.app_name, self._deployment_id.name, self)

    def load(self, replica: RunningReplica, now: float | None = None) -> float:
        """The replica's load: ongoing requests (with those chosen for it and not yet sent) over its limit,
        plus weighted KV-cache use."""
        stats = replica.routing_stats or {}
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        ongoing += self._num_unsent(replica.replica_id, time.monotonic() if now is None else now)
        return ongoing / max(1, replica.max_ongoing_requests) + self.kv_weight * stats.get("kv_cache_usage", 0.0)

    def _num_unsent(self, replica_id: ReplicaID, now: float) -> int:
        """Requests chosen for the replica within `unsent_s` that Serve has not sent yet."""
        unsent = self._unsent.get(replica_id)
        if not unsent:
            return 0
        while unsent and now - unsent[0] > self.unsent_s:
            unsent.popleft()
        return len(unsent)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Replicas in order of preference, one per rank (Serve tries them in turn)."""
        now = time.monotonic()
        ranked = sorted(candidate_replicas, key=lambda r: (self.load(r, now), r.replica_id.unique_id))
        try:
            ranked = self._prefer_home(ranked, pending_request)
        except Exception:  # never fail routing: the caller would wait forever
            log.exception("prefix affinity failed; routing by load")
        if ranked:
            self._unsent[ranked[0].replica_id].append(now)
        return [[r] for r in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Serve sent a request to the replica: its queue-length count now has it, so one choice is settled."""
        super().on_send_request(replica_id)
        unsent = self._unsent.get(replica_id)
        if unsent:
            unsent.popleft()

    def held_chars(self, replica: RunningReplica, keys: list[PrefixKey], now: float | None = None) -> int:
        """Characters of the longest prefix of the conversation (`keys`) the replica holds: reported as
        cached by it, or routed to it by this router within `memory_s`; 0 for none."""
        now = time.monotonic() if now is None else now
        listed = (replica.routing_stats or {}).get("prefix_keys") or ()
        seen = self._reported.get(replica.replica_id)
        if seen is None or seen[0] is not listed:  # a new report: its keys as a set, once
            seen = self._reported[replica.replica_id] = (listed, set(listed))
        reported = seen[1]
        for k in reversed(keys):
            if k.key in reported:
                return k.chars
            routed = self.affinity.get(k.key)
            if routed is not None and routed[0] == replica.replica_id and now - routed[1] <= self.memory_s:
                return k.chars
        return 0

    def _prefer_home(
        self, ranked: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        """Move the replica holding the longest prefix of this conversation to the front, unless it is
        too loaded or the request is of a tight SLO class."""
        request = routed_request(pending_request)
        if request is None or not ranked or request.slo_class in self.tight_classes:
            return ranked
        keys = conversation_keys(request_messages(request))
        if not keys:
            return ranked
        now = time.monotonic()
        held = [self.held_chars(r, keys, now) for r in ranked]
        best = max(range(len(ranked)), key=lambda i: (held[i], -i))  # ties: the less loaded
        home = ranked[best]
        if held[best] > 0 and self.load(home) <= self.load(ranked[0]) + self.imbalance:
            ranked.remove(home)
            ranked.insert(0, home)
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Remember where this conversation's prefixes went."""
        request = routed_request(pending_request)
        try:
            keys = [] if request is None else conversation_keys(request_messages(request))
        except Exception:  # an unreadable request has no affinity
            return
        now = time.monotonic()
        for k in keys:
            self.affinity[k.key] = (replica_id, now)
            self.affinity.move_to_end(k.key)
        while len(self.affinity) > self.max_prefixes:
            self.affinity.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's prefixes."""
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id, None)
        self._unsent.pop(replica_id, None)
        for key in [k for k, (r, _) in self.affinity.items() if r == replica_id]:
            del self.affinity[key]
