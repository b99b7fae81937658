"""Tensor-parallel linear layers (Megatron-style column/row split); world size 1 by default.

A column-parallel layer holds a slice of the output features, so its output is a shard; a
row-parallel layer holds a slice of the input features and sums partial results across ranks.
Attention heads and MLP channels are split so that each rank computes whole heads locally and the
only communication is one all-reduce after `o_proj` and one after `down_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels import onednn_linear


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process owns; `group` is a torch.distributed process group when world_size > 1."""

    world_size: int = 1
    rank: int = 0
    group: Any = None

    def shard(self, size: int, what: str) -> int:
        """Local size of a dimension split evenly across ranks."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tensor-parallel size {self.world_size}")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks in place (no-op on one rank)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x


class PackableLinear(nn.Module):
    """Base of the parallel linears: owns `weight` and, after `prepack()`, a faster CPU layout of it."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    wide: torch.Tensor | None = None  # fp32 copy for many-row GEMMs on CPUs that emulate bf16

    def prepack(self) -> None:
        """Lay the weight out for the CPU's fastest kernel (call after loading; no-op elsewhere)."""
        self.packed = onednn_linear.prepack(self.weight.data)

    def widen(self) -> None:
        """Keep an fp32 copy of the weight for GEMMs of many rows (see `onednn_linear.WIDE_MIN_ROWS`)."""
        self.wide = self.weight.data.float() if self.weight.dtype != torch.float32 else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T on the local shard (x is cast to the weight's dtype; fp32 out on the wide path)."""
        return onednn_linear.linear(x, self.weight, self.packed, self.wide)


class ColumnParallelLinear(PackableLinear):
    """y = x @ W.T where W's rows are split across ranks; `output_sizes` are fused segments (e.g. q, k, v)
    that are each split, so every rank holds the same share of every segment."""

    def __init__(self, in_features: int, output_sizes: list[int], tp: TensorParallel, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.output_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, "output segment") for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, local_out]
        return self.matmul(x)

    @torch.no_grad()
    def load_segments(self, full_weights: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each full (unsharded) segment weight."""
        shards = []
        for w, full, local in zip(full_weights, self.output_sizes, self.local_sizes, strict=True):
            assert w.shape[0] == full, (w.shape, full)
            shards.append(w[self.tp.rank * local : (self.tp.rank + 1) * local])
        self.weight.copy_(torch.cat(shards, dim=0))


class RowParallelLinear(PackableLinear):
    """y = x @ W.T where W's columns are split across ranks and the partial products are summed."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.local_in = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local_in] -> [T, out]
        return self.tp.all_reduce(self.matmul(x))

    @torch.no_grad()
    def load_full(self, w: torch.Tensor) -> None:
        """Copy this rank's columns of the full weight."""
        r = self.tp.rank
        self.weight.copy_(w[:, r * self.local_in : (r + 1) * self.local_in])
