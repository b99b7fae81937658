"""The speculative step executor: everything inside one scheduled step.

    SchedulerOutput ──▶ draft (policy plan → drafter catch-up and propose → policy allocation)
                    ──▶ StepPlan ──▶ one target forward (ModelRunner)
                    ──▶ sample plain rows / verify draft trees (one host copy)
                    ──▶ batched KV commit of the accepted paths
                    ──▶ one StepResult per scheduled request

The scheduler has already granted every decoding request that speculates its draft budget and the KV
blocks for it; the executor drafts within those grants and never changes the scheduler's output. It
does not touch a request's progress either: the engine applies the results (`LLMEngine.update`).
Plain decoding is this executor with no drafter.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from engines.attention import attention_keys
from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.drafters.lyanna import LyannaDrafter
from engines.drafters.text_first import TextFirstDrafter
from engines.kv_cache import PagedKVCache
from engines.logprobs import LogprobRows, LogprobsMode
from engines.model_runner import ModelRunner, StepResult
from engines.request import Request, TokenLogprob
from engines.sampling import SamplingParams, gumbel_argmax, processed_logprobs, sample, vocab_argmax
from engines.scheduler import (
    MULTI_STEP_MAX_SEQS,
    SPEC_ROUNDS_MAX_DEPTH,
    SPEC_ROUNDS_MAX_SEQS,
    ScheduledRequest,
    SchedulerOutput,
)
from engines.spec_decode.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy, StepRecord
from engines.spec_decode.stats import SpecStats, StepProfile
from engines.spec_params import SpecParams
from engines.step_plan import StepPlan
from engines.structured_output import MaskedRows, mask_logits, prune_draft
from engines.verification import VerifyItem, VerifyResult, verify_batch, verify_greedy
from lyanna_kernels.fused_decoder import native_seconds
from lyanna_kernels.spec_rounds import SpecRounds, phase_seconds

log = logging.getLogger(__name__)
# a drafter with more of a request's tokens than this left to read is "behind" (after text drafts): the adaptive
# policy measures native rounds apart there, since they read those tokens first (`choose_rounds`)
ROUNDS_BEHIND_TOKENS = 8


@dataclass
class RequestStepResult:
    """What one step did for one scheduled request, for the engine to apply."""

    request: Request
    num_computed_tokens: int  # tokens whose K/V this step committed (a chunk, a decode token, or a path)
    token_ids: list[int]  # new output tokens: sampled, or accepted drafts + bonus; [] mid-prompt
    num_draft_tokens: int = 0  # draft tokens verified (0: no draft this step)
    num_accepted_tokens: int = 0
    accepted_path: list[int] = field(default_factory=list)  # the verified tree's accepted nodes, root first
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt tokens this chunk scored, when asked
    num_verifications: int = 1  # target forwards that verified a draft (native rounds: several a step)


class SpecDecodeExecutor:
    """Runs scheduled steps: drafting and the in-step speculation policy, the target forward, sampling
    and verification, and the KV commit; one `RequestStepResult` per scheduled request."""

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: PagedKVCache,
        drafter: Drafter | None,
        policy: SpeculationPolicy,
        chain_verifier: str = "block",
        logprobs_mode: LogprobsMode = "raw_logprobs",
        multi_step: int = 1,
    ):
        self.runner = runner
        self.multi_step = multi_step
        self.logprobs_mode = logprobs_mode
        self.kv = kv_cache
        self.drafter = drafter
        self.policy = policy
        self.chain_verifier = chain_verifier
        self.stats = SpecStats()
        self.profile = StepProfile()
        self.num_forwards = 0
        # the last step's kind, tokens emitted, phases' seconds and own seconds, until the engine has applied it
        self._last_step: tuple[str, int, dict[str, float], float] | None = None
        # the last step's outcome kind for the policy ("text", "plain"; None: not one it compares), and requests
        self._last_outcome: tuple[str | None, int] = (None, 0)
        # Lyanna's width-1 chains as native rounds beside the fused decoder (`_execute_spec_rounds`); None: not
        # built yet, False: they do not apply
        self._rounds: SpecRounds | bool | None = None
        # this step's decision between native rounds and the policy's own plan (`_choose_rounds`): (requests, the
        # chain depth, 0 for the plan, whether the drafter was behind), for the policy to measure (`observe_rounds`)
        self._last_rounds: tuple[int, int, bool] | None = None

    def execute(self, sched: SchedulerOutput) -> list[RequestStepResult]:
        """Draft within the granted budgets, run the forward, sample or verify, commit the accepted
        paths' K/V; results in the order of `sched.scheduled`."""
        began = time.perf_counter()
        scheduled = sched.scheduled
        if self.drafter is not None:
            for req, num_cached in sched.cache_hits:  # admitted on cached blocks: the drafter's context for them
                self.drafter.on_cached_prefix(req, num_cached)
        record = StepRecord(num_tokens=0, target_s=0.0)
        self._last_rounds = None
        drafts = self._draft(scheduled, record)
        if record.rounds_depth:
            results = self._execute_spec_rounds(scheduled, record.rounds_depth, began, record)
            if results is not None:
                return results
        # what the policy compares: steps of decoding requests only that verified the text drafter's trees or none
        drafted = [s.request for s, tree in zip(scheduled, drafts, strict=True) if tree is not None]
        outcome = "plain" if not drafted else "text" if self._text_drafted(drafted[0]) else None
        if any(s.request.num_computed_tokens < s.request.num_prompt_tokens for s in scheduled):
            outcome = None
        self._last_outcome = (outcome, len(scheduled))
        steps = self._multi_steps(scheduled, drafts) if not record.num_drafted else 1
        if steps > 1:
            results = self._execute_multi_step(scheduled, steps, record)
            if results is not None:
                self._last_step = (*self._last_step[:3], time.perf_counter() - began)
                return results
        start = time.perf_counter()
        plan = StepPlan.from_scheduled(scheduled, drafts, self.kv)
        spans = [(plan.num_cached[b], plan.query_start[b + 1] - plan.query_start[b]) for b in range(plan.num_seqs)]
        record.num_context = attention_keys(spans)
        forward_start, native = time.perf_counter(), native_seconds()
        step = self.runner.execute_argmax(plan) if self._argmax_step(scheduled, drafts) else None
        if step is None:
            step = self.runner.execute(plan)
        record.forward_s = time.perf_counter() - forward_start
        forward, launch = _native_split(record.forward_s, native_seconds() - native, forward_start - start)
        self.num_forwards += 1
        if step.argmax is not None:
            results = self._accept_argmax(scheduled, drafts, step, record)
        else:
            results = self._sample_and_verify(scheduled, drafts, plan, step, record)
        record.num_tokens, record.target_s = plan.num_tokens, time.perf_counter() - start
        trees = [t for t in drafts if t is not None]
        record.num_trees, record.num_draft_tokens = len(trees), sum(t.num_draft for t in trees)
        self.policy.observe_step(record)
        phases = {
            "policy": record.policy_s,
            "catch_up": record.read_s,
            "draft": record.draft_s + record.text_s,
            "launch": launch,
            "forward": forward,
            "verify": record.target_s - forward - launch - record.commit_s,
            "commit": record.commit_s,
        }
        emitted = sum(len(r.token_ids) for r in results)
        self._last_step = ("tree" if trees else "plain", emitted, phases, time.perf_counter() - began)
        return results

    def finish_step(self, total_s: float) -> None:
        """The engine applied the last step, which took `total_s` seconds in all: its time outside the
        executor goes to the policy (`observe_host`), the step to the profile (`profile`)."""
        if self._last_step is None:
            return
        kind, emitted, phases, own_s = self._last_step
        self._last_step = None
        self.policy.observe_host(max(0.0, total_s - own_s))
        outcome, num_seqs = self._last_outcome
        if outcome is not None:
            self.policy.observe_outcome(outcome, num_seqs, emitted, total_s)
        if self._last_rounds is not None:
            num_seqs, depth, behind = self._last_rounds
            self.policy.observe_rounds(num_seqs, depth, emitted, total_s, behind)
            self._last_rounds = None
        self.profile.add_step(kind, emitted, phases, total_s)

    def on_finished(self, request: Request) -> None:
        """The request ended: drop the drafter's and the policy's state for it."""
        if self.drafter is not None:
            self.drafter.on_finished(request)
        self.policy.on_finished(request.request_id)

    # ---- several decode steps in one call ----------------------------------------------------------
    def _multi_steps(self, scheduled: list[ScheduledRequest], drafts: list[DraftTree | None] | None = None) -> int:
        """How many decode steps this step takes in one call (asked only when nothing was drafted, so the policy
        waits for no measurement of it): 1, unless every scheduled request (at most `MULTI_STEP_MAX_SEQS`) decodes
        (its last token, no draft) and may (`Request.multi_step_ok`), each granted the tokens of further steps
        (a draft grant the policy left unused, or a lookahead grant); then up to `multi_step`, within every
        grant and every request's `max_tokens`."""
        if self.multi_step < 2 or not 0 < len(scheduled) <= MULTI_STEP_MAX_SEQS:
            return 1
        if drafts is None:
            drafts = [None] * len(scheduled)
        most = self.multi_step - 1
        for s, tree in zip(scheduled, drafts, strict=True):
            req = s.request
            if tree is not None or s.num_new_tokens != 1 or req.num_computed_tokens + 1 != req.num_tokens:
                return 1
            if not req.multi_step_ok:
                return 1
            left = req.max_tokens - len(req.output_token_ids) - 1
            most = min(most, s.num_draft_tokens + s.num_lookahead_tokens, left)
        return 1 + max(most, 0)

    def _execute_multi_step(
        self, scheduled: list[ScheduledRequest], steps: int, record: StepRecord | None = None
    ) -> list[RequestStepResult] | None:
        """`steps` greedy decode steps of every scheduled request in one call of the target (its LM head and
        argmax in the call: exactly the tokens and K/V of as many plain steps); each request's results are its
        `steps` tokens, the K/V of its input token and the first `steps` - 1 of them committed. None where the
        model takes no such call (`ModelRunner.execute_greedy`). The call's time goes to the policy, which
        prices plain decoding by it."""
        start, native = time.perf_counter(), native_seconds()
        plan = StepPlan.from_scheduled(scheduled, [None] * len(scheduled), self.kv)
        out = self.runner.execute_greedy(plan, steps)
        if out is None:
            return None
        forward_s = time.perf_counter() - start
        forward, launch = _native_split(forward_s, native_seconds() - native, 0.0)
        hidden, tokens = out  # [steps, B, hidden], [steps, B]
        self.num_forwards += 1
        B = len(scheduled)
        if self.drafter is not None and self.drafter.wants_hidden:  # each request's rows in its positions' order
            rows = hidden.transpose(0, 1).reshape(B * steps, hidden.shape[-1])
            self.drafter.on_prefill([s.request for s in scheduled], rows, list(range(0, B * steps + 1, steps)))
        per_request = tokens.t().tolist()  # the step's one host copy
        seconds = time.perf_counter() - start
        context = attention_keys([(s.request.num_computed_tokens, 1) for s in scheduled])
        self.policy.observe_multi_step(B, steps, seconds, context)
        record = record or StepRecord(num_tokens=0, target_s=0.0)  # what the step's drafting (none kept) took
        phases = {
            "policy": record.policy_s,
            "draft": record.text_s,
            "launch": launch,
            "forward": forward,
            "verify": seconds - forward_s,
        }
        self._last_step = ("multi", B * steps, phases, 0.0)
        return [RequestStepResult(s.request, steps, ids) for s, ids in zip(scheduled, per_request, strict=True)]

    # ---- several rounds of draft and verification in one call ------------------------------------------
    def takes_spec_rounds(self) -> bool:
        """Whether steps of greedy decoding requests may run up to `multi_step` rounds of drafting width-1 chains,
        verifying and accepting them in one native call (`_execute_spec_rounds`): with Lyanna drafting natively
        beside the target's fused decoder, under the fixed policy (whose trees are such chains) or the adaptive
        one (which measures the rounds against its own plans: `SpeculationPolicy.choose_rounds`)."""
        return self._spec_rounds() is not None

    def spec_rounds_max_seqs(self) -> int:
        """The most sequences a step of native rounds takes (0: none runs): `SPEC_ROUNDS_MAX_SEQS` under the fixed
        policy, the adaptive policy's `rounds_max_seqs`."""
        if self._spec_rounds() is None:
            return 0
        policy = self.policy
        most = policy.settings.rounds_max_seqs if isinstance(policy, AdaptivePolicy) else SPEC_ROUNDS_MAX_SEQS
        return min(most, SPEC_ROUNDS_MAX_SEQS)

    def _spec_rounds(self) -> SpecRounds | None:
        if self._rounds is None:
            drafter, model = _model_drafter(self.drafter), getattr(self.runner, "model", None)
            applies = (
                self.multi_step > 1
                and isinstance(self.policy, FixedPolicy | AdaptivePolicy)
                and isinstance(drafter, LyannaDrafter)
                and drafter.takes_rounds()
                and model is not None
                and model.takes_greedy_steps(self.kv)
            )
            if applies:
                assert isinstance(drafter, LyannaDrafter) and drafter.fused_layer is not None
                assert drafter.fuse is not None and drafter.chains is not None
                norm = drafter.model.norm
                self._rounds = SpecRounds(drafter.fused_layer, drafter.fuse, drafter.chains, norm.weight, norm.eps)
            else:
                self._rounds = False
        return self._rounds or None

    def _choose_rounds(self, scheduled: list[ScheduledRequest]) -> int:
        """The chain depth this step runs native rounds at (0: it does not), noted for the policy's measurement:
        under the fixed policy (or for fixed trees) their depth, under the adaptive one its choice (`choose_rounds`)."""
        most = self._rounds_depth(scheduled)
        if not most:
            return 0
        fixed = isinstance(self.policy, FixedPolicy) or any(s.request.spec.fixed for s in scheduled)  # type: ignore[union-attr]
        if fixed:
            return most
        drafter = _model_drafter(self.drafter)
        behind = isinstance(drafter, LyannaDrafter) and any(
            drafter.unread(s.request) > ROUNDS_BEHIND_TOKENS for s in scheduled
        )
        depth = self.policy.choose_rounds(len(scheduled), list(range(1, most + 1)), behind)
        self._last_rounds = (len(scheduled), depth, behind)
        return depth

    def rounds_request_ok(self, req: Request) -> bool:
        """Whether a decoding request's next steps may run as native rounds (`takes_spec_rounds`): greedy, without
        log-probabilities or a grammar, speculating within the rounds' chains (under the fixed policy, or for a
        request with a fixed tree: width 1, at most `SPEC_ROUNDS_MAX_DEPTH` deep)."""
        spec = req.spec
        if spec is None or not req.multi_step_ok or self._spec_rounds() is None:
            return False
        if isinstance(self.policy, FixedPolicy) or spec.fixed:
            return spec.width == 1 and spec.depth <= SPEC_ROUNDS_MAX_DEPTH
        return True

    def _rounds_depth(self, scheduled: list[ScheduledRequest]) -> int:
        """The deepest chain a step may run as native rounds: every scheduled request (at most
        `spec_rounds_max_seqs`) decodes its last token, may run rounds (`rounds_request_ok`) and was granted a draft;
        the shallowest of their limits (`Request.draft_limit`: `max_tokens` cuts them) and grants, at most
        `SPEC_ROUNDS_MAX_DEPTH`. 0: the step runs otherwise."""
        if not 0 < len(scheduled) <= self.spec_rounds_max_seqs():
            return 0
        depth = SPEC_ROUNDS_MAX_DEPTH
        for s in scheduled:
            req = s.request
            if not s.num_draft_tokens or s.num_new_tokens != 1 or req.num_computed_tokens + 1 != req.num_tokens:
                return 0
            limit = req.draft_limit()
            if limit is None or not self.rounds_request_ok(req):
                return 0
            depth = min(depth, limit.depth, limit.budget, s.num_draft_tokens)
        return depth

    def _execute_spec_rounds(
        self, scheduled: list[ScheduledRequest], depth: int, began: float, record: StepRecord
    ) -> list[RequestStepResult] | None:
        """Up to `multi_step` rounds of `depth`-token chains for every scheduled request in one native call
        (lyanna_kernels/spec_rounds.py), each within the tokens and blocks granted to it (its draft and lookahead)
        and its `max_tokens`, and none after a stop token; a request's results are every token the rounds committed.
        None where a request's drafter has no context yet or the call fails (logged): the step then decodes
        without drafts."""
        rounds, drafter, model = self._spec_rounds(), _model_drafter(self.drafter), self.runner.model
        assert rounds is not None and isinstance(drafter, LyannaDrafter)
        requests = [s.request for s in scheduled]
        start = time.perf_counter()
        last_out = drafter.rounds_inputs(requests)
        if last_out is None:
            self._last_rounds = None
            return None
        read_s = time.perf_counter() - start
        rows = [self.kv.block_tables[r.request_id] for r in requests]
        tables = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.int32)  # a slot past them is refused
        for b, row in enumerate(rows):
            tables[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        roots = [r.token_ids(r.num_tokens - 1, r.num_tokens)[0] for r in requests]
        left = [r.max_tokens - len(r.output_token_ids) for r in requests]
        rooms = [min(1 + s.num_draft_tokens + s.num_lookahead_tokens, n) for s, n in zip(scheduled, left, strict=True)]
        stops = sorted(set().union(*(r.stop_token_ids for r in requests)))
        call, native, inside = time.perf_counter(), native_seconds(), phase_seconds()
        target, head = model.fused_decoder(self.kv, 1), model.greedy_head()
        try:
            out = rounds(target, head, roots, [r.num_tokens for r in requests], rooms, tables, last_out, depth,
                         self.multi_step, stops)  # fmt: skip
        except (RuntimeError, MemoryError) as e:  # nothing is committed: the step decodes without drafts
            log.warning("native speculative rounds failed (%s); the step decodes without drafts", e)
            self._last_rounds = None
            return None
        forward_s = time.perf_counter() - call
        forward, launch = _native_split(forward_s, native_seconds() - native, call - start - read_s)
        inside = {k: v - inside[k] for k, v in phase_seconds().items()}  # the call's phases
        results = []
        for b, req in enumerate(requests):
            tokens, accepted = out.tokens[b], out.accepted[b]
            drafter.on_rounds(req, out.hidden[b, : len(tokens)].clone(), last_out[b : b + 1].clone())
            # what the request keeps: its tokens through a stop token and within max_tokens, and the rounds they came
            # from (the counters and the policy count those)
            keep = min(left[b], next((i + 1 for i, tok in enumerate(tokens) if tok in req.stop_token_ids), len(tokens)))
            kept, done = [], 0
            for a in accepted:
                if done >= keep:
                    break
                kept.append(a)
                done += a + 1
            for a in kept:
                self.stats.record_chain(depth, a)
            results.append(
                RequestStepResult(req, len(tokens), tokens[:keep], num_draft_tokens=depth * len(kept),
                                  num_accepted_tokens=sum(kept), num_verifications=len(kept))
            )  # fmt: skip
        self.num_forwards += max(len(r) for r in out.accepted)
        self._last_outcome = (None, len(scheduled))
        # the native call split by its own clock: the drafter's trajectory and chains, its catch-up, the target's
        # forward, LM head and argmax, and acceptance with what the call spent between its phases
        drafting, catching_up = inside["trajectory"] + inside["chains"], inside["catch_up"]
        target_s = inside["forward"] + inside["head"]
        accept = forward - drafting - catching_up - target_s + time.perf_counter() - call - forward_s
        phases = {"policy": record.policy_s, "draft": record.text_s + drafting, "catch_up": read_s + catching_up,
                  "launch": launch, "forward": target_s, "verify": accept}  # fmt: skip
        emitted = sum(len(r.token_ids) for r in results)
        self._last_step = ("rounds", emitted, phases, time.perf_counter() - began)
        return results

    # ---- drafting ----------------------------------------------------------------------------
    def _draft(self, scheduled: list[ScheduledRequest], record: StepRecord) -> list[DraftTree | None]:
        """Per scheduled request, the draft tree it verifies this step (None: no draft). The policy
        plans each granted request's tree within its grant, the drafter drafts them in one batch, and
        the policy allocates verification to subtrees of them."""
        drafts: list[DraftTree | None] = [None] * len(scheduled)
        granted = [b for b, s in enumerate(scheduled) if s.num_draft_tokens]
        if self.drafter is None or not granted:
            return drafts
        other_tokens = sum(s.num_new_tokens for s in scheduled if not s.num_draft_tokens)
        context = attention_keys([(s.request.num_computed_tokens, s.num_new_tokens) for s in scheduled])
        plain_steps = self._multi_steps(scheduled)
        if isinstance(self.drafter, TextFirstDrafter):
            # A step verifies the text drafter's trees or the model drafter's, not both: the model drafter's
            # option is priced against plain decoding as it runs, which a step that verifies text trees no
            # longer is, and its catch-up and levels cost the step as much for one request as for many.
            self.drafter.use_text(set())
            if self.policy.probes_plain(len(scheduled)):
                return drafts
            if self.policy.wants_text_drafts(len(scheduled)) and self._draft_text(
                scheduled, granted, other_tokens, context, plain_steps, drafts, record
            ):
                return drafts
        record.rounds_depth = self._choose_rounds(scheduled)
        if record.rounds_depth:  # the step runs as native rounds (`_execute_spec_rounds`)
            return drafts
        reqs = [scheduled[b].request for b in granted]
        caps = [_cap(scheduled[b]) for b in granted]
        start = time.perf_counter()
        plans = self.policy.plan(reqs, caps, other_tokens, context, plain_steps)
        record.policy_s = time.perf_counter() - start
        chosen = [(b, r, p) for b, r, p in zip(granted, reqs, plans, strict=True) if p is not None]
        if not chosen:
            return drafts
        rows, reqs, plans = [b for b, _, _ in chosen], [r for _, r, _ in chosen], [p for _, _, p in chosen]
        start = time.perf_counter()
        record.num_read = sum(self.drafter.catch_up(reqs))  # every request's unread context in one pass
        record.read_s = time.perf_counter() - start
        start = time.perf_counter()
        trees = self.drafter.propose(reqs, plans)
        record.draft_s = time.perf_counter() - start
        record.num_drafted = len(reqs)
        record.draft_depth = max(p.depth for p in plans)
        record.draft_width = max(p.width for p in plans)
        start = time.perf_counter()
        kept = self.policy.allocate(reqs, plans, trees, other_tokens)
        record.policy_s += time.perf_counter() - start
        kept = _prune_for_grammar(reqs, kept)
        for b, tree in zip(rows, kept, strict=True):
            if tree is None or not tree.num_draft:
                continue
            if tree.num_draft > scheduled[b].num_draft_tokens:  # the policy keeps within the caps it was given
                raise RuntimeError(
                    f"a draft of {tree.num_draft} tokens exceeds the {scheduled[b].num_draft_tokens} granted"
                )
            drafts[b] = tree
        return drafts

    def _text_drafted(self, req: Request) -> bool:
        """Whether the request's tree this step is the text drafter's."""
        return isinstance(self.drafter, TextFirstDrafter) and req.request_id in self.drafter.text_requests

    def _draft_text(
        self,
        scheduled: list[ScheduledRequest],
        granted: list[int],
        other_tokens: int,
        context: int | None,
        plain_steps: int,
        drafts: list[DraftTree | None],
        record: StepRecord,
    ) -> bool:
        """The text drafter's trees for the granted requests (as deep as their grants and `max_tokens` allow),
        those the policy keeps set in `drafts`; whether it kept any."""
        start = time.perf_counter()
        reqs = [scheduled[b].request for b in granted]
        specs = []
        for b, req in zip(granted, reqs, strict=True):
            grant, cap = scheduled[b].num_draft_tokens, _cap(scheduled[b])
            room = req.max_tokens - len(req.output_token_ids) - 1
            specs.append(SpecParams(depth=max(1, min(grant, room)), width=cap.width, budget=grant))
        trees = self.drafter.propose_text(reqs, specs)
        kept = self.policy.choose_text_drafts(reqs, trees, other_tokens, context, plain_steps)
        kept = _prune_for_grammar(reqs, kept)
        chosen = set()
        for b, req, tree in zip(granted, reqs, kept, strict=True):
            if tree is not None and tree.num_draft:
                drafts[b] = tree
                chosen.add(req.request_id)
        self.drafter.use_text(chosen)
        record.text_s = time.perf_counter() - start
        return bool(chosen)

    # ---- forward results -----------------------------------------------------------------------
    @staticmethod
    def _argmax_step(scheduled: list[ScheduledRequest], drafts: list[DraftTree | None]) -> bool:
        """Whether the step needs no more of the target than each row's greedy token: every request greedy,
        without log-probabilities or a grammar, past its prompt (`Request.multi_step_ok`), and decoding one
        token or verifying a tree."""
        return all(
            s.request.multi_step_ok
            and (tree is not None or s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens)
            for s, tree in zip(scheduled, drafts, strict=True)
        )

    def _accept_argmax(
        self,
        scheduled: list[ScheduledRequest],
        drafts: list[DraftTree | None],
        step: StepResult,
        record: StepRecord,
    ) -> list[RequestStepResult]:
        """`_sample_and_verify` for a step of greedy rows (`_argmax_step`) that the target ran with every row's
        argmax (`ModelRunner.execute_argmax`): each plain request's token is its row's argmax, each tree follows
        the argmax from its root (`verify_greedy`); the same tokens and commits as verifying the logits."""
        argmax, starts = step.argmax, step.plan.query_start
        drafted = [b for b, tree in enumerate(drafts) if tree is not None]
        if self.drafter is not None and self.drafter.wants_hidden and len(drafted) < len(scheduled):
            self._hidden_to_drafter(scheduled, drafts, step)
        results = [RequestStepResult(s.request, s.num_new_tokens, []) for s in scheduled]
        for b, tree in enumerate(drafts):
            if tree is None:
                results[b].token_ids = [argmax[starts[b + 1] - 1]]
        if drafted:
            verified = [verify_greedy(drafts[b], argmax[starts[b] : starts[b + 1]]) for b in drafted]
            start = time.perf_counter()
            self._commit(scheduled, drafts, drafted, verified, step, results)
            record.commit_s = time.perf_counter() - start
        return results

    def _hidden_to_drafter(
        self, scheduled: list[ScheduledRequest], drafts: list[DraftTree | None], step: StepResult
    ) -> None:
        """Give the drafter the target's hidden states of every request that did not verify a tree (its
        blocks may serve another's drafter from the prefix cache), in one call."""
        starts = step.plan.query_start
        plain = [b for b in range(len(scheduled)) if drafts[b] is None]
        if len(plain) == len(scheduled):
            hidden, row_starts = step.hidden, starts
        else:
            rows = [r for b in plain for r in range(starts[b], starts[b + 1])]
            hidden = step.hidden.index_select(0, torch.tensor(rows, device=step.hidden.device))
            row_starts = [0]
            for b in plain:
                row_starts.append(row_starts[-1] + starts[b + 1] - starts[b])
        self.drafter.on_prefill([scheduled[b].request for b in plain], hidden, row_starts)

    def _sample_and_verify(
        self,
        scheduled: list[ScheduledRequest],
        drafts: list[DraftTree | None],
        plan: StepPlan,
        step: StepResult,
        record: StepRecord,
    ) -> list[RequestStepResult]:
        """Sample the plain rows and verify the trees (one host copy between them, which also carries
        the log-probabilities requests asked for), commit accepted paths, and tell the drafter and the
        policy what was verified."""
        _mask_for_grammar(scheduled, drafts, plan, step)  # before anything reads the logits
        sampling: list[tuple[int, int]] = []  # (index in the step, its logits row)
        drafted: list[int] = []
        for b, s in enumerate(scheduled):
            if drafts[b] is not None:
                drafted.append(b)
                continue
            if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens:
                sampling.append((b, plan.logits_start[b + 1] - 1))
        if self.drafter is not None and self.drafter.wants_hidden and len(drafted) < len(scheduled):
            self._hidden_to_drafter(scheduled, drafts, step)
        sampled: torch.Tensor | None = None
        if sampling:
            reqs = [scheduled[b].request for b, _ in sampling]
            rows = [row for _, row in sampling]
            logits = step.logits
            if rows != list(range(logits.shape[0])):  # not every row in order (a decode step's): select them
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            sampled = sample(
                logits,
                [r.params for r in reqs],
                [r.seed for r in reqs],
                [len(r.output_token_ids) for r in reqs],  # the output index of the token drawn
            )
        logprob_rows, owners = self._logprob_rows(scheduled, drafts, plan, step, sampling, sampled)
        also = sampled
        if logprob_rows:
            payload = logprob_rows.gather(step.logits, self.logprobs_mode)
            also = payload if sampled is None else torch.cat([sampled, payload])
        verified: list[VerifyResult] = []
        if drafted:
            items = []
            for b in drafted:
                req = scheduled[b].request
                items.append(VerifyItem(drafts[b], req.params, req.seed, len(req.output_token_ids)))
            logits = torch.cat([step.seq_logits(b) for b in drafted])
            verified, also_host = verify_batch(items, logits, self.chain_verifier, also=also)
        else:
            also_host = [] if also is None else also.tolist()  # the step's one host copy
        sampled_host, logprobs_host = also_host[: len(sampling)], also_host[len(sampling) :]
        results = [RequestStepResult(s.request, s.num_new_tokens, []) for s in scheduled]
        for (b, _), token in zip(sampling, sampled_host, strict=True):
            results[b].token_ids = [token]
        if drafted:
            start = time.perf_counter()
            self._commit(scheduled, drafts, drafted, verified, step, results)
            record.commit_s = time.perf_counter() - start
        if logprob_rows:
            self._attach_logprobs(logprob_rows.unpack(logprobs_host), owners, results)
        self._chain_logprobs(scheduled, drafts, drafted, verified, plan, step, results)
        return results

    # ---- log-probabilities ----------------------------------------------------------------------
    def _logprob_rows(
        self,
        scheduled: list[ScheduledRequest],
        drafts: list[DraftTree | None],
        plan: StepPlan,
        step: StepResult,
        sampling: list[tuple[int, int]],
        sampled: torch.Tensor | None,
    ) -> tuple[LogprobRows, list[tuple[int, str, int]]]:
        """The rows whose log-probabilities this step returns, with their owners (index in the step,
        "output" / "prompt" / "tree", count): each sampled row scores its sampled token; a prompt chunk
        scores the next prompt token at each row; every node of a deterministic draft tree scores the
        target's own draw there (the token emitted after the node when it lies on the accepted path:
        the argmax, or the positional Gumbel draw `verify_batch` makes). Stochastic chains are scored
        after verification (`_chain_logprobs`)."""
        rows = LogprobRows.empty()
        owners: list[tuple[int, str, int]] = []
        device = step.logits.device
        for m, (b, row) in enumerate(sampling):
            params = scheduled[b].request.params
            if params.logprobs is not None:
                rows.add([row], sampled[m : m + 1], params, params.logprobs)
                owners.append((b, "output", 1))
        for b, s in enumerate(scheduled):
            req = s.request
            wanted = req.prompt_logprob_rows(req.num_computed_tokens, s.num_new_tokens)
            if wanted:
                first = plan.logits_start[b]
                # StepPlan gives a prompt-logprobs chunk a logits row at each of its tokens that needs one
                chunk_rows = plan.logits_indices[first : plan.logits_start[b + 1]]
                local = {r - plan.query_start[b]: first + i for i, r in enumerate(chunk_rows)}
                tokens = [req.prompt_token_ids[req.num_computed_tokens + r + 1] for r in wanted]
                rows.add(
                    [local[r] for r in wanted],
                    torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True),
                    req.params,
                    req.params.prompt_logprobs,
                )
                owners.append((b, "prompt", len(wanted)))
        trees = [
            b
            for b, tree in enumerate(drafts)
            if tree is not None
            and scheduled[b].request.params.logprobs is not None
            and not _stochastic_chain(tree, scheduled[b].request.params)
        ]
        if trees:
            node_rows = [plan.logits_start[b] + n for b in trees for n in range(drafts[b].size)]
            index = torch.tensor(node_rows, dtype=torch.long).to(device, non_blocking=True)
            logits = step.logits.index_select(0, index)
            draws = vocab_argmax(logits)
            drawn = [i for i, b in enumerate(trees) if not scheduled[b].request.params.greedy]
            if drawn:
                offsets = [0, *accumulate(drafts[b].size for b in trees)]
                local = [offsets[i] + n for i in drawn for n in range(drafts[trees[i]].size)]
                reqs = [scheduled[trees[i]].request for i in drawn]
                sizes = [drafts[trees[i]].size for i in drawn]
                params = [r.params for r, k in zip(reqs, sizes, strict=True) for _ in range(k)]
                seeds = [r.seed for r, k in zip(reqs, sizes, strict=True) for _ in range(k)]
                positions = [
                    len(r.output_token_ids) + d
                    for r, i in zip(reqs, drawn, strict=True)
                    for d in drafts[trees[i]].depths
                ]
                at = torch.tensor(local, dtype=torch.long).to(device, non_blocking=True)
                draws = draws.index_copy(
                    0, at, gumbel_argmax(processed_logprobs(logits.index_select(0, at), params), seeds, positions)
                )
            offset = 0
            for b in trees:
                size, params = drafts[b].size, scheduled[b].request.params
                rows.add(node_rows[offset : offset + size], draws[offset : offset + size], params, params.logprobs)
                owners.append((b, "tree", size))
                offset += size
        return rows, owners

    @staticmethod
    def _attach_logprobs(
        entries: list[TokenLogprob], owners: list[tuple[int, str, int]], results: list[RequestStepResult]
    ) -> None:
        """Hand each request its log-probabilities: the sampled token's, the prompt chunk's, or those of
        the nodes on its accepted path (node path[j]'s draw is the j-th emitted token)."""
        offset = 0
        for b, kind, count in owners:
            mine, offset = entries[offset : offset + count], offset + count
            if kind == "prompt":
                results[b].prompt_logprobs = mine
                continue
            if kind == "output":
                results[b].logprobs = mine
                continue
            path = results[b].accepted_path
            chosen = [mine[node] for node in path]
            if [e.token_id for e in chosen] != results[b].token_ids:
                raise RuntimeError("log-probabilities were read for other tokens than the verified ones")
            results[b].logprobs = chosen

    def _chain_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        drafts: list[DraftTree | None],
        drafted: list[int],
        verified: list[VerifyResult],
        plan: StepPlan,
        step: StepResult,
        results: list[RequestStepResult],
    ) -> None:
        """Log-probabilities for stochastic chains (the draft-model drafter), whose bonus token is a
        residual draw known only after verification: one more gather and host copy, in steps where such
        a request asked for them."""
        rows = LogprobRows.empty()
        chains = []
        for b, result in zip(drafted, verified, strict=True):
            params = scheduled[b].request.params
            if params.logprobs is None or not _stochastic_chain(drafts[b], params):
                continue
            tokens = results[b].token_ids
            node_rows = [plan.logits_start[b] + node for node in result.path]
            rows.add(
                node_rows, torch.tensor(tokens, dtype=torch.long, device=step.logits.device), params, params.logprobs
            )
            chains.append(b)
        if rows:
            entries = rows.unpack(rows.gather(step.logits, self.logprobs_mode).tolist())
            offset = 0
            for b in chains:
                n = len(results[b].token_ids)
                results[b].logprobs, offset = entries[offset : offset + n], offset + n

    def _commit(
        self,
        scheduled: list[ScheduledRequest],
        drafts: list[DraftTree | None],
        drafted: list[int],
        verified: list[VerifyResult],
        step: StepResult,
        results: list[RequestStepResult],
    ) -> None:
        """Move every accepted path's K/V into place in one copy; record and report each verification."""
        commits = [
            (scheduled[b].request.request_id, scheduled[b].request.num_computed_tokens, r.path)
            for b, r in zip(drafted, verified, strict=True)
        ]
        self.runner.move_kv(*self.kv.path_moves(commits))
        # every accepted path's hidden states in one gather (one host-to-device copy of the rows)
        rows = [step.plan.query_start[b] + i for b, r in zip(drafted, verified, strict=True) for i in r.path]
        rows_on_device = torch.tensor(rows).to(step.hidden.device, non_blocking=True)
        path_hidden = step.hidden.index_select(0, rows_on_device).split([len(r.path) for r in verified])
        for b, result, hidden in zip(drafted, verified, path_hidden, strict=True):
            req, tree = scheduled[b].request, drafts[b]
            self.stats.record(tree, result)
            if self._text_drafted(req):
                self.policy.observe_text(tree, result.path)
            else:
                self.policy.observe_verified(req, tree, result.path)
            self.drafter.on_verified(req, tree, result, hidden)
            results[b] = RequestStepResult(
                req,
                num_computed_tokens=len(result.path),
                token_ids=[tree.tokens[i] for i in result.path[1:]] + [result.bonus],
                num_draft_tokens=tree.num_draft,
                num_accepted_tokens=result.num_accepted,
                accepted_path=result.path,
            )


