"""Cost of verifying sampled (temperature > 0) draft trees: the batched walk against drawing at every node.

    python -m engines.bench.verify_latency --batch-sizes 1,8,32 --rounds 15

`verify_batch` walks all requests' trees level by level and draws the target's token (positional
Gumbel-max) only at the node each request visits. The alternative it replaced draws at every node
of every tree, then walks each tree on the host (`verify_tree_sampled`). Both give the same results
(tests/engines/test_verification.py); here they run interleaved in one process on the same random
trees and logits (vocabulary 49,152, 16-node trees of depth 4 and width 2, temperature 0.7), and
the median milliseconds of each and their ratio are printed. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from engines.draft_tree import DraftTree
from engines.positional_random import gumbel_noise
from engines.sampling import SamplingParams, processed_logprobs
from engines.verification import VerifyItem, verify_batch, verify_tree_sampled

VOCAB = 49152


def random_tree(depth: int, width: int, budget: int, generator: torch.Generator) -> DraftTree:
    """A top-k-shaped tree: `width` children for each of the `width` best nodes per depth, up to `budget`."""
    tokens, parents, frontier = [0], [-1], [0]
    for _ in range(depth):
        grown = []
        for parent in frontier:
            for _ in range(width):
                if len(tokens) > budget:
                    break
                tokens.append(int(torch.randint(VOCAB, (), generator=generator)))
                parents.append(parent)
                grown.append(len(tokens) - 1)
        frontier = grown[:width]
    return DraftTree(tokens=tokens, parents=parents)


def draw_at_every_node(items: list[VerifyItem], logits: torch.Tensor) -> list:
    """The replaced rule: every node's processed distribution and positional draw, then a host walk."""
    params = [it.params for it in items for _ in range(it.tree.size)]
    seeds = torch.tensor([it.seed for it in items for _ in range(it.tree.size)])
    positions = torch.tensor([it.base_position + d for it in items for d in it.tree.depths])
    drawn = (processed_logprobs(logits, params) + gumbel_noise(seeds, positions, VOCAB)).argmax(-1).tolist()
    results, start = [], 0
    for it in items:
        results.append(verify_tree_sampled(it.tree, drawn[start : start + it.tree.size]))
        start += it.tree.size
    return results


def median_ms(fn: Callable[[], object], rounds: int, other: Callable[[], object]) -> tuple[float, float]:
    """Median milliseconds of `fn` and `other`, run alternately."""
    a, b = [], []
    for _ in range(rounds):
        for f, out in ((fn, a), (other, b)):
            t0 = time.perf_counter()
            f()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    """Time both rules per batch size; print a line each, then one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    report = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        trees = [random_tree(4, 2, 15, g) for _ in range(batch)]
        logits = torch.randn(sum(t.size for t in trees), VOCAB, generator=g) * 3
        items = [VerifyItem(t, SamplingParams(temperature=0.7), i, 5) for i, t in enumerate(trees)]
        walk, every = median_ms(
            functools.partial(verify_batch, items, logits),
            args.rounds,
            functools.partial(draw_at_every_node, items, logits),
        )
        ratio = walk / every
        report[batch] = {"nodes": len(logits), "walk_ms": walk, "every_node_ms": every, "walk_over_every": ratio}
        print(f"batch {batch}: {len(logits)} nodes, walk {walk:.2f} ms, every node {every:.2f} ms, ratio {ratio:.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
