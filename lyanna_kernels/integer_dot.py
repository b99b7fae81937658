"""Integer-dot matrix products for 4-bit and 8-bit weights on x86 CPUs with AVX2 (lyanna_kernels/csrc/int4_gemm.c).

PyTorch's weight-only CPU kernels widen every weight to float before multiplying. Like llama.cpp, this
kernel instead quantizes the activations to int8 in blocks of 32 and multiplies them with the weights'
codes as integers, so a step reads each weight byte once and does a quarter of the float work. The same
library holds the one-call decoder of lyanna_kernels/fused_decoder.py (csrc/decoder.c) and products over weights
interleaved 16 output rows at a time (csrc/vnni.c: AVX512-VNNI, else AVX2), whose cost grows far less
with the number of activation rows (verified draft trees, batches); on CPUs with AMX, the same
products 16 rows per tile product and the attention of long prompt chunks (csrc/amx.c). The C sources are
compiled with the system's C compiler on first use, into `$LYANNA_CACHE_DIR/kernels` (else
~/.cache/lyanna-serve/kernels), keyed by the sources' hash; where there is no compiler, no AVX2/FMA, or
the build fails, `available()` is False and the PyTorch kernels run instead.

Weights (w [N, K], K a multiple of 32):
- q4: codes q in [0, 15] with, per (row, group of 32), an fp16 scale d and minimum m: w = q * d + m
  (GGUF's Q4_1; Q4_0 is m = -8 d);
- q8: codes q in [-127, 127] with an fp16 scale d per (row, group of 32): w = q * d (GGUF's Q8_0).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

GROUP = 32
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("int4_gemm.c", "decoder.c", "vnni.c", "amx.c", "argmax.c", "draft_native.c", "spec_rounds.c")
)
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("integer_dot.h", "decoder.h", "draft_native.h"))
# No contraction of a * b + c into FMAs at the compiler's choice: it may choose differently in each inlined
# copy of a row's code, and a row's result would then depend on how many rows it was computed with.
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
SCALE_DTYPE = torch.float16  # of the per-group scales and minimums, as GGUF stores them

log = logging.getLogger(__name__)


def build_dir() -> Path:
    """Where the compiled kernel is cached."""
    root = os.environ.get("LYANNA_CACHE_DIR", Path.home() / ".cache" / "lyanna-serve")
    return Path(root) / "kernels"


def cpu_supports_kernel() -> bool:
    """Whether this is a Linux x86-64 CPU with AVX2, FMA and F16C."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split(":", 1)[1].split())


