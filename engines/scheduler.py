"""Continuous-batching scheduler: waiting and running queues, a per-step token budget shared by
decodes and (chunked) prefills, and recompute-preemption when the KV cache runs out."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.kv_cache import PagedKVCache
from engines.request import Request, RequestStatus

MAX_FINISHED_PREFIXES = 1024  # finished requests whose `FinishedPrefix` waits for its reader
# Decodes that run several steps a call at most (`multi_step`): on a 2-core CPU four steps a call decode 1.15x as
# fast at batch 1 and 4, 1.07x at 8 and no faster at 16, where the host's share of a step is small and a
# request arriving waits for the whole call.
MULTI_STEP_MAX_SEQS = 8
# Sequences whose width-1 drafts take several rounds a call at most (the executor's spec rounds): as many as multi-step
# decodes (a request arriving waits for the whole call).
SPEC_ROUNDS_MAX_SEQS = MULTI_STEP_MAX_SEQS
SPEC_ROUNDS_MAX_DEPTH = 3  # the deepest chain the rounds run: the grant of further rounds is sized by it


@dataclass(frozen=True)
class FinishedPrefix:
    """What the prefix cache holds of a finished request: the chain hashes of its last cached block within
    the prompt and overall (None where none), and its output text (a conversation's next turn)."""

    prompt_anchor: int | None
    full_anchor: int | None
    output_text: str


@dataclass
class ScheduledRequest:
    """Run `num_new_tokens` of this request's tokens, starting at its `num_computed_tokens`.

    A decoding request (one new token, its last) may also verify up to `num_draft_tokens` draft tokens
    in this step: the step's token budget and the KV blocks for them are reserved; the executor
    decides how many it drafts (from none to all of them).
    """

    request: Request
    num_new_tokens: int
    num_draft_tokens: int = 0  # draft tokens granted (the root, its new token, is not counted)
    num_lookahead_tokens: int = 0  # tokens of further decode steps granted (or of further rounds: spec rounds)


@dataclass
class SchedulerOutput:
    """What one engine step runs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests admitted this step with a prefix-cache hit, and the tokens the hit covers (their
    # `num_computed_tokens` start there; the drafter rebuilds its context state for them).
    cache_hits: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens this step may run: new tokens plus the draft tokens granted."""
        return sum(s.num_new_tokens + s.num_draft_tokens + s.num_lookahead_tokens for s in self.scheduled)


class Scheduler:
    """Decides each step which requests run and how many tokens each gets.

    Running requests go first, oldest first, so decodes are never starved by new prompts. A decoding
    request that speculates is granted as many draft tokens as its limit (`Request.draft_limit`), the
    token budget and the KV cache allow (blocks allocated before the drafter runs, so no draft is made
    to be thrown away). With `multi_step` > 1, in a step of decodes only, a decoding request that does not
    speculate but may take several decode steps in one call (`Request.multi_step_ok`) is granted the tokens
    and blocks of up to `multi_step` - 1 further steps the same way (engines/spec_decode/executor.py takes
    them). A running
    request that cannot get KV blocks preempts the newest running request (freeing its blocks; it
    recomputes later). Waiting requests are admitted in arrival order while the token budget,
    `max_num_seqs` and free blocks allow. Prompts are read in chunks: while any request is decoding, a
    step carries at most one chunk's work of prompt, `prefill_chunk_tokens` tokens at the start of a
    prompt and fewer further in, where each token's attention over the context read so far costs
    more (a token at context c costs 1 + c / `attention_keys_per_token` tokens' worth), so a decode
    step never waits behind more than one chunk; with nothing decoding, prompts fill the token budget.

    With prefix caching on, a request is admitted with the cached blocks of its longest cached prefix
    (none for a request asking for prompt log-probabilities: it needs every prompt row's logits) and
    computes from there. A request whose next full blocks are being computed right now by other
    requests' prefills (the same prompt, as `n` > 1 fans out, or a long shared system prompt) waits until
    they are cached rather than computing them twice, when they make at least half of what it has left
    to compute; requests behind it may go first. A step's blocks
    become hits after it: the blocks each request completed are cached at the start of the next
    `schedule` (and when a request finishes or is preempted).
    """

    def __init__(
        self,
        kv_cache: PagedKVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_tokens: int | None = None,
        attention_keys_per_token: float | None = None,
        multi_step: int = 1,
    ):
        self.kv = kv_cache
        self.multi_step = multi_step
        # the most sequences a step of the executor's native rounds takes (SpecDecodeExecutor.spec_rounds_max_seqs;
        # 0: it runs none), whose requests are granted further rounds
        self.spec_rounds_max_seqs = 0
        self.rounds_request_ok: Callable[[Request], bool] = lambda req: False  # SpecDecodeExecutor.rounds_request_ok
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens or max_num_batched_tokens
        # Context keys whose attention costs as much as one token's projections (None: attention is free).
        self.attention_keys_per_token = attention_keys_per_token
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # What the prefix cache keeps of the latest finished requests, for prefix-aware routing.
        self.finished_prefixes: OrderedDict[str, FinishedPrefix] = OrderedDict()

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests, their token counts and draft grants, allocating their KV blocks."""
        out = SchedulerOutput()
        if self.kv.prefix_caching:
            for req in self.running:  # the last step's completed blocks become hits from now on
                self._cache_blocks(req)
        budget = self.max_num_batched_tokens
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        prefill_budget = self.prefill_chunk_tokens if decoding else budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo, budget) if todo == 1 else min(todo, budget, self._chunk(req, prefill_budget))
            if n == 0:
                i += 1
                continue
            granted = self._grant_draft(req, budget) if todo == 1 else 0
            if granted:
                self.kv.allocate(req.request_id, req.num_computed_tokens + 1 + granted)
                out.scheduled.append(ScheduledRequest(req, 1, num_draft_tokens=granted))
                budget -= 1 + granted
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
                if todo > 1:
                    prefill_budget -= self._chunk_cost(req, n)
                i += 1
                continue
            break
        # Admit new work only when nothing had to be evicted: admitting while evicting would thrash.
        w = 0
        while (
            w < len(self.waiting)
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            req = self.waiting[w]
            hit: list[int] = []
            lookup = self.kv.prefix_caching and req.params.prompt_logprobs is None
            if lookup:
                hit, pending = self.kv.match(req.request_id, req.token_ids, req.num_tokens)
                # Blocks another prompt computes now, worth half of what it has to compute: take them
                # once cached (a short shared head, the chat template's system prompt, is not worth a step).
                if 2 * pending * self.kv.block_size >= req.num_tokens - len(hit) * self.kv.block_size:
                    w += 1
                    continue
            cached = len(hit) * self.kv.block_size
            n = min(req.num_tokens - cached, budget, self._chunk(req, prefill_budget, cached))
            if n == 0 or not self.kv.can_allocate_with(req.request_id, hit, cached + n):
                break
            if lookup:
                self.kv.attach(req.request_id, hit, req.num_tokens)
                if req.num_preemptions == 0:
                    self.kv.record_lookup(req.num_prompt_tokens, cached)
                if cached:
                    out.cache_hits.append((req, cached))
            req.num_computed_tokens = cached
            self.kv.allocate(req.request_id, cached + n)
            del self.waiting[w]
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            prefill_budget -= self._chunk_cost(req, n)
        self._grant_lookaheads(out, budget)
        if self.kv.prefix_caching:
            for s in out.scheduled:  # a step writes only into blocks its request holds alone
                self.kv.check_writable(s.request.request_id, s.request.num_computed_tokens)
        return out

    def _cache_blocks(self, req: Request) -> None:
        self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens, req.num_tokens)

    def _chunk(self, req: Request, work: float, context: int | None = None) -> int:
        """Prompt tokens of `req` that fit `work` (in tokens at context 0) at its current context (or at
        `context` tokens)."""
        if work <= 0:
            return 0
        context = req.num_computed_tokens if context is None else context
        per_token = 1.0 if self.attention_keys_per_token is None else 1 + context / self.attention_keys_per_token
        return max(1, int(work / per_token))

    def _chunk_cost(self, req: Request, n: int) -> float:
        """Work (tokens at context 0) of `n` prompt tokens of `req` read from its current context."""
        if self.attention_keys_per_token is None:
            return n
        return n * (1 + req.num_computed_tokens / self.attention_keys_per_token)

    def _grant_draft(self, req: Request, budget: int) -> int:
        """Draft tokens a decoding request may verify besides its root: its limit's budget, cut to the
        step's token budget and to the KV blocks free; 0 for none."""
        limit = req.draft_limit()
        if limit is None:
            return 0
        have = len(self.kv.block_tables.get(req.request_id, ()))
        room = (have + self.kv.allocator.num_free) * self.kv.block_size - req.num_computed_tokens
        return max(0, min(limit.budget, budget - 1, room - 1))

    def _grant_lookaheads(self, out: SchedulerOutput, budget: int) -> None:
        """In a step of decodes only (no prompt read, nothing preempted, at most `MULTI_STEP_MAX_SEQS`), grant
        each request that does not speculate but may take several decode steps a call the tokens and blocks
        of up to `multi_step` - 1 more (in a step the executor may run as native rounds, `spec_rounds_max_seqs`, a
        request granted a draft those of up to
        `multi_step` - 1 more rounds of a draft as large), within its `max_tokens`, the `budget` of tokens left
        and the free KV blocks."""
        if self.multi_step < 2 or not 0 < len(out.scheduled) <= MULTI_STEP_MAX_SEQS or out.preempted:
            return
        for s in out.scheduled:  # a prompt is read, or a request takes one step a call: one step for all
            if s.request.num_tokens - s.request.num_computed_tokens != 1 or not s.request.multi_step_ok:
                return
        for i, s in enumerate(out.scheduled):
            req, drafts = s.request, s.num_draft_tokens
            if req.spec is None and not drafts:
                want = self.multi_step - 1
            elif drafts and len(out.scheduled) <= self.spec_rounds_max_seqs and self.rounds_request_ok(req):
                want = (self.multi_step - 1) * (min(drafts, SPEC_ROUNDS_MAX_DEPTH) + 1)
            else:
                continue
            have = len(self.kv.block_tables.get(req.request_id, ()))
            room = (have + self.kv.allocator.num_free) * self.kv.block_size - req.num_computed_tokens - 1 - drafts
            left = req.max_tokens - len(req.output_token_ids) - 1
            ahead = max(0, min(want, left, budget, room))
            if ahead:
                self.kv.allocate(req.request_id, req.num_computed_tokens + 1 + drafts + ahead)
                out.scheduled[i] = ScheduledRequest(req, 1, num_draft_tokens=drafts, num_lookahead_tokens=ahead)
                budget -= ahead

    def _preempt(self, req: Request) -> None:
        self._cache_blocks(req)  # what it computed stays findable: it may hit its own blocks when it resumes
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
        self._cache_blocks(req)  # its blocks stay cached: a conversation's next turn hits them
        if self.kv.prefix_caching:
            anchors = self.kv.prefix_anchors(req.request_id, req.num_prompt_tokens)
            self.finished_prefixes[req.request_id] = FinishedPrefix(*anchors, req.output_text)
            if len(self.finished_prefixes) > MAX_FINISHED_PREFIXES:
                self.finished_prefixes.popitem(last=False)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
