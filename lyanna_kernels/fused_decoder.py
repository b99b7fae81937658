"""The decoder layers in one call for a few rows at a time on CPU (lyanna_kernels/csrc/decoder.c).

At a few rows (decode tokens, draft trees, short prefill chunks) eager PyTorch spends more time in the
~10 small operators around each layer's projections than in the projections. `FusedDecoder` runs every
layer of a quantized Llama-family model (integer-dot weights, lyanna_kernels/integer_dot.py) in one OpenMP region:
norms, int8 activation blocks, projections (with Qwen2's q/k/v biases, fp32, where the model has them),
RoPE, cache writes, paged attention over the block tables and tree ancestors, SwiGLU and residuals, with
fp32 activations. It computes the same function as
`LlamaModel`'s layers over the quantized weights (up to fp32 rounding), and each row the same way
whatever else is in its batch (`decoder.c`).

`FusedDecoder.greedy` runs several greedy decode steps in one call, the LM head (`GreedyHead`: the interleaved
layout), the argmax and the next step's embeddings in it too, bit for bit what as many steps with those calls
on the host give (decoder.c's `decoder_greedy`).

It applies (`applies`) where the model runs the integer-dot kernels (either layout) on CPU, on one rank or
on tensor-parallel ranks that sum through shared memory (engines/shm_all_reduce.py: the C forward does its
two all-reduces a layer there itself), with an fp32, bf16 or int8 cache, head_dim a multiple of 8 up to 128 and
at most 16 query heads per KV head; where it applies it takes every step (whole prompt chunks too), and every
other configuration runs through the model's eager layers.

Every token is computed the same way whatever shares its call and whatever it is: a prompt token (in a chunk of
any size, after cached blocks or not), a decode, a draft tree's node. The projections are exact integer dot
products per row; attention goes over a token's keys in tiles fixed by key position (decoder.c's attend_tile), and
a prompt's tokens attend as a run that shares each block of keys among its rows, with the same numbers. So greedy
and seeded answers do not depend on the load, on chunking, on prefix-cache hits, on speculation, or on a
resumption that re-reads generated tokens as prompt.

On CPUs with AMX (csrc/amx.c) the projections of 16 rows or more go 16 rows per tile product (the same numbers
as csrc/vnni.c's). `LYANNA_PROMPT_BF16=1` (not deterministic) lets a sequence's prompt tokens
(`AttentionMetadata.prompt_tokens`) enter the projections there as bf16 rows against the weights dequantized to
bf16 instead: faster prompts, but a prompt token's result then differs from the same token decoded.
"""

from __future__ import annotations

import ctypes
import operator
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lyanna_kernels import integer_dot
from lyanna_kernels.dispatch import kernel_mode
from lyanna_kernels.quantized_linear import INTEGER_LAYOUTS

if TYPE_CHECKING:
    from engines.attention import AttentionMetadata
    from engines.config import ModelConfig
    from engines.kv_cache import PagedKVCache
    from engines.model import LlamaModel
    from engines.parallel import PackableLinear, TensorParallel
    from engines.shm_all_reduce import SharedSegment
    from lyanna_kernels.quantized_linear import QuantizedWeight

MAX_ROWS = 64  # rows of one call of a drafter's layer (FusedDraftLayer)
MANY_ROWS = 16384  # rows of one call of the target's decoder (whole prompt chunks)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # int8: codes beside a bf16 scale per 32 values
# Prompt tokens' projections in bf16 tiles on AMX CPUs (amx.c's amx_bf16_blocks over the weights dequantized a
# panel at a time) with `LYANNA_PROMPT_BF16=1`: faster prompts there, but not deterministic (a prompt token's
# result differs from the same token decoded). By default they go through the int8 blocks that decoding uses.
PROMPT_BF16 = os.environ.get("LYANNA_PROMPT_BF16", "0") == "1"
# Those rows' gate_up and SwiGLU in one pass (the gate and up sums of a tile stay in L1); True: in two, as before,
# which the one pass equals bit for bit (the tests' reference).
SPLIT_SWIGLU = False

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
        ("qkv_bias", _p),
        ("k_scale", _p),
        ("v_scale", _p),
    ]


