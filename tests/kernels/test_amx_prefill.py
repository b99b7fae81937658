"""Prompt chunks in the fused CPU decoder, on every CPU: prompt tokens attend as runs whose results do not depend on
how the prompt is cut into chunks or what else is in the batch and equal decoding the same tokens, at least as
accurately as the eager layers, in a bf16 or an int8 cache. Where AMX runs (lyanna_kernels/csrc/amx.c): projections of
many rows equal csrc/vnni.c's bit for bit, and the opt-in bf16 prompt projections (`LYANNA_PROMPT_BF16=1`) stay as
accurate as the eager layers."""

from __future__ import annotations

import pytest
import torch

from engines.attention import SequenceLayout, build_attention_metadata
from engines.config import ModelConfig
from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from lyanna_kernels import fused_decoder, integer_dot
from lyanna_kernels.quantized_linear import quantize
from tests.kernels.test_fused_decoder import cache_values, copy_cache, fill_random, reference_layers

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")
amx_only = pytest.mark.skipif(not integer_dot.amx_active(), reason="no AMX CPU here")

BLOCK = 16
HIDDEN = 256


@pytest.fixture
def amx_off_after():
    """Leaves the AMX kernels on whatever a test does."""
    yield
    integer_dot.set_amx(True)


@amx_only
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_many_row_projections_equal_the_vnni_kernel_bit_for_bit(kind, amx_off_after):
    torch.manual_seed(0)
    weight = quantize(kind, torch.randn(96, 576), "vnni")  # 18 groups: pairs of groups in flight, no tail
    odd = quantize(kind, torch.randn(32, 160), "vnni")  # 5 groups: the tail group
    for w in (weight, odd):
        x = torch.randn(53, w.in_features).bfloat16()
        tiles = [w.matmul(x[:rows], torch.float32) for rows in (16, 37, 53)]
        integer_dot.set_amx(False)
        rows = [w.matmul(x[:r], torch.float32) for r in (16, 37, 53)]
        integer_dot.set_amx(True)
        for a, b in zip(tiles, rows, strict=True):
            assert torch.equal(a, b)


