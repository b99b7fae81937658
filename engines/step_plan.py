"""The step as data: what one target forward computes, in plain flat arrays.

The scheduler decides who runs and how many tokens each gets (`SchedulerOutput`); once the executor
has drafted within the granted budgets, `StepPlan.from_scheduled` flattens the step: every sequence's
new tokens (a prefill chunk, a decode token, or a draft tree's nodes) one after another, with their
positions, each token's parent among its sequence's new tokens, the rows that need logits, and each
sequence's block table. The model runner turns it into device tensors once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.draft_tree import DraftTree
    from engines.kv_cache import PagedKVCache
    from engines.scheduler import ScheduledRequest


@dataclass
class StepPlan:
    """One forward pass over a ragged batch of B sequences and T new tokens."""

    seq_ids: list[str] = field(default_factory=list)  # [B]
    num_cached: list[int] = field(default_factory=list)  # [B] tokens already in the cache
    query_start: list[int] = field(default_factory=lambda: [0])  # [B + 1] offsets of each sequence's tokens
    is_tree: list[bool] = field(default_factory=list)  # [B] new tokens form a draft tree (else a causal run)
    num_prompt: list[int] = field(default_factory=list)  # [B] of a causal run, how many lead tokens are the prompt's
    token_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    parents: list[int] = field(default_factory=list)  # [T] parent among the sequence's new tokens, -1 for none
    logits_indices: list[int] = field(default_factory=list)  # [N] rows of T whose logits are needed
    logits_start: list[int] = field(default_factory=lambda: [0])  # [B + 1] offsets into logits_indices
    block_tables: list[list[int]] = field(default_factory=list)  # [B] each sequence's blocks

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        """New tokens in the step (T)."""
        return len(self.token_ids)

    def add(
        self,
        seq_id: str,
        block_table: list[int],
        num_cached: int,
        token_ids: list[int],
        parents: list[int] | None = None,
        depths: list[int] | None = None,
        logits_rows: list[int] | None = None,
        num_prompt: int = 0,
    ) -> None:
        """Append one sequence: a causal run of tokens, or a tree (`parents`, `depths`) rooted at cache
        index `num_cached`; `logits_rows` (indices into its tokens) default to its last token; `num_prompt`:
        how many of a run's tokens are prompt tokens (the CPU decoder reads them as a run, model.py)."""
        n = len(token_ids)
        offset = len(self.token_ids)
        self.seq_ids.append(seq_id)
        self.num_cached.append(num_cached)
        self.is_tree.append(parents is not None)
        self.num_prompt.append(0 if parents is not None else min(num_prompt, n))
        self.token_ids.extend(token_ids)
        if parents is None:
            self.parents.extend(range(-1, n - 1))
            self.positions.extend(range(num_cached, num_cached + n))
        else:
            self.parents.extend(parents)
            self.positions.extend(num_cached + d for d in (depths or []))
        self.query_start.append(offset + n)
        rows = logits_rows if logits_rows is not None else [n - 1]
        self.logits_indices.extend(offset + r for r in rows)
        self.logits_start.append(len(self.logits_indices))
        self.block_tables.append(block_table)

    @classmethod
    def from_scheduled(
        cls, scheduled: list[ScheduledRequest], drafts: list[DraftTree | None], kv: PagedKVCache
    ) -> StepPlan:
        """The step of the scheduler's decisions and the drafts made for them (one per scheduled
        request, None for none): draft trees with logits at every node, prefill chunks with logits at
        their end only when they finish the prompt (and at every token that scores a prompt token for
        a request asking for prompt log-probabilities), decode tokens with logits."""
        plan = cls()
        for s, tree in zip(scheduled, drafts, strict=True):
            req = s.request
            start = req.num_computed_tokens
            table = kv.block_tables[req.request_id]
            if tree is not None:
                plan.add(req.request_id, table, start, tree.tokens, tree.parents, tree.depths, list(range(tree.size)))
                continue
            end = start + s.num_new_tokens
            rows = req.prompt_logprob_rows(start, s.num_new_tokens)
            if end == req.num_tokens:
                rows = [*rows, s.num_new_tokens - 1]
            prompt = max(0, min(end, req.num_prompt_tokens) - start)
            plan.add(req.request_id, table, start, req.token_ids(start, end), logits_rows=rows, num_prompt=prompt)
        return plan
