"""Weight-only quantization: the GGUF's own blocks load exactly, quantized linears compute what their
dequantized weights do, every setting serves, and speculation stays lossless against the quantized
target (the model being served)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.gguf_weights import GGUFWeights, hf_name, hf_rows, read_gguf
from engines.loader import CheckpointReader, embedded_gguf_path, load_model, resolve_checkpoint, resolve_quantization
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels import integer_dot
from lyanna_kernels.quantized_linear import (
    GROUP_SIZE,
    Int4Codes,
    dequantized,
    int4_codes,
    pack_int4,
    quantize,
    quantize_int8,
    relayout,
)
from tests.conftest import CHAT_PROMPTS

needs_integer_dot = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's reordering of query/key rows (written from its description: within each
    head the two rotary halves are interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_hf_rows_undo_llama_cpps_rope_reordering():
    w = torch.arange(3 * 64).float()[:, None].expand(-1, 4)
    permuted = llama_cpp_permute(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(permuted[hf_rows(3 * 64, 3)], w)


def test_gguf_names():
    assert hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_embedded_gguf_int4_codes_are_its_dequantized_weights_exactly(layer):
    """The shipped Q4_1 blocks as int4 codes (scale d, zero m + 8 d) give back, bit for bit, the weights
    transformers dequantizes from the same file (rows of q and k included)."""
    weights = GGUFWeights(embedded_gguf_path(), num_heads=9, num_kv_heads=3)
    dense = CheckpointReader(resolve_checkpoint())
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
        name = f"model.layers.{layer}.{proj}.weight"
        assert weights.kind(name) == "Q4_1"
        codes = weights.int4(name)
        assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 15
        assert torch.equal(codes.dequantize(), dense.get(name).float()), name
    assert weights.kind("model.embed_tokens.weight") == "Q8_0"


def write_tiny_gguf(path):
    """A GGUF with a Q4_0, a Q4_1 and a Q8_0 linear: (its tensor types, the dense values written)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    tensors = {
        "blk.0.attn_q.weight": GGMLQuantizationType.Q4_0,
        "blk.0.attn_k.weight": GGMLQuantizationType.Q4_1,
        "blk.0.ffn_down.weight": GGMLQuantizationType.Q8_0,
    }
    dense = {}
    for name, kind in tensors.items():
        rows = 128 if "attn_q" in name else 64
        values = rng.standard_normal((rows, 96)).astype(np.float32)
        dense[name] = values
        packed = gguf_quantize(values, kind)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors, dense


def test_q4_0_and_q8_0_blocks(tmp_path):
    """A GGUF written with Q4_0, Q4_1 and Q8_0 tensors reads back as gguf's own dequantization."""
    from gguf import GGMLQuantizationType

    path = tmp_path / "tiny.gguf"
    tensors, dense = write_tiny_gguf(path)
    weights = GGUFWeights(path, num_heads=2, num_kv_heads=1)
    for gname, kind in tensors.items():
        name = hf_name(gname)
        ref = weights.dequantized(name)
        if kind == GGMLQuantizationType.Q8_0:
            with pytest.raises(ValueError, match="not Q4_0/Q4_1"):
                weights.int4(name)
            continue
        assert torch.equal(weights.int4(name).dequantize(), ref)
        # and the stored values are the written ones up to 4-bit rounding, in HF row order
        heads = 2 if "q_proj" in name else 1
        hf_dense = torch.from_numpy(dense[gname])[hf_rows(dense[gname].shape[0], heads)]
        assert (ref - hf_dense).abs().mean() < 0.15


