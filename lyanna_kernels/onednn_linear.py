"""oneDNN linear with prepacked weights for bf16/fp16 on CPU.

PyTorch's default bf16 GEMM path re-lays out the weight on every call; for the skinny matrices of
decoding (a few rows against a large weight) that dominates. Packing the weight once into oneDNN's
blocked layout lets AMX/AVX-512 kernels stream it directly. The results match `F.linear` up to the
summation order (bit-identical for small batches on the machines measured). fp32 keeps the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `prepack` applies: a CPU bf16/fp16 weight and a PyTorch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight ([out, in]) in oneDNN's layout, or None where packing does not apply (then the
    plain path runs), including a CPU without the dtype's oneDNN kernels (fp16 needs AVX512-FP16 or
    AVX-NE-CONVERT)."""
    if not can_prepack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    except RuntimeError:
        return None


# On a CPU that emulates bf16 (AVX2) a bf16 GEMM costs about one GEMV per row (the embedded model's
# projections, 30 layers, 2 cores: 14.7 ms at 1 row, 91.8 at 7, 231 at 16), while fp32 ones are erratic
# below 7 rows (36 ms at 1, 135 at 3, 86 at 6) and cheaper from there on (62.7 at 7, 111 at 16; 4x cheaper
# at 32). Such CPUs keep an fp32 copy of each weight (`wide`) for GEMMs of this many rows or more.
WIDE_MIN_ROWS = 7


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, wide: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T: through the fp32 copy `wide` for `WIDE_MIN_ROWS` rows or more when there is one (the
    result is then fp32), else in the weight's dtype, through the packed weight when there is one."""
    if wide is not None and x.shape[0] >= WIDE_MIN_ROWS:
        return F.linear(x.float(), wide)
    x = x.to(weight.dtype)
    if packed is None:
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
