"""The fused CPU decoder cannot be driven out of bounds: every index it hands to C is checked (an error
raised, nothing read or written), and a weight swapped after it was built is picked up, never read
through a stale pointer."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from engines.attention import AttentionMetadata, build_attention_metadata
from engines.kv_cache import PagedKVCache
from lyanna_kernels import fused_decoder, integer_dot
from lyanna_kernels.quantized_linear import quantize
from tests.kernels.test_fused_decoder import BLOCK, positions_of, ragged_batch, tiny_model

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")

# ragged_batch's rows: dec 0, tree 1-6 (parents -1 0 0 1 3 2), new 7-11, chunk 12-14; 64 blocks of 4 slots.
NUM_SLOTS = 64 * BLOCK


@pytest.fixture(scope="module")
def setup():
    """A decoder over a ragged batch, the batch's layout, positions and input rows."""
    model = tiny_model()
    kv = PagedKVCache(2, 2, 16, 64, BLOCK, torch.float32, "cpu")
    seqs = ragged_batch(kv)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    return model, kv, fused_decoder.FusedDecoder(model, kv), meta, positions_of(seqs)


def edited(t: torch.Tensor, index, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def bad_batches(meta: AttentionMetadata, positions: torch.Tensor, max_positions: int):
    """(what is wrong, positions, metadata, the error it must raise, its message) for each index C reads."""
    qs, lens, tables, parents = meta.query_start, meta.seq_lens, meta.block_tables, meta.parents
    assert parents is not None and meta.prompt_tokens is not None
    cases = [
        ("position past the rotary table", edited(positions, 3, max_positions), {}, IndexError, "positions\\[3\\]"),
        ("negative position", edited(positions, 0, -1), {}, IndexError, "positions\\[0\\]"),
        ("slot past the cache", positions, {"slot_mapping": edited(meta.slot_mapping, 5, NUM_SLOTS)},
         IndexError, "slots\\[5\\]"),
        ("negative slot", positions, {"slot_mapping": edited(meta.slot_mapping, 14, -1)}, IndexError, "slots\\[14\\]"),
        ("block past the cache", positions, {"block_tables": edited(tables, (0, 2), 64)}, IndexError,
         "block_tables\\[0, 2\\]"),
        ("negative block", positions, {"block_tables": edited(tables, (3, 0), -1)}, IndexError,
         "block_tables\\[3, 0\\]"),
        ("table row too short for the cached tokens", positions, {"block_tables": tables[:, :2]}, IndexError,
         "sequence 0"),
        ("fewer keys than new tokens", positions, {"seq_lens": edited(lens, 1, 5)}, ValueError, "seq_lens\\[1\\]"),
        ("a node its own parent", positions, {"parents": edited(parents, 4, 3)}, ValueError, "parents\\[4\\]"),
        ("a parent after its child (a cycle)", positions, {"parents": edited(parents, 2, 4)}, ValueError,
         "parents\\[2\\]"),
        ("a parent below -1", positions, {"parents": edited(parents, 0, -2)}, ValueError, "parents\\[0\\]"),
        ("a parent in another sequence", positions, {"parents": edited(parents, 7, 0)}, ValueError,
         "parents\\[7\\]"),
        ("query_start not from 0", positions, {"query_start": edited(qs, 0, 1)}, ValueError, "query_start\\[0\\]"),
        ("query_start decreasing", positions, {"query_start": edited(qs, 2, 0)}, ValueError, "query_start\\[2\\]"),
        ("query_start past the tokens", positions, {"query_start": edited(qs, 3, 16)}, ValueError,
         "query_start\\[3\\]"),
        ("query_start short of the tokens", positions, {"query_start": edited(qs, 4, 14)}, ValueError,
         "query_start\\[4\\]"),
        ("fewer positions than rows", positions[:-1], {}, ValueError, "positions"),
        ("fewer slots than rows", positions, {"slot_mapping": meta.slot_mapping[:-1]}, ValueError, "slots"),
        ("fewer parents than rows", positions, {"parents": parents[:-1]}, ValueError, "parents"),
        ("query_start not one longer than seq_lens", positions, {"query_start": qs[:-1]}, ValueError, "query_start"),
        ("fewer table rows than sequences", positions, {"block_tables": tables[:3]}, ValueError, "block_tables"),
        ("no parents", positions, {"parents": None}, ValueError, "parents"),
        ("more prompt tokens than new tokens", positions, {"prompt_tokens": edited(meta.prompt_tokens, 2, 6)},
         ValueError, "runs\\[2\\]"),
        ("a tree read as a run of prompt tokens", positions, {"prompt_tokens": edited(meta.prompt_tokens, 1, 3)},
         ValueError, "parents\\[3\\]"),
    ]  # fmt: skip
    for what, pos, fields, error, match in cases:
        yield what, pos, replace(meta, **fields), error, match


def test_every_bad_index_raises_and_touches_nothing(setup):
    model, kv, decoder, meta, positions = setup
    x = torch.randn(len(positions), 160)
    snapshot = (kv.k.clone(), kv.v.clone())
    good = decoder(x.clone(), positions, meta)  # the unedited batch runs
    cases = list(bad_batches(meta, positions, model.rotary.cos.shape[0]))
    assert len(cases) == 24
    for what, pos, bad_meta, error, match in cases:
        kv.k.copy_(snapshot[0])
        kv.v.copy_(snapshot[1])
        rows = x.clone()
        with pytest.raises(error, match=match):
            decoder(rows, pos, bad_meta)
        assert torch.equal(kv.k, snapshot[0]) and torch.equal(kv.v, snapshot[1]), what
        assert torch.equal(rows, x), what
    kv.k.copy_(snapshot[0])
    kv.v.copy_(snapshot[1])
    assert torch.equal(decoder(x.clone(), positions, meta), good)  # and the checks do not reject good batches


def test_row_count_is_checked(setup):
    _, _, decoder, meta, positions = setup
    with pytest.raises(ValueError, match="positions must be"):
        decoder(torch.randn(len(positions) + 1, 160), positions, meta)  # more rows than the batch's tokens
    with pytest.raises(ValueError, match="x must be"):
        decoder(torch.randn(len(positions), 128), positions, meta)  # not the hidden size
    rows = fused_decoder.max_rows() + 1
    with pytest.raises(ValueError, match="x must be"):
        decoder(torch.randn(rows, 160), torch.arange(rows), meta)


def test_a_swapped_weight_is_read_not_the_freed_one():
    """Weights replaced after the decoder was built (a projection's quantized weight, a norm's data) are
    the ones it computes with: the same output as a decoder built afresh; the replaced ones are gone."""
    model = tiny_model(2)
    kv = PagedKVCache(2, 2, 16, 64, BLOCK, torch.float32, "cpu")
    seqs = ragged_batch(kv)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    decoder = fused_decoder.FusedDecoder(model, kv)
    x = torch.randn(len(positions), 160)
    snapshot = (kv.k.clone(), kv.v.clone())
    before = decoder(x.clone(), positions, meta)

    torch.manual_seed(3)
    layer = model.layers[1]
    layer.attn.qkv_proj.quant = quantize("int8", torch.randn(128, 160) * 0.15, "integer_dot")
    layer.mlp.down_proj.quant = quantize("int4", torch.randn(160, 224) * 0.15, "integer_dot")
    layer.post_attn_norm.weight.data = torch.rand(160, dtype=torch.bfloat16) + 0.5
    gc.collect()  # the replaced weights are freed unless something holds them

    def run(d: fused_decoder.FusedDecoder) -> torch.Tensor:
        kv.k.copy_(snapshot[0])
        kv.v.copy_(snapshot[1])
        return d(x.clone(), positions, meta)

    after = run(decoder)
    assert torch.equal(after, run(fused_decoder.FusedDecoder(model, kv)))
    assert not torch.equal(after, before)


def test_a_weight_of_the_wrong_shape_is_refused():
    model = tiny_model()
    kv = PagedKVCache(2, 2, 16, 64, BLOCK, torch.float32, "cpu")
    model.layers[0].mlp.down_proj.quant = quantize("int8", torch.randn(160, 192), "integer_dot")  # reads 224
    with pytest.raises(ValueError, match="the layer reads \\[160, 224\\]"):
        fused_decoder.FusedDecoder(model, kv)
