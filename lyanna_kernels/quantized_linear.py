"""Weight-only quantized linears on CPU: int4 in groups of 32 along the input, and int8.

An int4 weight is built from codes q in [0, 15] with, per (row, group), a scale s and a zero z:
w = (q - 8) * s + z. That is exactly GGUF's Q4_0 (z = 0) and Q4_1 (w = q * d + m, so s = d and
z = m + 8 d), which load without re-quantizing (engines/gguf_weights.py).

Three layouts compute the products, all taking and returning bf16:
- "integer_dot" (lyanna_kernels/integer_dot.py; the row layout, kept for weights whose output size "vnni" does not
  take): int8 activations times the codes as integers, llama.cpp's way; int8 weights have a scale per group
  of 32 (GGUF's Q8_0); scales and minimums are fp16, as GGUF stores them.
- "vnni" (the default): the same numbers, with the codes interleaved 16 output rows at a time for dot
  products of 4 inputs of 16 (AVX512-VNNI) or 8 (AVX2) rows per instruction, so a product of several
  activation rows costs little more than one (weights whose output size is not a multiple of 16 keep
  "integer_dot").
- "torch": PyTorch's own kernels (`_weight_int8pack_mm`, int8 per output channel;
  `_weight_int4pack_mm_for_cpu`, bf16 scales and zeros), which widen the weights to float (their
  fp32-activation paths are ~10x slower on an AVX2 CPU, measured). Kernel mode "torch" forces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lyanna_kernels import integer_dot
from lyanna_kernels.dispatch import kernel_mode

GROUP_SIZE = 32
INT4_ROW_MULTIPLE = 16  # PyTorch's CPU int4 packing takes output sizes divisible by 16
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
ACTIVATION_DTYPE = torch.bfloat16  # what the packed kernels take (and return)
LAYOUTS = ("integer_dot", "vnni", "torch")
# On a CPU without bf16 arithmetic (AVX2) fp32 GEMMs over the dequantized values beat the quantized kernels
# from about this many rows; such CPUs keep an fp32 copy of the values for those GEMMs. Measured on the
# embedded model's projections, 2 cores (`python -m lyanna_kernels.bench --linears`): torch int4 98.6 ms vs fp32
# 136 ms at 16 rows, 184 vs 174 at 32; integer-dot int4 120 vs 136 at 32 rows, 235 vs 204 at 64.
# (VNNI CPUs without bf16 arithmetic were not measured; the VNNI kernel's cost per extra row is a fraction of
# the AVX2 one's, so the copy is left to long prompt chunks there.)
WIDE_MIN_ROWS = {"integer_dot": 48, "vnni": 256, "torch": 24}
INTEGER_LAYOUTS = ("integer_dot", "vnni")  # the layouts of lyanna_kernels/integer_dot.py


def default_layout() -> str:
    """ "vnni" where the integer-dot kernels build (x86 with AVX2) and the kernel mode is not "torch", else
    "torch"."""
    if kernel_mode() == "torch" or not integer_dot.available():
        return "torch"
    return "vnni"


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
    # integer_dot: int8 [N, K] int8; int4 [N, K / 2] uint8 (`integer_dot.pack_q4`).
    # torch: int8 [N, K] int8; int4 PyTorch's CPU int4 packing, [N, K / 2] uint8.
    data: torch.Tensor
    # integer_dot: [N, K / group] fp16. torch: int8 [N] bf16; int4 [K / group, N, 2] bf16 scale and zero.
    scales: torch.Tensor
    out_features: int
    in_features: int
    layout: str = "torch"
    mins: torch.Tensor | None = None  # integer_dot int4: [N, K / group] fp16, w = q * scale + min; vnni: all

    @property
    def bits(self) -> int:
        """Bits per code: 8 for int8, 4 for int4."""
        return 8 if self.kind == "int8" else 4

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype = ACTIVATION_DTYPE) -> torch.Tensor:
        """x [M, K] -> [M, N] in bf16, or in fp32 when asked (the integer-dot layout then skips the bf16
        rounding: logits)."""
        x = x.to(ACTIVATION_DTYPE)
        if self.layout == "vnni":
            assert self.mins is not None
            n = self.out_features
            return integer_dot.vnni_matmul(x, self.data, self.scales, self.mins, self.bits, n, out_dtype)
        if self.layout == "integer_dot":
            if self.kind == "int8":
                return integer_dot.q8_matmul(x, self.data, self.scales, out_dtype)
            assert self.mins is not None
            return integer_dot.q4_matmul(x, self.data, self.scales, self.mins, out_dtype)
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales).to(out_dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, GROUP_SIZE, self.scales).to(out_dtype)

    @property
    def wide_min_rows(self) -> int:
        """From how many rows an fp32 copy of the values beats this layout on an AVX2 CPU."""
        return WIDE_MIN_ROWS[self.layout]

    @property
    def nbytes(self) -> int:
        """Memory of the packed weight, its scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)