class _Reducer(ctypes.Structure):
    _fields_ = [
        *((name, _p) for name in ("seqs", "pids", "data", "seq", "wait_seconds")),
        *((name, _i64) for name in ("rank", "world", "slot_bytes")),
        ("timeout_s", ctypes.c_double),
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
        ("max_positions", _i64),
        ("num_slots", _i64),
        ("reduce", ctypes.POINTER(_Reducer)),  # NULL on one rank
        ("final_norm", _p),  # [hidden] fp32 or NULL: the model's final norm on the last layer's output
        ("prompt_bf16", _i64),  # 1: prompt runs' projections in bf16 tiles (AMX)
        ("split_swiglu", _i64),  # 1: their gate_up and SwiGLU in two passes (SPLIT_SWIGLU)
        ("cache_int8", _i64),  # 1: int8 codes in k_cache / v_cache, their scales in k_scale / v_scale
    ]


class _Batch(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i64),
        ("num_seqs", _i64),
        ("table_stride", _i64),
        ("table_width", _i64),
        ("bad", _i64),  # out: the element a failed check points at
        *((name, _p) for name in ("positions", "slots", "query_start", "seq_lens", "block_tables", "parents")),
        ("runs", _p),  # [B] int32 or NULL
    ]


class _Head(ctypes.Structure):
    _fields_ = [
        ("codes", _p),
        ("scales", _p),
        ("mins", _p),
        ("bits", _i64),
        ("vocab", _i64),
        ("embed", _p),
        ("embed_rows", _i64),
        ("embed_bf16", _i64),
    ]


class GreedyHead:
    """The LM head (an interleaved integer-dot weight: `vnni_matmul`'s layout) and the token embeddings (bf16
    or fp32) that greedy steps in one call read (`FusedDecoder.greedy`), holding the tensors it points into."""

    def __init__(self, head: QuantizedWeight, embed: torch.Tensor):
        if head.layout != "vnni" or head.mins is None:
            raise ValueError(f"greedy steps take an LM head in the interleaved integer-dot layout, not {head.layout!r}")
        if embed.dtype not in (torch.bfloat16, torch.float32) or embed.dim() != 2 or not embed.is_contiguous():
            raise ValueError(f"embeddings must be a contiguous [vocab, hidden] bf16 or fp32 tensor, not {embed.dtype}")
        if embed.shape[1] != head.in_features:
            raise ValueError(f"the embeddings' width {embed.shape[1]} is not the LM head's input {head.in_features}")
        self.head, self.embed = head, embed
        pointers = (head.data.data_ptr(), head.scales.data_ptr(), head.mins.data_ptr())
        rows, bf16 = embed.shape[0], int(embed.dtype == torch.bfloat16)
        self.struct = _Head(*pointers, head.bits, head.out_features, embed.data_ptr(), rows, bf16)


def _integer_dot_weight(linear: PackableLinear) -> bool:
    q = linear.quant
    return q is not None and q.layout in INTEGER_LAYOUTS  # (an fp32 `wide` copy serves only >= 48 rows)


@dataclass(frozen=True)
class Shard:
    """What of each layer a rank holds: query and KV heads, MLP channels, and (tensor-parallel) the shared
    memory its partial sums are added up through."""

    num_heads: int
    num_kv_heads: int
    intermediate: int
    segment: SharedSegment | None = None


_RANK_DIED, _RANK_TIMEOUT = 9, 10  # decoder_forward's codes for a failed all-reduce (decoder.c)
_BAD_TOKEN = 11  # decoder_greedy's code for a token the embeddings lack

PHASES = ("norm", "qkv", "rope", "attend", "o", "mlp_in", "gate_up", "swiglu", "down")


def profile(on: bool) -> dict[str, float]:
    """Per-phase seconds the fused decoder spent (thread 0's view, summed over calls) since profiling was
    turned on; `on` turns it on (clearing the sums) or off. Profiling reads a clock a few times per layer."""
    lib = integer_dot.library()
    out = (ctypes.c_double * len(PHASES))()
    lib.decoder_profile(int(on), out)
    return dict(zip(PHASES, list(out), strict=True))


