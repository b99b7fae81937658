"""Runs a step plan on the model: device tensors once per step, one forward over the ragged batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.attention import AttentionMetadata, SequenceLayout, build_attention_metadata
from engines.cuda_graphs import StepGraphs
from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from engines.step_plan import StepPlan


@dataclass
class StepInput:
    """One sequence's new tokens for a forward pass (a prefill chunk, a decode token, or a draft tree)."""

    seq_id: str
    token_ids: list[int]
    num_cached: int  # tokens already in the cache before these
    parents: list[int] | None = None  # a draft tree's parents (positions follow its depths); None = causal
    logits_rows: list[int] | None = None  # which of its tokens need logits (indices into token_ids)


@dataclass
class StepResult:
    """The step's logits and hidden states, flat, with per-sequence views."""

    logits: torch.Tensor | None  # [N, vocab] fp32, the plan's logits rows in order (None: `argmax` instead)
    hidden: torch.Tensor  # [T, hidden] every new token's last-layer hidden state
    plan: StepPlan
    argmax: list[int] | None = None  # every new token's greedy next token, on the host (`execute_argmax`)

    def seq_logits(self, b: int) -> torch.Tensor:
        """Sequence b's logits rows."""
        if self.logits is None:
            raise RuntimeError("this step computed each row's argmax, not its logits")
        return self.logits[self.plan.logits_start[b] : self.plan.logits_start[b + 1]]

    def seq_hidden(self, b: int) -> torch.Tensor:
        """Sequence b's hidden states, one per new token."""
        return self.hidden[self.plan.query_start[b] : self.plan.query_start[b + 1]]


class ModelRunner:
    """Owns the model and KV cache tensors; turns a `StepPlan` into one forward pass.

    Block tables live in a persistent device buffer whose rows are overwritten each step. With `graphs`
    (CUDA) the steps they hold replay CUDA graphs captured at construction (engines/cuda_graphs.py)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        device: torch.device,
        max_num_seqs: int = 64,
        graphs: StepGraphs | None = None,
    ):
        self.model = model
        self.kv = kv_cache
        self.device = device
        self.block_tables = torch.zeros(max_num_seqs, 1, dtype=torch.int32, device=device)
        self.graphs = graphs

    def _table_buffer(self, rows: int, width: int) -> torch.Tensor:
        """The persistent block-table buffer, grown when a step needs more rows or blocks."""
        have_rows, have_width = self.block_tables.shape
        if rows > have_rows or width > have_width:
            self.block_tables = torch.zeros(
                max(rows, have_rows), max(width, 2 * have_width), dtype=torch.int32, device=self.device
            )
        return self.block_tables

    def execute(self, plan: StepPlan, logits: bool = True) -> StepResult:
        """One target forward over every sequence's new tokens; K/V are written to the cache. Without
        `logits` (a tensor-parallel rank other than 0) no logits rows are computed."""
        bucket = self.graphs.bucket(plan) if self.graphs is not None and logits else None
        if bucket is not None:
            out, hidden = self.graphs.run(plan, bucket)
            return StepResult(out, hidden, plan)
        meta = self._metadata(plan, self.model.fused_decoder(self.kv, plan.num_tokens) is None)
        host = torch.tensor([plan.token_ids, plan.positions], dtype=torch.long)
        ids_positions = host.to(self.device, non_blocking=True)
        rows = plan.logits_indices if logits else []
        logits_index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        out, hidden = self.model(ids_positions[0], ids_positions[1], meta, self.kv, logits_index)
        return StepResult(out, hidden, plan)

    def execute_greedy(self, plan: StepPlan, steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`steps` greedy decode steps of a plan of one decode token per sequence in one call (the KV blocks of
        every step allocated): each sequence's hidden states [steps, B, hidden] and argmax tokens [steps, B]
        on the host, or None where the model cannot take them in one call (`LlamaModel.greedy_steps`)."""
        if self.graphs is not None or plan.num_tokens != plan.num_seqs:
            return None
        meta = self._metadata(plan, cpu_groups=False)
        ids = torch.tensor(plan.token_ids, dtype=torch.long)
        positions = torch.tensor(plan.positions, dtype=torch.long)
        return self.model.greedy_steps(ids, positions, meta, self.kv, steps)

    def execute_argmax(self, plan: StepPlan) -> StepResult | None:
        """`execute` with every new token's greedy next token (`StepResult.argmax`, the step's one host copy)
        in place of logits, the LM head and argmax in the model's call; None where the model takes no such call
        (`LlamaModel.argmax_rows`): then `execute` gives the logits."""
        if self.graphs is not None:
            return None
        meta = self._metadata(plan, cpu_groups=False)
        ids = torch.tensor(plan.token_ids, dtype=torch.long)
        positions = torch.tensor(plan.positions, dtype=torch.long)
        out = self.model.argmax_rows(ids, positions, meta, self.kv)
        if out is None:
            return None
        hidden, tokens = out
        return StepResult(None, hidden, plan, tokens.tolist())

    def _metadata(self, plan: StepPlan, cpu_groups: bool) -> AttentionMetadata:
        """The plan's attention metadata over the persistent block-table buffer."""
        seqs = []
        for b in range(plan.num_seqs):
            lo, hi = plan.query_start[b], plan.query_start[b + 1]
            parents = plan.parents[lo:hi] if plan.is_tree[b] else None
            seqs.append(SequenceLayout(plan.block_tables[b], plan.num_cached[b], hi - lo, parents, plan.num_prompt[b]))
        width = max(len(t) for t in plan.block_tables)
        tables = self._table_buffer(plan.num_seqs, width)
        return build_attention_metadata(seqs, self.kv.block_size, self.device, tables, cpu_groups=cpu_groups)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy cached K/V from slots `src` to slots `dst` (accepted draft paths), every layer."""
        self.kv.move_slots(src, dst)

    def execute_inputs(self, inputs: list[StepInput]) -> StepResult:
        """`execute` for sequences given one by one (their KV blocks already allocated)."""
        plan = StepPlan()
        for inp in inputs:
            depths = None
            if inp.parents is not None:
                depths = []
                for p in inp.parents:
                    depths.append(0 if p < 0 else depths[p] + 1)
            table = self.kv.block_tables[inp.seq_id]
            plan.add(inp.seq_id, table, inp.num_cached, inp.token_ids, inp.parents, depths, inp.logits_rows)
        return self.execute(plan)
