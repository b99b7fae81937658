"""Continuous-batching scheduler: waiting and running queues, a per-step token budget shared by
decodes and (chunked) prefills, and recompute-preemption when the KV cache runs out."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engines.draft_tree import DraftTree
from engines.kv_cache import PagedKVCache
from engines.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """Run `num_new_tokens` of this request's tokens, starting at its `num_computed_tokens`.

    With a `draft`, the request is decoding: its one new token is the draft's root and the
    draft's other nodes ride along for verification (`num_new_tokens` counts them all).
    """

    request: Request
    num_new_tokens: int
    draft: DraftTree | None = None


@dataclass
class SchedulerOutput:
    """What one engine step runs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in this step's forward pass."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides each step which requests run and how many tokens each gets.

    Running requests go first, oldest first, so decodes are never starved by new prompts. A decoding
    request's draft tree is verified in the same step when the token budget and the KV cache allow
    it (it is pruned to the budget left, or dropped). A running request that cannot get KV blocks
    preempts the newest running request (freeing its blocks; it recomputes later).
    Waiting requests are admitted in arrival order while the token budget,
    `max_num_seqs` and free blocks allow; a prompt longer than the remaining budget is prefilled in
    chunks over several steps.
    """

    def __init__(self, kv_cache: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._fit_draft(req, n, budget)
            if draft is not None:
                self.kv.allocate(req.request_id, req.num_computed_tokens + draft.size)
                out.scheduled.append(ScheduledRequest(req, draft.size, draft))
                budget -= draft.size
                i += 1
                continue
            while not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self.kv.allocate(req.request_id, req.num_computed_tokens + n)
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
                continue
            break
        # Admit new work only when nothing had to be evicted: admitting while evicting would thrash.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n):
                break
            self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _fit_draft(self, req: Request, n: int, budget: int) -> DraftTree | None:
        """The request's draft, pruned to the token budget, if it is decoding and the KV cache has room."""
        draft, req.draft = req.draft, None  # a draft is good for one step only
        if draft is None or n != 1 or budget < 2:
            return None
        draft = draft.prune(budget)
        if not self.kv.can_allocate(req.request_id, req.num_computed_tokens + draft.size):
            return None
        return draft

    def _preempt(self, req: Request) -> None:
        req.draft = None
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Take a finished or aborted request out of the queues and free its KV blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