def test_a_gguf_index_maps_the_same_tensors_without_parsing_the_header(tmp_path, monkeypatch):
    """The first read of a GGUF saves where its tensors lie; later reads of the same file map them from
    that index (no header parse) and get the same types and bytes; a changed file gets a new index."""
    import gguf

    index = tmp_path / "index"
    architecture, first = read_gguf(embedded_gguf_path(), index)
    assert architecture == "llama" and len(list(index.glob("*.json"))) == 1
    parse = gguf.GGUFReader

    def no_parse(*args, **kwargs):
        raise AssertionError("the header was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    again_architecture, again = read_gguf(embedded_gguf_path(), index)
    assert again_architecture == architecture and again.keys() == first.keys()
    assert len(first) == 30 * 7 + 1  # every layer's seven projections and the embedding
    for name, t in first.items():
        assert again[name].tensor_type == t.tensor_type and np.array_equal(again[name].data, t.data), name
    weights = GGUFWeights(embedded_gguf_path(), num_heads=9, num_kv_heads=3, index_folder=index)
    codes = weights.int4("model.layers.3.self_attn.q_proj.weight")
    monkeypatch.setattr(gguf, "GGUFReader", parse)
    plain = GGUFWeights(embedded_gguf_path(), num_heads=9, num_kv_heads=3)  # no index: parsed
    assert torch.equal(codes.dequantize(), plain.int4("model.layers.3.self_attn.q_proj.weight").dequantize())

    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    read_gguf(tiny, index)
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten in place, say
    read_gguf(tiny, index)
    assert len(list(index.glob("tiny-*.json"))) == 2


LAYOUTS = ["torch", pytest.param("integer_dot", marks=needs_integer_dot), pytest.param("vnni", marks=needs_integer_dot)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_equals_its_dequantized_weight(kind, layout):
    torch.manual_seed(0)
    w = torch.randn(192, 160)
    q = quantize(kind, w, layout)
    assert q.layout == layout
    dense = int4_codes(w).dequantize() if kind == "int4" and layout == "torch" else dequantized(q)
    if kind == "int4" and layout != "torch":
        codes = int4_codes(w)
        if layout == "integer_dot":
            unpacked = integer_dot.unpack_q4(q.data)
        else:
            unpacked = integer_dot.deinterleave(q.data, 4, 192, 160)
        assert torch.equal(unpacked, codes.codes)  # the codes as quantized
        torch.testing.assert_close(dense, codes.dequantize(), rtol=0, atol=3e-3)  # fp16 scales and minimums
    x = torch.randn(5, 160)
    got = q.matmul(x).float()
    want = x.bfloat16().float() @ dense.t()
    assert got.dtype == torch.float32 and got.shape == (5, 192)
    # the integer dot quantizes activations to int8 per block of 32 (its exact math is tested below)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.15 if layout == "torch" else 0.4)
    assert (got - want).norm() < 0.02 * want.norm()
    assert (dense - w).abs().max() < (0.03 if kind == "int8" else 0.35)  # the rounding of each kind
    assert q.nbytes < w.numel() * (1.2 if kind == "int8" else 0.8)  # bf16 would be 2 bytes a weight


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_dot_kernel_matches_its_definition(kind, rows, layout):
    """The C kernels equal their definition computed in fp64: activations quantized to int8 per block of
    32, integer sums per group, scaled; for every row count their row tiles and tails take (1-4 rows
    a tile in the row layout, 1-8 interleaved), and group counts that are and are not multiples of four
    (the row layout's vector steps)."""
    torch.manual_seed(rows)
    for k in (4 * GROUP_SIZE, 7 * GROUP_SIZE):
        w = torch.randn(48, k)
        q = quantize(kind, w, layout)
        assert q.layout == layout
        x = torch.randn(rows, k).bfloat16()
        xs = x.float().view(rows, -1, GROUP_SIZE)
        dx = xs.abs().amax(-1, keepdim=True) / 127  # fp32, as the kernel rounds it
        xq = (xs * (1 / dx)).round()
        x_int = (xq.double() * dx.double()).view(rows, k)  # the kernel's int8 activations, dequantized
        want = x_int @ dequantized(q).double().t()
        got = q.matmul(x).double()
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)  # bf16 output rounding


@needs_integer_dot
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_two_integer_layouts_hold_the_same_weight(kind):
    """`relayout` moves a weight between the row and the interleaved layout exactly: the same values, and
    products that differ only by the order the groups' scaled sums are added in."""
    torch.manual_seed(1)
    rows = quantize(kind, torch.randn(64, 224), "integer_dot")
    inter = relayout(rows, "vnni")
    assert inter.layout == "vnni" and torch.equal(dequantized(inter), dequantized(rows))
    back = relayout(inter, "integer_dot")
    assert all(torch.equal(getattr(back, f), getattr(rows, f)) for f in ("data", "scales"))
    x = torch.randn(11, 224)
    torch.testing.assert_close(inter.matmul(x, torch.float32), rows.matmul(x, torch.float32), rtol=1e-5, atol=1e-4)
    w = torch.randn(40, 224)  # 40 rows: not blocks of 16, so the row layout
    odd = quantize_int8(w, "vnni") if kind == "int8" else pack_int4(int4_codes(w), "vnni")
    assert odd.layout == "integer_dot" and relayout(odd, "vnni") is odd


def test_int4_codes_slice_on_groups_only():
    codes = int4_codes(torch.randn(32, 4 * GROUP_SIZE))
    assert codes.columns(GROUP_SIZE, 3 * GROUP_SIZE).codes.shape == (32, 2 * GROUP_SIZE)
    with pytest.raises(ValueError, match="groups"):
        codes.columns(5, 3 * GROUP_SIZE)
    both = Int4Codes.cat([codes.rows(0, 3), codes.rows(3, 32)])
    assert torch.equal(pack_int4(both, "torch").data, pack_int4(codes, "torch").data)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int4(codes.rows(0, 24), "torch")


def test_quantization_setting_resolution():
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", None, torch.bfloat16, cpu) == "gguf"  # the embedded model as shipped
    assert resolve_quantization("auto", None, torch.float32, cpu) == "none"  # fp32 stays the exact reference
    folder = str(resolve_checkpoint())  # a Hugging Face checkpoint folder runs int8 on the fused decoder
    assert resolve_quantization("auto", folder, torch.bfloat16, cpu) == "int8"
    assert resolve_quantization("auto", folder, torch.float16, cpu) == "int8"
    assert resolve_quantization("auto", folder, torch.float32, cpu) == "none"
    assert resolve_quantization("auto", folder, torch.bfloat16, torch.device("cuda")) == "none"
    with pytest.raises(ValueError, match=r"must be a \.gguf"):
        resolve_quantization("gguf", str(resolve_checkpoint()), torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int4", None, torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"quantization\s+Input should be 'auto', 'none'"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("setting", ["int8", "int4", "gguf"])
def test_quantized_model_keeps_the_dequantized_models_predictions(setting):
    """Each setting's next-token log-probabilities on a real prompt stay close to the bf16 model's."""
    dense = load_model(None, "bfloat16", "cpu", quantization="none").model
    quant = load_model(None, "bfloat16", "cpu", quantization=setting)
    assert quant.quantization == setting
    layer = quant.model.layers[3]
    kinds = {
        m.quant.kind for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    }
    assert kinds == {"int8" if setting == "int8" else "int4"}
    assert quant.model.lm_head_quant is not None
    assert quant.model.embed_tokens.weight.dtype == torch.bfloat16  # lookups and drafters keep the dense table
    from engines.training.data import target_hidden_states

    tokens = list(range(100, 160))
    h_dense = target_hidden_states(dense, tokens)
    h_quant = target_hidden_states(quant.model, tokens)
    lp_dense = dense.compute_logits(h_dense).log_softmax(-1)
    lp_quant = quant.model.compute_logits(h_quant).log_softmax(-1)
    top = lp_dense.argmax(-1)
    drift = (lp_quant.gather(1, top[:, None]) - lp_dense.gather(1, top[:, None])).abs().mean()
    assert drift < 0.5
    assert (lp_quant.argmax(-1) == top).float().mean() > 0.7


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_speculation_is_lossless_against_the_quantized_target(setting):
    """In fp32 the quantized target computes with its dequantized values exactly; greedy and seeded
    outputs with Lyanna then equal plain decoding of that same target, in one batch."""
    engine = LLMEngine(EngineConfig(dtype="float32", quantization=setting, num_kv_blocks=256))
    assert engine.quantization == setting and engine.model.layers[0].mlp.down_proj.quant_kind == setting
    off = SpecParams(enabled=False)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    for params in (greedy, seeded):
        reqs = [engine.add_request(p, params, spec=spec) for p in CHAT_PROMPTS[:2] for spec in (None, off)]
        while engine.has_unfinished():
            engine.step()
        assert reqs[0].output_token_ids == reqs[1].output_token_ids
        assert reqs[2].output_token_ids == reqs[3].output_token_ids
    assert engine.stats().spec.num_accepted_tokens > 0


@pytest.mark.slow
def test_the_default_serves_the_embedded_model_as_shipped():
    """bf16 on CPU: the GGUF's int4 blocks, the shipped Lyanna drafter accepting drafts."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=128))
    assert engine.quantization == "gguf" and engine.model.layers[0].attn.qkv_proj.quant is not None
    prompt = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.text  # (the bare question is a near tie between "The" and "L'" for this model)
    assert engine.stats().spec.num_accepted_tokens > 0 and engine.stats().kv_free_blocks == 128


def test_bf16_conversion_for_the_llama_cpp_peer(tmp_path, monkeypatch):
    """The peer's bf16 GGUF keeps metadata and holds every quantized tensor's values rounded to bf16."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    from engines.bench.llamacpp_peer import bf16_gguf

    monkeypatch.setenv("LYANNA_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    values = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    packed = gguf_quantize(values, GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_v.weight", packed, raw_shape=packed.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(96, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = bf16_gguf(source)
    assert bf16_gguf(source) == out  # written once
    reader = GGUFReader(str(out))
    assert reader.fields["llama.block_count"].contents() == 1
    tensors = {t.name: t for t in reader.tensors}
    v = tensors["blk.0.attn_v.weight"]
    assert v.tensor_type == GGMLQuantizationType.BF16 and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    want = torch.from_numpy(dequantize(packed, GGMLQuantizationType.Q4_1)).reshape(64, 96).bfloat16().float()
    got = torch.from_numpy(np.asarray(dequantize(v.data, v.tensor_type))).reshape(64, 96)
    assert torch.equal(got, want)


def test_a_hugging_face_checkpoint_runs_int8_on_the_fused_decoder_by_default():
    """A user's bf16 checkpoint folder gets the fast path without asking: int8 weights, the fused decoder."""
    engine = LLMEngine(EngineConfig(model=str(resolve_checkpoint()), drafter="none", num_kv_blocks=64))
    assert engine.quantization == "int8"
    assert engine.model.fused_decoder(engine.kv_cache, 8) is not None
    req = engine.add_request(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(req.output_token_ids) == 8
