"""Which implementation a hot path runs: the Triton kernel or its PyTorch reference.

The mode is one setting for the process (`EngineConfig.kernels`, or the `LYANNA_KERNELS` environment
variable): "auto" runs the Triton kernels on CUDA tensors and the PyTorch references elsewhere;
"triton" forces the kernels (CPU tensors need Triton's interpreter, `TRITON_INTERPRET=1`, set before
the kernels are first imported); "torch" forces the references.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNEL_MODES = ("auto", "triton", "torch")


def default_kernel_mode() -> str:
    """The mode of the `LYANNA_KERNELS` environment variable ("auto" when unset)."""
    return os.environ.get("LYANNA_KERNELS", "auto")


_mode = default_kernel_mode()


def triton_available() -> bool:
    """Whether the `triton` package is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_kernel_mode(mode: str) -> None:
    """Choose "auto", "triton" or "torch" for every hot path of this process."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {mode!r}")
    if mode == "triton" and not triton_available():
        raise ValueError("kernels='triton' needs the triton package (pip install 'lyanna-serve[gpu]')")
    global _mode
    _mode = mode


def kernel_mode() -> str:
    """The current mode."""
    return _mode


_deterministic = False


def set_deterministic(on: bool) -> None:
    """Where the Triton kernels run, run the batch-invariant ones (lyanna_kernels/batch_invariant.py) and attention in
    one tile shape, so a row computes the same bits whatever shares its launch (`EngineConfig.deterministic`)."""
    global _deterministic
    _deterministic = on


def deterministic() -> bool:
    """Whether the batch-invariant kernels are on (`set_deterministic`)."""
    return _deterministic


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the hot path over `tensor` runs the Triton kernel (else the PyTorch reference)."""
    if _mode == "torch":
        return False
    if _mode == "auto":
        return tensor.is_cuda and triton_available()
    if tensor.device.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels on CPU tensors run in Triton's interpreter: set TRITON_INTERPRET=1")
    return True


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def cpu_has_half_precision_math(dtype: torch.dtype) -> bool:
    """Whether this CPU computes in `dtype` natively (AVX512-BF16 or AMX for bf16, AMX-FP16 for fp16)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if dtype == torch.float16:
        return getattr(cpu, "_is_amx_fp16_supported", lambda: False)()
    return True
