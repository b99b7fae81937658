"""Prompt runs (lyanna_kernels/csrc/decoder.c's attend_run_rows) with AMX off, the path of CPUs without it: a prompt's
tokens attend as runs whose results do not depend on how the prompt is cut into chunks or on what else is in the batch,
equal decoding the same tokens one by one, and are at least as accurate as the eager layers, in an fp32, bf16 or
int8 cache."""

from __future__ import annotations

import pytest
import torch

from engines.attention import SequenceLayout
from lyanna_kernels import fused_decoder, integer_dot
from tests.kernels.test_amx_prefill import (
    HIDDEN,
    assert_decode_beside_prompt_unchanged,
    cache,
    errors_against_fp64,
    model64,
    read,
    read_whole_and_in_cuts,
    slots_of,
)

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


@pytest.fixture(autouse=True)
def without_amx():
    """The path of CPUs without AMX on any CPU: AMX off for the test (as it was after)."""
    was = integer_dot.amx_active()
    integer_dot.set_amx(False)
    yield
    integer_dot.set_amx(was)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("cuts", [[37, 63], [16, 16, 68], [5, 300, 2], [250, 1, 90]])
def test_a_prompt_reads_the_same_however_it_is_cut_into_chunks(cuts, cache_dtype):
    """Every prompt token's output and K/V, read in one call or in chunks over the chunks before it, are equal
    bit for bit, also past the 256 keys a run scores at a time."""
    model = model64(3)
    n = sum(cuts)
    x = torch.randn(n, HIDDEN)
    kv = cache(64, cache_dtype)
    whole, parts = read_whole_and_in_cuts(model, kv, x, cuts)
    assert torch.equal(parts, whole)
    a, b = slots_of(kv, "whole", n), slots_of(kv, "cut", n)
    assert torch.equal(kv.k[:, a], kv.k[:, b]) and torch.equal(kv.v[:, a], kv.v[:, b])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("cached", [0, 150])
def test_a_prompt_read_as_a_run_equals_its_tokens_decoded_one_by_one(cached, cache_dtype):
    """A prompt of 300 tokens (over 150 cached ones or none: keys across several tiles) read in one call, its rows
    sharing each block of keys, gives every token the output and K/V that decoding the same tokens one at a time
    gives, bit for bit: a resumed request, which re-reads its generated tokens as prompt, continues as it was."""
    model = model64(6)
    kv = cache(128, cache_dtype)
    x = torch.randn(cached + 300, HIDDEN)
    decoder = fused_decoder.FusedDecoder(model, kv)
    for seq in ("run", "one"):
        if cached:
            read(decoder, kv, seq, x[:cached], 0, cached)
    run = read(decoder, kv, "run", x[cached:], cached, 300)
    one = torch.cat([read(decoder, kv, "one", x[i : i + 1], i, 0) for i in range(cached, cached + 300)])
    assert torch.equal(run, one)
    a, b = slots_of(kv, "run", cached + 300), slots_of(kv, "one", cached + 300)
    assert torch.equal(kv.k[:, a], kv.k[:, b]) and torch.equal(kv.v[:, a], kv.v[:, b])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_decode_beside_a_prompt_is_unchanged_and_so_is_the_prompt(cache_dtype):
    """A decode row computes the same alone and beside another sequence's prompt run, and the prompt's rows
    (from the second row of the step) are those it gives alone."""
    model = model64(4)
    kv = cache(64, cache_dtype)
    decoder = fused_decoder.FusedDecoder(model, kv)
    read(decoder, kv, "a", torch.randn(45, HIDDEN), 0, 45)
    assert_decode_beside_prompt_unchanged(decoder, kv)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_prompt_runs_are_as_accurate_as_the_eager_layers(kind):
    """Against the layers in fp64 (activations as int8 blocks, K/V in bf16), the runs' fp32 attention stays within
    5% of the eager layers' error (both compute attention in fp32 on such CPUs; the int8 blocks dominate), over
    cached tokens and without, past a chunk of 256 keys."""
    model = model64(5, kind)
    for cached, new in ((0, 90), (37, 300)):
        kv = cache(64)
        kv.allocate("s", cached + new)
        for layer in range(2):
            kv.k[layer].normal_()
            kv.v[layer].normal_()
        seqs = [SequenceLayout(kv.block_tables["s"], cached, new, num_prompt=new)]
        ids, positions = torch.randint(0, 96, (new,)), torch.arange(cached, cached + new)
        fused_error, eager_error = errors_against_fp64(model, kv, seqs, ids, positions)
        assert fused_error <= 1.05 * eager_error, (cached, new, fused_error, eager_error)