def model64(seed: int = 0, kind: str = "int4") -> LlamaModel:
    """A random bf16 Llama with heads of 64 (6 query / 2 KV heads), 8,192 positions and `kind` weights in the
    default layout."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=512, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=8192)  # fmt: skip
    model = LlamaModel(cfg, torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.08)
    for layer in model.layers:
        layer.input_norm.weight.data.uniform_(0.5, 1.5)
        layer.post_attn_norm.weight.data.uniform_(0.5, 1.5)
        for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.quantize(kind)
    return model


def cache(blocks: int = 64, dtype: torch.dtype = torch.bfloat16) -> PagedKVCache:
    kv = PagedKVCache(2, 2, 64, blocks, BLOCK, dtype, "cpu")
    kv.allocate("pad", 40)  # the sequences' blocks do not start at block 0
    return kv


def read(decoder, kv: PagedKVCache, seq: str, x: torch.Tensor, start: int, prompt: int) -> torch.Tensor:
    """Rows `x` of sequence `seq` from cache index `start` (its first `prompt` rows prompt tokens)."""
    n = x.shape[0]
    kv.allocate(seq, start + n)
    layout = SequenceLayout(kv.block_tables[seq], start, n, num_prompt=prompt)
    meta = build_attention_metadata([layout], BLOCK, "cpu", cpu_groups=False)
    return decoder(x.clone(), torch.arange(start, start + n), meta)


def read_whole_and_in_cuts(model: LlamaModel, kv: PagedKVCache, x: torch.Tensor, cuts: list[int]):
    """Prompt rows `x` read in one call as sequence "whole", and as sequence "cut" in chunks of `cuts` rows, each
    over the chunks before it: (whole's outputs, the chunks' outputs concatenated)."""
    whole = read(fused_decoder.FusedDecoder(model, kv), kv, "whole", x, 0, x.shape[0])
    parts, start = [], 0
    decoder = fused_decoder.FusedDecoder(model, kv)
    for rows in cuts:
        parts.append(read(decoder, kv, "cut", x[start : start + rows], start, rows))
        start += rows
    return whole, torch.cat(parts)


def slots_of(kv: PagedKVCache, seq: str, n: int) -> torch.Tensor:
    table = torch.tensor(kv.block_tables[seq])
    idx = torch.arange(n)
    return table[idx // BLOCK] * BLOCK + idx % BLOCK


CACHE_DTYPES = [torch.bfloat16, torch.int8]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("cuts", [[37, 63], [64, 1, 35], [16, 16, 68], [530, 70], [17, 600, 3]])
def test_a_prompt_reads_the_same_however_it_is_cut_into_chunks(cuts, cache_dtype):
    """Every prompt token's output and K/V, read in one call or in chunks (over the chunks before it in the
    cache), are equal bit for bit (also past several tiles of keys), in a bf16 cache and in an int8 one."""
    model = model64()
    n = sum(cuts)
    x = torch.randn(n, HIDDEN)
    kv = cache(128, cache_dtype)
    whole, parts = read_whole_and_in_cuts(model, kv, x, cuts)
    n = cuts[-1]  # (the slots compared below, as this test has always compared them)
    assert torch.equal(parts, whole)
    a, b = slots_of(kv, "whole", n), slots_of(kv, "cut", n)
    assert torch.equal(kv.k[:, a], kv.k[:, b]) and torch.equal(kv.v[:, a], kv.v[:, b])
    if cache_dtype == torch.int8:
        assert torch.equal(kv.k_scale[:, a], kv.k_scale[:, b]) and torch.equal(kv.v_scale[:, a], kv.v_scale[:, b])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_decode_row_beside_a_prompt_is_unchanged_and_generated_tokens_attend_one_by_one(cache_dtype):
    """A decode row computes the same alone and beside a prompt's run; a chunk that recomputes a prompt and
    the tokens generated after it (a preempted request) reproduces the generated tokens' rows as decoding
    them did, bit for bit (in a bf16 cache and in an int8 one)."""
    model = model64(1)
    kv = cache(64, cache_dtype)
    decoder = fused_decoder.FusedDecoder(model, kv)
    x = torch.randn(45, HIDDEN)
    prompt = read(decoder, kv, "a", x[:40], 0, 40)
    decoded = [read(decoder, kv, "a", x[i : i + 1], i, 0) for i in range(40, 45)]

    # the same again in one chunk: 40 prompt tokens, then the 5 generated ones
    again = read(decoder, kv, "b", x, 0, 40)
    assert torch.equal(again[:40], prompt)
    assert torch.equal(again[40:], torch.cat(decoded))

    assert_decode_beside_prompt_unchanged(decoder, kv)


def assert_decode_beside_prompt_unchanged(decoder, kv: PagedKVCache) -> None:
    """A decode of sequence "a" (45 tokens cached) computes the same alone and beside another sequence's 70-token
    prompt chunk, and the prompt's rows (from the second row of the step, mid-tile) are those it gives alone."""
    kv.allocate("a", 46)
    kv.allocate("c", 70)
    row = torch.randn(1, HIDDEN)
    step = SequenceLayout(kv.block_tables["a"], 45, 1)
    alone = decoder(row.clone(), torch.tensor([45]), build_attention_metadata([step], BLOCK, "cpu", cpu_groups=False))
    chunk = SequenceLayout(kv.block_tables["c"], 0, 70, num_prompt=70)
    prompt_rows = torch.randn(70, HIDDEN)
    both = decoder(torch.cat([row, prompt_rows]), torch.cat([torch.tensor([45]), torch.arange(70)]),
                   build_attention_metadata([step, chunk], BLOCK, "cpu", cpu_groups=False))  # fmt: skip
    assert torch.equal(both[0], alone[0])
    assert torch.equal(both[1:], read(decoder, kv, "d", prompt_rows, 0, 70))


