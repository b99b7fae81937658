"""The deterministic mode's kernels (lyanna_kernels/batch_invariant.py; Triton's interpreter on CPU, compiled on a GPU):
products and norms close to PyTorch's and each row the same bits whatever shares its launch; and a model's eager
layers on the Triton kernels with `deterministic` on compute a decode row the same alone and beside a prompt."""

from __future__ import annotations

import pytest
import torch

from engines.attention import SequenceLayout, build_attention_metadata
from engines.config import ModelConfig
from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from lyanna_kernels import dispatch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def deterministic_triton():
    """Triton kernels, deterministic, for the test; back to "auto" and off afterwards."""
    dispatch.set_kernel_mode("triton")
    dispatch.set_deterministic(True)
    yield
    dispatch.set_deterministic(False)
    dispatch.set_kernel_mode("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_and_norm_do_not_depend_on_the_other_rows(dtype):
    from lyanna_kernels.batch_invariant import linear, rms_norm

    torch.manual_seed(0)
    w = torch.randn(100, 96, device=DEVICE).to(dtype)  # N and K not multiples of the 64-wide tiles
    x = torch.randn(70, 96, device=DEVICE).to(dtype)
    full = linear(x, w)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), rtol=tol, atol=tol * 10)
    for rows in (slice(0, 1), slice(5, 8), slice(63, 70), slice(60, 61)):
        assert torch.equal(linear(x[rows], w), full[rows])
    assert torch.equal(linear(x.flip(0), w), full.flip(0))  # other neighbours, other tiles

    weight = torch.rand(96, device=DEVICE).to(dtype) + 0.5
    normed = rms_norm(x, weight, 1e-6)
    want = weight * torch.nn.functional.rms_norm(x.float(), (96,), eps=1e-6).to(dtype)
    torch.testing.assert_close(normed.float(), want.float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(33, 70)):
        assert torch.equal(rms_norm(x[rows], weight, 1e-6), normed[rows])


def tiny_dense_model() -> LlamaModel:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16)  # fmt: skip
    model = LlamaModel(cfg, torch.float32).to(DEVICE)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


def test_eager_layers_compute_a_decode_row_alone_as_beside_a_prompt(deterministic_triton):
    """A decode of sequence "a" (20 tokens cached) alone, then in a step beside a 45-token prompt chunk (other row
    counts for every product, another longest query for attention): its logits are the same bits."""
    model = tiny_dense_model()
    kv = PagedKVCache(2, 2, 16, 16, 16, torch.float32, DEVICE)
    kv.allocate("a", 21)
    kv.allocate("b", 45)
    for layer in range(2):
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    decode = SequenceLayout(kv.block_tables["a"], 20, 1)
    token, position = torch.tensor([7], device=DEVICE), torch.tensor([20], device=DEVICE)
    alone, _ = model(token, position, build_attention_metadata([decode], 16, DEVICE), kv)
    prompt = SequenceLayout(kv.block_tables["b"], 0, 45, num_prompt=45)
    ids = torch.cat([token, torch.randint(0, 96, (45,), device=DEVICE)])
    positions = torch.cat([position, torch.arange(45, device=DEVICE)])
    both, _ = model(ids, positions, build_attention_metadata([decode, prompt], 16, DEVICE), kv)
    assert torch.equal(both[0], alone[0])
