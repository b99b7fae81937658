"""The Lyanna drafter in the engine: hidden-state auto-regression plus token-info tree sampling.

Per request it keeps the target's hidden states H_j for the committed context (from prefill chunks,
plain decode steps and verified paths) and its decoder layer's K/V over the teacher-forced inputs
fuse(H_j, E(t_{j+1})). With tokens t_0..t_{T-1} (t_{T-1}: the root, not yet verified), the context
runs through position T-2, whose output is the first draft state h_1; steps 2..N extend a temporary
K/V. One LM-head GEMM gives l_1..l_N and Algorithm 1 builds the tree (token_info_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.draft_tree import DraftTree, merge_trees
from engines.drafters.base import Drafter
from engines.drafters.lyanna_model import LyannaDraftModel
from engines.drafters.token_info_sampling import resample_tree, token_info_tree
from engines.request import Request
from engines.spec_params import SpecParams
from engines.verification import VerifyResult


@dataclass
class _State:
    hidden: list[torch.Tensor] = field(default_factory=list)  # H_0.. of the committed context, [hidden] each
    keys: torch.Tensor | None = None  # [processed, heads, head_dim] draft-layer K over the context
    values: torch.Tensor | None = None

    @property
    def processed(self) -> int:
        """Context positions whose draft-layer K/V are cached."""
        return 0 if self.keys is None else self.keys.shape[0]

    last_out: torch.Tensor | None = None  # the layer's output at the last processed position
    logits: torch.Tensor | None = None  # [steps, vocab] raw draft logits of the last proposal
    resampled: DraftTree | None = None  # Algorithm 2's tree, to be fused into the next verification


class LyannaDrafter(Drafter):
    """Drafts with a trained `LyannaDraftModel`; token info comes from a collapsed hot-token table
    when one is given, else from the model's low-rank embedding."""

    name = "lyanna"
    wants_hidden = True

    def __init__(
        self,
        model: LyannaDraftModel,
        token_info_table=None,
        resample: bool = True,
        resample_threshold: int = 1,
        fusion: bool = True,
    ):
        self.model = model
        self.token_info = token_info_table or model.token_info
        self.resample = resample
        self.fusion = fusion  # off: a re-sampled tree is verified alone, in place of the next draft
        self.resample_threshold = resample_threshold
        self.states: dict[str, _State] = {}
        self.num_fused = 0  # proposals that carried a re-sampled tree
        self.num_resampled_alone = 0  # proposals that were a re-sampled tree alone (fusion off)

    # ---- hidden states from the target -----------------------------------------------------------
    def _record(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        st = self.states.setdefault(request.request_id, _State())
        if start < len(st.hidden):  # recomputation after preemption: drop what follows
            del st.hidden[start:]
            if st.processed > start:
                st.keys, st.values = st.keys[:start], st.values[:start]
            st.last_out = None
        st.hidden.extend(hidden.to(self.model.embed.dtype).unbind(0))

    def on_prefill(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        self._record(request, start, hidden)

    def on_verified(self, request: Request, tree: DraftTree, result: VerifyResult, hidden: torch.Tensor) -> None:
        self._record(request, request.num_computed_tokens - len(result.path), hidden)
        st = self.states[request.request_id]
        st.resampled = None
        last = result.path[-1]
        rejected = any(p == last for p in tree.parents)  # the walk stopped at a node with children
        if self.resample and rejected and st.logits is not None:
            # The bonus token sits at draft depth a+1; the logits of the depths past it are reused.
            remaining = st.logits[result.num_accepted + 1 :]
            width = max(1, max(len(tree.children(i)) for i in range(tree.size)))
            resampled = resample_tree(
                remaining, result.bonus, self.token_info, width, self.resample_threshold, self.model.d2t
            )
            if resampled.num_draft:
                st.resampled = resampled

    def on_finished(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    # ---- drafting -------------------------------------------------------------------------------
    def catch_up(self, requests: list[Request]) -> list[int]:
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
        positions = torch.cat([torch.arange(start, end) for _, _, start, end in todo]).to(device)
        x = m.fused_input(hidden, torch.tensor(next_tokens, device=device))
        q, k, v = m._qkv(x, positions)
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
            st.keys, st.values = keys, values
            offset += n
        layer_out = m._finish(x, torch.cat(outs))
        offset = 0
        for _, st, start, end in todo:
            offset += end - start
            st.last_out = layer_out[offset - 1 : offset]
        return [end - start for _, _, start, end in spans]

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
        ready = [(i, req, st) for i, req in enumerate(requests) if (st := self._context_ready(req)) is not None]
        out: list[torch.Tensor | None] = [None] * len(requests)
        if not ready:
            return out
        m = self.model
        h = torch.cat([st.last_out for _, _, st in ready])  # [B, hidden]
        lens = [st.keys.shape[0] for _, _, st in ready]
        width = max(lens) + steps - 1
        keys = h.new_zeros(len(ready), width, m.num_heads, m.head_dim)
        values = torch.zeros_like(keys)
        valid = torch.zeros(len(ready), width, dtype=torch.bool, device=h.device)
        for b, (_, _, st) in enumerate(ready):
            keys[b, : lens[b]], values[b, : lens[b]], valid[b, : lens[b]] = st.keys, st.values, True
        pos = torch.tensor([req.num_tokens - 2 for _, req, _ in ready], device=h.device)
        traj = [h]
        for i in range(1, steps):
            q, k, v = m._qkv(h, pos + i)  # q: [B, heads, d]; k, v: [B, kv_heads, d]
            col = max(lens) + i - 1
            keys[:, col], values[:, col], valid[:, col] = m._expand_kv(k), m._expand_kv(v), True
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys[:, : col + 1].transpose(1, 2),
                values[:, : col + 1].transpose(1, 2),
                attn_mask=valid[:, None, None, : col + 1],
            )  # [B, heads, 1, d]
            h = m._finish(h, attn.squeeze(2))
            traj.append(h)
        stacked = torch.stack(traj, dim=1)  # [B, steps, hidden]
        for b, (i, _, _) in enumerate(ready):
            out[i] = stacked[b]
        return out

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees: list[DraftTree | None] = [None] * len(requests)
        drafting: list[int] = []
        for i, (req, spec) in enumerate(zip(requests, specs, strict=True)):
            st = self.states.get(req.request_id)
            if not self.fusion and st is not None and st.resampled is not None:
                # Without verification fusion the re-sampled tree takes this step's place (no drafter forward).
                trees[i], st.resampled, st.logits = st.resampled.prune(spec.budget + 1), None, None
                self.num_resampled_alone += 1
            else:
                drafting.append(i)
        if not drafting:
            return trees
        depth = max(specs[i].depth for i in drafting)
        trajs = self.trajectories([requests[i] for i in drafting], depth)
        done = [(i, t[: specs[i].depth]) for i, t in zip(drafting, trajs, strict=True) if t is not None]
        if not done:
            return trees
        all_logits = self.model.logits(torch.cat([t for _, t in done]))  # one LM-head GEMM for every step
        for (i, _), logits in zip(done, all_logits.split([specs[i].depth for i, _ in done]), strict=True):
            req, spec = requests[i], specs[i]
            root = req.token_ids(req.num_tokens - 1, req.num_tokens)[0]
            tree = token_info_tree(logits, root, self.token_info, spec.width, spec.budget, self.model.d2t)
            st = self.states[req.request_id]
            if st.resampled is not None and st.resampled.tokens[0] == root:
                # Verification fusion: the re-sampled tree rides along, competing for the budget.
                tree = merge_trees(tree, st.resampled).prune(spec.budget + 1)
                self.num_fused += 1
            st.logits, st.resampled = logits, None
            trees[i] = tree
        return trees
