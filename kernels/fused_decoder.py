"""The decoder layers in one call for a few rows at a time on CPU (kernels/csrc/decoder.c).

At a few rows (decode tokens, draft trees, short prefill chunks) eager PyTorch spends more time in the
~10 small operators around each layer's projections than in the projections. `FusedDecoder` runs every
layer of a quantized Llama-family model (integer-dot weights, kernels/integer_dot.py) in one OpenMP region:
norms, int8 activation blocks, projections, RoPE, cache writes, paged attention over the block tables
and tree ancestors, SwiGLU and residuals, with fp32 activations. It computes the same function as
`LlamaModel`'s layers over the quantized weights (up to fp32 rounding), and each row the same way
whatever else is in its batch (`decoder.c`).

It applies (`applies`) where the model runs the integer-dot kernels (either layout) on CPU on one rank,
with an fp32 or bf16 cache, head_dim a multiple of 8 up to 128 and at most 16 query heads per KV head;
the model runs larger steps (`MAX_ROWS`) and every other configuration through its eager layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import integer_dot
from kernels.dispatch import kernel_mode
from kernels.quantized_linear import INTEGER_LAYOUTS

if TYPE_CHECKING:
    from engines.attention import AttentionMetadata
    from engines.config import ModelConfig
    from engines.kv_cache import PagedKVCache
    from engines.model import LlamaModel
    from engines.parallel import PackableLinear

# Rows up to which one call beats the eager layers (above, the projections dominate either way).
MAX_ROWS = 64
CACHE_DTYPES = (torch.float32, torch.bfloat16)

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _QWeight(ctypes.Structure):
    _fields_ = [("codes", _p), ("scales", _p), ("mins", _p), *((f, _i64) for f in ("n", "k", "bits", "interleaved"))]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("qkv", _QWeight),
        ("o", _QWeight),
        ("gate_up", _QWeight),
        ("down", _QWeight),
        ("k_cache", _p),
        ("v_cache", _p),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads")),
        *((name, _i64) for name in ("head_dim", "block_size", "cache_bf16")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", _p),
        ("sin", _p),
        ("layers", ctypes.POINTER(_Layer)),
    ]


class _Batch(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i64),
        ("num_seqs", _i64),
        ("table_stride", _i64),
        *((name, _p) for name in ("positions", "slots", "query_start", "seq_lens", "block_tables", "parents")),
    ]


def _integer_dot_weight(linear: PackableLinear) -> bool:
    q = linear.quant
    return q is not None and q.layout in INTEGER_LAYOUTS  # (an fp32 `wide` copy serves only >= 48 rows)


def applies(model: LlamaModel, kv_cache: PagedKVCache) -> bool:
    """Whether `FusedDecoder` can run this model over this cache."""
    cfg = model.cfg
    linears = [lin for layer in model.layers for lin in (layer.attn.qkv_proj, layer.attn.o_proj)]
    linears += [lin for layer in model.layers for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    return (
        kernel_mode() == "auto"
        and kv_cache.k.device.type == "cpu"
        and kv_cache.k.dtype in CACHE_DTYPES
        and model.tp.world_size == 1
        and cfg.head_dim % 8 == 0
        and cfg.head_dim <= 128
        and cfg.num_heads // cfg.num_kv_heads <= 16
        and integer_dot.available()
        and all(_integer_dot_weight(lin) for lin in linears)
    )


def _qweight(linear: PackableLinear) -> _QWeight:
    q = linear.quant
    assert q is not None
    mins = q.mins.data_ptr() if q.mins is not None else None
    n, k = q.out_features, q.in_features
    return _QWeight(q.data.data_ptr(), q.scales.data_ptr(), mins, n, k, q.bits, q.layout == "vnni")


@dataclass
class LayerWeights:
    """One Llama decoder layer's pieces, as `decoder.c` reads them."""

    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    qkv_proj: PackableLinear  # rows: q heads, k heads, v heads
    o_proj: PackableLinear
    gate_up_proj: PackableLinear  # rows: gate, up
    down_proj: PackableLinear


