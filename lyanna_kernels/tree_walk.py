"""Triton tree verification walk over the flattened batch of draft trees.

Behind `engines.verification.walk_trees` (same arguments). One program per tree: from the root, take
the first child (in node order) carrying the target's token at the current node, until no child
does; that token is the bonus. The target's tokens are given per node: the argmax at temperature 0,
or the target's own draw at each node (the positional Gumbel-max draw for the node's depth) at
temperature > 0, which makes the same walk the exact sampling rule for deterministic trees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lyanna_kernels.dispatch import next_power_of_2


@triton.jit
def _tree_walk_kernel(
    target_ptr,  # [N] int64: the target's token at every node
    tokens_ptr,  # [N] int64: the draft tokens (a root's token is never compared)
    parents_ptr,  # [N] int64: parent node within its tree, -1 at roots
    offsets_ptr,  # [R + 1] int64: each tree's first node
    path_ptr,  # [R, levels] int64 out, pre-filled with -1: accepted nodes (within the tree), root first
    bonus_ptr,  # [R] int64 out
    levels,
    BLOCK: tl.constexpr,  # >= the largest tree
):
    r = tl.program_id(0)
    lo = tl.load(offsets_ptr + r)
    n = tl.load(offsets_ptr + r + 1) - lo
    idx = tl.arange(0, BLOCK)
    ok = idx < n
    tokens = tl.load(tokens_ptr + lo + idx, mask=ok, other=-1)
    parents = tl.load(parents_ptr + lo + idx, mask=ok, other=-2)
    node = tl.zeros([], tl.int64)
    walking = tl.full([], 1, tl.int1)
    for level in range(0, levels):
        want = tl.load(target_ptr + lo + node)
        tl.store(path_ptr + r * levels + level, node, mask=walking)
        match = ok & (parents == node) & (tokens == want)
        child = tl.min(tl.where(match, idx, BLOCK), 0)
        found = child < BLOCK
        tl.store(bonus_ptr + r, want, mask=walking & (found == 0))
        walking = walking & found
        node = tl.where(walking, child.to(tl.int64), node)


def triton_walk_trees(
    target_tokens: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    offsets: torch.Tensor,
    levels: int,
    max_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`engines.verification.walk_trees` as one Triton launch."""
    num_trees = offsets.shape[0] - 1
    device = target_tokens.device
    path = torch.full((num_trees, levels), -1, dtype=torch.int64, device=device)
    bonus = torch.empty(num_trees, dtype=torch.int64, device=device)
    if num_trees == 0:
        return path, bonus
    _tree_walk_kernel[(num_trees,)](
        target_tokens.long(),
        tree_tokens.long(),
        parents.long(),
        offsets.long(),
        path,
        bonus,
        levels,
        BLOCK=next_power_of_2(max(max_size, 2)),
    )
    return path, bonus