def _model_drafter(drafter: Drafter | None) -> Drafter | None:
    """The model drafter: the drafter itself, or the one beside a text drafter."""
    return drafter.model if isinstance(drafter, TextFirstDrafter) else drafter


def _native_split(forward_s: float, native_s: float, before_s: float) -> tuple[float, float]:
    """A step's forward phase split in two for the profile: the model's own time (the fused decoder's native calls
    where it ran them, else the whole forward) and the launch (building the step's plan, `before_s`, and the Python
    around the native calls)."""
    if native_s <= 0.0:
        return forward_s, before_s
    native_s = min(native_s, forward_s)
    return native_s, before_s + forward_s - native_s


def _stochastic_chain(tree: DraftTree, params: SamplingParams) -> bool:
    """Whether `verify_batch` verifies this draft as a stochastic chain (a draft model's sampled draft)."""
    return not params.greedy and tree.draft_probs is not None


def _prune_for_grammar(reqs: list[Request], trees: list[DraftTree | None]) -> list[DraftTree | None]:
    """Each constrained request's tree without the draft tokens its grammar forbids (and their subtrees):
    the masked target could never accept them."""
    return [
        tree if tree is None or req.grammar is None else prune_draft(req.grammar, tree, req.params)
        for req, tree in zip(reqs, trees, strict=True)
    ]


def _mask_for_grammar(
    scheduled: list[ScheduledRequest], drafts: list[DraftTree | None], plan: StepPlan, step: StepResult
) -> None:
    """Mask in place the logits rows that constrained requests sample or verify (a tree node's row gets
    the grammar's mask after the path root..node): masks filled on the host, one copy to the device."""
    rows = MaskedRows()
    for b, s in enumerate(scheduled):
        req = s.request
        if req.grammar is None:
            continue
        if drafts[b] is not None:
            rows.add(req.grammar, drafts[b], plan.logits_start[b])
        elif req.num_computed_tokens + s.num_new_tokens == req.num_tokens:  # the row it samples from
            rows.add(req.grammar, None, plan.logits_start[b + 1] - 1)
    mask_logits(step.logits, rows)


def _cap(s: ScheduledRequest) -> SpecParams:
    """The largest tree a granted request may draft: its limit, within its grant."""
    limit = s.request.draft_limit()
    if limit is None:
        raise RuntimeError(f"request {s.request.request_id!r} was granted a draft it may not make")
    return limit if limit.budget <= s.num_draft_tokens else dataclasses.replace(limit, budget=s.num_draft_tokens)
