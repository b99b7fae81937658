"""CUDA graphs of the target's decode and verification steps: forwards captured per bucket, replayed.

A step of a small model on a GPU costs its kernel launches, not its math: about 735 launches and
17-24 ms of host time a plain step against 2 ms on the device for the embedded model on an H200
(docs/gpu.md). `StepGraphs` captures the target's forward once per bucket of (sequences B, new tokens
per sequence Q) at start-up, with every input in a static device buffer, and replays the smallest
bucket that holds a step whose sequences each bring at most Q new tokens: Q = 1 for plain decode steps,
larger Q for draft trees (and short causal runs, as chains) under speculation. Prompt chunks larger
than the largest Q run eagerly.

Padding needs no reserved cache space: a padding token repeats its sequence's first token (same id,
position, K/V slot and ancestor mask), so it writes the same K/V values again and sees what that token
sees; a padding sequence repeats the step's first sequence. Their outputs are dropped. Decode buckets
compute the LM head inside the graph (every row is needed); tree buckets return hidden states, and the
rows that need logits go through the LM head after the replay.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engines.attention import AttentionMetadata, ancestor_bitmasks
from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from engines.step_plan import StepPlan
from lyanna_kernels.dispatch import use_triton

GRAPH_BATCH_SIZES = (1, 2, 4, *range(8, 129, 8))  # sequences per bucket (up to the engine's max_num_seqs)
GRAPH_TREE_SIZES = (2, 4, 8, 16, 32, 64)  # new tokens per sequence of the verification buckets


def _sizes_up_to(sizes: tuple[int, ...], limit: int) -> list[int]:
    """Every size below `limit` and the first that holds it."""
    out = []
    for size in sizes:
        out.append(size)
        if size >= limit:
            break
    return out


def graph_buckets(max_num_seqs: int, max_tree_tokens: int, max_rows: int) -> list[tuple[int, int]]:
    """The (B, Q) buckets of an engine running at most `max_num_seqs` sequences whose draft trees have at
    most `max_tree_tokens` tokens (1: no speculation), with at most `max_rows` tokens in a step."""
    batches = _sizes_up_to(GRAPH_BATCH_SIZES, max_num_seqs)
    trees = _sizes_up_to(GRAPH_TREE_SIZES, max_tree_tokens) if max_tree_tokens > 1 else []
    return [(b, q) for q in [1, *trees] for b in batches if q == 1 or b * q <= max_rows]


@dataclass
class _Captured:
    """One bucket's graph and the outputs it writes (in the graphs' shared memory pool)."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    hidden: torch.Tensor


