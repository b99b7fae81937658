"""The EAGLE-2-style drafter in the engine: dynamic top-k trees grown one drafter forward per depth.

Context handling is Lyanna's (the same teacher-forced layer inputs fuse(H_j, E(t_{j+1})), and the
same K/V cache: per request with the eager layer, or paged beside the target's with the fused one,
see lyanna.py). The tree grows like EAGLE-2's: the root's children are the
top-k of the first step's logits; at each later depth the k frontier nodes (highest joint
probability) run through the layer together, each on fuse(its parent's output, E(its token)) and
attending to the context plus its own ancestors, then the LM head scores their children. The
tree is finally reranked by joint probability down to the verification budget (`total_tokens`).
SpecParams map as depth -> depth, width -> top_k, budget -> total_tokens - 1.
"""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engines.draft_tree import DraftTree
from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna import LyannaDrafter, _State
from engines.drafters.token_info_sampling import TreeLevels, next_frontier, top_candidates
from engines.request import Request
from engines.spec_params import SpecParams

if TYPE_CHECKING:
    from engines.kv_cache import PagedKVCache
    from lyanna_kernels.fused_decoder import FusedDraftLayer


class EagleDrafter(LyannaDrafter):
    """Drafts with a trained `EagleDraftModel` (no token info, no re-sampling)."""

    name = "eagle"

    def __init__(
        self, model: EagleDraftModel, fused_layer: FusedDraftLayer | None = None, kv_cache: PagedKVCache | None = None
    ):
        super().__init__(model, resample=False, fused_layer=fused_layer, kv_cache=kv_cache)
        self.lm_head_calls = 0  # LM-head GEMMs run (one per depth per proposal)

    def _top_children(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k child probabilities and target token ids for each row of drafter outputs."""
        self.lm_head_calls += 1
        probs = torch.softmax(self.model.logits(h), dim=-1)
        top_p, top = probs.topk(k, dim=-1)
        if self.model.d2t is not None:
            top = self.model.d2t[top]
        return top_p, top

    @torch.no_grad()
    def grow(self, req: Request, depth: int, k: int) -> DraftTree | None:
        """The full dynamic tree for the request's current root (before budget pruning), grown request by
        request with the eager layer: the reference `grow_batch` is tested against."""
        if self.fused_layer is not None:
            raise RuntimeError("grow is the eager layer's reference; with the fused layer use grow_batch")
        st = self._context_ready(req)
        if st is None:
            return None
        m = self.model
        device = st.last_out.device
        root = req.token_ids(req.num_tokens - 1, req.num_tokens)[0]
        tokens, parents, scores = [root], [-1], [1.0]
        out_of: dict[int, torch.Tensor] = {0: st.last_out[0]}  # node -> layer output (predicts its children)
        row_of: dict[int, int] = {}  # node -> row of its K/V among the tree's processed nodes
        tree_k: list[torch.Tensor] = []
        tree_v: list[torch.Tensor] = []
        ctx = st.keys.shape[0]
        frontier = [0]
        for d in range(1, depth + 1):
            if d > 1:  # the frontier (depth d-1) runs through the layer together
                x = m.chain_input(
                    torch.stack([out_of[parents[i]] for i in frontier]),
                    torch.tensor([tokens[i] for i in frontier], device=device),
                )
                pos = torch.full((len(frontier),), req.num_tokens - 3 + d, device=device)
                q, k_new, v_new = m._qkv(x, pos)
                for j, node in enumerate(frontier):
                    row_of[node] = len(tree_k) + j
                tree_k.extend(m._expand_kv(k_new).unbind(0))
                tree_v.extend(m._expand_kv(v_new).unbind(0))
                mask = torch.zeros(len(frontier), ctx + len(tree_k), dtype=torch.bool, device=device)
                mask[:, :ctx] = True
                for j, node in enumerate(frontier):
                    a = node
                    while a > 0:  # itself and its ancestors below the root
                        mask[j, ctx + row_of[a]] = True
                        a = parents[a]
                keys = torch.cat([st.keys, torch.stack(tree_k)]).transpose(0, 1)
                values = torch.cat([st.values, torch.stack(tree_v)]).transpose(0, 1)
                attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
                h = m._finish(x, attn.transpose(0, 1))
                for j, node in enumerate(frontier):
                    out_of[node] = h[j]
            top_p, top_tok = self._top_children(torch.stack([out_of[i] for i in frontier]), k)
            joint = (torch.tensor([scores[i] for i in frontier]).unsqueeze(1) * top_p.float().cpu()).flatten()
            top_tok = top_tok.cpu()
            first_new = len(tokens)
            for f, node in enumerate(frontier):
                for j in range(k):
                    tokens.append(int(top_tok[f, j]))
                    parents.append(node)
                    scores.append(float(joint[f * k + j]))
            # Expand only the k most probable new nodes next (EAGLE-2's confidence-ranked expansion).
            frontier = [first_new + c for c in top_candidates(joint.tolist(), k)]
        return DraftTree(tokens, parents, scores)

    @torch.no_grad()
    def grow_batch(self, requests: list[Request], depths: list[int], widths: list[int]) -> list[DraftTree | None]:
        """`grow` for several requests at once (request r to depths[r] with top-k widths[r]): the same
        trees, grown on the device with one host copy at the end; None where a request has no context.

        Requests of one width grow together: per depth, their frontiers run through the layer in one
        forward (each attends to its own context, padded to the longest and masked, and to its own
        tree ancestors) and the LM head scores them in one GEMM.
        """
        states = self._ready_states(requests)
        roots = [req.token_ids(req.num_tokens - 1, req.num_tokens)[0] for req in requests]
        # Requests of one width form a contiguous run, deepest first, so a depth's growing requests
        # are a prefix of their run.
        growing = [r for r, st in enumerate(states) if st is not None and depths[r] > 0]
        order = sorted(growing, key=lambda r: (widths[r], -depths[r]))
        levels = TreeLevels(roots)
        if order:
            device = states[order[0]].last_out.device
            # Context lengths and the positions before the first tree step, in one host-to-device copy.
            meta = [[states[r].processed for r in order], [requests[r].num_tokens - 3 for r in order]]
            lens, base_pos = torch.tensor(meta, device=device)
            start = 0
            for k, members in groupby(order, key=lambda r: widths[r]):
                group = list(members)
                end = start + len(group)
                sts = [states[r] for r in group]
                self._grow_group(
                    levels,
                    group,
                    [requests[r] for r in group],
                    sts,
                    [depths[r] for r in group],
                    k,
                    lens[start:end],
                    base_pos[start:end],
                )
                start = end
        trees = levels.trees()
        return [None if st is None else tree for st, tree in zip(states, trees, strict=True)]

    def _grow_group(
        self,
        levels: TreeLevels,
        rows: list[int],
        requests: list[Request],
        states: list[_State],
        depths: list[int],
        k: int,
        lens: torch.Tensor,
        base_pos: torch.Tensor,
    ) -> None:
        """Grow the trees of requests `rows` of width k (`depths` descending) into `levels`; `lens`: their
        context lengths, `base_pos`: their positions before the first tree step (both [len(rows)])."""
        m = self.model
        n = len(rows)
        h = torch.cat([st.last_out for st in states])  # [n, hidden]: the root's output predicts its children
        top_p, top_tok = self._top_children(h, k)
        scores = top_p.float()  # [n, k]: the root's children are the first frontier (joint = 1 * p)
        levels.add(rows, top_tok, torch.zeros_like(top_tok), scores)
        if depths[0] < 2:
            return
        if self.fused_layer is not None:
            frontier: _Frontier = _PagedFrontier(self, requests, states, depths[0], k)
        else:
            frontier = _EagerFrontier(m, states, lens, base_pos, depths[0], k)
        nodes = torch.arange(1, k + 1, device=h.device).expand(n, k)  # frontier node indices
        tokens, parent_out = top_tok, h.unsqueeze(1).expand(n, k, h.shape[-1])
        first_new = 1 + k
        for d in range(2, depths[0] + 1):
            a = sum(1 for depth in depths if depth >= d)  # requests still growing
            x = m.chain_input(parent_out[:a].reshape(a * k, -1), tokens[:a].reshape(-1))
            out = frontier.forward(d, a, x)  # [a * k, hidden]
            top_p, top_tok = self._top_children(out, k)  # one LM-head GEMM for every request's frontier
            joint = (scores[:a].unsqueeze(2) * top_p.float().view(a, k, k)).flatten(1)  # [a, k * k]
            new_tokens = top_tok.view(a, k * k)
            levels.add(rows[:a], new_tokens, nodes[:a].unsqueeze(2).expand(a, k, k).flatten(1), joint)
            # Expand only the k most probable new nodes next (EAGLE-2's confidence-ranked expansion).
            keep = next_frontier(joint, k)  # [a, k]
            parent = keep // k  # each new frontier node's parent, as a position in this frontier
            nodes, tokens, scores = first_new + keep, new_tokens.gather(1, keep), joint.gather(1, keep)
            parent_out = out.view(a, k, -1).gather(1, parent.unsqueeze(2).expand(a, k, out.shape[-1]))
            if d < depths[0]:
                frontier.follow(a, parent)
            first_new += k * k

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees = self.grow_batch(requests, [spec.depth for spec in specs], [spec.width for spec in specs])
        return [None if tree is None else tree.prune(spec.budget + 1) for tree, spec in zip(trees, specs, strict=True)]


class _Frontier(Protocol):
    """How a tree's frontier nodes run through the drafter's layer, each attending to its request's
    context and its own ancestors."""

    def forward(self, d: int, a: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's outputs ([a * k, hidden]) for the depth-d frontiers of the first `a` requests
        (inputs `x`, k rows per request), their keys kept for their descendants."""
        ...

    def follow(self, a: int, parent: torch.Tensor) -> None:
        """The next frontier's node j of request b descends from this frontier's node parent[b, j]."""
        ...


class _EagerFrontier:
    """Frontier attention over K/V tensors: the contexts padded to the longest and masked, then one key
    column per frontier node run, each node seeing its ancestors' columns."""

    def __init__(
        self,
        model: EagleDraftModel,
        states: list[_State],
        lens: torch.Tensor,
        base_pos: torch.Tensor,
        depth: int,
        k: int,
    ):
        h = states[0].last_out
        self.model, self.k, self.base_pos = model, k, base_pos
        self.ctx = max(st.processed for st in states)
        self.cap = (depth - 1) * k  # one key column per frontier node run through the layer
        self.keys = h.new_zeros(len(states), self.ctx + self.cap, model.num_heads, model.head_dim)
        self.values = torch.zeros_like(self.keys)
        for b, st in enumerate(states):
            self.keys[b, : st.processed], self.values[b, : st.processed] = st.keys, st.values
        self.ctx_valid = torch.arange(self.ctx, device=h.device) < lens.unsqueeze(1)  # [n, ctx]
        self.ancestors = torch.zeros(len(states), k, self.cap, dtype=torch.bool, device=h.device)

    def forward(self, d: int, a: int, x: torch.Tensor) -> torch.Tensor:
        m, k = self.model, self.k
        heads, head_dim = m.num_heads, m.head_dim
        q, k_new, v_new = m._qkv(x, (self.base_pos[:a] + d).repeat_interleave(k))
        col = self.ctx + (d - 2) * k  # this depth's frontier keys
        self.keys[:a, col : col + k] = m._expand_kv(k_new).view(a, k, heads, head_dim)
        self.values[:a, col : col + k] = m._expand_kv(v_new).view(a, k, heads, head_dim)
        self.ancestors = self.ancestors[:a]
        self.ancestors[:, :, (d - 2) * k : (d - 1) * k] |= torch.eye(k, dtype=torch.bool, device=x.device)  # itself
        context = self.ctx_valid[:a].unsqueeze(1).expand(a, k, self.ctx)
        mask = torch.cat([context, self.ancestors[:, :, : (d - 1) * k]], dim=-1)
        attn = F.scaled_dot_product_attention(
            q.view(a, k, heads, head_dim).transpose(1, 2),
            self.keys[:a, : col + k].transpose(1, 2),
            self.values[:a, : col + k].transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
        )  # [a, heads, k, head_dim]
        return m._finish(x, attn.transpose(1, 2).reshape(a * k, heads, head_dim))

    def follow(self, a: int, parent: torch.Tensor) -> None:
        self.ancestors = self.ancestors.gather(1, parent.unsqueeze(2).expand(a, self.k, self.cap))


class _PagedFrontier:
    """Frontier attention through the fused layer (lyanna_kernels/fused_decoder.py): frontier node j of request b
    runs as a sequence of its own, whose block table is the request's full context blocks followed by
    path j's scratch blocks. A path holds a copy of the context's partial last block, then the node's
    ancestors' keys and its own; `follow` copies each parent's path into its children's."""

    def __init__(self, drafter: EagleDrafter, requests: list[Request], states: list[_State], depth: int, k: int):
        fused, bs = drafter.fused_layer, drafter.kv_cache.block_size
        assert fused is not None
        self.fused, self.model, self.k = fused, drafter.model, k
        span = max(st.processed % bs for st in states) + depth - 1  # slots past the full context blocks
        per_path = -(-span // bs)
        fused.reserve(len(states) * k)
        paths = [[fused.scratch(b * k + j)[:per_path] for j in range(k)] for b in range(len(states))]
        own = [drafter.kv_cache.block_tables[req.request_id] for req in requests]
        self.tables = [own[b][: st.processed // bs] + paths[b][j] for b, st in enumerate(states) for j in range(k)]
        self.positions = [st.processed - 2 for st in states]  # a depth-d node sits at position + d
        self.paths = torch.tensor(paths)  # [n, k, per_path]
        partial = [(b, own[b][st.processed // bs]) for b, st in enumerate(states) if st.processed % bs]
        if partial:
            rows, blocks = (torch.tensor(c) for c in zip(*partial, strict=True))
            for cache in fused.block_views():
                cache[self.paths[rows, :, 0]] = cache[blocks].unsqueeze(1)

    def forward(self, d: int, a: int, x: torch.Tensor) -> torch.Tensor:
        k = self.k
        positions = [p + d for p in self.positions[:a] for _ in range(k)]
        out = self.fused(x, positions, [1] * (a * k), self.tables[: a * k])
        return self.model.norm(out.to(x.dtype))

    def follow(self, a: int, parent: torch.Tensor) -> None:
        paths = self.paths[:a]
        parents = paths.gather(1, parent.unsqueeze(2).expand_as(paths))
        for cache in self.fused.block_views():
            cache[paths] = cache[parents]