_native_seconds = [0.0]  # every native forward's and greedy call's wall time, in all


def native_seconds() -> float:
    """Seconds this process has spent inside the fused decoder's native forwards and greedy calls, in all: where a
    step's forward phase went to the layers rather than to the Python that prepared them."""
    return _native_seconds[0]


def max_rows() -> int:
    """The most new tokens one call takes: every step of an engine whose model the fused decoder applies to
    (the eager layers would compute other numbers)."""
    return MANY_ROWS


def shared_segment(tp: TensorParallel) -> SharedSegment | None:
    """The shared-memory all-reduce a tensor-parallel rank's C forward sums through (engines/shm_all_reduce.py's
    `SharedSegment`), or None where the ranks sum otherwise (gloo, NCCL)."""
    segment = getattr(tp.reducer, "segment", None)
    return segment() if segment is not None else None


def applies(model: LlamaModel, kv_cache: PagedKVCache) -> bool:
    """Whether `FusedDecoder` can run this model over this cache."""
    return kv_cache.k.device.type == "cpu" and kv_cache.k.dtype in CACHE_DTYPES and applies_to_model(model)


def applies_to_model(model: LlamaModel) -> bool:
    """Whether `FusedDecoder` can run this model over a CPU cache of one of `CACHE_DTYPES`."""
    cfg = model.cfg
    linears = [lin for layer in model.layers for lin in (layer.attn.qkv_proj, layer.attn.o_proj)]
    linears += [lin for layer in model.layers for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    return (
        kernel_mode() == "auto"
        and (model.tp.world_size == 1 or shared_segment(model.tp) is not None)
        and cfg.head_dim % 8 == 0
        and cfg.head_dim <= 128
        and cfg.num_heads // cfg.num_kv_heads <= 16
        and integer_dot.available()
        and all(_integer_dot_weight(lin) for lin in linears)
    )


def _held(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of its own over `t`'s values (contiguous, in `dtype`), for the C view to point into: an alias
    that a later `.data =` on `t` does not redirect, so the memory stays alive as long as the view does."""
    t = t.detach()
    return (t if dtype is None else t.to(dtype)).contiguous()


def _qweight(linear: PackableLinear, n: int, k: int, held: list[object]) -> _QWeight:
    """The C view of `linear`'s quantized weight, checked to be the [n, k] matrix the layer reads (its
    tensors appended to `held`)."""
    q = linear.quant
    if q is None or q.layout not in INTEGER_LAYOUTS:
        raise ValueError("the fused decoder takes integer-dot quantized projections")
    blocks = integer_dot.INTERLEAVE if q.layout == "vnni" else 1  # output rows the layout groups
    if (q.out_features, q.in_features) != (n, k) or k % integer_dot.GROUP or n % blocks:
        raise ValueError(f"a projection is [{q.out_features}, {q.in_features}], the layer reads [{n}, {k}]")
    mins_needed = q.bits == 4 or q.layout == "vnni"
    sizes = [(q.data, 1, n * k * q.bits // 8), (q.scales, 2, n * k // integer_dot.GROUP)]
    if q.mins is not None or mins_needed:
        sizes.append((q.mins, 2, n * k // integer_dot.GROUP))
    for t, width, numel in sizes:
        if t is None or t.device.type != "cpu" or t.element_size() != width or t.numel() != numel:
            raise ValueError(f"a [{n}, {k}] {q.kind} weight's tensors do not have the sizes the kernel reads")
    codes, scales = _held(q.data), _held(q.scales)
    mins = _held(q.mins) if q.mins is not None else None
    held += [t for t in (codes, scales, mins) if t is not None]
    mins_ptr = mins.data_ptr() if mins is not None else None
    return _QWeight(codes.data_ptr(), scales.data_ptr(), mins_ptr, n, k, q.bits, q.layout == "vnni")


@dataclass
class LayerWeights:
    """One Llama decoder layer's pieces, as `decoder.c` reads them."""

    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]
    qkv_proj: PackableLinear  # rows: q heads, k heads, v heads
    o_proj: PackableLinear
    gate_up_proj: PackableLinear  # rows: gate, up
    down_proj: PackableLinear
    qkv_bias: torch.Tensor | None = None  # [q + k + v rows] (Qwen2), None for none


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
        attn.qkv_proj.bias,
    )


