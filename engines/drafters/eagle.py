"""The EAGLE-2-style drafter in the engine: dynamic top-k trees grown one drafter forward per depth.

Context handling is Lyanna's (the same teacher-forced layer inputs fuse(H_j, E(t_{j+1})) and a
per-request K/V cache, see lyanna.py). The tree grows like EAGLE-2's: the root's children are the
top-k of the first step's logits; at each later depth the k frontier nodes (highest joint
probability) run through the layer together, each on fuse(its parent's output, E(its token)) and
attending to the context plus its own ancestors, then the LM head scores their children. The
tree is finally reranked by joint probability down to the verification budget (`total_tokens`).
SpecParams map as depth -> depth, width -> top_k, budget -> total_tokens - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.draft_tree import DraftTree
from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna import LyannaDrafter
from engines.drafters.token_info_sampling import top_candidates
from engines.request import Request
from engines.spec_params import SpecParams


class EagleDrafter(LyannaDrafter):
    """Drafts with a trained `EagleDraftModel` (no token info, no re-sampling)."""

    name = "eagle"

    def __init__(self, model: EagleDraftModel):
        super().__init__(model, resample=False)
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
        """The full dynamic tree for the request's current root (before budget pruning)."""
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

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees: list[DraftTree | None] = []
        for req, spec in zip(requests, specs, strict=True):
            tree = self.grow(req, spec.depth, spec.width)
            trees.append(None if tree is None else tree.prune(spec.budget + 1))
        return trees
