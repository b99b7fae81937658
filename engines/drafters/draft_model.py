"""Draft-model drafter (SPS): a separate small causal LM that shares the target's tokenizer.

Greedy requests get a deterministic top-k tree: per depth, every frontier node's top-`width`
children are scored by joint draft probability and the best `width` of them form the next
frontier. Sampled requests get a chain whose tokens are drawn from the draft's processed
distribution q (recorded on the tree, so the engine verifies it with block verification or
token-wise rejection). The draft model keeps its own paged KV cache over each request's context;
draft nodes are recomputed every step rather than committed (this drafter aims at correctness and
generality, not speed).
"""

from __future__ import annotations

import torch

from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.errors import CacheCapacityError
from engines.kv_cache import PagedKVCache, kv_cache_dtype
from engines.loader import load_model
from engines.model_runner import ModelRunner, StepInput
from engines.request import Request
from engines.sampling import processed_logprobs
from engines.spec_params import SpecParams
from engines.verification import VerifyResult
from lyanna_kernels import fused_decoder
from lyanna_kernels.dispatch import cpu_has_half_precision_math


def draft_cache_dtype(engine, model) -> torch.dtype:
    """The draft model's KV cache dtype: the target cache's values' (bf16 for int8 codes), except on a CPU that
    would emulate it in the draft model's eager layers (a bf16 cache that only the target's fused decoder reads),
    where `auto` chooses for the draft model on its own."""
    dtype = engine.kv_cache.value_dtype
    if engine.device.type == "cpu" and not cpu_has_half_precision_math(dtype):
        return kv_cache_dtype(None, model.dtype, engine.device, fused_decoder.applies_to_model(model))
    return dtype


class DraftModelDrafter(Drafter):
    """Speculative sampling with a separate draft model."""

    name = "draft-model"

    def __init__(self, checkpoint: str, engine):
        loaded = load_model(checkpoint, engine.config.dtype, engine.config.device)
        if loaded.config.vocab_size < engine.tokenizer.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({loaded.config.vocab_size}) does not cover the target "
                f"tokenizer's ({engine.tokenizer.vocab_size}); it must share the tokenizer"
            )
        cfg = loaded.config
        self.vocab = engine.model_config.vocab_size
        self.kv = PagedKVCache(
            cfg.num_layers,
            loaded.model.attn_kv_heads,
            cfg.head_dim,
            engine.kv_cache.num_blocks,
            engine.kv_cache.block_size,
            draft_cache_dtype(engine, loaded.model),
            loaded.device,
        )
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device)
        self.computed: dict[str, int] = {}  # context tokens whose K/V the draft cache holds

    def _logits(
        self,
        req: Request,
        tokens: list[int],
        base: int,
        parents: list[int] | None = None,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        rid = req.request_id
        self.kv.allocate(rid, base + len(tokens))
        step = StepInput(rid, tokens, base, parents=parents, logits_rows=rows)
        return self.runner.execute_inputs([step]).logits[:, : self.vocab]

    def _catch_up(self, req: Request) -> torch.Tensor:
        """Feed the context the draft cache has not seen (root included); logits after the root."""
        rid = req.request_id
        start = min(self.computed.get(rid, 0), req.num_tokens - 1)
        logits = self._logits(req, req.token_ids(start, req.num_tokens), start)
        self.computed[rid] = req.num_tokens
        return logits[-1]

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees = []
        for req, spec in zip(requests, specs, strict=True):
            try:
                trees.append(self._chain(req, spec) if not req.params.greedy else self._tree(req, spec))
            except CacheCapacityError:
                trees.append(None)  # no room in the draft cache this step: no speculation
        return trees

    def _tree(self, req: Request, spec: SpecParams) -> DraftTree:
        base = req.num_tokens  # draft nodes sit after the context (the root is the context's last token)
        logq = self._catch_up(req).float().log_softmax(-1)
        tokens, parents, scores = [req.token_ids(base - 1, base)[0]], [-1], [1.0]
        frontier = [(0, logq)]
        for _ in range(spec.depth):
            candidates = []
            for node, lq in frontier:
                top = lq.topk(spec.width)
                for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    candidates.append((scores[node] * float(torch.tensor(lp).exp()), node, tok))
            candidates.sort(key=lambda c: -c[0])
            new_nodes = []
            for score, parent, tok in candidates[: spec.width]:
                tokens.append(tok)
                parents.append(parent)
                scores.append(score)
                new_nodes.append(len(tokens) - 1)
            tree = DraftTree(tokens, parents, scores)
            if len(tokens) - 1 >= spec.budget or tree.depth == spec.depth:
                break
            # Re-run all draft nodes (tree-masked) on top of the cached context for the new frontier.
            rows = [n - 1 for n in new_nodes]
            # Node i's parent is node i - 1 among the draft nodes; the root's children have none.
            logits = self._logits(req, tokens[1:], base, parents=[p - 1 for p in parents[1:]], rows=rows)
            frontier = list(zip(new_nodes, logits.float().log_softmax(-1), strict=True))
        return DraftTree(tokens, parents, scores)

    def _chain(self, req: Request, spec: SpecParams) -> DraftTree:
        base = req.num_tokens
        q_rows = [processed_logprobs(self._catch_up(req)[None].float(), [req.params]).exp()[0]]
        draft: list[int] = []
        for t in range(spec.depth):
            # Drafting draws from the request's generator; verification has counter-based numbers of its own.
            draft.append(int(torch.multinomial(q_rows[-1], 1, generator=req.generator)))
            if t + 1 < spec.depth:
                logits = self._logits(req, [draft[-1]], base + t)
                q_rows.append(processed_logprobs(logits[-1:].float(), [req.params]).exp()[0])
        q = torch.stack([*q_rows, torch.zeros_like(q_rows[0])])  # the leaf row is never read
        scores = [1.0]
        for t, tok in enumerate(draft):
            scores.append(scores[-1] * q_rows[t][tok].item())
        return DraftTree.chain(req.token_ids(base - 1, base)[0], draft, scores=scores, draft_probs=q)

    def on_verified(self, request: Request, tree: DraftTree, result: VerifyResult, hidden: torch.Tensor) -> None:
        # Draft nodes' K/V are discarded; the accepted tokens are fed as context next step.
        rid = request.request_id
        self.computed[rid] = min(self.computed.get(rid, 0), request.num_tokens)
        self.kv.truncate(rid, self.computed[rid])

    def on_finished(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.computed.pop(request.request_id, None)
