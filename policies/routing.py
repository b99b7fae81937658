"""Request router for the LLM replicas: load- and SLO-aware, with prefix affinity (Ray Serve's
custom request-router API; set on `LLMReplica` by `request_router_config` in serve_config.yaml).

Every replica reports its engine load through `record_routing_stats` (running and waiting requests,
KV-cache use); the router adds the requests it has itself sent since (Serve's queue-length cache).
A replica's load is

    ongoing / max_ongoing_requests + kv_weight * KV-cache use

Requests of a tight SLO class go to the least-loaded replica. Other requests go back to the replica
that last served the same conversation prefix (its KV and drafter state are warm, and a relaxed
request does not need the emptiest replica) unless that replica's load exceeds the least-loaded one's
by more than `imbalance`; otherwise they too go to the least loaded. Serve's default router instead
probes two random replicas and takes the shorter queue.

Routing never fails a request: a request the router cannot read (a lone surrogate in a message, a
malformed field) is ranked by load alone, since a router that raises leaves the caller waiting
forever. The router also answers, read-only, which replicas its process routes to and their latest
reported stats (`policies.live_routers`): the ingress builds its readiness and replica metrics on that.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from typing import Protocol, runtime_checkable

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from policies import live_routers


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


def prefix_key(messages: list[dict[str, str]] | None, chars: int) -> str | None:
    """A hash of the conversation's first `chars` characters (None without messages)."""
    if not messages:
        return None
    text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in messages)
    # surrogatepass: a str from JSON may hold a lone surrogate, which strict UTF-8 cannot encode.
    return hashlib.blake2b(text[:chars].encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


log = logging.getLogger("ray.serve.lyanna.routing")


class LoadAwareRouter(RequestRouter):
    """Ranks replicas by engine load; tight SLO classes get the least loaded, others prefix affinity."""

    def replicas(self) -> list[RunningReplica]:
        """The replicas Serve reports running (model loaded, health checks passed), with their stats."""
        return list(self.curr_replicas.values())

    def initialize_state(
        self,
        tight_classes: list[str] | None = None,
        prefix_chars: int = 512,
        imbalance: float = 0.25,
        kv_weight: float = 0.5,
        max_prefixes: int = 10_000,
    ) -> None:
        """Settings from `request_router_kwargs`."""
        self.tight_classes = set(tight_classes if tight_classes is not None else ["interactive"])
        self.prefix_chars = prefix_chars
        self.imbalance = imbalance
        self.kv_weight = kv_weight
        self.max_prefixes = max_prefixes
        self.affinity: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()
        live_routers.register(self._deployment_id.app_name, self._deployment_id.name, self)

    def load(self, replica: RunningReplica) -> float:
        """The replica's load: ongoing requests over its limit, plus weighted KV-cache use."""
        stats = replica.routing_stats or {}
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        return ongoing / max(1, replica.max_ongoing_requests) + self.kv_weight * stats.get("kv_cache_usage", 0.0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Replicas in order of preference, one per rank (Serve tries them in turn)."""
        ranked = sorted(candidate_replicas, key=lambda r: (self.load(r), r.replica_id.unique_id))
        try:
            ranked = self._prefer_home(ranked, pending_request)
        except Exception:  # never fail routing: the caller would wait forever
            log.exception("prefix affinity failed; routing by load")
        return [[r] for r in ranked]

    def _prefer_home(
        self, ranked: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        """Move the replica that last served this conversation prefix to the front, unless it is
        too loaded or the request is of a tight SLO class."""
        request = routed_request(pending_request)
        if request is None:
            return ranked
        key = prefix_key(request.messages, self.prefix_chars)
        if ranked and key is not None and request.slo_class not in self.tight_classes:
            home = self.affinity.get(key)
            match = [r for r in ranked if r.replica_id == home]
            if match and self.load(match[0]) <= self.load(ranked[0]) + self.imbalance:
                ranked.remove(match[0])
                ranked.insert(0, match[0])
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Remember where this prefix went."""
        request = routed_request(pending_request)
        try:
            key = None if request is None else prefix_key(request.messages, self.prefix_chars)
        except Exception:  # an unreadable request has no affinity
            return
        if key is None:
            return
        self.affinity[key] = replica_id
        self.affinity.move_to_end(key)
        while len(self.affinity) > self.max_prefixes:
            self.affinity.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's prefixes."""
        super().on_replica_actor_died(replica_id)
        for key in [k for k, r in self.affinity.items() if r == replica_id]:
            del self.affinity[key]