def can_quantize(kind: str, weight: torch.Tensor) -> bool:
    """Whether `kind` applies to this weight: a CPU tensor, and for int4 an input size made of groups and an
    output size the packing takes."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    n, k = weight.shape
    return kind == "int8" or (kind == "int4" and k % GROUP_SIZE == 0 and n % INT4_ROW_MULTIPLE == 0)


def quantize_int8(weight: torch.Tensor, layout: str | None = None) -> QuantizedWeight:
    """Symmetric int8, w ≈ q * scale with q in [-127, 127]: a scale per group of 32 inputs in the
    integer-dot layout (where the input size is made of groups), else per output channel."""
    layout = layout or default_layout()
    w = weight.float()
    n, k = w.shape
    if layout in INTEGER_LAYOUTS and k % GROUP_SIZE == 0:
        groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
        scales = (groups.abs().amax(-1) / 127).clamp_min(1e-7).half().float()  # what the kernel reads
        q = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k)
        scales = scales.to(integer_dot.SCALE_DTYPE).contiguous()
        return relayout(QuantizedWeight("int8", q.contiguous(), scales, n, k, "integer_dot"), layout)
    scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.contiguous(), scales.to(ACTIVATION_DTYPE), n, k)


def int4_codes(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric int4 in groups of 32: each group's minimum and range map onto codes 0..15."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Codes(codes, scales, low + 8 * scales)


def pack_int4(codes: Int4Codes, layout: str | None = None) -> QuantizedWeight:
    """Pack int4 codes for `layout` (the default layout when None; ValueError for an output size PyTorch's
    CPU packing does not take)."""
    n, k = codes.codes.shape
    layout = layout or default_layout()
    if layout in INTEGER_LAYOUTS:
        half = integer_dot.SCALE_DTYPE
        scales = codes.scales.to(half).contiguous()
        mins = (codes.zeros.float() - 8 * codes.scales.float()).to(half).contiguous()
        rows = QuantizedWeight("int4", integer_dot.pack_q4(codes.codes), scales, n, k, "integer_dot", mins)
        return relayout(rows, layout)
    if n % INT4_ROW_MULTIPLE:
        raise ValueError(f"int4 packing needs a multiple of {INT4_ROW_MULTIPLE} output rows, not {n}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 2)
    scales_zeros = torch.stack([codes.scales.t(), codes.zeros.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
    return QuantizedWeight("int4", packed, scales_zeros, n, k)


def dequantized(weight: QuantizedWeight | Int4Codes, layout: str | None = None) -> torch.Tensor:
    """The fp32 [N, K] values a quantized weight, or int4 codes packed for `layout` (the default layout when
    None), compute with: an fp32 model computes the quantized model's weights exactly with them. PyTorch's
    int4 layout rounds scales and zeros to bf16; the integer-dot layout holds scales and minimums in fp16."""
    if isinstance(weight, Int4Codes):
        if (layout or default_layout()) in INTEGER_LAYOUTS:  # both hold the same fp16 scales and minimums
            return dequantized(pack_int4(weight, "integer_dot"))
        rounded = Int4Codes(weight.codes, *(t.to(ACTIVATION_DTYPE).float() for t in (weight.scales, weight.zeros)))
        return rounded.dequantize()
    n, k = weight.out_features, weight.in_features
    if weight.layout == "vnni":
        assert weight.mins is not None
        codes = integer_dot.deinterleave(weight.data, weight.bits, n, k).float()
        d, m = (integer_dot.deinterleave_groups(t, n).float() for t in (weight.scales, weight.mins))
        return (codes.view(n, k // GROUP_SIZE, GROUP_SIZE) * d[..., None] + m[..., None]).view(n, k)
    if weight.layout == "integer_dot":
        codes = weight.data.float() if weight.kind == "int8" else integer_dot.unpack_q4(weight.data).float()
        values = codes.view(n, k // GROUP_SIZE, GROUP_SIZE) * weight.scales.float()[..., None]
        if weight.mins is not None:
            values = values + weight.mins.float()[..., None]
        return values.view(n, k)
    if weight.kind != "int8":
        raise ValueError("packed int4 weights in PyTorch's layout are not unpacked: dequantize their codes")
    return weight.data.float() * weight.scales.float()[:, None]


def quantize(kind: str, weight: torch.Tensor, layout: str | None = None) -> QuantizedWeight:
    """`kind` ("int8" or "int4") of a dense [N, K] weight, in `layout` (the default layout when None)."""
    if not can_quantize(kind, weight):
        raise ValueError(f"cannot quantize a {tuple(weight.shape)} {weight.device.type} weight as {kind}")
    return quantize_int8(weight, layout) if kind == "int8" else pack_int4(int4_codes(weight), layout)


def relayout(weight: QuantizedWeight, layout: str) -> QuantizedWeight:
    """The same quantized weight (codes, scales and minimums unchanged) in the other integer layout
    ("integer_dot" or "vnni"; where the output size does not take "vnni", it stays as it is)."""
    assert weight.layout in INTEGER_LAYOUTS and layout in INTEGER_LAYOUTS
    n, k, bits = weight.out_features, weight.in_features, weight.bits
    if weight.layout == layout or (layout == "vnni" and n % integer_dot.INTERLEAVE):
        return weight
    if weight.layout == "vnni":  # -> rows
        assert weight.mins is not None
        codes = integer_dot.deinterleave(weight.data, bits, n, k)
        scales = integer_dot.deinterleave_groups(weight.scales, n).contiguous()
        if bits == 8:
            return QuantizedWeight("int8", (codes.to(torch.int16) - 128).to(torch.int8), scales, n, k, "integer_dot")
        mins = integer_dot.deinterleave_groups(weight.mins, n).contiguous()
        return QuantizedWeight("int4", integer_dot.pack_q4(codes), scales, n, k, "integer_dot", mins)
    codes = weight.data if bits == 8 else integer_dot.unpack_q4(weight.data)
    mins = (-128 * weight.scales.float()).to(integer_dot.SCALE_DTYPE) if weight.mins is None else weight.mins
    data, scales = integer_dot.interleave(codes, bits), integer_dot.interleave_groups(weight.scales)
    return QuantizedWeight(weight.kind, data, scales, n, k, "vnni", integer_dot.interleave_groups(mins))
