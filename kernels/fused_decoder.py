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
from typing import TYPE_CHECKING

import torch

from kernels import integer_dot
from kernels.dispatch import kernel_mode
from kernels.quantized_linear import INTEGER_LAYOUTS

if TYPE_CHECKING:
    from engines.attention import AttentionMetadata
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


class FusedDecoder:
    """Every decoder layer of `model` over `kv_cache`, for up to `MAX_ROWS` new tokens in one call."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        assert applies(model, kv_cache)
        cfg = model.cfg
        # fp32 copies of the norms and rotary tables, held here for the pointers the C struct keeps.
        self._tensors = [model.rotary.cos.float().contiguous(), model.rotary.sin.float().contiguous()]
        layers = []
        for i, layer in enumerate(model.layers):
            norms = [layer.input_norm.weight.float().contiguous(), layer.post_attn_norm.weight.float().contiguous()]
            self._tensors += norms
            attn, mlp = layer.attn, layer.mlp
            layers.append(
                _Layer(
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    _qweight(attn.qkv_proj),
                    _qweight(attn.o_proj),
                    _qweight(mlp.gate_up_proj),
                    _qweight(mlp.down_proj),
                    kv_cache.k[i].data_ptr(),
                    kv_cache.v[i].data_ptr(),
                )
            )
        self._layers = (_Layer * len(layers))(*layers)
        self._model = model  # keeps the quantized weights alive
        self._cache = (kv_cache.k, kv_cache.v)  # keeps the cache the layers point into alive
        self._decoder = _Decoder(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=kv_cache.block_size,
            cache_bf16=int(kv_cache.k.dtype == torch.bfloat16),
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            cos=self._tensors[0].data_ptr(),
            sin=self._tensors[1].data_ptr(),
            layers=self._layers,
        )

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] fp32 residual stream after the embedding
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] fp32: the last layer's output, before the final norm
        """Run every layer over the step's new tokens (K/V written to their slots)."""
        T = x.shape[0]
        assert 0 < T <= MAX_ROWS and meta.parents is not None
        x = x.float().contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        query_start = meta.query_start.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables
        assert tables.dtype == torch.int32 and tables.stride(1) == 1
        batch = _Batch(
            T,
            len(seq_lens),
            tables.stride(0),
            positions.data_ptr(),
            slots.data_ptr(),
            query_start.data_ptr(),
            seq_lens.data_ptr(),
            tables.data_ptr(),
            meta.parents.data_ptr(),
        )
        lib = integer_dot.library()
        if lib.decoder_forward(ctypes.byref(self._decoder), ctypes.byref(batch), x.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the fused decoder could not allocate its buffers")
        return x
