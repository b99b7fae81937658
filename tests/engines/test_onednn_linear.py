"""The prepacked oneDNN linear: the same product as `F.linear`, and the plain path where a CPU cannot pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lyanna_kernels import onednn_linear


def test_packed_linear_matches_the_plain_one():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    packed = onednn_linear.prepack(weight)
    out = onednn_linear.linear(x, weight, packed)
    assert torch.allclose(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_a_cpu_without_the_dtypes_kernels_falls_back_to_the_plain_path(monkeypatch):
    """oneDNN refuses fp16 on CPUs without AVX512-FP16 or AVX-NE-CONVERT: loading must not fail."""

    def refuse(weight: torch.Tensor, groups: int) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: fp16 path needs the cpu support avx_ne_convert")

    if not onednn_linear.can_prepack(torch.zeros(2, 2, dtype=torch.float16)):
        pytest.skip("this PyTorch has no oneDNN weight packing")
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    weight, x = torch.randn(8, 4).half(), torch.randn(2, 4).half()
    assert onednn_linear.prepack(weight) is None
    assert torch.equal(onednn_linear.linear(x, weight, None), F.linear(x, weight))