class StepGraphs:
    """The target's forward over static input buffers, captured per (B, Q) bucket.

    `capture=False` keeps the same buffers and padding but runs the forward eagerly at each replay (the
    tests check the layout that way on CPU, with the Triton kernels in their interpreter)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        buckets: list[tuple[int, int]],
        max_blocks: int,
        capture: bool,
    ):
        if not use_triton(kv.k):
            raise ValueError("step graphs attend through the Triton kernel (kernels: auto or triton)")
        self.model = model
        self.kv = kv
        self.buckets = sorted(buckets, key=lambda bq: (bq[1], bq[0]))
        self.max_blocks = max_blocks
        device = kv.k.device
        rows = max(b * q for b, q in buckets)
        seqs = max(b for b, _ in buckets)
        self.max_q = max(q for _, q in buckets)
        self.max_seqs = seqs
        # token ids, positions, K/V slots (int64: index_copy_ takes them as they are)
        self.tokens = torch.zeros(3, rows, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.long, device=device)  # keys per sequence
        self.block_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32, device=device)
        self.words = -(-self.max_q // 32)
        self.tree_masks = torch.ones(rows, self.words, dtype=torch.int32, device=device)
        self.is_tree = torch.ones(seqs, dtype=torch.int32, device=device)
        self.arange = torch.arange(rows + 1, dtype=torch.long, device=device)
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.replays: Counter[int] = Counter()  # steps served by a replay, by the bucket's Q
        if capture:
            self._capture()

    def bucket(self, plan: StepPlan) -> tuple[int, int] | None:
        """The smallest bucket holding the step, or None (the step runs eagerly): decode buckets take steps
        of one token per sequence with a logits row each; tree buckets, steps of at most Q tokens per
        sequence; block tables within the captured width."""
        B = plan.num_seqs
        if B == 0 or B > self.max_seqs or max(len(t) for t in plan.block_tables) > self.max_blocks:
            return None
        decode = plan.num_tokens == B and len(plan.logits_indices) == B and not any(plan.is_tree)
        q = 1 if decode else max(2, max(plan.query_start[b + 1] - plan.query_start[b] for b in range(B)))
        for size, bucket_q in self.buckets:  # by Q, then B
            if bucket_q >= q and size >= B:
                return size, bucket_q
        return None

    def run(self, plan: StepPlan, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits [N, vocab] fp32 and hidden states [T, hidden], in the plan's order: its inputs
        copied into the buffers, then the bucket's graph replayed (or its forward run eagerly)."""
        size, q = bucket
        B = plan.num_seqs
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        masks: list[list[int]] = []
        lens: list[int] = []
        table_rows: list[list[int]] = []
        width = max(len(t) for t in plan.block_tables)
        for b in range(size):
            s = b if b < B else 0  # padding sequences repeat the first
            lo, hi = plan.query_start[s], plan.query_start[s + 1]
            table, cached, n = plan.block_tables[s], plan.num_cached[s], hi - lo
            pad = q - n
            ids += plan.token_ids[lo:hi] + plan.token_ids[lo : lo + 1] * pad
            positions += plan.positions[lo:hi] + plan.positions[lo : lo + 1] * pad
            seq_slots = [table[i // bs] * bs + i % bs for i in range(cached, cached + n)]
            slots += seq_slots + seq_slots[:1] * pad
            if q > 1:
                seq_masks = ancestor_bitmasks(plan.parents[lo:hi], self.words)  # (a causal run's: a chain)
                masks += seq_masks + seq_masks[:1] * pad
            lens.append(cached + q)
            table_rows.append(table + [0] * (width - len(table)))
        rows = size * q
        self.tokens[:, :rows].copy_(torch.tensor([ids, positions, slots], dtype=torch.long), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.long), non_blocking=True)
        self.block_tables[:size, :width].copy_(torch.tensor(table_rows, dtype=torch.int32), non_blocking=True)
        if q > 1:
            self.tree_masks[:rows].copy_(torch.tensor(masks, dtype=torch.int32), non_blocking=True)
        self.replays[q] += 1
        captured = self.captured.get(bucket)
        if captured is None:
            logits, hidden = self._forward(size, q)
        else:
            captured.graph.replay()
            logits, hidden = captured.logits, captured.hidden
        if q == 1:
            # the outputs live in the graphs' shared memory pool: the next replay overwrites them
            return logits[:B].clone(), hidden[:B].clone()
        # the plan's rows in the padded layout: sequence b's token j at row b * q + j
        owner = [b for b in range(B) for _ in range(plan.query_start[b], plan.query_start[b + 1])]
        padded = [owner[t] * q + t - plan.query_start[owner[t]] for t in range(plan.num_tokens)]
        index = torch.tensor(padded + [padded[r] for r in plan.logits_indices]).to(hidden.device, non_blocking=True)
        logits = self.model.compute_logits(hidden.index_select(0, index[plan.num_tokens :]))
        return logits, hidden.index_select(0, index[: plan.num_tokens])

    def _forward(self, size: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward over the buffers' first `size` sequences of `q` tokens."""
        rows = size * q
        meta = AttentionMetadata(
            slot_mapping=self.tokens[2, :rows],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size].to(torch.int32),
            query_start=(self.arange[: size + 1] * q).to(torch.int32),
            groups=[],
            num_tokens=rows,
            max_query_len=q,
            block_size=self.kv.block_size,
            tree_masks=self.tree_masks[:rows] if q > 1 else None,
            is_tree=self.is_tree[:size] if q > 1 else None,
        )
        logits_rows = self.arange[:rows] if q == 1 else self.arange[:0]  # tree buckets: the LM head runs after
        return self.model(self.tokens[0, :rows], self.tokens[1, :rows], meta, self.kv, logits_rows)

    def _capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory. Warm-up runs first on a
        side stream (Triton compiles, cuBLAS picks its kernels); they write K/V to slot 0 of an empty cache."""
        order = sorted(self.buckets, key=lambda bq: -bq[0] * bq[1])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size, q in order:
                self._forward(size, q)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for size, q in order:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, hidden = self._forward(size, q)
            self.captured[(size, q)] = _Captured(graph, logits, hidden)
        torch.cuda.synchronize()
