"""Weight-only quantized linears on CPU: int8 per output channel, int4 in groups of 32 along the input.

The matrix products are PyTorch's own CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`),
which read the packed weights and take bf16 activations (their fp32-activation paths are ~10x slower on
an AVX2 CPU, measured). An int4 weight is built from codes q in [0, 15] with, per (row, group), a scale
s and a zero z: w = (q - 8) * s + z. That is exactly GGUF's Q4_0 (z = 0) and Q4_1 (w = q * d + m, so
s = d and z = m + 8 d), which load without re-quantizing (engines/gguf_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
INT4_ROW_MULTIPLE = 16  # PyTorch's CPU int4 packing takes output sizes divisible by 16
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
ACTIVATION_DTYPE = torch.bfloat16  # what the packed kernels take (and return)
# On a CPU without bf16 arithmetic (AVX2) fp32 GEMMs over the dequantized values beat the packed kernels
# from about this many rows (the embedded model's projections, 2 cores: int4 98.6 ms vs fp32 136 ms at 16
# rows, 184 vs 174 at 32); such CPUs keep an fp32 copy of the values for those GEMMs.
WIDE_MIN_ROWS = 24


@dataclass
class Int4Codes:
    """An int4 weight before packing: codes [N, K] uint8 in [0, 15], scales and zeros [N, K / group] fp32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def rows(self, start: int, end: int) -> Int4Codes:
        """Output rows [start, end)."""
        return Int4Codes(self.codes[start:end], self.scales[start:end], self.zeros[start:end])

    def columns(self, start: int, end: int) -> Int4Codes:
        """Input columns [start, end) (on group boundaries)."""
        if start % GROUP_SIZE or end % GROUP_SIZE:
            raise ValueError(f"columns [{start}, {end}) do not fall on groups of {GROUP_SIZE}")
        g0, g1 = start // GROUP_SIZE, end // GROUP_SIZE
        return Int4Codes(self.codes[:, start:end], self.scales[:, g0:g1], self.zeros[:, g0:g1])

    @staticmethod
    def cat(parts: list[Int4Codes]) -> Int4Codes:
        """Row-wise concatenation (fused projections)."""
        return Int4Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP_SIZE, GROUP_SIZE) - 8
        return (q * self.scales[..., None] + self.zeros[..., None]).view(n, k)


@dataclass
class QuantizedWeight:
    """A packed weight-only quantized [out_features, in_features] matrix and its x @ W.T."""

    kind: str  # "int8" or "int4"
    data: torch.Tensor  # int8: [N, K] int8; int4: PyTorch's CPU int4 packing, [N, K / 2] uint8
    scales: torch.Tensor  # int8: [N] bf16; int4: [K / group, N, 2] bf16 scale and zero
    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in bf16."""
        x = x.to(ACTIVATION_DTYPE)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, GROUP_SIZE, self.scales)

    @property
    def nbytes(self) -> int:
        """Memory of the packed weight and its scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def can_quantize(kind: str, weight: torch.Tensor) -> bool:
    """Whether `kind` applies to this weight: a CPU tensor, and for int4 an input size made of groups and an
    output size the packing takes."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    n, k = weight.shape
    return kind == "int8" or (kind == "int4" and k % GROUP_SIZE == 0 and n % INT4_ROW_MULTIPLE == 0)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel: w ≈ q * scale, q in [-127, 127]."""
    w = weight.float()
    scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.contiguous(), scales.to(ACTIVATION_DTYPE), *w.shape)


def int4_codes(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric int4 in groups of 32: each group's minimum and range map onto codes 0..15."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Codes(codes, scales, low + 8 * scales)


def pack_int4(codes: Int4Codes) -> QuantizedWeight:
    """Pack int4 codes into PyTorch's CPU layout (ValueError for an output size it does not take)."""
    n, k = codes.codes.shape
    if n % INT4_ROW_MULTIPLE:
        raise ValueError(f"int4 packing needs a multiple of {INT4_ROW_MULTIPLE} output rows, not {n}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 2)
    scales_zeros = torch.stack([codes.scales.t(), codes.zeros.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
    return QuantizedWeight("int4", packed, scales_zeros, n, k)


def dequantized(weight: QuantizedWeight | Int4Codes) -> torch.Tensor:
    """The fp32 [N, K] values an int8 weight or int4 codes compute with (scales and zeros rounded to bf16,
    as the packed kernels hold them): an fp32 model computes the quantized model's math exactly with them."""
    if isinstance(weight, Int4Codes):
        rounded = Int4Codes(weight.codes, *(t.to(ACTIVATION_DTYPE).float() for t in (weight.scales, weight.zeros)))
        return rounded.dequantize()
    if weight.kind != "int8":
        raise ValueError("packed int4 weights are not unpacked: dequantize their codes")
    return weight.data.float() * weight.scales.float()[:, None]


def quantize(kind: str, weight: torch.Tensor) -> QuantizedWeight:
    """`kind` ("int8" or "int4") of a dense [N, K] weight."""
    if not can_quantize(kind, weight):
        raise ValueError(f"cannot quantize a {tuple(weight.shape)} {weight.device.type} weight as {kind}")
    return quantize_int8(weight) if kind == "int8" else pack_int4(int4_codes(weight))