def _compile(sources: tuple[Path, ...], target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *COMPILE_FLAGS, "-o", str(built), *map(str, sources)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent builders (Ray workers) never load a partial file


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (None where it cannot be)."""
    if not cpu_supports_kernel():
        return None
    text = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS)) + " ".join(COMPILE_FLAGS).encode()
    target = build_dir() / f"integer_dot-{hashlib.sha256(text).hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _compile(SOURCES, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as e:
        log.warning("integer-dot kernel unavailable, using PyTorch's weight-only kernels: %s", e)
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quantize_activations.argtypes = [p, i64, i64, p, p, p]
    lib.q4_gemm.argtypes = [p, p, p, i64, i64, p, p, p, i64, p, i32, i32]
    lib.q8_gemm.argtypes = [p, p, i64, i64, p, p, i64, p, i32, i32]
    for fn in (lib.quantize_activations, lib.q4_gemm, lib.q8_gemm):
        fn.restype = None
    lib.decoder_forward.argtypes = [p, p, p, i32]
    lib.decoder_forward.restype = i32
    lib.decoder_greedy.argtypes = [p, p, p, i32, p, i64, p, p]
    lib.decoder_greedy.restype = i32
    lib.decoder_profile.argtypes = [i32, p]
    lib.decoder_profile.restype = i32
    lib.vnni_gemm.argtypes = [p, p, p, i32, i64, i64, p, p, p, i64, p, i32]
    lib.vnni_gemm.restype = None
    lib.vnni_supported.argtypes = []
    lib.vnni_supported.restype = i32
    lib.row_argmax.argtypes = [p, i64, i64, p, i32]
    lib.row_argmax.restype = None
    lib.amx_configure.argtypes = [i32]
    lib.amx_configure.restype = i32
    lib.amx_active.argtypes = []
    lib.amx_active.restype = i32
    lib.vnni_configure.argtypes = [i32]
    lib.vnni_configure.restype = i32
    lib.kernel_path.argtypes = [i64]
    lib.kernel_path.restype = i32
    lib.kernel_paths_measure.argtypes = [i32]
    lib.kernel_paths_measure.restype = i32
    lib.draft_chains.argtypes = [p, p, i64, p, p, p, p, p, i32]  # lyanna_kernels/draft_native.py
    lib.draft_chains.restype = i32
    lib.draft_fuse_rows.argtypes = [p, p, p, i64, p, i32]
    lib.draft_fuse_rows.restype = i32
    # lyanna_kernels/spec_rounds.py
    lib.spec_rounds.argtypes = [p, i64, p, p, p, p, i64, i64, p, i64, i64, p, i64, i32, p, p, p, p]
    lib.spec_rounds.restype = i32
    lib.spec_rounds_profile.argtypes = [p]
    lib.spec_rounds_profile.restype = i32
    lib.amx_configure(int(os.environ.get("LYANNA_AMX", "1") != "0"))
    lib.vnni_configure(int(os.environ.get("LYANNA_VNNI", "1") != "0"))  # 0: AVX2's kernels (the same numbers)
    _measure_paths(lib)
    return lib


def _measure_paths(lib: ctypes.CDLL) -> None:
    """Time the integer-dot paths that run here and keep the fastest per class of row counts (csrc/vnni.c's
    `kernel_paths_measure`, some tens of milliseconds), unless `LYANNA_KERNEL_PATHS=default` asks for the
    defaults (AMX for 16 rows or more where it runs, else VNNI where it runs, else AVX2)."""
    if os.environ.get("LYANNA_KERNEL_PATHS", "measured") != "default":
        lib.kernel_paths_measure(torch.get_num_threads())


def library() -> ctypes.CDLL:
    """The compiled kernels (call `available()` first)."""
    lib = _library()
    assert lib is not None, "the integer-dot kernel is not available (check available() first)"
    return lib


def available() -> bool:
    """Whether the kernel runs on this machine (compiling it on the first call)."""
    return _library() is not None


def row_argmax(values: torch.Tensor) -> torch.Tensor | None:
    """Each row's index of its largest value over the last dimension, as torch.argmax gives it (the first
    on ties, the first NaN where there is one), [rows] int64; None where the kernel does not take these
    values (not a contiguous fp32 CPU tensor, or no kernel on this machine)."""
    if values.dtype != torch.float32 or values.device.type != "cpu" or not values.is_contiguous() or values.dim() < 1:
        return None
    lib = _library()
    if lib is None or values.shape[-1] == 0:
        return None
    out = torch.empty(values.shape[:-1], dtype=torch.int64)
    rows = out.numel()
    lib.row_argmax(values.data_ptr(), rows, values.shape[-1], out.data_ptr(), torch.get_num_threads())
    return out


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in [0, 15] -> [N, K / 2] uint8: per group, byte j holds element j (low nibble) and j + 16."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // GROUP, GROUP)
    return (c[..., :16] | (c[..., 16:] << 4)).contiguous().view(n, k // 2)


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_q4`."""
    n, half = packed.shape
    p = packed.view(n, half // 16, 16)
    return torch.cat([p & 0xF, p >> 4], dim=-1).view(n, 2 * half)


def _quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lib = library()
    rows, k = x.shape
    xq = torch.empty(rows, k, dtype=torch.int8)
    dx = torch.empty(rows, k // GROUP)
    sx = torch.empty(rows, k // GROUP)
    lib.quantize_activations(x.data_ptr(), rows, k, xq.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return xq, dx, sx


OUT_DTYPES = (torch.bfloat16, torch.float32)


def q4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in `out_dtype` (bf16 or fp32) for a q4 weight (packed [N, K / 2] from
    `pack_q4`, scales and mins [N, K / 32] fp16)."""
    assert out_dtype in OUT_DTYPES
    x = x.to(torch.bfloat16).contiguous()
    (rows, k), n = x.shape, packed.shape[0]
    xq, dx, sx = _quantized_activations(x)
    out = torch.empty(rows, n, dtype=out_dtype)
    library().q4_gemm(
        packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k, xq.data_ptr(), dx.data_ptr(),
        sx.data_ptr(), rows, out.data_ptr(), out_dtype == torch.float32, torch.get_num_threads(),
    )  # fmt: skip
    return out


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in `out_dtype` (bf16 or fp32) for a q8 weight (codes [N, K] int8, scales
    [N, K / 32] fp16)."""
    assert out_dtype in OUT_DTYPES
    x = x.to(torch.bfloat16).contiguous()
    (rows, k), n = x.shape, codes.shape[0]
    xq, dx, _ = _quantized_activations(x)
    out = torch.empty(rows, n, dtype=out_dtype)
    library().q8_gemm(
        codes.data_ptr(), scales.data_ptr(), n, k, xq.data_ptr(), dx.data_ptr(), rows, out.data_ptr(),
        out_dtype == torch.float32, torch.get_num_threads(),
    )  # fmt: skip
    return out


# ---- AVX512-VNNI: weights interleaved 16 output rows at a time (csrc/vnni.c) ----------------------------
INTERLEAVE = 16  # output rows per block


def vnni_supported() -> bool:
    """Whether the kernel builds, this CPU has AVX512-F/BW/VNNI and they are not turned off (`set_vnni`, or
    `LYANNA_VNNI=0`): then `vnni_matmul` can run on `vpdpbusd`; elsewhere on AVX2."""
    lib = _library()
    return lib is not None and bool(lib.vnni_supported())


def amx_active() -> bool:
    """Whether the AMX kernels (csrc/amx.c) run: this CPU has AMX-INT8/BF16, the OS lets this process use
    the tiles, and they are not turned off (`set_amx(False)`, or `LYANNA_AMX=0` in the environment)."""
    lib = _library()
    return lib is not None and bool(lib.amx_active())


def set_amx(on: bool) -> bool:
    """Turn the AMX kernels on or off for this process (on only where they run); returns whether they are on.
    Off, the fused decoder computes the same projections through csrc/vnni.c and reads long prompts in
    pieces of `fused_decoder.MAX_ROWS` rows at most."""
    return _switch("amx_configure", on)


def set_vnni(on: bool) -> bool:
    """Turn the AVX512-VNNI kernels on or off for this process (on only where the CPU has them); returns whether
    they are on. Off, the interleaved layouts take AVX2's kernels: the same numbers (csrc/vnni.c)."""
    return _switch("vnni_configure", on)


def _switch(configure: str, on: bool) -> bool:
    """Turn a kind of kernel on or off through its C `configure` function, then measure the paths again (what
    runs changed); returns whether that kind now runs."""
    lib = _library()
    if lib is None:
        return False
    active = bool(getattr(lib, configure)(int(on)))
    _measure_paths(lib)
    return active


KERNEL_PATHS = ("avx2", "vnni", "amx")  # csrc/vnni.c's paths through an interleaved weight, in its order
ROW_CLASSES = {"1": 1, "2-8": 4, "9-15": 12, "16+": 32}  # classes of a step's row counts, each with a member


def kernel_paths() -> dict[str, str]:
    """The path ("avx2", "vnni" or "amx") each class of row counts takes through an interleaved weight in
    this process: the fastest measured at start-up (`LYANNA_KERNEL_PATHS`); every path gives the same numbers.
    Empty where the kernels are not available."""
    lib = _library()
    if lib is None:
        return {}
    return {label: KERNEL_PATHS[lib.kernel_path(rows)] for label, rows in ROW_CLASSES.items()}


def interleave(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (4-bit: uint8 in [0, 15]; 8-bit: int8) -> csrc/vnni.c's layout, flat uint8."""
    n, k = codes.shape
    blocks = n // INTERLEAVE
    if bits == 8:
        c = (codes.to(torch.int16) + 128).to(torch.uint8).view(blocks, INTERLEAVE, k // 4, 4)
        return c.permute(0, 2, 1, 3).contiguous().view(-1)
    c = codes.to(torch.uint8).view(blocks, INTERLEAVE, k // 8, 2, 4)
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [blocks, 16, k / 8, 4]
    return packed.permute(0, 2, 1, 3).contiguous().view(-1)


def deinterleave(data: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Inverse of `interleave`: the codes [N, K] (8-bit as stored, q + 128, uint8)."""
    blocks = n // INTERLEAVE
    if bits == 8:
        return data.view(blocks, k // 4, INTERLEAVE, 4).permute(0, 2, 1, 3).reshape(n, k)
    p = data.view(blocks, k // 8, INTERLEAVE, 4).permute(0, 2, 1, 3)  # [blocks, 16, k / 8, 4]
    return torch.stack([p & 0xF, p >> 4], dim=3).reshape(n, k)


def interleave_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) values [N, G] -> [N / 16, G, 16] (each block's 16 rows side by side), flat."""
    n, g = values.shape
    return values.view(n // INTERLEAVE, INTERLEAVE, g).transpose(1, 2).contiguous().view(-1)


def deinterleave_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `interleave_groups`: [N, G]."""
    return values.view(n // INTERLEAVE, -1, INTERLEAVE).transpose(1, 2).reshape(n, -1)


def vnni_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    n: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] for an interleaved weight (`interleave`, scales and mins from
    `interleave_groups`, fp16; an 8-bit weight's mins are -128 * scales)."""
    assert out_dtype in OUT_DTYPES
    x = x.to(torch.bfloat16).contiguous()
    rows, k = x.shape
    xq, dx, sx = _quantized_activations(x)
    out = torch.empty(rows, n, dtype=torch.float32)
    library().vnni_gemm(
        codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), bits, n, k, xq.data_ptr(), dx.data_ptr(),
        sx.data_ptr(), rows, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if out_dtype == torch.float32 else out.to(out_dtype)
