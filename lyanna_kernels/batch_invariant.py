"""Batch-invariant matrix products and RMSNorm for the deterministic mode on CUDA (`EngineConfig.deterministic`).

cuBLAS picks its GEMM algorithm (tile shapes, split-K) by the problem's shape, so a row's x @ W.T rounds
differently when it shares the call with 1, 7 or 60 other rows; PyTorch's row reductions choose their launch shape
by the number of rows too. Here every launch uses the same tiles whatever the number of rows: an output element sums
its K dimension BLOCK_K at a time in order (no split-K), in one tile shape, and an RMSNorm row is one program over the
whole row. So a row computes the same bits alone, in a batch, in a CUDA graph's padded bucket or in a prompt chunk.
(The cost is the speed cuBLAS would have picked for each shape.) Kernels run on CUDA tensors, or on CPU tensors in
Triton's interpreter (`TRITON_INTERPRET=1`), where the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lyanna_kernels.dispatch import interpreting, next_power_of_2

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # one tile shape for every call


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    x_stride,
    w_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter multiplies bf16 blocks in fp32
    INTERPRETED: tl.constexpr,  # Triton's interpreter: products summed per row (see below)
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in order, BLOCK_K at a time: the same for every row
        k = k0 + ks
        x_mask = (rows[:, None] < M) & (k[None, :] < K)
        w_mask = (cols[:, None] < N) & (k[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_ptr + cols[:, None] * w_stride + k[None, :], mask=w_mask, other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if INTERPRETED:
            # The interpreter's tl.dot is NumPy's matmul, whose BLAS kernels may round a row by its place in their
            # register tiles (OpenBLAS's AVX2 sgemm does): a plain product and row sum is the same for every row.
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N] in weight's dtype
    """x @ weight.T, each row computed the same way whatever the other rows (fp32 sums)."""
    x = x.to(weight.dtype).contiguous()
    weight = weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = x.new_empty(M, N)
    if M == 0:
        return out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](
        x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        UPCAST=interpreting() and weight.dtype != torch.float32, INTERPRETED=interpreting(),
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, x_stride, out_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < dim, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty)  # rounded to the input's dtype, then scaled (as Llama does)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=cols < dim)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [M, dim] -> [M, dim], x's dtype
    """weight * (x / rms(x)), the norm in fp32 and rounded to x's dtype before the weight: one program per row."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps, BLOCK=next_power_of_2(x.shape[1])
        )
    return out.reshape(shape)
