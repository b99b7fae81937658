"""The one-call CPU decoder (lyanna_kernels/fused_decoder.py): it computes the model's layers over the quantized
weights, rows do not depend on their batch, and in the served configuration speculation stays lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.attention import SequenceLayout, build_attention_metadata, reference_paged_attention, sequence_slots
from engines.config import ModelConfig
from engines.engine import EngineConfig, LLMEngine
from engines.kv_cache import PagedKVCache, dequantize_rows, kv_cache_dtype, quantize_rows
from engines.model import LlamaModel
from engines.parallel import PackableLinear
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from lyanna_kernels import dispatch, fused_decoder, integer_dot
from lyanna_kernels.quantized_linear import GROUP_SIZE, dequantized, quantize, relayout
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(not integer_dot.available(), reason="no AVX2 CPU or C compiler here")

BLOCK = 4


def tiny_model(
    seed: int = 0, layout: str | None = None, qkv_bias: bool = False, heads: tuple[int, int, int] = (4, 2, 16)
) -> LlamaModel:
    """A random bf16 Llama (`heads`: 4 query / 2 KV heads of 16; 5 and 7 groups of 32 in, so the kernels run
    both their four-group loop and its tail) with int4 attention and int8 MLP weights (and Qwen2's q/k/v
    biases with `qkv_bias`)."""
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    cfg = ModelConfig(
        vocab_size=96, hidden_size=160, intermediate_size=224, num_layers=2, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=qkv_bias,
    )  # fmt: skip
    model = LlamaModel(cfg, torch.bfloat16)
    for name, p in model.named_parameters():
        if not name.endswith("bias"):
            p.data.normal_(0, 0.15)
    biases = torch.Generator().manual_seed(seed + 1)  # its own: every other number is the bias-free model's
    for layer in model.layers:
        if qkv_bias:
            layer.attn.qkv_proj.bias.data.normal_(0, 0.15, generator=biases)
        layer.input_norm.weight.data.uniform_(0.5, 1.5)
        layer.post_attn_norm.weight.data.uniform_(0.5, 1.5)
        layer.attn.qkv_proj.quantize("int4")
        layer.attn.o_proj.quantize("int4")
        layer.mlp.gate_up_proj.quantize("int8")
        layer.mlp.down_proj.quantize("int8")
        if layout is not None:
            for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.quant = relayout(lin.quant, layout)
    return model


def blocks_of_32(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: int8 codes per block of 32 times the block's scale (computed in fp32)."""
    v = x.float().reshape(-1, GROUP_SIZE)
    d = v.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(v * inv).double() * d.double()).reshape(x.shape)


def fill_random(kv: PagedKVCache) -> None:
    """Random K/V in every slot: values ~N(0, 1), or for an int8 cache random codes and scales of that size."""
    for layer in range(kv.k.shape[0]):
        if kv.k.dtype == torch.int8:
            for codes, scales in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
                codes[layer].random_(-127, 128)
                scales[layer] = torch.empty(scales[layer].shape).uniform_(0.005, 0.02)
        else:
            kv.k[layer].normal_()
            kv.v[layer].normal_()


def copy_cache(dst: PagedKVCache, src: PagedKVCache) -> None:
    """dst's K/V (and an int8 cache's scales) = src's."""
    dst.k.copy_(src.k)
    dst.v.copy_(src.v)
    if src.k_scale is not None:
        dst.k_scale.copy_(src.k_scale)
        dst.v_scale.copy_(src.v_scale)


