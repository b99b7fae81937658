"""The synchronous engine: admits requests and steps them, schedule -> execute -> update.

The scheduler picks each step's requests, token counts and draft grants (`SchedulerOutput`); the
speculative step executor (engines/spec_decode/) drafts, runs the target, samples or verifies and
commits the KV cache; the engine applies the results: progress, stop checks, detokenized deltas.
`AsyncEngine` (async_engine.py) drives it from a background thread."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.cuda_graphs import StepGraphs, graph_buckets
from engines.drafters.factory import make_drafter
from engines.engine_config import EngineConfig
from engines.errors import ContextLengthError, InvalidRequestError
from engines.kv_cache import PagedKVCache, kv_cache_dtype
from engines.loader import cache_root, load_model, parse_dtype, parse_kv_cache_dtype
from engines.model_runner import ModelRunner
from engines.request import FinishReason, GenerationRequest, Request, RequestOutput, RequestStatus, TokenLogprob
from engines.sampling import SamplingParams
from engines.scheduler import FinishedPrefix, Scheduler
from engines.spec_decode.executor import RequestStepResult, SpecDecodeExecutor
from engines.spec_decode.policy import AdaptivePolicy, make_policy
from engines.spec_decode.profile import profile_or_reuse
from engines.spec_decode.stats import SpecStats
from engines.spec_params import SpecParams
from engines.structured_output import StructuredOutputCompiler
from engines.tensor_parallel import CacheSpec, ParallelModelRunner, WorkerGroup
from engines.tokenizer import IncrementalDetokenizer, Tokenizer
from lyanna_kernels import fused_decoder
from lyanna_kernels.dispatch import set_deterministic, set_kernel_mode

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
    spec_policy: str = "fixed"  # the in-step speculation policy's name
    policy: dict[str, Any] = field(default_factory=dict)  # its decision and model statistics
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of them, tokens served from cached blocks
    prefix_cache_blocks: int = 0  # blocks the prefix cache holds (in use or free)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the prefix cache (0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


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
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        set_kernel_mode(config.kernels)
        set_deterministic(config.deterministic)
        if config.device.startswith("cuda"):
            # cuDNN's attention builds an execution plan for every new shape (about 50 ms each on an H200);
            # the drafters' attention changes shape every step, so flash / memory-efficient kernels serve it
            torch.backends.cuda.enable_cudnn_sdp(False)
        tp = None if self.workers is None else self.workers.tp
        loaded = load_model(config.model, config.dtype, config.device, tp=tp, quantization=config.quantization)
        self.quantization = loaded.quantization
        self.model, self.model_config, self.device = loaded.model, loaded.config, loaded.device
        self.model.enforce_eager = config.enforce_eager
        self.checkpoint = loaded.checkpoint
        self.tokenizer = Tokenizer(loaded.checkpoint)
        cfg = self.model_config
        # whether the fused CPU decoder (lyanna_kernels/fused_decoder.py) can take every step of this model
        fused = self.device.type == "cpu" and not config.enforce_eager and fused_decoder.applies_to_model(self.model)
        setting = parse_kv_cache_dtype(config.kv_cache_dtype)
        dtype = kv_cache_dtype(setting, parse_dtype(config.dtype), self.device, fused)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            # per rank: the rank holding the most KV heads sets the block count every rank uses
            most_heads = -(-cfg.num_kv_heads // config.tensor_parallel_size)
            per_token = PagedKVCache.bytes_per_token(cfg.num_layers, most_heads, cfg.head_dim, dtype)
            num_blocks = max(1, int(config.kv_cache_gib * 2**30) // (per_token * config.block_size))
        if dtype == torch.float32 and self.model.dtype != torch.float32:
            self.model.compute_in(torch.float32)  # this CPU would emulate bf16 math: only the GEMMs keep it
        self.kv_cache = PagedKVCache(
            cfg.num_layers,
            self.model.attn_kv_heads,
            cfg.head_dim,
            num_blocks,
            config.block_size,
            dtype,
            self.device,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.max_model_len = min(cfg.max_position_embeddings, self.kv_cache.capacity_tokens)
        if config.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, config.max_model_len)
        chunk = config.prefill_chunk_tokens or (256 if self.device.type == "cpu" else 2048)
        step_tokens = config.max_num_batched_tokens
        if dtype == torch.int8:  # only the fused decoder reads int8 codes: every step goes through it
            if config.enforce_eager or not fused_decoder.applies(self.model, self.kv_cache):
                raise ValueError(
                    "kv_cache_dtype int8 runs on the fused CPU decoder only: a CPU device, integer-dot weights "
                    "(quantization gguf, int4 or int8), kernels auto and enforce_eager false"
                )
        # where the fused decoder applies it takes every step: the eager layers would compute other numbers, and a
        # token's result would then depend on how many tokens share its step (and an int8 cache only it reads)
        fused_only = dtype == torch.int8 or fused
        if fused_only:
            step_tokens = min(step_tokens, fused_decoder.max_rows())
            chunk = min(chunk, step_tokens)
            self.model.drop_layer_copies()  # only the eager layers read them (405 MB for the embedded model)
        # A token's projections cost 2 x params FLOPs; attending over one more key, 4 x heads x head_dim
        # per layer: past this many context keys a prompt token's attention outweighs its projections.
        params = sum(p.numel() for p in self.model.parameters()) - self.model.embed_tokens.weight.numel()
        params += self.model.lm_head_weight.numel() if self.model.lm_head is None else 0
        keys_per_token = 2 * params / (4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)
        # several decode steps a call where the model takes them (else lookahead blocks would be reserved for nothing)
        multi_step = config.multi_step if self.model.takes_greedy_steps(self.kv_cache) else 1
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, step_tokens, chunk, keys_per_token, multi_step)
        if self.workers is None:
            graphs = None
            if self.device.type == "cuda" and not config.enforce_eager and config.kernels != "torch":
                tree_tokens = 1 if config.drafter == "none" else config.spec_budget + 1
                buckets = graph_buckets(config.max_num_seqs, tree_tokens, config.max_num_batched_tokens)
                # block tables as wide as the longest sequence and its tree's padding (plus a lookahead block)
                blocks = -(-(self.max_model_len + max(q for _, q in buckets)) // config.block_size) + 2
                graphs = StepGraphs(self.model, self.kv_cache, buckets, blocks, capture=True)
            self.runner = ModelRunner(self.model, self.kv_cache, self.device, config.max_num_seqs, graphs)
        else:
            compute_fp32 = self.model.compute_dtype == torch.float32 and self.model.dtype != torch.float32
            spec = CacheSpec(
                num_blocks,
                config.block_size,
                str(dtype).removeprefix("torch."),
                compute_fp32,
                fused_only,
                config.deterministic,
            )
            self.workers.start(spec, config.max_num_seqs, config.kernels)
            self.runner = ParallelModelRunner(self.model, self.kv_cache, self.device, config.max_num_seqs, self.workers)
        self.requests: dict[str, Request] = {}
        # structured outputs: grammars compiled at admission (any thread), once per spec
        self.structured = StructuredOutputCompiler.for_hf_tokenizer(
            self.tokenizer.hf, cfg.vocab_size, self.tokenizer.stop_token_ids
        )
        self.busy_seconds = 0.0
        policy = make_policy(config.spec_policy, config.adaptive)
        self.executor = SpecDecodeExecutor(
            self.runner,
            self.kv_cache,
            make_drafter(config, self),
            policy,
            config.chain_verifier,
            config.logprobs_mode,
            multi_step,
        )
        self.scheduler.spec_rounds_max_seqs = self.executor.spec_rounds_max_seqs()
        self.scheduler.rounds_request_ok = self.executor.rounds_request_ok
        if self.executor.drafter is not None:  # a drafter keeping K/V in the blocks needs their next token hashed
            self.kv_cache.lookahead = self.executor.drafter.cache_lookahead
        if self.executor.drafter is not None and isinstance(policy, AdaptivePolicy) and config.adaptive.profile:
            profile_or_reuse(self, policy, cache_root() / "profiles" if config.adaptive.profile_cache else None)
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
        """Validate hand-built settings (offline use), then admit the request (`admit`).

        `spec` overrides the engine's default speculation for this request (`enabled=False` turns
        it off); without a drafter it is ignored. `tpot_target_s` is the request's time-per-output-
        token target, which the adaptive speculation policy keeps to.
        """
        if tpot_target_s is not None and not tpot_target_s > 0:
            raise InvalidRequestError("the TPOT target must be positive", param="slo.tpot_ms")
        request = GenerationRequest(
            request_id=request_id or uuid.uuid4().hex,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            params=(params or SamplingParams()).validate(self.tokenizer.vocab_size),
            spec=(spec or self.config.spec).validate(),
            tpot_target_s=tpot_target_s,
        )
        return self.admit(request)

    def admit(self, request: GenerationRequest) -> Request:
        """Tokenize a request whose fields are validated and check what only the engine knows (the
        context length, the vocabulary); touches no engine state (safe from any thread)."""
        arrival = time.monotonic()  # tokenizing counts toward the time to first token
        params, vocab = request.params, self.tokenizer.vocab_size
        if request.prompt is not None:  # completions: the text as is, no template
            prompt = self.tokenizer.encode_prompt(request.prompt)
        elif request.prompt_token_ids is None:
            prompt = self.tokenizer.apply_chat_template(request.messages, request.tools)
        else:
            prompt = list(request.prompt_token_ids)
            if not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise InvalidRequestError(
                    "prompt_token_ids must be a non-empty list of valid token ids", param="prompt_token_ids"
                )
        spec = request.spec or self.config.spec
        limit = self.max_model_len
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens; the prompt has {len(prompt)} tokens "
                "and leaves no room for a completion.",
                param="messages" if request.messages is not None else "prompt",
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
        # a spec the grammar library cannot compile fails here, naming its field; nothing else is touched
        grammar = None if params.structured is None else self.structured.matcher(params.structured)
        resumed = request.resume_token_ids or []
        if resumed and (len(resumed) >= max_tokens or not all(isinstance(t, int) and 0 <= t < vocab for t in resumed)):
            raise InvalidRequestError(
                "resume_token_ids must be valid token ids, fewer than max_tokens", param="resume_token_ids"
            )
        seed = params.resolve_seed()  # drawn once: every positional draw of the request uses it
        req = Request(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            generator=params.make_generator(self.device, seed),
            seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt),
            arrival_time=arrival,
            spec=spec if spec.enabled and self.executor.drafter is not None else None,
            tpot_target_s=request.tpot_target_s,
            grammar=grammar,
        )
        if resumed:
            self._resume(req, resumed, request.resume_text_sent)
        return req

    @staticmethod
    def _resume(req: Request, tokens: list[int], text_sent: int) -> None:
        """Take a resumed request's produced tokens as its output so far (text, grammar state) without
        emitting them: its prefill computes them with the prompt, its next token is output index
        len(tokens), and its first delta carries the text the client does not have yet."""
        for tok in tokens:
            req.output_token_ids.append(tok)
            req.output_text += req.detokenizer.push([tok])
            if req.grammar is not None:
                req.grammar.advance(tok)
        req.num_resumed_tokens = req.num_tokens_sent = len(tokens)
        req.num_text_sent = min(text_sent, len(req.output_text))
        req.prompt_logprobs_sent = True  # the first replica sent them

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request` or `admit`."""
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

    def pop_finished_prefix(self, request_id: str) -> FinishedPrefix | None:
        """What the prefix cache holds of a request that finished lately (None if unknown or without prefix
        caching), handed over once, for prefix-aware routing. Safe from any thread."""
        return self.scheduler.finished_prefixes.pop(request_id, None)

    def stats(self) -> EngineStats:
        """Current queue lengths and KV-cache use."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage(),
            kv_free_blocks=self.kv_cache.allocator.num_free,
            num_forwards=self.executor.num_forwards,
            busy_seconds=self.busy_seconds,
            spec=self.executor.stats if self.executor.drafter is not None else None,
            spec_policy=self.executor.policy.name,
            policy=self.executor.policy.stats(),
            prefix_cache_queries=self.kv_cache.prefix_stats.queries,
            prefix_cache_hits=self.kv_cache.prefix_stats.hits,
            prefix_cache_blocks=self.kv_cache.allocator.num_cached,
        )

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, execute (draft, forward, verify or sample, KV commit), update the
        requests (append tokens, stop checks, deltas). Returns a delta per request that emitted tokens."""
        start = time.perf_counter()
        set_deterministic(self.config.deterministic)  # (a process-wide switch: engines of one process may differ)
        try:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return []
            outputs = self.update(self.executor.execute(sched))
            self.executor.finish_step(time.perf_counter() - start)
            return outputs
        finally:
            self.busy_seconds += time.perf_counter() - start

    def update(self, results: list[RequestStepResult]) -> list[RequestOutput]:
        """Apply a step's results to its requests: progress, speculation counters, new tokens."""
        outputs = []
        for r in results:
            req = r.request
            req.num_forwards += 1
            req.num_computed_tokens += r.num_computed_tokens
            if r.num_draft_tokens:
                req.num_spec_steps += r.num_verifications
                req.num_draft_tokens += r.num_draft_tokens
                req.num_accepted_tokens += r.num_accepted_tokens
            if r.prompt_logprobs:
                req.prompt_logprob_entries.extend(r.prompt_logprobs)
            if r.token_ids:
                outputs.append(self.append_tokens(req, r.token_ids, r.logprobs))
        return outputs

    def append_tokens(
        self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        """Append generated tokens (and their log-probabilities, when the request asked), applying stop
        tokens, stop strings and max_tokens; emit the delta."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.params
        reason: FinishReason | None = None
        max_stop = max((len(s) for s in params.stop), default=0)
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
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
            if req.grammar is not None and req.grammar.advance(tok):  # the grammar is complete: nothing may follow
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
        self.executor.on_finished(req)
        out = self._delta(req)
        del self.requests[req.request_id]
        return out

    def _delta(self, req: Request) -> RequestOutput:
        text = req.output_text
        end = len(text) if req.status is RequestStatus.FINISHED else len(text) - stop_holdback(text, req.params.stop)
        new_text = text[req.num_text_sent : end]
        req.num_text_sent = max(req.num_text_sent, end)
        new_ids = req.output_token_ids[req.num_tokens_sent :]
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = req.output_logprobs[req.num_tokens_sent - req.num_resumed_tokens :]
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs, req.prompt_logprobs_sent = [None, *req.prompt_logprob_entries], True
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
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