@amx_only
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_gate_up_and_swiglu_in_one_pass_equal_two_passes_bit_for_bit(kind, monkeypatch):
    """A step of two prompt chunks (one starting mid-tile, after a decode row; one over cached tokens) and two
    decode rows, the prompt rows' projections in bf16 tiles (opt-in): with their gate_up and SwiGLU in one pass,
    every row and the K/V written are what the two passes give, bit for bit."""
    monkeypatch.setattr(fused_decoder, "PROMPT_BF16", True)
    model = model64(2, kind)
    x = [torch.randn(n, HIDDEN) for n in (1, 37, 1, 70)]
    outputs, caches = [], []
    for split in (False, True):
        monkeypatch.setattr(fused_decoder, "SPLIT_SWIGLU", split)
        kv = cache(128)
        torch.manual_seed(3)
        for layer in range(2):
            kv.k[layer].normal_()
            kv.v[layer].normal_()
        decoder = fused_decoder.FusedDecoder(model, kv)
        seqs, positions = [], []
        shapes = ((1, 30, 0), (37, 0, 37), (1, 12, 0), (70, 21, 70))  # (rows, cached tokens, prompt rows)
        for name, (rows, start, prompt) in zip("abcd", shapes, strict=True):
            kv.allocate(name, start + rows)
            seqs.append(SequenceLayout(kv.block_tables[name], start, rows, num_prompt=prompt))
            positions.append(torch.arange(start, start + rows))
        meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
        outputs.append(decoder(torch.cat(x), torch.cat(positions), meta))
        caches.append((kv.k.clone(), kv.v.clone()))
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def errors_against_fp64(model: LlamaModel, kv: PagedKVCache, seqs: list[SequenceLayout], ids, positions,
                        int8_blocks: bool = True):  # fmt: skip
    """(fused decoder, eager layers) largest errors relative to the layers in fp64 (activations as int8
    blocks, or exact with `int8_blocks` False; K/V in bf16) for one step over `kv`, whose K/V are as before
    on return."""
    snapshot = (kv.k.clone(), kv.v.clone())
    model._fused = None
    model.enforce_eager = True
    _, eager = model(ids, positions, build_attention_metadata(seqs, BLOCK, "cpu"), kv)
    kv.k.copy_(snapshot[0])
    kv.v.copy_(snapshot[1])
    model.enforce_eager = False
    assert model.fused_decoder(kv, len(ids)) is not None
    _, fused = model(ids, positions, build_attention_metadata(seqs, BLOCK, "cpu"), kv)
    ref_kv = PagedKVCache(2, 2, 64, kv.k.shape[1] // BLOCK, BLOCK, torch.bfloat16, "cpu")
    ref_kv.k.copy_(snapshot[0])
    ref_kv.v.copy_(snapshot[1])
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    ref = model.norm(reference_layers(model, model.embed_tokens(ids).float(), positions, seqs, ref_kv,
                                      meta.slot_mapping, BLOCK, int8_blocks).float()).double()  # fmt: skip
    kv.k.copy_(snapshot[0])
    kv.v.copy_(snapshot[1])
    return tuple(float((h.double() - ref).abs().max() / ref.abs().max()) for h in (fused, eager))


@pytest.mark.parametrize(
    "prompt_bf16,kind", [pytest.param(True, "int4", marks=amx_only), pytest.param(True, "int8", marks=amx_only),
                         (False, "int4")]
)  # fmt: skip
def test_prompt_runs_are_at_least_as_accurate_as_the_eager_layers(prompt_bf16, kind, monkeypatch):
    """Against the layers in fp64 (K/V in bf16), the fused decoder's prompt runs (fp32 attention) stay within the
    eager layers' error (5% over it: both compute attention in fp32 on CPUs without bf16 arithmetic), over cached
    tokens and without: with the projections as int8 blocks (the default) against int8 blocks, and where AMX runs
    with them in bf16 tiles (opt-in) against exact activations."""
    monkeypatch.setattr(fused_decoder, "PROMPT_BF16", prompt_bf16)
    model = model64(2, kind)
    for cached, new in ((0, 90), (37, 120)):
        kv = cache()
        kv.allocate("s", cached + new)
        for layer in range(2):
            kv.k[layer].normal_()
            kv.v[layer].normal_()
        seqs = [SequenceLayout(kv.block_tables["s"], cached, new, num_prompt=new)]
        ids, positions = torch.randint(0, 96, (new,)), torch.arange(cached, cached + new)
        fused_error, eager_error = errors_against_fp64(model, kv, seqs, ids, positions, int8_blocks=not prompt_bf16)
        assert fused_error <= 1.05 * eager_error, (cached, new, fused_error, eager_error)


@pytest.mark.parametrize("dec", [700, 4500])
def test_decodes_and_trees_attend_as_accurately_as_the_eager_layers(dec):
    """Tokens that attend one by one (a decode, a draft tree's nodes), over many tiles of keys folded afterwards,
    stay within the eager layers' error against the layers in fp64 (5% over it), and a tree's chain equals
    decoding its tokens alone (a step whose KV heads go in separate tasks), bit for bit."""
    model = model64(3)
    kv = cache(400)
    kv.allocate("dec", dec + 1)
    kv.allocate("tree", 604)
    for layer in range(2):
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    seqs = [
        SequenceLayout(kv.block_tables["dec"], dec, 1),
        SequenceLayout(kv.block_tables["tree"], 600, 4, [-1, 0, 1, 0]),
    ]
    ids = torch.randint(0, 96, (5,))
    positions = torch.tensor([dec, 600, 601, 602, 601])
    fused_error, eager_error = errors_against_fp64(model, kv, seqs, ids, positions)
    assert fused_error <= 1.05 * eager_error, (fused_error, eager_error)

    # the tree's chain 0 -> 1 -> 2, decoded token by token over the same cache, gives the same rows
    decoder = fused_decoder.FusedDecoder(model, kv)
    x = model.embed_tokens(ids).float()
    tree = decoder(x.clone(), positions, build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False))
    table = kv.block_tables["tree"]
    for depth in range(3):
        step = SequenceLayout(table, 600 + depth, 1)
        row = decoder(x[1 + depth : 2 + depth].clone(), torch.tensor([600 + depth]),
                      build_attention_metadata([step], BLOCK, "cpu", cpu_groups=False))  # fmt: skip
        assert torch.equal(row[0], tree[1 + depth]), depth


