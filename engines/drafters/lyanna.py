"""The Lyanna drafter in the engine: hidden-state auto-regression plus token-info tree sampling.

Per request it keeps the target's hidden states H_j for the committed context (from prefill chunks,
plain decode steps and verified paths) and its decoder layer's K/V over the teacher-forced inputs
fuse(H_j, E(t_{j+1})). With tokens t_0..t_{T-1} (t_{T-1}: the root, not yet verified), the context
runs through position T-2, whose output is the first draft state h_1; steps 2..N extend a temporary
K/V. One LM-head GEMM gives l_1..l_N and Algorithm 1 builds the tree (token_info_sampling.py).

`propose` drafts every request at once: one layer forward per step over all requests, one LM-head
GEMM, and one batched Algorithm 1 run that also builds the re-sampled trees (Algorithm 2) recorded
by `on_verified`, so a proposal copies from the device to the host once.

Prefix caching: the target skips a request's cached prefix, so its hidden states there come from a
store beside the KV cache (one row per slot, written by every step that writes the slot's K/V); on a
hit, `on_cached_prefix` reads the prefix's states from it and the drafter's own K/V over the prefix are
rebuilt by the next catch-up (one drafter-layer pass, like a prompt read). The fused layer writes those
K/V into the target's blocks, shared ones included: the cache then hashes each block with the token
after it (`cache_lookahead`), so every request sharing a block writes the same values there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engines.draft_tree import DraftTree, merge_trees
from engines.drafters.base import Drafter
from engines.drafters.lyanna_model import LyannaDraftModel
from engines.drafters.token_info import DenseTokenInfo
from engines.drafters.token_info_sampling import build_subtrees
from engines.request import Request
from engines.spec_params import SpecParams
from engines.verification import VerifyResult
from lyanna_kernels import integer_dot
from lyanna_kernels.draft_native import DraftChains, DraftFuse

if TYPE_CHECKING:
    from engines.kv_cache import PagedKVCache
    from lyanna_kernels.fused_decoder import FusedDraftLayer


@dataclass
class _Resample:
    """What Algorithm 2 needs after a rejection; the tree itself is built by the next `propose`."""

    logits: torch.Tensor  # [steps, vocab] the last proposal's logits of the depths past the bonus token
    bonus: int  # the re-sampled tree's root
    width: int  # the verified tree's widest fan-out
    num_tokens: int  # the request's length when recorded: the tree is stale once the request grows


@dataclass
class _State:
    hidden: list[torch.Tensor] = field(default_factory=list)  # H_0.. of the committed context, [hidden] each
    processed: int = 0  # context positions whose draft-layer K/V are cached
    # The eager layer's cache: [processed, heads, head_dim] K and V over the context (the fused layer keeps
    # them in its paged cache instead).
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    last_out: torch.Tensor | None = None  # the layer's output at the last processed position
    logits: torch.Tensor | None = None  # [steps, vocab] raw draft logits of the last proposal
    pending: _Resample | None = None  # Algorithm 2's tree to build, fused into the next verification


def draft_chains_for(model: LyannaDraftModel, token_info: object) -> DraftChains | None:
    """The native width-1 drafting (`DraftChains`) of a model whose LM head runs the interleaved int8 kernels, with
    dense token information or none; None for any other (a collapsed table, a bf16 head, no kernels)."""
    head = model.lm_head_quant
    if head is None or head.layout != "vnni" or not integer_dot.available():
        return None
    if token_info is not None and not isinstance(token_info, DenseTokenInfo):
        return None
    return DraftChains(head, model.embed.shape[0], token_info, model.d2t)


def draft_fuse_for(model: LyannaDraftModel) -> DraftFuse | None:
    """The native input fusion (`DraftFuse`) of a model that fuses its inputs through an interleaved int8
    projection; None for any other."""
    quant = model.fuse.quant if model.cfg.use_fusion else None
    if quant is None or quant.layout != "vnni" or not integer_dot.available():
        return None
    return DraftFuse(model.hidden_norm.weight, model.embed_norm.weight, model.hidden_norm.eps, model.embed, quant)


class LyannaDrafter(Drafter):
    """Drafts with a trained `LyannaDraftModel`; token info comes from a collapsed hot-token table
    when one is given, else from the model's low-rank embedding for every token (`DenseTokenInfo`)."""

    name = "lyanna"
    wants_hidden = True

    def __init__(
        self,
        model: LyannaDraftModel,
        token_info_table=None,
        resample: bool = True,
        resample_threshold: int = 1,
        fusion: bool = True,
        fused_layer: FusedDraftLayer | None = None,
        kv_cache: PagedKVCache | None = None,
    ):
        self.model = model
        # The layer in one call over a paged cache addressed by the target's block tables (kv_cache's), where
        # the target runs its fused CPU decoder; else the eager layer over per-request K/V tensors.
        self.fused_layer = fused_layer
        self.kv_cache = kv_cache
        self.token_info = token_info_table
        if token_info_table is None and model.token_info is not None:
            self.token_info = DenseTokenInfo(model.token_info)
        # Width-1 trees' head and sampling in one native call, where the head runs the interleaved int8 kernels
        # beside the fused layer and token information is the dense one (or none).
        self.chains = draft_chains_for(model, self.token_info) if fused_layer is not None else None
        # The input fusion W_fuse [norm(h); norm(E(t))] in one native call beside the fused layer (`DraftFuse`).
        self.fuse = draft_fuse_for(model) if fused_layer is not None else None
        self.resample = resample
        self.fusion = fusion  # off: a re-sampled tree is verified alone, in place of the next draft
        self.resample_threshold = resample_threshold
        self.states: dict[str, _State] = {}
        # The target's hidden state at every KV slot, for requests admitted on cached blocks (None
        # without prefix caching): [slots, hidden].
        self.hidden_store: torch.Tensor | None = None
        if kv_cache is not None and kv_cache.prefix_caching:
            slots = kv_cache.num_blocks * kv_cache.block_size
            self.hidden_store = model.embed.new_zeros(slots, model.embed.shape[1])
        self._unstored: list[tuple[torch.Tensor, torch.Tensor]] = []  # (CPU slots, hidden) for `_flush_store`
        self.num_rebuilt = 0  # cached-prefix tokens whose hidden states came from the store
        self.num_fused = 0  # proposals that carried a re-sampled tree
        self.num_resampled_alone = 0  # proposals that were a re-sampled tree alone (fusion off)

    # ---- hidden states from the target -----------------------------------------------------------
    @property
    def cache_lookahead(self) -> int:
        """1 with the fused layer: its K/V at a block's last position read the next token, and they sit in
        the target's (shared) blocks; the eager layer keeps them per request."""
        return 1 if self.fused_layer is not None else 0

    def _store(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        """Keep the target's hidden states of positions start.. at their KV slots (prefix caching). The
        slots are read now, while the request's blocks are its own; the copy waits for `_flush_store`, so
        a step's verified requests cost one host-to-device copy, not one each."""
        if self.hidden_store is None or self.kv_cache is None:
            return
        self._unstored.append((self.kv_cache.slots(request.request_id, start, start + hidden.shape[0]), hidden))

    def _flush_store(self) -> None:
        """Write the hidden states `_store` held back: before anything else reads or writes the store."""
        if not self._unstored or self.hidden_store is None:
            return
        slots = torch.cat([s for s, _ in self._unstored]).to(self.hidden_store.device)
        hidden = torch.cat([h for _, h in self._unstored]).to(self.hidden_store.dtype)
        self._unstored.clear()
        self.hidden_store.index_copy_(0, slots, hidden)

    def on_cached_prefix(self, request: Request, num_cached: int) -> None:
        if request.spec is None or self.hidden_store is None or self.kv_cache is None:
            return
        self._flush_store()
        slots = self.kv_cache.slots(request.request_id, 0, num_cached).to(self.hidden_store.device)
        # A fresh state (also after a preemption: the blocks may differ): the context is read again from 0.
        st = self.states[request.request_id] = _State()
        st.hidden = list(self.hidden_store.index_select(0, slots).to(self.model.embed.dtype).unbind(0))
        self.num_rebuilt += num_cached

    def _record(self, request: Request, start: int, hidden: Sequence[torch.Tensor]) -> None:
        """Keep the target's hidden states of positions start.. (one [hidden] row each, the model's dtype)."""
        st = self.states.get(request.request_id)
        if st is None:
            st = self.states[request.request_id] = _State()
        if start < len(st.hidden):  # recomputation after preemption: drop what follows
            del st.hidden[start:]
            if st.processed > start:
                st.processed = start
                if st.keys is not None:
                    st.keys, st.values = st.keys[:start], st.values[:start]
            st.last_out = None
        st.hidden.extend(hidden)

    def on_prefill(self, requests: list[Request], hidden: torch.Tensor, row_starts: list[int]) -> None:
        lengths = [row_starts[i + 1] - row_starts[i] for i in range(len(requests))]
        hidden = hidden.to(self.model.embed.dtype)  # the store's dtype too
        if self.hidden_store is not None and self.kv_cache is not None:
            self._flush_store()
            ids, starts = [r.request_id for r in requests], [r.num_computed_tokens for r in requests]
            slots = self.kv_cache.batch_slots(ids, starts, lengths).to(self.hidden_store.device)
            self.hidden_store.index_copy_(0, slots, hidden)
        rows = hidden.unbind(0)  # one split for the whole step
        for i, request in enumerate(requests):
            if request.spec is not None:
                self._record(request, request.num_computed_tokens, rows[row_starts[i] : row_starts[i + 1]])

    def on_verified(self, request: Request, tree: DraftTree, result: VerifyResult, hidden: torch.Tensor) -> None:
        self._store(request, request.num_computed_tokens, hidden)
        self._record(request, request.num_computed_tokens, hidden.to(self.model.embed.dtype).unbind(0))
        st = self.states[request.request_id]
        st.pending = None
        last = result.path[-1]
        rejected = any(p == last for p in tree.parents)  # the walk stopped at a node with children
        if self.resample and rejected and st.logits is not None:
            # The bonus token sits at draft depth a+1; the logits of the depths past it are reused.
            remaining = st.logits[result.num_accepted + 1 :]
            if remaining.shape[0] > max(self.resample_threshold, 0):  # else `resample_tree` gives just a root
                width = max(1, max(len(c) for c in tree.child_lists()))
                # the request's length once the path's tokens and the bonus are appended
                st.pending = _Resample(remaining, result.bonus, width, request.num_tokens + len(result.path))

    def on_finished(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    # ---- speculative rounds in one native call (lyanna_kernels/spec_rounds.py) ------------------------------
    def takes_rounds(self) -> bool:
        """Whether its width-1 chains can run as native rounds beside the fused decoder: the fused layer, the
        native chains and fusion, and a trajectory that reads the hidden state alone (no `chain_fusion`)."""
        native = self.fused_layer is not None and self.chains is not None and self.fuse is not None
        return native and self.model.cfg.use_fusion and self.model.chain_embed is None

    def rounds_inputs(self, requests: list[Request]) -> torch.Tensor | None:
        """Each request's drafter output at its last context position ([B, hidden] bf16), its context read
        first; None where any request has no context yet (its hidden states not produced)."""
        self._flush_store()
        states = self._ready_states(requests)
        if any(st is None for st in states):
            return None
        return torch.cat([st.last_out for st in states]).contiguous()  # type: ignore[union-attr]

    def unread(self, request: Request) -> int:
        """How many of the request's context positions the drafter has yet to read before it drafts."""
        st = self.states.get(request.request_id)
        return max(0, request.num_tokens - 1 - (st.processed if st else 0))

    def on_rounds(self, request: Request, hidden: torch.Tensor, last_out: torch.Tensor) -> None:
        """Native rounds committed `hidden`'s rows ([n, hidden] bf16, the target's states of the positions from
        the request's computed tokens on) and read them: `last_out` [1, hidden] is its output at the last."""
        start = request.num_computed_tokens
        self._store(request, start, hidden)
        self._record(request, start, hidden.unbind(0))
        st = self.states[request.request_id]
        st.processed, st.last_out, st.logits, st.pending = start + hidden.shape[0], last_out, None, None

    # ---- drafting -------------------------------------------------------------------------------
    def catch_up(self, requests: list[Request]) -> list[int]:
        self._flush_store()
        states = [self.states.get(req.request_id) for req in requests]
        read = iter(self._advance_contexts([(req, st) for req, st in zip(requests, states, strict=True) if st]))
        return [next(read) if st else 0 for st in states]

    @torch.no_grad()
    def _advance_contexts(self, items: list[tuple[Request, _State]]) -> list[int]:
        """Run the layer over each request's context positions not yet processed, through position
        T-2: every request's positions in one pass, attention per request. How many, per request."""
        spans = [(req, st, st.processed, min(len(st.hidden), req.num_tokens - 1)) for req, st in items]
        todo = [span for span in spans if span[2] < span[3]]
        if not todo:
            return [0] * len(items)
        m = self.model
        hidden = torch.stack([h for _, st, start, end in todo for h in st.hidden[start:end]])
        device = hidden.device
        next_tokens = [t for req, _, start, end in todo for t in req.token_ids(start + 1, end + 1)]
        positions = [p for _, _, start, end in todo for p in range(start, end)]
        ids = torch.tensor([next_tokens, positions], device=device)  # one host-to-device copy
        if self.fuse is not None and not m.fuse.takes_wide(hidden.shape[0]):
            x = self.fuse(hidden, ids[0]).to(hidden.dtype)
        else:  # (and the rows a CPU without bf16 arithmetic projects through an fp32 copy: a prompt read at once)
            x = m.fused_input(hidden, ids[0]).to(hidden.dtype)  # that copy's rows come out in fp32
        if self.fused_layer is not None:
            return self._advance_fused(spans, todo, x)
        q, k, v = m._qkv(x, ids[1])
        k, v = m._expand_kv(k), m._expand_kv(v)
        outs, offset = [], 0
        for _, st, start, end in todo:
            n = end - start
            rows = slice(offset, offset + n)
            keys = k[rows] if st.keys is None else torch.cat([st.keys, k[rows]])
            values = v[rows] if st.values is None else torch.cat([st.values, v[rows]])
            mask = torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=start)
            out = torch.nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
            )
            outs.append(out.transpose(0, 1))
            st.keys, st.values, st.processed = keys, values, end
            offset += n
        layer_out = m._finish(x, torch.cat(outs))
        offset = 0
        for _, st, start, end in todo:
            offset += end - start
            st.last_out = layer_out[offset - 1 : offset]
        return [end - start for _, _, start, end in spans]

    def _advance_fused(self, spans, todo, x: torch.Tensor) -> list[int]:
        """`_advance_contexts`' layer pass through the fused layer: the keys go to the paged cache."""
        assert self.fused_layer is not None and self.kv_cache is not None
        tables = [self.kv_cache.block_tables[req.request_id] for req, _, _, _ in todo]
        firsts, counts = [start for _, _, start, _ in todo], [end - start for _, _, start, end in todo]
        layer_out = self.model.norm(self.fused_layer(x, firsts, counts, tables).to(x.dtype))
        offset = 0
        for (_, st, _, end), n in zip(todo, counts, strict=True):
            offset += n
            st.processed, st.last_out = end, layer_out[offset - 1 : offset]
        return [end - start for _, _, start, end in spans]

    def _fused_trajectories(self, ready: list[tuple[int, Request, _State]], steps: int) -> torch.Tensor:
        """`trajectories` through the fused layer ([B, steps, hidden]): the later steps' keys go to the
        request's blocks past its context and to scratch blocks, overwritten when the context grows."""
        assert self.fused_layer is not None and self.kv_cache is not None
        fused, bs = self.fused_layer, self.fused_layer.block_size
        h = torch.cat([st.last_out for _, _, st in ready])  # [B, hidden]
        tables = []
        for b, (_, req, st) in enumerate(ready):
            own = self.kv_cache.block_tables[req.request_id][: -(-st.processed // bs)]
            tables.append(own + fused.scratch(b))
        traj = [h]
        ones = [1] * len(ready)
        for i in range(1, steps):
            positions = [req.num_tokens - 2 + i for _, req, _ in ready]
            h = self.model.norm(fused(self.model.chain_input(h), positions, ones, tables).to(h.dtype))
            traj.append(h)
        return torch.stack(traj, dim=1)

    def _ready_states(self, requests: list[Request]) -> list[_State | None]:
        """`_context_ready` for several requests, their unread contexts read in one pass."""
        states = [self.states.get(req.request_id) for req in requests]
        ok = [st is not None and len(st.hidden) >= req.num_tokens - 1 for req, st in zip(requests, states, strict=True)]
        self._advance_contexts([(req, st) for req, st, o in zip(requests, states, ok, strict=True) if o])
        return [st if o and st.last_out is not None else None for st, o in zip(states, ok, strict=True)]

    def _context_ready(self, req: Request) -> _State | None:
        """The request's state with its context K/V brought up to date, or None when the target has
        not yet produced the hidden states a draft needs."""
        st = self.states.get(req.request_id)
        if st is None or len(st.hidden) < req.num_tokens - 1:
            return None
        self._advance_contexts([(req, st)])
        return st if st.last_out is not None else None

    @torch.no_grad()
    def trajectory(self, req: Request, steps: int) -> torch.Tensor | None:
        """h_1..h_steps for the request's current root ([steps, hidden]), or None without context."""
        return self.trajectories([req], steps)[0]

    @torch.no_grad()
    def trajectories(self, requests: list[Request], steps: int) -> list[torch.Tensor | None]:
        """`trajectory` for several requests, their layer steps batched into one forward per step
        (each request attends to its own context: K/V padded to the longest, masked)."""
        states = self._ready_states(requests)
        ready = [(i, req, st) for i, (req, st) in enumerate(zip(requests, states, strict=True)) if st is not None]
        out: list[torch.Tensor | None] = [None] * len(requests)
        if not ready:
            return out
        if self.fused_layer is not None:
            stacked = self._fused_trajectories(ready, steps)
            for b, (i, _, _) in enumerate(ready):
                out[i] = stacked[b]
            return out
        m = self.model
        h = torch.cat([st.last_out for _, _, st in ready])  # [B, hidden]
        lens = [st.keys.shape[0] for _, _, st in ready]
        width = max(lens) + steps - 1
        keys = h.new_zeros(len(ready), width, m.num_heads, m.head_dim)
        values = torch.zeros_like(keys)
        for b, (_, _, st) in enumerate(ready):
            keys[b, : lens[b]], values[b, : lens[b]] = st.keys, st.values
        pos, ctx_lens = torch.tensor([[req.num_tokens - 2 for _, req, _ in ready], lens], device=h.device)
        valid = torch.arange(width, device=h.device) < ctx_lens.unsqueeze(1)  # [B, width]
        traj = [h]
        for i in range(1, steps):
            x = m.chain_input(h)
            q, k, v = m._qkv(x, pos + i)  # q: [B, heads, d]; k, v: [B, kv_heads, d]
            col = max(lens) + i - 1
            keys[:, col], values[:, col], valid[:, col] = m._expand_kv(k), m._expand_kv(v), True
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys[:, : col + 1].transpose(1, 2),
                values[:, : col + 1].transpose(1, 2),
                attn_mask=valid[:, None, None, : col + 1],
            )  # [B, heads, 1, d]
            h = m._finish(x, attn.squeeze(2))
            traj.append(h)
        stacked = torch.stack(traj, dim=1)  # [B, steps, hidden]
        for b, (i, _, _) in enumerate(ready):
            out[i] = stacked[b]
        return out

    def _native_chains(
        self, done: list[tuple[int, torch.Tensor]], specs: list[SpecParams], roots: list[int]
    ) -> dict[int, tuple[torch.Tensor, DraftTree]]:
        """The logits and trees of the width-1 requests among `done` (request index, trajectory), drafted in one
        native call (`DraftChains`) where the drafter has one; {} otherwise."""
        chains = [(i, t) for i, t in done if specs[i].width == 1] if self.chains is not None else []
        if not chains:
            return {}
        steps = [t.shape[0] for _, t in chains]
        logits, tokens, scores = self.chains(torch.cat([t for _, t in chains]), steps, [roots[i] for i, _ in chains])
        out, at = {}, 0
        for (i, _), lg, n in zip(chains, logits.split(steps), steps, strict=True):
            tree = DraftTree([roots[i], *tokens[at : at + n]], list(range(-1, n)), [1.0, *scores[at : at + n]])
            out[i], at = (lg, tree), at + n
        return out

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees: list[DraftTree | None] = [None] * len(requests)
        roots = [req.token_ids(req.num_tokens - 1, req.num_tokens)[0] for req in requests]
        pending: dict[int, _Resample] = {}  # request index -> its re-sampled tree's inputs
        for i, req in enumerate(requests):
            st = self.states.get(req.request_id)
            if st is not None and st.pending is not None:
                if st.pending.num_tokens == req.num_tokens:
                    pending[i] = st.pending
                else:  # the request went on without a draft: the tree's root is no longer its last token
                    st.pending = None
        # Without verification fusion a re-sampled tree takes its step's place (no drafter forward).
        alone = [] if self.fusion else list(pending)
        drafting = [i for i in range(len(requests)) if i not in pending or self.fusion]
        depth = max((specs[i].depth for i in drafting), default=0)
        trajs = self.trajectories([requests[i] for i in drafting], depth) if drafting else []
        done = [(i, t[: specs[i].depth]) for i, t in zip(drafting, trajs, strict=True) if t is not None]
        drafted = self._native_chains(done, specs, roots)  # request index -> (its logits, its chain)
        done_general = [(i, t) for i, t in done if i not in drafted]
        step_logits: list[torch.Tensor] = []
        if done_general:
            all_logits = self.model.logits(torch.cat([t for _, t in done_general]))  # one LM-head GEMM for every step
            step_logits = list(all_logits.split([specs[i].depth for i, _ in done_general]))
        resampling = alone + [i for i, _ in done if i in pending]
        if not done and not resampling:
            return trees
        # One Algorithm 1 run for this step's other trees and the re-sampled trees (Algorithm 2).
        built = build_subtrees(
            step_logits + [pending[i].logits for i in resampling],
            [roots[i] for i, _ in done_general] + [pending[i].bonus for i in resampling],
            self.token_info,
            [specs[i].width for i, _ in done_general] + [pending[i].width for i in resampling],
            self.model.d2t,
        )
        resampled = dict(zip(resampling, built[len(done_general) :], strict=True))
        for i in alone:
            st = self.states[requests[i].request_id]
            trees[i], st.pending, st.logits = resampled[i].prune(specs[i].budget + 1), None, None
            self.num_resampled_alone += 1
        drafted.update(
            (i, (logits, tree))
            for (i, _), logits, tree in zip(done_general, step_logits, built[: len(done_general)], strict=True)
        )
        for i, _ in done:
            logits, tree = drafted[i]
            spec, st = specs[i], self.states[requests[i].request_id]
            tree = tree.prune(spec.budget + 1)
            if i in resampled:
                # Verification fusion: the re-sampled tree rides along, competing for the budget.
                tree = merge_trees(tree, resampled[i]).prune(spec.budget + 1)
                self.num_fused += 1
            st.logits, st.pending = logits, None
            trees[i] = tree
        return trees
