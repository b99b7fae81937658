"""A plain Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache: Llama,
Mistral and Qwen2 (q/k/v biases) checkpoints (engines/config.py says what each brings).

`LlamaModel.forward` takes a flat ragged batch: the new tokens of several sequences with their
positions and an `AttentionMetadata` saying where their K/V go and what each token may see. It returns
logits for the selected rows and the last-layer hidden states (post final norm) of every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import AttentionMetadata, paged_attention
from engines.config import ModelConfig
from engines.kv_cache import PagedKVCache
from engines.parallel import (
    ColumnParallelLinear,
    PackableLinear,
    RowParallelLinear,
    TensorParallel,
    balanced_shares,
)
from lyanna_kernels import fused_decoder, onednn_linear
from lyanna_kernels.dispatch import deterministic, use_triton
from lyanna_kernels.quantized_linear import (
    GROUP_SIZE,
    Int4Codes,
    QuantizedWeight,
    can_quantize,
    dequantized,
    int4_codes,
    pack_int4,
    quantize_int8,
)

if TYPE_CHECKING:
    from engines.gguf_weights import GGUFWeights


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as Llama does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if deterministic() and use_triton(x):
            from lyanna_kernels.batch_invariant import rms_norm  # (triton: the gpu extra)

            return rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the config's scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [T, 1, head_dim] in `dtype`."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query/key heads: x * cos + rotate_half(x) * sin (x: [T, heads, head_dim])."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query self-attention with a fused, column-parallel QKV projection (with Qwen2's q/k/v biases
    when the config has them)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.head_dim = cfg.head_dim
        # A rank holds whole KV heads and the query heads that read them (units: KV-head groups).
        groups = cfg.num_kv_heads
        self.num_kv_heads = tp.split(groups, "num_kv_heads")[1]
        self.num_heads = self.num_kv_heads * (cfg.num_heads // groups)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q_size, kv_size, kv_size], tp, dtype, units=groups, bias=cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp, dtype, units=groups)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [slots, kv_heads, head_dim] of this layer
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        T = x.shape[0]
        q_local, kv_local = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # RoPE and attention run in the cache's dtype (fp32 where the CPU has no bf16 arithmetic); a bias is
        # added in fp32 before that cast.
        qkv = self.qkv_proj(x).to(k_cache.dtype)
        # RoPE on q and k heads in one go: they are adjacent in the fused projection.
        heads = self.num_heads + self.num_kv_heads
        qk = apply_rope(qkv[:, : q_local + kv_local].view(T, heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_local + kv_local :]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v.view(T, self.num_kv_heads, self.head_dim))
        return self.o_proj(paged_attention(q, k_cache, v_cache, meta, self.scale))


def mlp_shares(cfg: ModelConfig, tp: TensorParallel) -> list[int] | None:
    """MLP channels per rank: an even split, unless the KV heads split unevenly; then the ranks with
    fewer heads take more channels, so every rank holds about the same weights (and no rank waits for
    another at each all-reduce). Channels move in groups of 32 where they divide (quantized shards then
    hold whole int4 groups). None: even."""
    if tp.world_size == 1:
        return None
    heads = tp.counts(cfg.num_kv_heads)
    if len(set(heads)) == 1:
        return None
    group = cfg.num_heads // cfg.num_kv_heads
    per_kv_head = (2 * group + 2) * cfg.head_dim * cfg.hidden_size  # its q and o rows/columns, its k and v
    granule = GROUP_SIZE if cfg.intermediate_size % GROUP_SIZE == 0 else 1
    units = cfg.intermediate_size // granule
    shares = balanced_shares(units, 3 * cfg.hidden_size * granule, [h * per_kv_head for h in heads])
    return [n * granule for n in shares]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        shares = mlp_shares(cfg, tp)
        size, hidden = cfg.intermediate_size, cfg.hidden_size
        self.gate_up_proj = ColumnParallelLinear(hidden, [size] * 2, tp, dtype, shares=shares)
        self.down_proj = RowParallelLinear(size, hidden, tp, dtype, shares=shares)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, tp, dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, tp, dtype)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream, in the model's compute dtype; the projections take their weights' dtype."""
        x = x + self.attn(self.input_norm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding when configured)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_wide: torch.Tensor | None = None
        self.lm_head_quant: QuantizedWeight | None = None  # the LM head's own quantized copy (see `quantize`)
        self.lm_head_exact: torch.Tensor | None = None  # fp32 models: its dequantized values instead
        self.compute_dtype = dtype  # of the residual stream and the norms (see `compute_in`)
        # (the cache's K tensor, its fused decoder or None where none applies), decided on first use
        self._fused: tuple[torch.Tensor, fused_decoder.FusedDecoder | None] | None = None
        # (the LM head's quantized copy, what greedy steps in one call read of it and the embeddings), on first use
        self._greedy_head: tuple[QuantizedWeight, fused_decoder.GreedyHead] | None = None
        self.enforce_eager = False  # True: always the eager layers (no fused CPU decoder)

    def compute_in(self, dtype: torch.dtype) -> None:
        """Keep the residual stream and the norms in `dtype` (fp32 on CPUs that would emulate bf16: fewer,
        cheaper ops per layer) while the projections keep the weights' dtype. Outputs keep the model's."""
        self.compute_dtype = dtype
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(dtype)
            elif isinstance(m, PackableLinear) and dtype == torch.float32:
                m.widen()  # many-row GEMMs (prefill chunks, large batches) run ~4x faster in fp32 there
        if dtype == torch.float32 and self.dtype != torch.float32 and self.lm_head_quant is None:
            self.lm_head_wide = self.lm_head_weight.data.float()

    @property
    def attn_kv_heads(self) -> int:
        """KV heads held by this rank (the KV cache's width)."""
        return self.layers[0].attn.num_kv_heads

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden] output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        """LM head in the model dtype (or quantized), returned in fp32 for sampling."""
        if self.lm_head_quant is not None:
            return self.lm_head_quant.matmul(hidden, torch.float32)  # each row's logits whatever the rows
        if self.lm_head_exact is not None:
            return F.linear(hidden.float(), self.lm_head_exact)
        if deterministic() and use_triton(hidden):
            from lyanna_kernels.batch_invariant import linear  # (triton: the gpu extra)

            return linear(hidden, self.lm_head_weight).float()
        return onednn_linear.linear(hidden, self.lm_head_weight, self.lm_head_packed, self.lm_head_wide).float()

    def prepack(self) -> None:
        """Lay out every projection for the CPU's fastest kernel (no-op on CUDA and in fp32)."""
        for m in self.modules():
            if isinstance(m, PackableLinear):
                m.prepack()
        if self.lm_head_quant is None and self.lm_head_exact is None:
            self.lm_head_packed = onednn_linear.prepack(self.lm_head_weight.data)

    def drop_layer_copies(self) -> None:
        """Release the layers' fp32 weight copies for many-row GEMMs (`PackableLinear.wide`): for a model whose
        every step the fused CPU decoder takes, the eager layers that read them never run (the LM head keeps
        its copy: many rows' logits use it)."""
        for m in self.layers.modules():
            if isinstance(m, PackableLinear):
                m.wide = None

    def quantize(self, kind: str) -> None:
        """Weight-only quantization ("int4" or "int8") of every projection's local shard and of the LM head
        (a copy: the embedding it may be tied to stays as it is, for lookups and the drafters)."""
        for m in self.modules():
            if isinstance(m, PackableLinear):
                m.quantize(kind)
        head = self.lm_head_weight.data
        self._take_head(int4_codes(head) if kind == "int4" and can_quantize("int4", head) else quantize_int8(head))

    def _take_head(self, weight: QuantizedWeight | Int4Codes) -> None:
        """The LM head's quantized copy (dequantized values in an fp32 model, as `PackableLinear.take`)."""
        if self.dtype == torch.float32:
            self.lm_head_exact = dequantized(weight)
            return
        self.lm_head_quant = pack_int4(weight) if isinstance(weight, Int4Codes) else weight
        self.lm_head_packed = None
        self.lm_head_wide = None

    @torch.no_grad()
    def load_gguf(self, weights: GGUFWeights) -> None:
        """Replace the projections with a GGUF's own quantized weights (after `load_hf_weights` from its
        dequantized conversion): Q4_0/Q4_1 load as int4 exactly as stored; other types (Q8_0 among them)
        are quantized again from their stored values (int8)."""

        def all_int4(names: list[str]) -> bool:
            return all(weights.kind(n) in ("Q4_0", "Q4_1") for n in names)

        # The loaded weights are transformers' dequantization of this same file: the first query projection
        # must come out of the file as loaded (else its rows are in another order than `weights` assumes).
        name, (start, end) = "model.layers.0.self_attn.q_proj.weight", self.layers[0].attn.qkv_proj.ranges[0]
        loaded = self.layers[0].attn.qkv_proj.weight[: end - start].float()
        stored = weights.dequantized(name)[start:end]
        if not torch.allclose(loaded, stored, rtol=1e-2, atol=1e-2 * float(stored.abs().max())):
            raise ValueError(
                f"{weights.path}'s {name} does not match its conversion (architecture "
                f"{weights.architecture!r}): its rows are not in the order this loader assumes"
            )

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            fused = [
                (layer.attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                (layer.mlp.gate_up_proj, [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]),
            ]
            for linear, names in fused:
                if all_int4(names):
                    linear.load_int4_segments([weights.int4(n) for n in names])
                else:
                    linear.quantize("int8")
            split_inputs = [(layer.attn.o_proj, "self_attn.o_proj"), (layer.mlp.down_proj, "mlp.down_proj")]
            for linear, short in split_inputs:
                name = p + short + ".weight"
                if all_int4([name]):
                    linear.load_int4_full(weights.int4(name))
                else:
                    linear.quantize("int8")
        head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        if head in weights.tensors and all_int4([head]):
            self._take_head(weights.int4(head))
        else:  # from the stored values (a Q8_0 head's groups of 32 come back as stored in the integer-dot layout)
            stored = weights.dequantized(head) if head in weights.tensors else self.lm_head_weight.data
            self._take_head(quantize_int8(stored))

    def fused_decoder(self, kv_cache: PagedKVCache, num_tokens: int) -> fused_decoder.FusedDecoder | None:
        """The one-call CPU decoder (lyanna_kernels/fused_decoder.py) for a step of `num_tokens` new tokens over
        `kv_cache`, where it applies; None: the eager layers run."""
        if self.enforce_eager or not 0 < num_tokens <= fused_decoder.max_rows():
            return None
        if self._fused is None or self._fused[0] is not kv_cache.k:
            applies = fused_decoder.applies(self, kv_cache)
            fused = fused_decoder.FusedDecoder(self, kv_cache, final_norm=True) if applies else None
            self._fused = (kv_cache.k, fused)
        return self._fused[1]

    def takes_greedy_steps(self, kv_cache: PagedKVCache) -> bool:
        """Whether `greedy_steps` runs several decode steps in one call over `kv_cache` (for batches the fused
        decoder takes): a bf16 model on one rank with its LM head in the interleaved integer-dot layout."""
        head = self.lm_head_quant
        if head is None or head.layout != "vnni" or self.dtype != torch.bfloat16 or self.tp.world_size > 1:
            return False
        return self.fused_decoder(kv_cache, 1) is not None

    @torch.inference_mode()
    def greedy_steps(
        self,
        input_ids: torch.Tensor,  # [B] each sequence's one new token
        positions: torch.Tensor,  # [B]
        meta: AttentionMetadata,  # a decode step's (one token per sequence), its blocks allocated for all steps
        kv_cache: PagedKVCache,
        steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # hidden [steps, B, hidden], tokens [steps, B] int64
        """`steps` greedy decode steps in one call of the fused CPU decoder, the LM head and argmax in it too:
        exactly what as many `forward`s with an argmax of their logits give, K/V written the same. None where
        that call does not apply (no fused decoder for this model and cache, an LM head in another layout,
        weights other than bf16, tensor parallelism): then run `forward` step by step."""
        head, rows = self.lm_head_quant, input_ids.shape[0]
        if not self.takes_greedy_steps(kv_cache) or meta.parents is None or head is None:
            return None
        fused = self.fused_decoder(kv_cache, rows)
        if fused is None:
            return None
        x = self.embed_tokens(input_ids).float()
        hidden, tokens = fused.greedy(x, positions, meta, self._greedy_head_for(head), steps)
        return hidden.to(self.dtype), tokens

    @torch.inference_mode()
    def argmax_rows(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,  # any step's the fused decoder takes (draft trees, several rows a sequence)
        kv_cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # hidden [T, hidden], tokens [T] int64
        """`forward` with every row's greedy token instead of its logits, the LM head and argmax in the fused
        decoder's call: the same hidden states and K/V, and the tokens an argmax of `forward`'s logits gives.
        None where `greedy_steps` would be (see there)."""
        head = self.lm_head_quant
        if not self.takes_greedy_steps(kv_cache) or meta.parents is None or head is None:
            return None
        fused = self.fused_decoder(kv_cache, input_ids.shape[0])
        if fused is None:
            return None
        x = self.embed_tokens(input_ids).float()
        hidden, tokens = fused.argmax_rows(x, positions, meta, self._greedy_head_for(head))
        return hidden.to(self.dtype), tokens

    def greedy_head(self) -> fused_decoder.GreedyHead | None:
        """The fused decoder's view of the LM head and embeddings (`greedy_steps`'), or None where the head has
        no integer-dot layout."""
        head = self.lm_head_quant
        return None if head is None or head.layout != "vnni" else self._greedy_head_for(head)

    def _greedy_head_for(self, head: QuantizedWeight) -> fused_decoder.GreedyHead:
        """The fused decoder's view of the LM head and embeddings, rebuilt when the head was swapped."""
        if self._greedy_head is None or self._greedy_head[0] is not head:
            self._greedy_head = (head, fused_decoder.GreedyHead(head, self.embed_tokens.weight.data))
        return self._greedy_head[1]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        logits_indices: torch.Tensor | None = None,  # [N] rows of T that need logits; None = all
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [N, vocab] fp32, hidden [T, hidden]
        fused = self.fused_decoder(kv_cache, input_ids.shape[0]) if meta.parents is not None else None
        if fused is not None:  # every layer and the final norm in one call
            hidden = fused(self.embed_tokens(input_ids).float(), positions, meta).to(self.dtype)
        else:
            if kv_cache.k.dtype == torch.int8:
                raise RuntimeError("an int8 KV cache is read by the fused CPU decoder only; this step cannot take it")
            x = self.embed_tokens(input_ids).to(self.compute_dtype)
            cos, sin = self.rotary(positions, kv_cache.k.dtype)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv_cache.k[i], kv_cache.v[i], meta)
            hidden = self.norm(x).to(self.dtype)
        selected = hidden if logits_indices is None else hidden[logits_indices]
        return self.compute_logits(selected), hidden

    @torch.no_grad()
    def load_hf_weights(self, get: Callable[[str], torch.Tensor]) -> None:
        """Fill parameters from Hugging Face Llama / Mistral / Qwen2 tensor names (`model.layers.{i}.self_attn.
        q_proj.weight`, ...; Qwen2's q/k/v biases too); `get(name)` returns a full tensor."""

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.dtype)

        self.embed_tokens.weight.copy_(cast(get("model.embed_tokens.weight")))
        self.norm.weight.copy_(cast(get("model.norm.weight")))
        if self.lm_head is not None:
            self.lm_head.copy_(cast(get("lm_head.weight")))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.weight.copy_(cast(get(p + "input_layernorm.weight")))
            layer.post_attn_norm.weight.copy_(cast(get(p + "post_attention_layernorm.weight")))
            attn = p + "self_attn."
            biases = [get(attn + n + "_proj.bias") for n in "qkv"] if self.cfg.qkv_bias else None
            layer.attn.qkv_proj.load_segments([cast(get(attn + n + "_proj.weight")) for n in "qkv"], biases)
            layer.attn.o_proj.load_full(cast(get(attn + "o_proj.weight")))
            mlp = p + "mlp."
            layer.mlp.gate_up_proj.load_segments([cast(get(mlp + n + "_proj.weight")) for n in ("gate", "up")])
            layer.mlp.down_proj.load_full(cast(get(mlp + "down_proj.weight")))