_QUANT = operator.attrgetter("quant")


class _Layers:
    """The C view of some decoder layers over a paged cache (`cache.k`, `cache.v`: [layers, slots, kv_heads,
    head_dim]; for int8 codes also `cache.k_scale`, `cache.v_scale`: [layers, slots, kv_heads, head_dim / 32]),
    holding every tensor its pointers point into.

    The view is taken from the model's tensors as they are when it is built; `run` builds it again when any
    of them was swapped since (a projection's quantized weight replaced, a norm's or rotary table's `.data`
    or the cache reassigned), and until then the old tensors are held, so no pointer ever dangles."""

    def __init__(self, cfg: ModelConfig, rotary, layers: list[LayerWeights], cache, block_size: int,
                 shard: Shard | None = None, final_norm: torch.Tensor | None = None,
                 prompt_bf16: bool = False):  # fmt: skip
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.cfg, self.rotary, self.layers, self.cache, self.block_size = cfg, rotary, layers, cache, block_size
        self.final_norm = final_norm  # the model's final norm weight (applied after the last layer), or None
        self.prompt_bf16 = prompt_bf16
        self.split_swiglu = SPLIT_SWIGLU
        self.shard = shard or Shard(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        self._layer_tensors = [
            t for lw in layers for t in (lw.input_norm, lw.post_attn_norm, lw.qkv_bias) if t is not None
        ]
        self._projections = [p for lw in layers for p in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj)]
        self._build()

    def _sources(self) -> list[int]:
        """Where the view's pointers come from: the storage of the rotary tables, the cache and the norms, and
        the projections' quantized weights (held by the view, so their ids are not reused while it lives).
        Checked before every step, so built by C-level maps over lists made once."""
        r, c = self.rotary, self.cache
        ids = [r.cos.data_ptr(), r.sin.data_ptr(), c.k.data_ptr(), c.v.data_ptr()]
        ids += [t.data_ptr() for t in (getattr(c, "k_scale", None), getattr(c, "v_scale", None)) if t is not None]
        ids.append(0 if self.final_norm is None else self.final_norm.data_ptr())
        ids += map(torch.Tensor.data_ptr, self._layer_tensors)
        ids += map(id, map(_QUANT, self._projections))
        return ids

    def _build(self) -> None:
        cfg, layers, bs = self.cfg, self.layers, self.block_size
        H, D = cfg.hidden_size, cfg.head_dim
        Hq, Hk, inter = self.shard.num_heads, self.shard.num_kv_heads, self.shard.intermediate
        if D % 8 or D > 128 or Hq % Hk or Hq // Hk > 16:  # decoder.c's vectors and per-head arrays
            raise ValueError(f"the fused decoder takes head_dim a multiple of 8 up to 128 and at most 16 query "
                             f"heads per KV head, not {D} and {Hq} / {Hk}")  # fmt: skip
        k, v = self.cache.k.detach(), self.cache.v.detach()  # written in place: never a copy
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != len(layers) or k.shape[2:] != (Hk, D):
            raise ValueError(f"the cache is {list(k.shape)}, the layers read [{len(layers)}, slots, {Hk}, {D}]")
        if k.dtype not in CACHE_DTYPES or v.dtype != k.dtype or k.device.type != "cpu" or k.shape[1] % bs:
            raise ValueError("the cache must be fp32, bf16 or int8 on CPU, a whole number of blocks")
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("the cache must be contiguous")
        k_scale = v_scale = None
        if k.dtype == torch.int8:
            k_scale, v_scale = self.cache.k_scale.detach(), self.cache.v_scale.detach()
            want = (*k.shape[:3], D // 32)  # engines.kv_cache.INT8_GROUP, as decoder.c reads them
            for t in (k_scale, v_scale):
                if t.shape != want or t.dtype != torch.bfloat16 or not t.is_contiguous() or t.is_cuda:
                    raise ValueError(f"an int8 cache's scales must be contiguous CPU bf16 {list(want)}")
        cos, sin = _held(self.rotary.cos, torch.float32), _held(self.rotary.sin, torch.float32)
        if cos.dim() != 2 or cos.shape[1] != D or sin.shape != cos.shape:
            raise ValueError(f"the rotary tables are {list(cos.shape)}, the layers read [positions, {D}]")
        sources = self._sources()
        # The tensors the structs point into, and what `sources` names (a norm's own storage where `held` has
        # an fp32 copy, the quantized weights): while held, no new tensor or weight can reuse their addresses.
        held: list[object] = [cos, sin, k, v, k_scale, v_scale, self.rotary.cos.detach(), self.rotary.sin.detach()]
        structs = []
        for i, lw in enumerate(layers):
            held += [lw.input_norm.detach(), lw.post_attn_norm.detach()]
            held += [lw.qkv_proj.quant, lw.o_proj.quant, lw.gate_up_proj.quant, lw.down_proj.quant]
            norms = [_held(lw.input_norm, torch.float32), _held(lw.post_attn_norm, torch.float32)]
            if any(n.shape != (H,) for n in norms):
                raise ValueError(f"a norm's weight must be [{H}]")
            held += norms
            bias = None
            if lw.qkv_bias is not None:
                bias = _held(lw.qkv_bias, torch.float32)
                if bias.shape != ((Hq + 2 * Hk) * D,) or bias.device.type != "cpu":
                    raise ValueError(f"the qkv bias must be a CPU tensor of [{(Hq + 2 * Hk) * D}], "
                                     f"not {list(bias.shape)}")  # fmt: skip
                held += [lw.qkv_bias.detach(), bias]
            weights = [
                _qweight(lw.qkv_proj, (Hq + 2 * Hk) * D, H, held),
                _qweight(lw.o_proj, H, Hq * D, held),
                _qweight(lw.gate_up_proj, 2 * inter, H, held),
                _qweight(lw.down_proj, H, inter, held),
            ]
            bias_ptr = None if bias is None else bias.data_ptr()
            scales = (None, None) if k_scale is None else (k_scale[i].data_ptr(), v_scale[i].data_ptr())
            structs.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *weights, k[i].data_ptr(), v[i].data_ptr(),
                                  bias_ptr, *scales))  # fmt: skip
        final_norm = None
        if self.final_norm is not None:
            final_norm = _held(self.final_norm, torch.float32)
            if final_norm.shape != (H,):
                raise ValueError(f"the final norm's weight must be [{H}]")
            held += [self.final_norm.detach(), final_norm]
        self._held = held
        self._layer_structs = (_Layer * len(structs))(*structs)
        segment = self.shard.segment
        self._reducer = None if segment is None else _Reducer(**segment.__dict__)
        self.decoder = _Decoder(
            num_layers=len(layers),
            hidden=H,
            intermediate=inter,
            num_heads=Hq,
            num_kv_heads=Hk,
            head_dim=D,
            block_size=bs,
            cache_bf16=int(k.dtype == torch.bfloat16),
            eps=cfg.rms_norm_eps,
            scale=D**-0.5,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            layers=self._layer_structs,
            max_positions=cos.shape[0],
            num_slots=k.shape[1],
            reduce=None if self._reducer is None else ctypes.pointer(self._reducer),
            final_norm=None if final_norm is None else final_norm.data_ptr(),
            prompt_bf16=int(self.prompt_bf16),
            split_swiglu=int(self.split_swiglu),
            cache_int8=int(k.dtype == torch.int8),
        )
        self._sources_at_build = sources

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, query_start: torch.Tensor,
            seq_lens: torch.Tensor, tables: torch.Tensor, parents: torch.Tensor,
            runs: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Every layer over the new tokens `x` ([T, hidden]); returns the last layer's output, fp32. `runs`
        ([B]: how many lead new tokens of each sequence are a causal run of prompt tokens; None: none) lets
        those attend 16 queries at a time (AMX, bf16 or int8 cache); the others attend one by one.

        Shapes are checked here and every index in C before anything is read or written (`check_batch` of
        decoder.c): ValueError or IndexError name the first bad one."""
        x, batch, held = self._batch(x, positions, slots, query_start, seq_lens, tables, parents, runs)
        lib, threads = integer_dot.library(), torch.get_num_threads()
        start = time.perf_counter()
        code = lib.decoder_forward(ctypes.byref(self.decoder), ctypes.byref(batch), x.data_ptr(), threads)
        _native_seconds[0] += time.perf_counter() - start
        self._check(code, batch, *held)
        return x

    def greedy(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
               tables: torch.Tensor, head: GreedyHead, steps: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`steps` greedy decode steps of one new token per sequence (`x` [B, hidden], each sequence's last
        token) in one call (decoder.c's `decoder_greedy`; needs the final norm): returns every step's normed
        rows [steps, B, hidden] fp32 and its argmax tokens [steps, B] int64, bit for bit what `steps` calls of
        `run`, the LM head's `vnni_matmul` and `row_argmax` give. Step s > 0 reads the tokens of step s - 1 at
        the next positions, into the slots `tables` gives (blocks the scheduler allocated beforehand)."""
        self._check_head(head)
        if steps < 1:
            raise ValueError(f"steps must be positive, not {steps}")
        B = x.shape[0]
        one = torch.arange(B + 1, dtype=torch.int32)
        parents = torch.full((B,), -1, dtype=torch.int32)
        return self._greedy_call(*self._batch(x, positions, slots, one, seq_lens, tables, parents, None), head, steps)

    def argmax_rows(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, tables: torch.Tensor, parents: torch.Tensor, runs: torch.Tensor | None,
                    head: GreedyHead) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`run` over any batch (draft trees, several rows a sequence), then the final norm, the LM head and every
        row's argmax in the same call: the normed rows [T, hidden] fp32 and their argmax tokens [T] int64, bit for
        bit what `run`, the LM head's `vnni_matmul` and `row_argmax` give (decoder.c's `decoder_greedy`, one step)."""
        self._check_head(head)
        batch = self._batch(x, positions, slots, query_start, seq_lens, tables, parents, runs)
        hidden, tokens = self._greedy_call(*batch, head, 1)
        return hidden[0], tokens[0]

    def _check_head(self, head: GreedyHead) -> None:
        if self.final_norm is None or self._reducer is not None:
            raise ValueError("greedy steps need the model's final norm and one rank")
        if head.head.in_features != self.cfg.hidden_size:
            raise ValueError(f"the LM head reads {head.head.in_features} values, the rows are {self.cfg.hidden_size}")

    def _greedy_call(self, x: torch.Tensor, batch: _Batch, held: tuple[torch.Tensor, ...], head: GreedyHead,
                     steps: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """decoder_greedy over a checked batch (`_batch`'s): rows [steps, T, hidden] and tokens [steps, T]."""
        B = x.shape[0]
        hidden = torch.empty(steps, B, self.cfg.hidden_size)
        tokens = torch.empty(steps, B, dtype=torch.int64)
        lib, threads = integer_dot.library(), torch.get_num_threads()
        start = time.perf_counter()
        code = lib.decoder_greedy(ctypes.byref(self.decoder), ctypes.byref(batch), x.data_ptr(), threads,
                                  ctypes.byref(head.struct), steps, hidden.data_ptr(), tokens.data_ptr())  # fmt: skip
        _native_seconds[0] += time.perf_counter() - start
        if code == _BAD_TOKEN:
            raise IndexError(f"sequence {batch.bad}'s token is not one of the {head.struct.embed_rows} embeddings")
        self._check(code, batch, *held)
        return hidden, tokens

    def _batch(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, query_start: torch.Tensor,
               seq_lens: torch.Tensor, tables: torch.Tensor, parents: torch.Tensor,
               runs: torch.Tensor | None) -> tuple[torch.Tensor, _Batch, tuple[torch.Tensor, ...]]:  # fmt: skip
        """The checked, contiguous C batch of a step (rebuilding the view first where the model's tensors were
        swapped): x as fp32, the `_Batch`, and the arrays its pointers point into."""
        if self._sources() != self._sources_at_build:
            self._build()
        T, B, most = x.shape[0], seq_lens.shape[0], max_rows()
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size or not 0 < T <= most:
            raise ValueError(f"x must be [1..{most}, {self.cfg.hidden_size}], not {list(x.shape)}")
        checked = [("positions", positions, T), ("slots", slots, T), ("parents", parents, T), ("seq_lens", seq_lens, B),
                   ("query_start", query_start, B + 1)]  # fmt: skip
        if runs is not None:
            checked.append(("runs", runs, B))
        for name, a, n in checked:
            if a.shape != (n,) or a.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor of {n} entries, not {list(a.shape)} on {a.device}")
        if tables.dim() != 2 or tables.shape[0] < B or tables.device.type != "cpu":
            raise ValueError(f"block_tables must be a CPU [{B}, blocks] tensor, not {list(tables.shape)}")
        if tables.dtype != torch.int32 or tables.stride(1) != 1:  # (rows of a wider buffer are read in place)
            tables = tables.to(torch.int32).contiguous()
        x = x.float().contiguous()
        arrays = [positions.to(torch.int64), slots.to(torch.int64), query_start.to(torch.int32),
                  seq_lens.to(torch.int32), parents.to(torch.int32)]  # fmt: skip
        positions, slots, query_start, seq_lens, parents = (a.contiguous() for a in arrays)
        runs = None if runs is None else runs.to(torch.int32).contiguous()
        batch = _Batch(T, B, tables.stride(0), tables.shape[1], 0, positions.data_ptr(), slots.data_ptr(),
                       query_start.data_ptr(), seq_lens.data_ptr(), tables.data_ptr(), parents.data_ptr(),
                       None if runs is None else runs.data_ptr())  # fmt: skip
        return x, batch, (positions, slots, query_start, seq_lens, tables, parents)

    def _check(self, code: int, batch: _Batch, positions: torch.Tensor, slots: torch.Tensor,
               query_start: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
               parents: torch.Tensor) -> None:  # fmt: skip
        """Raise for a C call's failure `code`: no memory, a tensor-parallel rank lost, or a bad batch."""
        if code == -1:
            raise MemoryError("the fused decoder could not allocate its buffers")
        if code in (_RANK_DIED, _RANK_TIMEOUT):
            segment = self.shard.segment
            assert segment is not None
            if code == _RANK_DIED:
                pid = ctypes.c_int64.from_address(segment.pids + 8 * batch.bad).value
                raise RuntimeError(f"tensor-parallel rank {batch.bad} (pid {pid}) died")
            raise RuntimeError(f"tensor-parallel all-reduce waited {segment.timeout_s:.0f} s for rank {batch.bad}")
        if code:
            raise self._bad_batch(code, batch.bad, positions, slots, query_start, seq_lens, tables, parents)

    def _bad_batch(self, code: int, at: int, positions: torch.Tensor, slots: torch.Tensor,
                   query_start: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                   parents: torch.Tensor) -> Exception:  # fmt: skip
        """The error for `check_batch`'s `code` at element `at` (decoder.c's BAD_* values)."""
        d = self.decoder
        if code == 1:
            return ValueError(f"query_start must start at 0, not decrease and end at the {positions.shape[0]} "
                              f"tokens: query_start[{at}] = {int(query_start[at])}")  # fmt: skip
        if code == 2:
            return ValueError(f"seq_lens[{at}] = {int(seq_lens[at])} is fewer than the sequence's "
                              f"{int(query_start[at + 1] - query_start[at])} new tokens")  # fmt: skip
        if code == 8:
            return ValueError(f"runs[{at}] is negative or more than the sequence's new tokens")
        if code == 3:
            return IndexError(f"sequence {at}'s cached tokens need more blocks than its block-table row's "
                              f"{tables.shape[1]}")  # fmt: skip
        if code == 4:
            row, col = divmod(at, tables.shape[1])
            return IndexError(f"block_tables[{row}, {col}] = {int(tables[row, col])} is not one of the cache's "
                              f"{d.num_slots // d.block_size} blocks")  # fmt: skip
        if code == 5:
            return IndexError(f"positions[{at}] = {int(positions[at])} is outside the rotary tables' "
                              f"{d.max_positions} positions")  # fmt: skip
        if code == 6:
            return IndexError(f"slots[{at}] = {int(slots[at])} is outside the cache's {d.num_slots} slots")
        if code == 7:
            return ValueError(f"parents[{at}] = {int(parents[at])} is neither -1 nor an earlier token of its "
                              "sequence (in a run of prompt tokens: the token before it)")  # fmt: skip
        return RuntimeError(f"the fused decoder failed with code {code}")


class FusedDecoder:
    """Every decoder layer of `model` over `kv_cache`, for up to `max_rows()` new tokens in one call (on a
    tensor-parallel rank: this rank's shard, summed with the other ranks' inside the call), and with
    `final_norm` the model's final norm after them (in the same call: the step's rows are still in cache,
    where a separate operator after the call would find its own code and data evicted by the weights)."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, final_norm: bool = False,
                 prompt_bf16: bool | None = None):  # fmt: skip
        if not applies(model, kv_cache):
            raise ValueError("the fused decoder does not apply to this model and cache (see `applies`)")
        layers = [layer_weights(layer) for layer in model.layers]
        attn, mlp = model.layers[0].attn, model.layers[0].mlp
        intermediate = sum(mlp.gate_up_proj.local_sizes) // 2
        shard = Shard(attn.num_heads, attn.num_kv_heads, intermediate, shared_segment(model.tp))
        norm = model.norm.weight if final_norm else None
        self.final_norm = final_norm
        prompt_bf16 = PROMPT_BF16 if prompt_bf16 is None else prompt_bf16
        self._layers = _Layers(model.cfg, model.rotary, layers, kv_cache, kv_cache.block_size, shard, norm, prompt_bf16)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] fp32 residual stream after the embedding
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] fp32: the last layer's output (normed with `final_norm`)
        """Run every layer over the step's new tokens (K/V written to their slots)."""
        if meta.parents is None:
            raise ValueError("the fused decoder needs the step's parents (AttentionMetadata.parents)")
        tables, runs = meta.block_tables, meta.prompt_tokens
        return self._layers.run(
            x, positions, meta.slot_mapping, meta.query_start, meta.seq_lens, tables, meta.parents, runs
        )

    def greedy(
        self,
        x: torch.Tensor,  # [B, hidden] fp32: each sequence's one new token, embedded
        positions: torch.Tensor,  # [B] int64
        meta: AttentionMetadata,  # a decode step's: one token per sequence
        head: GreedyHead,
        steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [steps, B, hidden] fp32 normed rows, [steps, B] int64 tokens
        """`steps` greedy decode steps in one call: each step's tokens are the argmax of its logits and the
        next step's input (K/V written to the slots of the block tables); see `_Layers.greedy`."""
        if not self.final_norm:
            raise ValueError("greedy steps need the fused decoder built with the final norm")
        return self._layers.greedy(x, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables, head, steps)

    def argmax_rows(
        self,
        x: torch.Tensor,  # [T, hidden] fp32 residual stream after the embedding
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        head: GreedyHead,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] fp32 normed rows, [T] int64 argmax tokens
        """Every layer over the step's new tokens, then each row's greedy token, in one call (`_Layers.argmax_rows`)."""
        if not self.final_norm or meta.parents is None:
            raise ValueError("argmax rows need the fused decoder built with the final norm and the step's parents")
        return self._layers.argmax_rows(
            x, positions, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables, meta.parents,
            meta.prompt_tokens, head,
        )  # fmt: skip


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
        slots = (num_blocks + scratch_per_seq * max_seqs) * block_size
        shape = (1, slots, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self._layers = _Layers(cfg, rotary, [layer], self, block_size)  # follows `reserve`'s new k and v

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
        kept = self.num_blocks + self.scratch_per_seq * self.max_seqs
        slots = (self.num_blocks + self.scratch_per_seq * seqs) * self.block_size
        k, v = (t.new_zeros((1, slots, *t.shape[2:])) for t in (self.k, self.v))
        k[:, : kept * self.block_size], v[:, : kept * self.block_size] = self.k, self.v
        self.k, self.v, self.max_seqs = k, v, seqs  # the next call builds the C view over them

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
        x = x.to(torch.float32, copy=True)  # `run` computes in place: the caller's rows stay as they were
        return self._layers.run(x, ints[0], ints[1], query_start, lens, table, ints[2])
