"""Runs a scheduled step on the model: builds the flat ragged batch and its attention layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.attention import SequenceLayout, build_attention_metadata
from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from engines.scheduler import SchedulerOutput


@dataclass
class StepInput:
    """One sequence's new tokens for a forward pass (a prefill chunk, a decode token, or a draft tree)."""

    seq_id: str
    token_ids: list[int]
    num_cached: int  # tokens already in the cache before these
    positions: list[int] | None = None  # None = num_cached, num_cached+1, ...
    tree_mask: torch.Tensor | None = None  # [n, n] bool ancestor-or-self; None = causal
    logits_rows: list[int] | None = None  # which of its tokens need logits (indices into token_ids)


@dataclass
class StepResult:
    """Logits per sequence for the requested rows, and hidden states of every token."""

    logits: list[torch.Tensor]  # per sequence: [len(logits_rows), vocab] fp32
    hidden: list[torch.Tensor]  # per sequence: [n, hidden]


class ModelRunner:
    """Owns the model and KV cache tensors; turns `StepInput`s into one forward pass."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, device: torch.device):
        self.model = model
        self.kv = kv_cache
        self.device = device

    def execute(self, inputs: list[StepInput]) -> StepResult:
        """One target forward over all sequences' new tokens; K/V are written to the cache."""
        tokens: list[int] = []
        positions: list[int] = []
        layouts: list[SequenceLayout] = []
        logits_index: list[int] = []
        for inp in inputs:
            n = len(inp.token_ids)
            offset = len(tokens)
            tokens.extend(inp.token_ids)
            positions.extend(inp.positions if inp.positions is not None else range(inp.num_cached, inp.num_cached + n))
            layouts.append(
                SequenceLayout(self.kv.slots(inp.seq_id, 0, inp.num_cached + n), inp.num_cached, n, inp.tree_mask)
            )
            rows = inp.logits_rows if inp.logits_rows is not None else [n - 1]
            logits_index.extend(offset + r for r in rows)
        meta = build_attention_metadata(layouts, self.device)
        dev = self.device
        logits, hidden = self.model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            self.kv,
            torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
        out_logits, out_hidden = [], []
        row = tok = 0
        for inp in inputs:
            n_rows = len(inp.logits_rows) if inp.logits_rows is not None else 1
            out_logits.append(logits[row : row + n_rows])
            out_hidden.append(hidden[tok : tok + len(inp.token_ids)])
            row += n_rows
            tok += len(inp.token_ids)
        return StepResult(out_logits, out_hidden)

    def inputs_for(self, sched: SchedulerOutput) -> list[StepInput]:
        """Step inputs: a draft tree with logits at every node, or the next chunk with logits at its end."""
        inputs = []
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            if s.draft is not None:
                tree = s.draft
                inputs.append(
                    StepInput(
                        req.request_id,
                        tree.tokens,
                        start,
                        positions=tree.positions(start),
                        tree_mask=tree.attention_mask(),
                        logits_rows=list(range(tree.size)),
                    )
                )
                continue
            end = start + s.num_new_tokens
            rows = [s.num_new_tokens - 1] if end == req.num_tokens else []
            inputs.append(StepInput(req.request_id, req.token_ids(start, end), start, logits_rows=rows))
        return inputs