def layer_weights(layer) -> LayerWeights:
    """The pieces of a `DecoderLayer` of engines/model.py."""
    attn, mlp = layer.attn, layer.mlp
    return LayerWeights(
        layer.input_norm.weight,
        layer.post_attn_norm.weight,
        attn.qkv_proj,
        attn.o_proj,
        mlp.gate_up_proj,
        mlp.down_proj,
    )


class _Layers:
    """The C view of some decoder layers over a paged cache (`k`, `v`: [layers, slots, kv_heads, head_dim]),
    holding every tensor its pointers point into."""

    def __init__(self, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor, layers: list[LayerWeights],
                 k: torch.Tensor, v: torch.Tensor, block_size: int):  # fmt: skip
        self._tensors = [cos.float().contiguous(), sin.float().contiguous()]  # fp32 copies the struct points to
        structs = []
        for i, lw in enumerate(layers):
            norms = [lw.input_norm.float().contiguous(), lw.post_attn_norm.float().contiguous()]
            self._tensors += norms
            weights = (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj)
            structs.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *map(_qweight, weights),
                                  k[i].data_ptr(), v[i].data_ptr()))  # fmt: skip
        self._layers = (_Layer * len(structs))(*structs)
        self._keep = (layers, k, v)  # the quantized weights and the cache the layers point into
        self.decoder = _Decoder(
            num_layers=len(layers),
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            cache_bf16=int(k.dtype == torch.bfloat16),
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            cos=self._tensors[0].data_ptr(),
            sin=self._tensors[1].data_ptr(),
            layers=self._layers,
        )

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, query_start: torch.Tensor,
            seq_lens: torch.Tensor, tables: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Every layer over the new tokens `x` ([T, hidden]); returns the last layer's output, fp32."""
        T = x.shape[0]
        assert 0 < T <= MAX_ROWS
        x = x.float().contiguous()
        arrays = [positions.to(torch.int64), slots.to(torch.int64), query_start.to(torch.int32),
                  seq_lens.to(torch.int32), parents.to(torch.int32)]  # fmt: skip
        positions, slots, query_start, seq_lens, parents = (a.contiguous() for a in arrays)
        assert tables.dtype == torch.int32 and tables.stride(1) == 1
        batch = _Batch(T, len(seq_lens), tables.stride(0), positions.data_ptr(), slots.data_ptr(),
                       query_start.data_ptr(), seq_lens.data_ptr(), tables.data_ptr(), parents.data_ptr())  # fmt: skip
        lib = integer_dot.library()
        if lib.decoder_forward(ctypes.byref(self.decoder), ctypes.byref(batch), x.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the fused decoder could not allocate its buffers")
        return x


class FusedDecoder:
    """Every decoder layer of `model` over `kv_cache`, for up to `MAX_ROWS` new tokens in one call."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        assert applies(model, kv_cache)
        rotary, layers = model.rotary, [layer_weights(layer) for layer in model.layers]
        self._layers = _Layers(model.cfg, rotary.cos, rotary.sin, layers, kv_cache.k, kv_cache.v, kv_cache.block_size)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] fp32 residual stream after the embedding
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] fp32: the last layer's output, before the final norm
        """Run every layer over the step's new tokens (K/V written to their slots)."""
        assert meta.parents is not None
        return self._layers.run(
            x, positions, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables, meta.parents
        )


class FusedDraftLayer:
    """A drafter's decoder layer (Lyanna's, engines/drafters/lyanna_model.py) in one call, over its own
    paged K/V cache.

    The cache is addressed with the target's block tables: the drafter's keys of context position p live
    at the same slot as the target's, in a cache of one layer. `scratch_blocks` more blocks past the
    target's hold the keys of a draft's later steps (positions the target may not have allocated yet):
    request b of a call may use blocks `scratch(b)`.
    """

    def __init__(self, cfg: ModelConfig, rotary, layer: LayerWeights, num_blocks: int, block_size: int,
                 dtype: torch.dtype, scratch_per_seq: int, max_seqs: int):  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_per_seq, self.max_seqs = scratch_per_seq, max_seqs
        self._build = (cfg, rotary, layer)
        slots = (num_blocks + scratch_per_seq * max_seqs) * block_size
        shape = (1, slots, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self._layers = _Layers(cfg, rotary.cos, rotary.sin, [layer], self.k, self.v, block_size)

    def scratch(self, b: int) -> list[int]:
        """The scratch block ids of a call's sequence `b`."""
        if not 0 <= b < self.max_seqs:
            raise ValueError(f"a draft call holds at most {self.max_seqs} sequences (reserved), not {b + 1}")
        first = self.num_blocks + b * self.scratch_per_seq
        return list(range(first, first + self.scratch_per_seq))

    def reserve(self, seqs: int) -> None:
        """Make room for scratch blocks of `seqs` sequences (a tree's frontier paths), keeping the cache
        (grown at least twofold, so a batch that grows step by step copies it rarely)."""
        if seqs <= self.max_seqs:
            return
        seqs = max(seqs, 2 * self.max_seqs)
        cfg, rotary, layer = self._build
        kept = self.num_blocks + self.scratch_per_seq * self.max_seqs
        slots = (self.num_blocks + self.scratch_per_seq * seqs) * self.block_size
        k, v = (t.new_zeros((1, slots, *t.shape[2:])) for t in (self.k, self.v))
        k[:, : kept * self.block_size], v[:, : kept * self.block_size] = self.k, self.v
        self.k, self.v, self.max_seqs = k, v, seqs
        self._layers = _Layers(cfg, rotary.cos, rotary.sin, [layer], self.k, self.v, self.block_size)

    def block_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K and V cache as [blocks, block_size, kv_heads, head_dim], for block copies."""
        shape = (-1, self.block_size, *self.k.shape[2:])
        return self.k[0].view(shape), self.v[0].view(shape)

    def __call__(
        self, x: torch.Tensor, positions: list[int], counts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """The layer over `x` ([T, hidden]): sequence b's `counts[b]` rows are a chain at consecutive positions
        from `positions[b]`, attending to its cached keys before them through `tables[b]` (block ids).
        Returns [T, hidden] fp32, the layer's output before the drafter's final norm. More than `MAX_ROWS`
        rows (a prompt read at once) run in calls of up to `MAX_ROWS`, each chain's rows in order."""
        if x.shape[0] <= MAX_ROWS:
            return self._call(x, positions, counts, tables)
        pieces: list[list[tuple[int, int, list[int]]]] = [[]]
        room = MAX_ROWS
        for first, n, blocks in zip(positions, counts, tables, strict=True):
            while n:
                if room == 0:
                    pieces.append([])
                    room = MAX_ROWS
                take = min(n, room)
                pieces[-1].append((first, take, blocks))
                first, n, room = first + take, n - take, room - take
        outs, row = [], 0
        for piece in pieces:
            rows = sum(n for _, n, _ in piece)
            outs.append(self._call(x[row : row + rows], *map(list, zip(*piece, strict=True))))
            row += rows
        return torch.cat(outs)

    def _call(self, x: torch.Tensor, positions: list[int], counts: list[int], tables: list[list[int]]) -> torch.Tensor:
        bs = self.block_size
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        pos, slots, parents, seq_lens, starts = [], [], [], [], [0]
        for b, (first, n, blocks) in enumerate(zip(positions, counts, tables, strict=True)):
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for p in range(first, first + n):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            parents += range(-1, n - 1)
            seq_lens.append(first + n)
            starts.append(starts[-1] + n)
        ints = torch.tensor([pos, slots, parents], dtype=torch.int64)
        query_start, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        return self._layers.run(x, ints[0], ints[1], query_start, lens, table, ints[2])
