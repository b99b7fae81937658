"""Tensor-parallel linear layers (Megatron-style column/row split); world size 1 by default.

A column-parallel layer holds a slice of the output features, so its output is a shard; a
row-parallel layer holds a slice of the input features and sums partial results across ranks.
Attention is split by KV-head groups (a rank holds some KV heads and the query heads that read them)
and the MLP by channels, so that each rank computes whole heads locally and the only communication is
one all-reduce after `o_proj` and one after `down_proj`. Splits need not be even: 3 KV heads over 2
ranks give 1 and 2 (the embedded model has 3), sizes differing by at most one unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engines.kv_cache import cpu_has_half_precision_math
from lyanna_kernels import onednn_linear
from lyanna_kernels.dispatch import deterministic, use_triton
from lyanna_kernels.quantized_linear import (
    ACTIVATION_DTYPE,
    Int4Codes,
    QuantizedWeight,
    can_quantize,
    dequantized,
    int4_codes,
    pack_int4,
    quantize_int8,
)


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process owns; `group` is a torch.distributed `ProcessGroup` when world_size > 1
    (the default group's, or a standalone one: see engines/tensor_parallel.py)."""

    world_size: int = 1
    rank: int = 0
    group: Any = None
    reducer: Callable[[torch.Tensor], torch.Tensor] | None = None  # a faster all-reduce than the group's

    def counts(self, units: int) -> list[int]:
        """How many of `units` parts each rank holds under `split`."""
        return [TensorParallel(self.world_size, r).split(units, "units")[1] for r in range(self.world_size)]

    def split(self, units: int, what: str) -> tuple[int, int]:
        """This rank's share of `units` indivisible parts (heads, channels): (first, count), as even as
        can be. When they do not divide, the last ranks take one more: rank 0 also schedules, drafts
        and samples, so it gets the lighter share."""
        if units < self.world_size:
            raise ValueError(f"{what}={units} is fewer than the tensor-parallel size {self.world_size}")
        base, extra = divmod(units, self.world_size)
        light = self.world_size - extra  # ranks with `base` units; the rest have one more
        return self.rank * base + max(0, self.rank - light), base + (self.rank >= light)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks in place (no-op on one rank)."""
        if self.world_size > 1:
            if self.reducer is not None:
                return self.reducer(x)
            self.group.allreduce([x]).wait()
        return x


def balanced_shares(units: int, unit_cost: int, fixed_costs: list[int]) -> list[int]:
    """Parts per rank (at least one each, `units` in all) that even out each rank's total cost, rank r
    already carrying `fixed_costs[r]` (e.g. MLP channels around an uneven split of attention heads)."""
    world = len(fixed_costs)
    target = (sum(fixed_costs) + units * unit_cost) / world
    shares = [max(1, round((target - fixed) / unit_cost)) for fixed in fixed_costs]
    r = world - 1
    while (diff := units - sum(shares)) != 0:  # rounding: settle the difference from the last rank back
        step = 1 if diff > 0 else -1
        if shares[r] + step >= 1:
            shares[r] += step
        r = (r - 1) % world
    return shares


def shard_range(
    size: int, units: int | None, tp: TensorParallel, what: str, shares: list[int] | None = None
) -> tuple[int, int]:
    """Rows (or columns) [start, end) of a dimension of `size` made of `units` equal parts (None: every
    element is a part) that this rank holds: `shares[r]` parts for rank r when given, else `tp.split`."""
    n = units or size
    if size % n:
        raise ValueError(f"{what}={size} is not made of {n} equal parts")
    if shares is None:
        first, count = tp.split(n, what)
    else:
        assert len(shares) == tp.world_size and sum(shares) == n, (shares, n)
        first, count = sum(shares[: tp.rank]), shares[tp.rank]
    part = size // n
    return first * part, (first + count) * part


class PackableLinear(nn.Module):
    """Base of the parallel linears: owns `weight` and, after `prepack()`, a faster CPU layout of it, or
    after `quantize()` / `set_quantized()` a weight-only quantized form in place of it."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    wide: torch.Tensor | None = None  # fp32 copy for many-row GEMMs on CPUs that emulate bf16
    quant: QuantizedWeight | None = None
    quant_kind: str | None = None  # "int4" / "int8" once quantized (also in fp32, which keeps dequantized values)

    def prepack(self) -> None:
        """Lay the weight out for the CPU's fastest kernel (call after loading; no-op elsewhere)."""
        if self.quant is None:
            self.packed = onednn_linear.prepack(self.weight.data)

    def widen(self) -> None:
        """Keep an fp32 copy of the weight for GEMMs of many rows (see `onednn_linear.WIDE_MIN_ROWS`)."""
        if self.quant is None:
            self.wide = self.weight.data.float() if self.weight.dtype != torch.float32 else None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Compute with `weight` from now on; the dense weight is released (`take` may add an fp32 copy
        of the quantized values for many-row GEMMs on CPUs without bf16 arithmetic)."""
        self.quant, self.packed, self.wide = weight, None, None
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def take(self, weight: QuantizedWeight | Int4Codes) -> None:
        """Compute with quantized `weight` (int4 codes are packed here; ValueError where packing does not
        apply). An fp32 layer keeps the dequantized values instead: the quantized model's math, exactly."""
        self.quant_kind = "int4" if isinstance(weight, Int4Codes) else weight.kind
        if self.weight.dtype == torch.float32:
            self.weight.data = dequantized(weight)
            return
        self.set_quantized(pack_int4(weight) if isinstance(weight, Int4Codes) else weight)
        if not cpu_has_half_precision_math(ACTIVATION_DTYPE):
            self.wide = dequantized(weight)  # for GEMMs of `quant.wide_min_rows` rows or more

    def quantize(self, kind: str) -> None:
        """Quantize the local shard: `kind` ("int4" or "int8"), or int8 where int4 does not fit the shape."""
        w = self.weight.data
        self.take(int4_codes(w) if kind == "int4" and can_quantize("int4", w) else quantize_int8(w))

    def takes_wide(self, rows: int) -> bool:
        """Whether `matmul` projects `rows` rows through the fp32 copy of a quantized weight (the wide path)."""
        return self.quant is not None and self.wide is not None and rows >= self.quant.wide_min_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T on the local shard (x is cast to the weight's dtype; fp32 out on the wide path;
        bf16 out when quantized)."""
        if self.quant is not None:
            if self.takes_wide(x.shape[0]):
                return torch.nn.functional.linear(x.float(), self.wide)
            return self.quant.matmul(x)
        if deterministic() and use_triton(x):
            from lyanna_kernels.batch_invariant import linear  # (triton: the gpu extra)

            return linear(x, self.weight)
        return onednn_linear.linear(x, self.weight, self.packed, self.wide)


class ColumnParallelLinear(PackableLinear):
    """y = x @ W.T (+ b) where W's rows are split across ranks; `output_sizes` are fused segments (e.g. q,
    k, v) that are each split into `units` parts (e.g. KV-head groups), so every rank holds the same parts
    of every segment (`shares[r]` of them for rank r when given, else an even split). With `bias`, each
    segment's bias is split with its rows and kept in fp32 whatever the weight becomes (quantized or not)."""

    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        tp: TensorParallel,
        dtype: torch.dtype | None = None,
        units: int | None = None,
        shares: list[int] | None = None,
        bias: bool = False,
    ):
        super().__init__()
        self.tp = tp
        self.output_sizes = list(output_sizes)
        self.ranges = [shard_range(s, units, tp, "output segment", shares) for s in output_sizes]
        self.local_sizes = [end - start for start, end in self.ranges]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features, dtype=dtype), requires_grad=False)
        local = sum(self.local_sizes)
        self.bias = nn.Parameter(torch.zeros(local, dtype=torch.float32), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, local_out] (fp32 with a bias)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias  # promotes to fp32: the bias is not rounded

    @torch.no_grad()
    def load_segments(self, full_weights: list[torch.Tensor], full_biases: list[torch.Tensor] | None = None) -> None:
        """Copy this rank's rows of each full (unsharded) segment weight, and of each segment's bias when the
        layer has one (`full_biases` in the same order; required then, refused otherwise)."""
        if (full_biases is None) != (self.bias is None):
            raise ValueError("biases must be given exactly when the layer has one")
        shards, bias_shards = [], []
        for i, (w, full, (start, end)) in enumerate(zip(full_weights, self.output_sizes, self.ranges, strict=True)):
            if w.shape[0] != full:
                raise ValueError(f"segment {i} has {w.shape[0]} rows, the layer takes {full}")
            shards.append(w[start:end])
            if full_biases is not None:
                if full_biases[i].shape != (full,):
                    raise ValueError(f"segment {i}'s bias is {list(full_biases[i].shape)}, the layer takes [{full}]")
                bias_shards.append(full_biases[i][start:end])
        self.weight.copy_(torch.cat(shards, dim=0))
        if self.bias is not None:
            self.bias.copy_(torch.cat(bias_shards).float())

    def load_int4_segments(self, full_codes: list[Int4Codes]) -> None:
        """Take this rank's rows of each full segment's int4 codes as the weight, as stored (no rounding)."""
        parts = Int4Codes.cat([c.rows(start, end) for c, (start, end) in zip(full_codes, self.ranges, strict=True)])
        try:
            self.take(parts)
        except ValueError:  # a shard the int4 packing does not take: int8 of the stored values
            self.take(quantize_int8(parts.dequantize()))


class RowParallelLinear(PackableLinear):
    """y = x @ W.T where W's columns (`units` equal parts) are split across ranks and the partial
    products are summed."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        dtype: torch.dtype | None = None,
        units: int | None = None,
        shares: list[int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_range = shard_range(in_features, units, tp, "input features", shares)
        self.local_in = self.in_range[1] - self.in_range[0]
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local_in] -> [T, out]
        return self.tp.all_reduce(self.matmul(x))

    @torch.no_grad()
    def load_full(self, w: torch.Tensor) -> None:
        """Copy this rank's columns of the full weight."""
        start, end = self.in_range
        self.weight.copy_(w[:, start:end])

    def load_int4_full(self, codes: Int4Codes) -> None:
        """Take this rank's columns of the full int4 codes as the weight, as stored, when the shard falls on
        whole groups; otherwise the shard is dequantized and quantized again (int4, or int8)."""
        start, end = self.in_range
        try:
            self.take(codes.columns(start, end))
        except ValueError:
            self.weight.data = codes.dequantize()[:, start:end].to(self.weight.dtype)
            self.quantize("int4")