def cache_values(kv: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V as fp64 values (an int8 cache's codes times their scales)."""
    if kv.k.dtype == torch.int8:
        return (dequantize_rows(kv.k[layer], kv.k_scale[layer], torch.float64),
                dequantize_rows(kv.v[layer], kv.v_scale[layer], torch.float64))  # fmt: skip
    return kv.k[layer].double(), kv.v[layer].double()


def reference_layers(
    model, x, positions, seqs, kv, slots, block: int = BLOCK, int8_blocks: bool = True
) -> torch.Tensor:
    """The layers in fp64 over the dequantized weights, activations as int8 blocks (or exact, `int8_blocks`
    False), K/V rounded to the cache's dtype or quantized as an int8 cache holds them (of `block` slots a
    block); writes the new tokens' K/V into `kv` as the kernel does."""
    cfg = model.cfg
    D, Hq, Hk = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    cos, sin = model.rotary.cos[positions].double()[:, None], model.rotary.sin[positions].double()[:, None]

    def linear(h, lin):
        return (blocks_of_32(h) if int8_blocks else h) @ dequantized(lin.quant).double().T

    def rms(h, w):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w.double()

    def rope(t):
        a, b = t.chunk(2, -1)
        return t * cos + torch.cat([-b, a], -1) * sin

    x = x.double()
    for i, layer in enumerate(model.layers):
        qkv = linear(rms(x, layer.input_norm.weight), layer.attn.qkv_proj)
        if layer.attn.qkv_proj.bias is not None:
            qkv = qkv + layer.attn.qkv_proj.bias.double()
        q = rope(qkv[:, : Hq * D].view(-1, Hq, D))
        k = rope(qkv[:, Hq * D : (Hq + Hk) * D].view(-1, Hk, D))
        v = qkv[:, (Hq + Hk) * D :].view(-1, Hk, D)
        if kv.k.dtype == torch.int8:
            (kv.k[i][slots], kv.k_scale[i][slots]), (kv.v[i][slots], kv.v_scale[i][slots]) = map(quantize_rows, (k, v))
        else:
            kv.k[i][slots], kv.v[i][slots] = k.to(kv.k.dtype), v.to(kv.v.dtype)
        attn = reference_paged_attention(q, *cache_values(kv, i), seqs, block, D**-0.5)
        x = x + linear(attn, layer.attn.o_proj)
        gate, up = linear(rms(x, layer.post_attn_norm.weight), layer.mlp.gate_up_proj).chunk(2, -1)
        x = x + linear(F.silu(gate) * up, layer.mlp.down_proj)
    return x


# Cached tokens of the ragged batch's decode, tree and second chunk: short contexts, and long ones whose
# tokens attend over several tiles of keys (decoder.c's KEY_TILE of 256: 3 for the decode, 2 for the tree's
# nodes, 8 for the chunk's tokens)
CONTEXTS = {"short": (37, 9, 10), "long": (700, 300, 1900)}
NUM_BLOCKS = {"short": 64, "long": 1000}  # of BLOCK slots


def ragged_batch(kv: PagedKVCache, contexts: str = "short") -> list[SequenceLayout]:
    """A decode over 37 cached tokens in scattered blocks, a 6-node tree over 9, a 5-token prompt chunk
    with nothing cached and a 3-token chunk over 10 (or the `long` CONTEXTS); cached K/V are random."""
    dec, tree, chunk = CONTEXTS[contexts]
    tree_parents = [-1, 0, 0, 1, 3, 2]
    specs = [("dec", dec, 1, None), ("tree", tree, 6, tree_parents), ("new", 0, 5, None), ("chunk", chunk, 3, None)]
    kv.allocate("pad", 8)  # later sequences' blocks do not start at block 0
    seqs = []
    for name, cached, new, parents in specs:
        kv.allocate(name, cached + new)
        if name == "dec":
            kv.allocate("gap", 8)  # ... nor run consecutively
        seqs.append(SequenceLayout(kv.block_tables[name], cached, new, parents))
    fill_random(kv)
    return seqs


def positions_of(seqs: list[SequenceLayout]) -> torch.Tensor:
    pos = []
    for s in seqs:
        if s.tree_parents is None:
            pos += range(s.num_cached, s.num_keys)
        else:
            depth: list[int] = []
            for p in s.tree_parents:
                depth.append(0 if p < 0 else depth[p] + 1)
            pos += [s.num_cached + d for d in depth]
    return torch.tensor(pos)


LAYOUTS = ["integer_dot", "vnni"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("qkv_bias", "contexts"), [(False, "short"), (True, "short"), (False, "long")], ids=["llama", "qwen2-bias", "long"]
)
def test_fused_decoder_computes_the_layers_over_the_quantized_weights(cache_dtype, layout, qkv_bias, contexts):
    model = tiny_model(layout=layout, qkv_bias=qkv_bias)
    assert model.layers[0].attn.qkv_proj.quant.layout == layout
    assert (model.layers[0].attn.qkv_proj.bias is not None) == qkv_bias
    kv = PagedKVCache(2, 2, 16, NUM_BLOCKS[contexts], BLOCK, cache_dtype, "cpu")
    seqs = ragged_batch(kv, contexts)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    x = torch.randn(len(positions), 160)
    ref_kv = PagedKVCache(2, 2, 16, NUM_BLOCKS[contexts], BLOCK, cache_dtype, "cpu")
    copy_cache(ref_kv, kv)

    assert fused_decoder.applies(model, kv)
    out = fused_decoder.FusedDecoder(model, kv)(x.clone(), positions, meta)
    ref = reference_layers(model, x, positions, seqs, ref_kv, meta.slot_mapping)

    # fp32 math against fp64; in a bf16 cache a K/V value near a rounding boundary may round the other way
    tolerance = 2e-3 if cache_dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max() < tolerance * ref.abs().max()
    new = meta.slot_mapping
    rest = torch.ones(kv.k.shape[1], dtype=torch.bool)
    rest[new] = False
    for layer in range(2):
        for got, want in zip(cache_values(kv, layer), cache_values(ref_kv, layer), strict=True):
            # (values grow with RoPE at late positions: a bf16 rounding step is relative)
            assert torch.allclose(got[new], want[new], rtol=2**-7, atol=2e-2)
        # every other slot is untouched
        for got, want in ((kv.k, ref_kv.k), (kv.v, ref_kv.v)):
            assert torch.equal(got[layer][rest], want[layer][rest])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads", [(8, 1, 24), (6, 2, 32)], ids=["8-per-kv-head-of-24", "3-per-kv-head-of-32"])
def test_attention_over_other_head_shapes(heads, cache_dtype):
    """A decode's attention takes its keys 8 at a time and its query heads 4 at a time: with a head of 24 (an
    odd number of 8-value vectors), 8 or 3 query heads per KV head, and long contexts (the last block of keys
    partial, keys in parts), the layers still compute the reference's numbers, and a decode row alone is the
    same row in its batch, bit for bit."""
    if cache_dtype == torch.int8 and heads[2] % 32:
        pytest.skip("an int8 cache's heads are whole groups of 32")
    model = tiny_model(layout=LAYOUTS[-1], heads=heads)
    Hk, D = heads[1], heads[2]
    kv = PagedKVCache(2, Hk, D, NUM_BLOCKS["long"], BLOCK, cache_dtype, "cpu")
    seqs = ragged_batch(kv, "long")
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    x = torch.randn(len(positions), 160)
    ref_kv = PagedKVCache(2, Hk, D, NUM_BLOCKS["long"], BLOCK, cache_dtype, "cpu")
    copy_cache(ref_kv, kv)
    snapshot = PagedKVCache(2, Hk, D, NUM_BLOCKS["long"], BLOCK, cache_dtype, "cpu")
    copy_cache(snapshot, kv)

    decoder = fused_decoder.FusedDecoder(model, kv)
    out = decoder(x.clone(), positions, meta)
    ref = reference_layers(model, x, positions, seqs, ref_kv, meta.slot_mapping)
    tolerance = 2e-3 if cache_dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max() < tolerance * ref.abs().max()

    copy_cache(kv, snapshot)
    alone = decoder(x[:1].clone(), positions[:1], build_attention_metadata(seqs[:1], BLOCK, "cpu", cpu_groups=False))
    assert torch.equal(alone[0], out[0])


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_in_the_call_is_the_models_final_norm(model_dtype):
    """With `final_norm` the call's rows are the model's final norm of the layers' output (as `LlamaModel.
    forward` applies it after the eager layers), to fp32 rounding, and the K/V it writes are the same."""
    model = tiny_model(layout=LAYOUTS[0])
    with torch.no_grad():
        model.norm.weight.copy_(torch.rand_like(model.norm.weight) + 0.5)
        model.norm.weight.data = model.norm.weight.data.to(model_dtype)
    caches = [PagedKVCache(2, 2, 16, 64, BLOCK, torch.bfloat16, "cpu") for _ in range(2)]
    seqs = ragged_batch(caches[0])  # with its cached context's K/V
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    x = torch.randn(len(positions), 160)
    plain = fused_decoder.FusedDecoder(model, caches[0])(x.clone(), positions, meta)
    normed = fused_decoder.FusedDecoder(model, caches[1], final_norm=True)(x.clone(), positions, meta)
    want = model.norm(plain)
    assert normed.dtype == torch.float32 and not torch.equal(normed, plain)
    assert (normed - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def greedy_model() -> LlamaModel:
    """`tiny_model` in the interleaved layout with an int8 LM head in that layout too (as the shipped model's on
    every CPU), which greedy steps in one call read."""
    model = tiny_model(layout="vnni")
    model.lm_head_quant = relayout(quantize("int8", model.lm_head_weight.data), "vnni")
    return model


def decode_batch(kv: PagedKVCache, contexts: list[int], steps: int) -> list[SequenceLayout]:
    """One decode token per sequence over `contexts` cached tokens each (random K/V, blocks scattered), with
    the blocks of `steps` - 1 more tokens allocated."""
    kv.allocate("pad", 8)
    seqs = []
    for i, cached in enumerate(contexts):
        kv.allocate(f"s{i}", cached + steps)
        kv.allocate(f"gap{i}", 5)
        seqs.append(SequenceLayout(kv.block_tables[f"s{i}"], cached, 1, None))
    fill_random(kv)
    return seqs


@pytest.mark.parametrize("contexts", [[23], [9, 40, 3]], ids=["one", "three"])
def test_greedy_steps_in_one_call_are_as_many_decode_steps(contexts):
    """`LlamaModel.greedy_steps` (the layers, final norm, LM head and argmax of several decode steps in one C
    call) gives bit for bit the tokens and hidden rows of as many `forward`s with an argmax, and writes the
    same K/V, across block boundaries (BLOCK slots a block)."""
    steps = 6
    model = greedy_model()
    caches = [PagedKVCache(2, 2, 16, 64, BLOCK, torch.bfloat16, "cpu") for _ in range(2)]
    seqs = decode_batch(caches[0], contexts, steps)
    decode_batch(caches[1], contexts, steps)
    copy_cache(caches[1], caches[0])
    first = torch.tensor([5, 77, 31][: len(contexts)])
    positions = torch.tensor(contexts)
    tokens, hidden, ids = [], [], first
    for s in range(steps):  # the reference: one forward a step
        step = [SequenceLayout(q.block_table, q.num_cached + s, 1, None) for q in seqs]
        meta = build_attention_metadata(step, BLOCK, "cpu", cpu_groups=False)
        logits, rows = model(ids, positions + s, meta, caches[0])
        ids = logits.argmax(-1)
        tokens.append(ids)
        hidden.append(rows)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    out = model.greedy_steps(first, positions, meta, caches[1], steps)
    assert out is not None
    got_hidden, got_tokens = out
    assert torch.equal(got_tokens, torch.stack(tokens)) and len(set(got_tokens.flatten().tolist())) > 3
    assert torch.equal(got_hidden, torch.stack(hidden))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_argmax_rows_in_one_call_are_forward_and_an_argmax():
    """`LlamaModel.argmax_rows` (the layers, final norm, LM head and every row's argmax in one C call) over a
    ragged batch (a decode, a draft tree, prompt chunks) gives bit for bit `forward`'s hidden rows and the
    argmax of its logits at every row, and writes the same K/V."""
    model = greedy_model()
    caches = [PagedKVCache(2, 2, 16, 64, BLOCK, torch.bfloat16, "cpu") for _ in range(2)]
    seqs = ragged_batch(caches[0])
    copy_cache(caches[1], caches[0])
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    ids = torch.randint(0, model.embed_tokens.weight.shape[0], (len(positions),))
    logits, rows = model(ids, positions, meta, caches[0])
    out = model.argmax_rows(ids, positions, meta, caches[1])
    assert out is not None
    hidden, tokens = out
    assert torch.equal(hidden, rows) and torch.equal(tokens, logits.argmax(-1))
    assert len(set(tokens.tolist())) > 3
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    model.lm_head_quant = relayout(model.lm_head_quant, "integer_dot")  # a head the call cannot read
    assert model.argmax_rows(ids, positions, meta, caches[1]) is None


def test_greedy_steps_refuse_a_position_past_the_block_table_and_other_heads():
    """A later step's position beyond the blocks allocated is an IndexError naming the block table; an LM head
    in another layout, or weights other than bf16, take no such call (None: the caller steps one by one)."""
    model = greedy_model()
    kv = PagedKVCache(2, 2, 16, 64, BLOCK, torch.bfloat16, "cpu")
    seqs = decode_batch(kv, [6], 2)  # blocks for positions up to 7: a fourth step would write position 9
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    with pytest.raises(IndexError, match="block"):
        model.greedy_steps(torch.tensor([3]), torch.tensor([6]), meta, kv, 4)
    model.lm_head_quant = relayout(model.lm_head_quant, "integer_dot")
    assert model.greedy_steps(torch.tensor([3]), torch.tensor([6]), meta, kv, 2) is None


@pytest.mark.parametrize("contexts", list(CONTEXTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_row_does_not_depend_on_its_batch(layout, contexts):
    """A tree node's output equals decoding its path token by token, and a decode row alone equals the
    same row in a mixed batch: bit for bit (with long contexts too, attended in parts)."""
    model = tiny_model(1, layout)
    kv = PagedKVCache(2, 2, 16, NUM_BLOCKS[contexts], BLOCK, torch.bfloat16, "cpu")
    seqs = ragged_batch(kv, contexts)
    meta = build_attention_metadata(seqs, BLOCK, "cpu", cpu_groups=False)
    positions = positions_of(seqs)
    decoder = fused_decoder.FusedDecoder(model, kv)
    x = torch.randn(len(positions), 160)
    snapshot = (kv.k.clone(), kv.v.clone())
    batch = decoder(x.clone(), positions, meta)

    # The decode row alone (rows: dec 0, tree 1-6, new 7-11, chunk 12-14).
    kv.k.copy_(snapshot[0])
    kv.v.copy_(snapshot[1])
    alone = decoder(x[:1].clone(), positions[:1], build_attention_metadata(seqs[:1], BLOCK, "cpu", cpu_groups=False))
    assert torch.equal(alone[0], batch[0])

    # The tree's path 0 -> 1 -> 3 -> 4 decoded one token at a time over the same 9 cached tokens.
    tree = seqs[1]
    path = [0, 1, 3, 4]
    kv.allocate("path", tree.num_cached + len(path))
    table = kv.block_tables["path"]
    cached = sequence_slots(tree.block_table, BLOCK, 0, tree.num_cached)
    mine = sequence_slots(table, BLOCK, 0, tree.num_cached)
    for cache in (kv.k, kv.v):
        cache[:, mine] = cache[:, cached]
    for depth, node in enumerate(path):
        step = SequenceLayout(table, tree.num_cached + depth, 1)
        row = decoder(
            x[1 + node : 2 + node].clone(),
            torch.tensor([tree.num_cached + depth]),
            build_attention_metadata([step], BLOCK, "cpu", cpu_groups=False),
        )
        assert torch.equal(row[0], batch[1 + node]), f"depth {depth}"


# A tree of 21 nodes (more than one task's rows: its nodes attend in two groups), branching at several depths.
WIDE_TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9, 10, 12, 12, 13, 16, 19]


@pytest.mark.parametrize("cached", [9, 250, 300], ids=["one-tile", "across-tiles", "second-tile"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_every_tree_node_attends_as_its_path_decoded_alone(cached, cache_dtype):
    """A draft tree's nodes attend together, sharing the keys they have in common (the context, their common
    ancestors), each reading its own ancestors past them: every node's output equals decoding its path one token
    at a time, bit for bit, with its keys in one tile, across the boundary of two, or in the second."""
    model = tiny_model(2, "vnni", heads=(8, 2, 32))  # 4 query heads a KV head: 16 rows a task
    kv = PagedKVCache(2, 2, 32, 200, BLOCK, cache_dtype, "cpu")
    kv.allocate("pad", 5)
    kv.allocate("tree", cached + len(WIDE_TREE))
    tree = SequenceLayout(kv.block_tables["tree"], cached, len(WIDE_TREE), WIDE_TREE)
    kv.allocate("path", cached + 8)
    fill_random(kv)
    decoder = fused_decoder.FusedDecoder(model, kv)
    positions = positions_of([tree])
    x = torch.randn(len(WIDE_TREE), 160)
    snapshot = (kv.k.clone(), kv.v.clone(), None if kv.k_scale is None else (kv.k_scale.clone(), kv.v_scale.clone()))
    batch = decoder(x.clone(), positions, build_attention_metadata([tree], BLOCK, "cpu", cpu_groups=False))
    table = kv.block_tables["path"]
    context, mine = (sequence_slots(t, BLOCK, 0, cached) for t in (tree.block_table, table))
    for node in range(len(WIDE_TREE)):
        path = [node]
        while WIDE_TREE[path[0]] >= 0:
            path.insert(0, WIDE_TREE[path[0]])
        kv.k.copy_(snapshot[0])
        kv.v.copy_(snapshot[1])
        if snapshot[2] is not None:
            kv.k_scale.copy_(snapshot[2][0])
            kv.v_scale.copy_(snapshot[2][1])
        for cache in [kv.k, kv.v] + ([] if snapshot[2] is None else [kv.k_scale, kv.v_scale]):
            cache[:, mine] = cache[:, context]
        for depth, step_node in enumerate(path):
            step = SequenceLayout(table, cached + depth, 1)
            row = decoder(
                x[step_node : step_node + 1].clone(),
                torch.tensor([cached + depth]),
                build_attention_metadata([step], BLOCK, "cpu", cpu_groups=False),
            )
        assert torch.equal(row[0], batch[node]), f"node {node}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_an_integer_dot_row_does_not_depend_on_the_rows_beside_it(kind, layout):
    """Each output row of the projections equals that row computed alone, for 1 to 17 rows (tiles of 1-4
    rows in the row layout, 1-8 interleaved), with 18 groups of 32 (the four-group loop and its tail)."""
    torch.manual_seed(0)
    weight = quantize(kind, torch.randn(64, 576), layout)
    x = torch.randn(17, 576).bfloat16()
    alone = torch.cat([weight.matmul(x[r : r + 1], torch.float32) for r in range(17)])
    for rows in range(1, 18):
        assert torch.equal(weight.matmul(x[:rows], torch.float32), alone[:rows]), rows


def test_where_it_applies():
    model = tiny_model()
    kv = PagedKVCache(2, 2, 16, 64, BLOCK, torch.float32, "cpu")
    assert fused_decoder.applies(model, kv)
    assert not fused_decoder.applies(model, PagedKVCache(2, 2, 16, 64, BLOCK, torch.float16, "cpu"))
    most = fused_decoder.max_rows()  # on every CPU: it takes every step, whole prompt chunks too
    assert most == fused_decoder.MANY_ROWS
    assert model.fused_decoder(kv, most) is not None
    assert model.fused_decoder(kv, most + 1) is None  # more rows than a step ever has: the eager layers
    model.enforce_eager = True
    assert model.fused_decoder(kv, 1) is None
    model.enforce_eager = False
    dense = LlamaModel(model.cfg, torch.bfloat16)  # not quantized
    assert not fused_decoder.applies(dense, kv)
    dispatch.set_kernel_mode("torch")
    try:
        assert not fused_decoder.applies(model, kv)
    finally:
        dispatch.set_kernel_mode("auto")


@pytest.mark.slow
@pytest.mark.parametrize("cache_setting", ["auto", "int8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_speculation_is_lossless_in_the_served_configuration(layout, cache_setting):
    """The embedded model as served (bf16, the GGUF's int4 blocks, the fused decoder; each integer layout
    this CPU runs; the model's cache and an int8 one): with Lyanna trees, greedy and seeded outputs equal
    plain decoding's, in one batch, because a verified row computes exactly what decoding it would."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, kv_cache_dtype=cache_setting))
    auto = torch.bfloat16  # the fused decoder reads every step: bf16 even where bf16 arithmetic is emulated
    assert engine.kv_cache.k.dtype == (torch.int8 if cache_setting == "int8" else auto)
    model = engine.model
    for lin in model.modules():
        if getattr(lin, "quant", None) is not None:
            lin.quant = relayout(lin.quant, layout)
    model.lm_head_quant = relayout(model.lm_head_quant, layout)
    model._fused = None  # built again over the relaid weights
    assert engine.quantization == "gguf" and model.fused_decoder(engine.kv_cache, 8) is not None
    off = SpecParams(enabled=False)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    for params in (greedy, seeded):
        reqs = [engine.add_request(p, params, spec=spec) for p in CHAT_PROMPTS[1:3] for spec in (None, off)]
        while engine.has_unfinished():
            engine.step()
        assert reqs[0].output_token_ids == reqs[1].output_token_ids
        assert reqs[2].output_token_ids == reqs[3].output_token_ids
    assert engine.stats().spec.num_accepted_tokens > 0 and engine.stats().kv_free_blocks == 256


def test_the_auto_cache_is_bf16_where_the_fused_decoder_reads_every_step():
    """`kv_cache_dtype: auto` keeps K/V in bf16 wherever the fused decoder takes every step (it widens them as it
    loads them), also on CPUs without bf16 arithmetic, and caps a step at the rows it takes; where the eager layers
    run on such a CPU, fp32."""
    cpu = torch.device("cpu")
    emulated = not dispatch.cpu_has_half_precision_math(torch.bfloat16)
    assert kv_cache_dtype(None, torch.bfloat16, cpu, fused=True) == torch.bfloat16
    assert kv_cache_dtype(None, torch.float32, cpu, fused=True) == torch.float32
    assert kv_cache_dtype(None, torch.bfloat16, cpu) == (torch.float32 if emulated else torch.bfloat16)
    assert kv_cache_dtype(torch.float32, torch.bfloat16, cpu, fused=True) == torch.float32
    fused = LLMEngine(EngineConfig(num_kv_blocks=16, drafter="none"))
    assert fused.kv_cache.k.dtype == torch.bfloat16
    if emulated:  # a step is capped at the fused decoder's rows, and the eager layers' fp32 weight copies go
        assert fused.scheduler.max_num_batched_tokens <= fused_decoder.max_rows()
        assert all(lin.wide is None for lin in fused.model.layers.modules() if isinstance(lin, PackableLinear))
    eager = LLMEngine(EngineConfig(num_kv_blocks=16, drafter="none", enforce_eager=True))
    assert eager.kv_cache.k.dtype == (torch.float32 if emulated else torch.bfloat16)


def test_an_int8_cache_is_refused_where_the_fused_decoder_would_not_read_it():
    """Only the fused CPU decoder reads int8 codes: an engine that would run the eager layers says so."""
    with pytest.raises(ValueError, match="kv_cache_dtype int8"):
        LLMEngine(EngineConfig(num_kv_blocks=16, kv_cache_dtype="int8", enforce_eager=True))
