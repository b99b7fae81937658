"""The synchronous engine: admits requests, runs scheduler steps on the model runner, samples, stops,
and emits per-request deltas. `AsyncEngine` (async_engine.py) drives it from a background thread."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.attention import attention_keys
from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.errors import ContextLengthError, InvalidRequestError
from engines.kv_cache import PagedKVCache, kv_cache_dtype
from engines.loader import load_model, parse_dtype
from engines.model_runner import ModelRunner, StepResult
from engines.profiling import profile_engine
from engines.request import FinishReason, Request, RequestOutput, RequestStatus
from engines.sampling import SamplingParams, sample
from engines.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engines.spec_params import SpecParams
from engines.step_plan import StepPlan
from engines.tensor_parallel import CacheSpec, ParallelModelRunner, WorkerGroup
from engines.tokenizer import IncrementalDetokenizer, Tokenizer
from engines.verification import VerifyItem, VerifyResult, verify_batch
from kernels.dispatch import KERNEL_MODES, default_kernel_mode, set_kernel_mode
from kernels.quantized_linear import QUANTIZATIONS
from policies.speculation import AdaptivePolicy, AdaptiveSettings, StepRecord, make_policy

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine's load, for metrics and routing."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    kv_free_blocks: int
    num_forwards: int  # target forward passes since start
    busy_seconds: float = 0.0  # wall time spent inside `step` since start
    spec: SpecStats | None = None  # acceptance counters when a drafter is configured


@dataclass
class SpecStats:
    """Speculation counters since start (or since `reset`)."""

    num_steps: int = 0  # request-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    reached_depth: list[int] = field(default_factory=list)  # [d-1]: steps that could accept depth d
    accepted_depth: list[int] = field(default_factory=list)  # [d-1]: steps that accepted depth d

    def record(self, tree: DraftTree, result: VerifyResult) -> None:
        """Count one verified draft."""
        self.num_steps += 1
        self.num_draft_tokens += tree.num_draft
        self.num_accepted_tokens += result.num_accepted
        last = result.path[-1]
        # Depth d could be accepted if depth d-1 was and that node had children to try.
        reachable = result.num_accepted + (1 if any(p == last for p in tree.parents) else 0)
        for d in range(1, reachable + 1):
            while len(self.reached_depth) < d:
                self.reached_depth.append(0)
                self.accepted_depth.append(0)
            self.reached_depth[d - 1] += 1
            if d <= result.num_accepted:
                self.accepted_depth[d - 1] += 1

    def add(self, other: SpecStats) -> None:
        """Accumulate another set of counters into this one."""
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for d, (r, a) in enumerate(zip(other.reached_depth, other.accepted_depth, strict=True)):
            if d == len(self.reached_depth):
                self.reached_depth.append(0)
                self.accepted_depth.append(0)
            self.reached_depth[d] += r
            self.accepted_depth[d] += a

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted draft tokens plus the bonus token, per verification step."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Conditional acceptance at depth 1, 2, ...: accepted at d given d-1 accepted and d tried."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_depth, self.reached_depth, strict=True)]


@dataclass
class EngineConfig:
    """Engine settings: which model, where, and how much KV cache and batching it may use."""

    model: str | None = None  # None/"smollm2-135m-instruct" = embedded default; or a folder or .gguf
    dtype: str = "bfloat16"
    device: str = "cpu"
    # Ranks the target is split over (attention by KV-head groups, MLP by channels): this process is
    # rank 0, the others are Ray actors it starts (in its placement group's bundles when it has one).
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_gib: float = 1.0  # KV memory when num_kv_blocks is not given
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max positions, capped by the KV cache
    # Prompt tokens per step while other requests decode (a decode never waits behind more than one
    # chunk); None = 256 on CPU, 2048 on GPU. With nothing decoding, prompts fill max_num_batched_tokens.
    prefill_chunk_tokens: int | None = None
    # "auto": the model's dtype, except fp32 on a CPU without bf16/fp16 arithmetic (AVX2), where
    # attention over an fp32 cache runs 2-3x faster than over a bf16 one; or a dtype name.
    kv_cache_dtype: str = "auto"
    drafter: str = "lyanna"  # "none", "ngram", "draft-model", "lyanna" or "eagle"
    # Checkpoint for drafter "draft-model" (a causal LM), "lyanna" or "eagle"; for the last two the
    # embedded target's shipped drafter when None.
    draft_model: str | None = None
    spec: SpecParams = field(default_factory=SpecParams)  # default speculation per request
    spec_policy: str = "fixed"  # "fixed": every request's tree as configured; "adaptive": see policies/speculation.py
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    chain_verifier: str = "block"  # stochastic chains at temperature > 0: "block" or "rejection"
    lyanna_resampling: bool = True  # re-sample after rejections (Lyanna Algorithm 2)
    lyanna_token_info_rows: int = 1024  # hot tokens in the collapsed token-info table (0: dense low-rank product)
    lyanna_fusion: bool = True  # verify a re-sampled tree fused with the next draft (off: alone, instead)
    # Lyanna's and EAGLE's decoder layer: "auto" = int8 weights run in one call (kernels/fused_decoder.py) wherever the
    # target runs its fused CPU decoder; "none" = the eager layer in the drafter's own dtype everywhere.
    draft_quantization: str = "auto"
    # Hot paths (paged attention, tree walk, token-info expansion, KV commit): "auto" = Triton kernels on
    # CUDA and the PyTorch references on CPU; "triton" forces the kernels (CPU: TRITON_INTERPRET=1);
    # "torch" forces the references. One mode per process (kernels/dispatch.py); default: $LYANNA_KERNELS.
    kernels: str = field(default_factory=default_kernel_mode)
    # Weight-only quantization of the target's projections and LM head on CPU: "none", "int8" (per
    # channel), "int4" (groups of 32), "gguf" (a GGUF's own Q4_0/Q4_1 blocks as int4, as shipped), or
    # "auto" = "gguf" for a GGUF model (the embedded default) in bf16/fp16 on CPU, else "none".
    quantization: str = "auto"
    # Run the target's eager PyTorch layers for every step (vLLM's enforce_eager): no fused CPU decoder
    # (kernels/fused_decoder.py), which otherwise runs steps of up to 64 new tokens in one call.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {sorted(DRAFTERS)}")
        if self.chain_verifier not in ("block", "rejection"):
            raise ValueError("chain_verifier must be 'block' or 'rejection' (the lossy HSD rule is test-only)")
        self.spec.validate()
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.kv_cache_dtype != "auto":
            parse_dtype(self.kv_cache_dtype)
        if self.draft_quantization not in ("auto", "none"):
            raise ValueError(f"draft_quantization must be 'auto' or 'none', not {self.draft_quantization!r}")
        if self.quantization not in (*QUANTIZATIONS, "auto"):
            raise ValueError(f"quantization must be one of {[*QUANTIZATIONS, 'auto']}, not {self.quantization!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {self.kernels!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")


def stop_holdback(text: str, stops: list[str]) -> int:
    """Chars at the end of `text` that could be the start of a stop string (not yet safe to emit)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class LLMEngine:
    """Loads target and tokenizer, owns KV cache, scheduler and runner; `step()` advances every request.

    Not thread-safe: one thread drives it (`AsyncEngine` owns it from its loop thread). Only
    `make_request`, which reads no mutable state, may be called from elsewhere.
    """

    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.workers: WorkerGroup | None = None  # ranks 1..N-1 of a tensor-parallel target
        if config.tensor_parallel_size > 1:
            self.workers = WorkerGroup(
                config.model, config.dtype, config.device, config.tensor_parallel_size, config.quantization
            )
        try:
            self._init(config)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig) -> None:
        set_kernel_mode(config.kernels)
        tp = None if self.workers is None else self.workers.tp
        loaded = load_model(config.model, config.dtype, config.device, tp=tp, quantization=config.quantization)
        self.quantization = loaded.quantization
        self.model, self.model_config, self.device = loaded.model, loaded.config, loaded.device
        self.model.enforce_eager = config.enforce_eager
        self.checkpoint = loaded.checkpoint
        self.tokenizer = Tokenizer(loaded.checkpoint)
        cfg = self.model_config
        kv_setting = None if config.kv_cache_dtype == "auto" else parse_dtype(config.kv_cache_dtype)
        dtype = kv_cache_dtype(kv_setting, parse_dtype(config.dtype), self.device)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            # per rank: the rank holding the most KV heads sets the block count every rank uses
            most_heads = -(-cfg.num_kv_heads // config.tensor_parallel_size)
            per_token = PagedKVCache.bytes_per_token(cfg.num_layers, most_heads, cfg.head_dim, dtype)
            num_blocks = max(1, int(config.kv_cache_gib * 2**30) // (per_token * config.block_size))
        if dtype == torch.float32 and self.model.dtype != torch.float32:
            self.model.compute_in(torch.float32)  # this CPU would emulate bf16 math: only the GEMMs keep it
        self.kv_cache = PagedKVCache(
            cfg.num_layers, self.model.attn_kv_heads, cfg.head_dim, num_blocks, config.block_size, dtype, self.device
        )
        self.max_model_len = min(cfg.max_position_embeddings, self.kv_cache.capacity_tokens)
        if config.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, config.max_model_len)
        chunk = config.prefill_chunk_tokens or (256 if self.device.type == "cpu" else 2048)
        # A token's projections cost 2 x params FLOPs; attending over one more key, 4 x heads x head_dim
        # per layer: past this many context keys a prompt token's attention outweighs its projections.
        params = sum(p.numel() for p in self.model.parameters()) - self.model.embed_tokens.weight.numel()
        params += self.model.lm_head_weight.numel() if self.model.lm_head is None else 0
        keys_per_token = 2 * params / (4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, chunk, keys_per_token
        )
        if self.workers is None:
            self.runner = ModelRunner(self.model, self.kv_cache, self.device, config.max_num_seqs)
        else:
            compute_fp32 = self.model.compute_dtype == torch.float32 and self.model.dtype != torch.float32
            spec = CacheSpec(num_blocks, config.block_size, str(dtype).removeprefix("torch."), compute_fp32)
            self.workers.start(spec, config.max_num_seqs, config.kernels)
            self.runner = ParallelModelRunner(self.model, self.kv_cache, self.device, config.max_num_seqs, self.workers)
        self.requests: dict[str, Request] = {}
        self.num_forwards = 0
        self.busy_seconds = 0.0
        self.drafter: Drafter | None = make_drafter(config, self)
        self.spec_stats = SpecStats()
        self.policy = make_policy(config.spec_policy, config.adaptive)
        self._step_other_tokens = 0  # the current step's tokens besides decoding roots (the policy's input)
        if self.drafter is not None and isinstance(self.policy, AdaptivePolicy) and config.adaptive.profile:
            profile_engine(self, self.policy)
        log.info(
            "engine ready: %s %s on %s, %d KV blocks x %d tokens, max_model_len %d",
            loaded.checkpoint.name,
            config.dtype,
            self.device,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    # ---- admission -------------------------------------------------------------------------
    def make_request(
        self,
        messages: Any = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        spec: SpecParams | None = None,
        tpot_target_s: float | None = None,
    ) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).

        `spec` overrides the engine's default speculation for this request (`enabled=False` turns
        it off); without a drafter it is ignored. `tpot_target_s` is the request's time-per-output-
        token target, which the adaptive speculation policy keeps to.
        """
        if tpot_target_s is not None and not tpot_target_s > 0:
            raise InvalidRequestError("the TPOT target must be positive", param="slo.tpot_ms")
        params = (params or SamplingParams()).validate(self.tokenizer.vocab_size)
        spec = (spec or self.config.spec).validate()
        if prompt_token_ids is None:
            prompt = self.tokenizer.apply_chat_template(messages)
        else:
            prompt = list(prompt_token_ids)
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt):
                raise InvalidRequestError(
                    "prompt_token_ids must be a non-empty list of valid token ids", param="prompt_token_ids"
                )
        limit = self.max_model_len
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(prompt)} tokens "
                "and leaves no room for a completion."
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.stop_token_ids
        seed = params.resolve_seed()  # drawn once: every positional draw of the request uses it
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=prompt,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            generator=params.make_generator(self.device, seed),
            seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt),
            spec=spec if spec.enabled and self.drafter is not None else None,
            tpot_target_s=tpot_target_s,
        )

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request`."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def add_request(
        self,
        messages: Any = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        spec: SpecParams | None = None,
        tpot_target_s: float | None = None,
    ) -> Request:
        """Validate, tokenize and queue a request; raises InvalidRequestError without side effects."""
        req = self.make_request(messages, params, request_id, prompt_token_ids, spec, tpot_target_s)
        self.add(req)
        return req

    def check_health(self) -> None:
        """Raise if a tensor-parallel rank has died, stopped or hangs (no-op on one rank)."""
        if isinstance(self.runner, ParallelModelRunner):
            self.runner.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (no-op on one rank); the engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its KV blocks; None if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        return self._finish(req, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """Current queue lengths and KV-cache use."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage(),
            kv_free_blocks=self.kv_cache.allocator.num_free,
            num_forwards=self.num_forwards,
            busy_seconds=self.busy_seconds,
            spec=self.spec_stats if self.drafter is not None else None,
        )

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step: draft, forward, verify or sample, stop checks. Returns a delta per
        request that moved."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        record = StepRecord(num_tokens=0, target_s=0.0)
        specs = self._plan_speculation(record) if self.drafter is not None else {}
        # The scheduler grants draft budgets (and their KV blocks) before anything is drafted.
        sched = self.scheduler.schedule({rid: spec.budget + 1 for rid, spec in specs.items()})
        if not sched.scheduled:
            self.policy.observe_step(record)  # nothing ran: the policy's pending step is void
            return []
        if specs:
            self._draft(sched, specs, record)
        start = time.perf_counter()
        plan = StepPlan.from_scheduled(sched.scheduled, self.kv_cache)
        record.num_context = attention_keys(
            [(s.request.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled]
        )
        outputs = self._forward(sched, plan)
        record.num_tokens, record.target_s = plan.num_tokens, time.perf_counter() - start
        trees = [s.draft for s in sched.scheduled if s.draft is not None]
        record.num_trees, record.num_draft_tokens = len(trees), sum(t.num_draft for t in trees)
        self.policy.observe_step(record)
        return outputs

    def _plan_speculation(self, record: StepRecord) -> dict[str, SpecParams]:
        """The tree each decoding request that speculates would like this step, as the policy plans it
        within the request's limits (request id -> its tree); the policy's time goes into `record`."""
        reqs, caps, other_tokens, spans = [], [], 0, []
        for req in self.scheduler.running:
            todo = req.num_tokens - req.num_computed_tokens
            spans.append((req.num_computed_tokens, todo))
            # Leave room for the bonus token within max_tokens (admission already made
            # prompt + max_tokens fit the context, so this bounds positions too).
            depth = min(req.spec.depth, req.max_tokens - len(req.output_token_ids) - 1) if req.spec else 0
            if todo == 1 and depth >= 1:
                reqs.append(req)
                caps.append(req.spec if depth == req.spec.depth else dataclasses.replace(req.spec, depth=depth))
            else:
                other_tokens += todo
        if not reqs:
            return {}
        self._step_other_tokens = other_tokens
        start = time.perf_counter()
        plans = self.policy.plan(reqs, caps, other_tokens, attention_keys(spans))
        record.policy_s = time.perf_counter() - start
        return {r.request_id: p for r, p in zip(reqs, plans, strict=True) if p is not None}

    def _draft(self, sched: SchedulerOutput, specs: dict[str, SpecParams], record: StepRecord) -> None:
        """Draft for the requests granted a budget, each tree within its grant; keep the subtrees the
        policy allocates verification to."""
        granted = [s for s in sched.scheduled if s.draft_budget]
        if not granted:
            return
        drafting = [s.request for s in granted]
        plans = []
        for s in granted:
            spec = specs[s.request.request_id]
            plans.append(dataclasses.replace(spec, budget=min(spec.budget, s.draft_budget - 1)))
        start = time.perf_counter()
        record.num_read = sum(self.drafter.catch_up(drafting))  # all requests' unread context in one pass
        record.read_s = time.perf_counter() - start
        start = time.perf_counter()
        trees = self.drafter.propose(drafting, plans)
        record.draft_s = time.perf_counter() - start
        record.num_drafted = len(drafting)
        record.draft_depth = max(p.depth for p in plans)
        record.draft_width = max(p.width for p in plans)
        start = time.perf_counter()
        kept = self.policy.allocate(drafting, plans, trees, self._step_other_tokens)
        record.policy_s += time.perf_counter() - start
        for s, tree in zip(granted, kept, strict=True):
            s.attach_draft(None if tree is None else tree.prune(s.draft_budget))

    def _forward(self, sched: SchedulerOutput, plan: StepPlan) -> list[RequestOutput]:
        """Run the step through the target; verify drafts, sample the rest (one host copy), emit deltas."""
        result = self.runner.execute(plan)
        self.num_forwards += 1
        sampling: list[tuple[Request, int]] = []  # (request, its logits row)
        drafted: list[tuple[ScheduledRequest, int]] = []  # (scheduled, its index in the plan)
        for b, s in enumerate(sched.scheduled):
            req = s.request
            req.num_forwards += 1
            if s.draft is not None:
                drafted.append((s, b))
                continue
            if req.spec is not None and self.drafter is not None and self.drafter.wants_hidden:
                self.drafter.on_prefill(req, req.num_computed_tokens, result.seq_hidden(b))
            req.num_computed_tokens += s.num_new_tokens
            if plan.logits_start[b + 1] > plan.logits_start[b]:
                sampling.append((req, plan.logits_start[b + 1] - 1))
        sampled: torch.Tensor | None = None
        if sampling:
            reqs = [r for r, _ in sampling]
            rows = torch.tensor([row for _, row in sampling], device=result.logits.device)
            sampled = sample(
                result.logits.index_select(0, rows),
                [r.params for r in reqs],
                [r.seed for r in reqs],
                [len(r.output_token_ids) for r in reqs],  # the output index of the token drawn
            )
        verified: list[VerifyResult] = []
        if drafted:
            items = [
                VerifyItem(s.draft, s.request.params, s.request.seed, len(s.request.output_token_ids))
                for s, _ in drafted
            ]
            logits = torch.cat([result.seq_logits(b) for _, b in drafted])
            verified, sampled_host = verify_batch(items, logits, self.config.chain_verifier, also=sampled)
        else:
            sampled_host = [] if sampled is None else sampled.tolist()  # the step's one host copy
        outputs = self._accept_drafts(drafted, verified, result) if drafted else []
        for (req, _), tok in zip(sampling, sampled_host, strict=True):
            outputs.append(self.append_tokens(req, [tok]))
        return outputs

    def _accept_drafts(
        self, drafted: list[tuple[ScheduledRequest, int]], results: list[VerifyResult], step: StepResult
    ) -> list[RequestOutput]:
        """Commit every accepted path to the KV cache in one copy, emit accepted + bonus tokens."""
        pairs = list(zip(drafted, results, strict=True))
        commits = [(s.request.request_id, s.request.num_computed_tokens, r.path) for (s, _), r in pairs]
        self.runner.move_kv(*self.kv_cache.path_moves(commits))
        outputs = []
        for (s, b), result in zip(drafted, results, strict=True):
            req, tree = s.request, s.draft
            req.num_computed_tokens += len(result.path)
            req.num_spec_steps += 1
            req.num_draft_tokens += tree.num_draft
            req.num_accepted_tokens += result.num_accepted
            self.spec_stats.record(tree, result)
            self.policy.observe_verified(req, tree, result.path)
            outputs.append(self.append_tokens(req, [tree.tokens[i] for i in result.path[1:]] + [result.bonus]))
            if not req.finished:
                hidden = step.seq_hidden(b)
                path = torch.tensor(result.path, device=hidden.device)
                self.drafter.on_verified(req, tree, result, hidden.index_select(0, path))
        return outputs

    def append_tokens(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append generated tokens, applying stop tokens, stop strings and max_tokens; emit the delta."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.params
        reason: FinishReason | None = None
        max_stop = max((len(s) for s in params.stop), default=0)
        for tok in tokens:
            req.output_token_ids.append(tok)
            if tok in req.stop_token_ids:
                reason = FinishReason.STOP
                break
            before = len(req.output_text)
            req.output_text += req.detokenizer.push([tok])
            if params.stop and len(req.output_text) > before:
                hit = self._find_stop(req.output_text, params.stop, max(0, before - max_stop + 1))
                if hit is not None:
                    req.output_text = req.output_text[:hit]
                    reason = FinishReason.STOP
                    break
            if len(req.output_token_ids) >= req.max_tokens:
                reason = FinishReason.LENGTH
                break
        if reason is not None:
            return self._finish(req, reason)
        return self._delta(req)

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def _finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        req.finish_reason = reason
        self.scheduler.finish(req)
        if self.drafter is not None:
            self.drafter.on_finished(req)
        self.policy.on_finished(req.request_id)
        out = self._delta(req)
        del self.requests[req.request_id]
        return out

    def _delta(self, req: Request) -> RequestOutput:
        text = req.output_text
        end = len(text) if req.status is RequestStatus.FINISHED else len(text) - stop_holdback(text, req.params.stop)
        new_text = text[req.num_text_sent : end]
        req.num_text_sent = max(req.num_text_sent, end)
        new_ids = req.output_token_ids[req.num_tokens_sent :]
        req.num_tokens_sent = len(req.output_token_ids)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_forwards=req.num_forwards,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            first_scheduled_time=req.first_scheduled_time,
            num_spec_steps=req.num_spec_steps,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            num_preemptions=req.num_preemptions,
        )

    # ---- offline use -------------------------------------------------------------------------
    def generate(self, conversations: list[Any], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run conversations (message lists, or token-id lists) to completion; results in input order."""
        plist = params if isinstance(params, list) else [params] * len(conversations)
        ids = []
        for conv, p in zip(conversations, plist, strict=True):
            is_ids = isinstance(conv, list) and bool(conv) and isinstance(conv[0], int)
            req = self.add_request(None if is_ids else conv, p, prompt_token_ids=conv if is_ids else None)
            ids.append(req.request_id)
        done: dict[str, Completion] = {i: Completion(i) for i in ids}
        while self.has_unfinished():
            for out in self.step():
                c = done[out.request_id]
                c.token_ids.extend(out.new_token_ids)
                c.text += out.new_text
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.num_prompt_tokens = out.num_prompt_tokens
                    c.num_forwards = out.num_forwards
        return [done[i] for i in ids]


@dataclass
class Completion:
    """A finished generation from `LLMEngine.generate`."""

    request_id: str
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_forwards: int = 0
    token_ids: list[int] = field(default_factory=list)


def _ngram(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.ngram import NgramDrafter

    return NgramDrafter()


def _draft_model(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.draft_model import DraftModelDrafter

    if config.draft_model is None:
        raise ValueError("drafter 'draft-model' needs draft_model (a checkpoint sharing the target's tokenizer)")
    return DraftModelDrafter(config.draft_model, engine)


def _drafter_checkpoint(config: EngineConfig, kind: str) -> str:
    """The configured checkpoint, or the one shipped for the embedded target."""
    from engines.drafters.checkpoint import SHIPPED

    if config.draft_model is not None:
        return config.draft_model
    if config.model not in (None, "smollm2-135m-instruct"):
        raise ValueError(f"drafter {kind!r} needs draft_model (a checkpoint trained for this target)")
    return str(SHIPPED[kind])


def _lyanna(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.checkpoint import load_draft_model, token_info_table
    from engines.drafters.lyanna import LyannaDrafter

    checkpoint = _drafter_checkpoint(config, "lyanna")
    model = load_draft_model(checkpoint, engine, kind="lyanna")
    table = token_info_table(model, checkpoint, config.lyanna_token_info_rows)
    return LyannaDrafter(
        model,
        table,
        resample=config.lyanna_resampling,
        fusion=config.lyanna_fusion,
        fused_layer=_fused_draft_layer(config, engine, model),
        kv_cache=engine.kv_cache,
    )


def _fused_draft_layer(config: EngineConfig, engine: LLMEngine, model):
    """The drafter's layer in one int8 call where the target runs its fused CPU decoder and
    `draft_quantization` allows it; else None (the eager layer)."""
    from engines.drafters.lyanna_model import fused_draft_layer

    if config.draft_quantization == "auto" and engine.model.fused_decoder(engine.kv_cache, 1) is not None:
        return fused_draft_layer(model, engine.kv_cache, config.max_num_seqs)
    return None


def _eagle(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.checkpoint import load_draft_model
    from engines.drafters.eagle import EagleDrafter

    model = load_draft_model(_drafter_checkpoint(config, "eagle"), engine, kind="eagle")
    return EagleDrafter(model, _fused_draft_layer(config, engine, model), engine.kv_cache)


DRAFTERS = {"none": None, "ngram": _ngram, "draft-model": _draft_model, "lyanna": _lyanna, "eagle": _eagle}


def make_drafter(config: EngineConfig, engine: LLMEngine) -> Drafter | None:
    """The drafter named by the config, or None."""
    factory = DRAFTERS[config.drafter]
    return None if factory is None else factory(config, engine)
