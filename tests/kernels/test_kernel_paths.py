"""The integer-dot path each class of row counts takes (lyanna_kernels/csrc/vnni.c's `kernel_path`): measured at
start-up among the paths this CPU runs, recorded by the benchmarks, and without effect on any number."""

from __future__ import annotations

import os

import pytest
import torch

from lyanna_kernels import integer_dot
from lyanna_kernels.quantized_linear import quantize

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")


@pytest.fixture
def paths_restored():
    """Leaves the VNNI and AMX kernels as the environment set them (and the paths measured again)."""
    yield
    integer_dot.set_vnni(os.environ.get("LYANNA_VNNI", "1") != "0")
    integer_dot.set_amx(os.environ.get("LYANNA_AMX", "1") != "0")


def runs_here(path: str, label: str) -> bool:
    if path == "vnni":
        return integer_dot.vnni_supported()
    if path == "amx":
        return integer_dot.amx_active() and label == "16+"
    return path == "avx2"


def test_each_class_of_row_counts_takes_a_path_this_cpu_runs(paths_restored):
    paths = integer_dot.kernel_paths()
    assert list(paths) == list(integer_dot.ROW_CLASSES)
    assert all(runs_here(path, label) for label, path in paths.items()), paths
    integer_dot.set_vnni(False)
    integer_dot.set_amx(False)
    assert set(integer_dot.kernel_paths().values()) == {"avx2"}  # what is turned off is never chosen


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_every_path_gives_the_same_numbers(kind, paths_restored):
    torch.manual_seed(1)
    w = quantize(kind, torch.randn(96, 576), "vnni")
    xs = [torch.randn(rows, 576).bfloat16() for rows in (1, 3, 8, 12, 16, 37)]
    measured = [w.matmul(x, torch.float32) for x in xs]
    integer_dot.set_amx(False)
    without_amx = [w.matmul(x, torch.float32) for x in xs]
    integer_dot.set_vnni(False)
    assert set(integer_dot.kernel_paths().values()) == {"avx2"}
    avx2 = [w.matmul(x, torch.float32) for x in xs]
    for a, b, c in zip(measured, without_amx, avx2, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