def int8_batch(model: LlamaModel, dec: int, tree: int, cached: int, new: int, prompt: int):
    """An int8 cache of random codes and scales, and a step over it: a decode over `dec` cached tokens, a 4-node
    tree over `tree` (its chain 0 -> 1 -> 2) and a chunk of `new` tokens over `cached` (the first `prompt` of them
    prompt tokens). Returns (cache, layouts, positions, rows, metadata)."""
    kv = cache(128, torch.int8)
    kv.allocate("dec", dec + 1)
    kv.allocate("tree", tree + 4)
    kv.allocate("chunk", cached + new)
    fill_random(kv)
    seqs = [
        SequenceLayout(kv.block_tables["dec"], dec, 1),
        SequenceLayout(kv.block_tables["tree"], tree, 4, [-1, 0, 1, 0]),
        SequenceLayout(kv.block_tables["chunk"], cached, new, num_prompt=prompt),
    ]
    positions = torch.cat([torch.tensor([dec, tree, tree + 1, tree + 2, tree + 1]), torch.arange(cached, cached + new)])
    x = model.embed_tokens(torch.randint(0, 96, (5 + new,))).float()
    return kv, seqs, positions, x, build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)


def assert_the_chain_decodes_alike(decoder, kv: PagedKVCache, x: torch.Tensor, out: torch.Tensor, tree: int) -> None:
    """int8_batch's tree chain 0 -> 1 -> 2, decoded token by token over the same cache, gives its rows of `out`."""
    table = kv.block_tables["tree"]
    for depth in range(3):
        step = SequenceLayout(table, tree + depth, 1)
        row = decoder(x[1 + depth : 2 + depth].clone(), torch.tensor([tree + depth]),
                      build_attention_metadata([step], BLOCK, "cpu", cpu_groups=False))  # fmt: skip
        assert torch.equal(row[0].double(), out[1 + depth]), depth


def test_an_int8_cache_is_read_as_its_codes_say():
    """In an int8 cache (codes and a bf16 scale per 32 values), decodes, a draft tree's nodes and a prompt run
    attend over keys and values that are their codes times their groups' scales: against the layers in fp64 over
    the same codes (int8 activation blocks) they stay within 4.5% of the largest output (a code that rounds the other
    way moves the second layer's input); the first layer's K/V are the reference's quantization of their rows, to a
    code; and a tree's chain equals decoding its tokens, bit for bit."""
    model = model64(4)
    kv, seqs, positions, x, meta = int8_batch(model, 700, 600, 0, 70, 70)
    before = cache(128, torch.int8)
    copy_cache(before, kv)
    decoder = fused_decoder.FusedDecoder(model, kv)
    out = decoder(x.clone(), positions, meta).double()
    for rows, int8_blocks in ((slice(0, 5), True), (slice(5, 75), True)):
        ref_kv = cache(128, torch.int8)
        copy_cache(ref_kv, before)
        ref = reference_layers(model, x, positions, seqs, ref_kv, meta.slot_mapping, BLOCK, int8_blocks)
        assert (out[rows] - ref[rows]).abs().max() < 4.5e-2 * ref[rows].abs().max(), rows
        # the first layer's K/V (the second's inputs carry the first's attention error, a few codes' worth)
        new = meta.slot_mapping[rows]
        for got, want in zip(cache_values(kv, 0), cache_values(ref_kv, 0), strict=True):
            step = want[new].abs().amax(-1, keepdim=True) / 127  # one code of each row
            assert ((got[new] - want[new]).abs() <= 1.5 * step + 1e-6).all(), rows
    assert_the_chain_decodes_alike(decoder, kv, x, out, 600)


def test_an_int8_cache_is_read_in_fp32(amx_off_after):
    """With the AMX kernels off, every token attends over an int8 cache's codes times their groups' scales in fp32:
    against the layers in fp64 over the same codes, within fp32 math and int8 activation blocks (and a code that
    rounds the other way), and a tree's chain equals decoding its tokens, bit for bit."""
    model = model64(7)
    kv, seqs, positions, x, meta = int8_batch(model, 300, 200, 30, 10, 0)
    ref_kv = cache(128, torch.int8)
    copy_cache(ref_kv, kv)
    integer_dot.set_amx(False)
    decoder = fused_decoder.FusedDecoder(model, kv)
    out = decoder(x.clone(), positions, meta).double()
    ref = reference_layers(model, x, positions, seqs, ref_kv, meta.slot_mapping, BLOCK)
    assert (out - ref).abs().max() < 1e-2 * ref.abs().max()
    assert_the_chain_decodes_alike(decoder, kv, x, out, 200)
