"""Lyanna's draft model: one trainable decoder layer that auto-regresses on hidden states.

    h_1     = Layer(fuse(h_0, E(t_1)))    h_0: the target's last hidden state, t_1: the bonus token
    h_{i+1} = Layer(h_i)                  no token enters the trajectory after the first step
    l_i     = h_i · W_head                one LM-head GEMM over [h_1 .. h_N], optionally over the
                                          hot vocabulary only (a draft -> target token map, d2t)
    l'_i    = l_i + RMSNorm(E'(t_{i-1}))  token info, added only when sampling (token_info.py)

Context positions are teacher-forced the same way as the first step: position j holds
fuse(H_j, E(t_{j+1})), so the layer's keys over the context are what it sees at inference.
`unroll` trains every position's chain at once: step s of the chain anchored at j attends to the
context keys 0..j and to its own chain's keys of steps 2..s (a shifted-diagonal pattern), which is
exactly what `draft_chain` computes one anchor at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import ModelConfig
from engines.drafters.token_info import TokenInfoEmbedding
from engines.model import MLP, RMSNorm, RotaryEmbedding, apply_rope
from engines.parallel import ColumnParallelLinear, PackableLinear, RowParallelLinear, TensorParallel
from lyanna_kernels import onednn_linear
from lyanna_kernels.quantized_linear import QuantizedWeight, quantize_int8

if TYPE_CHECKING:
    from lyanna_kernels.fused_decoder import FusedDraftLayer


@dataclass(frozen=True)
class LyannaConfig:
    """Shape of the drafter (taken from the target) and the switches of the paper's ablations."""

    target: ModelConfig
    token_info_rank: int = 64
    use_fusion: bool = True  # first-step fusion of the bonus token's embedding
    use_token_info: bool = True  # token info added to the logits when sampling
    draft_vocab: int | None = None  # size of the hot vocabulary the LM head covers (None: all tokens)
    chain_fusion: bool = False  # steps >= 2 read fuse(h, a learned token-free embedding): step 1's input space


class LyannaDraftModel(nn.Module):
    """Fuse projection, one decoder layer, output norm and token info; embedding and LM head frozen."""

    kind = "lyanna"

    def __init__(
        self,
        cfg: LyannaConfig,
        embedding: torch.Tensor,
        lm_head: torch.Tensor,
        hot_tokens: torch.Tensor | None = None,
        final_norm: torch.Tensor | None = None,
    ):
        super().__init__()
        t = cfg.target
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = t.num_heads, t.num_kv_heads, t.head_dim
        dtype = embedding.dtype
        self.register_buffer("embed", embedding.detach(), persistent=False)  # [vocab, hidden]
        if cfg.draft_vocab is not None:
            if hot_tokens is None:  # placeholder until the checkpoint's map is loaded
                hot_tokens = torch.arange(cfg.draft_vocab)
            if hot_tokens.numel() != cfg.draft_vocab:
                raise ValueError(f"draft_vocab={cfg.draft_vocab} but {hot_tokens.numel()} hot tokens given")
            # Draft vocabulary index -> target token id; saved with the weights.
            self.register_buffer("d2t", hot_tokens.to(torch.long).clone(), persistent=True)
        else:
            self.d2t = None
        self.lm_head_full = lm_head.detach()
        self.register_buffer("lm_head", self._head_rows(), persistent=False)  # [draft vocab, hidden]
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_quant: QuantizedWeight | None = None  # int8 rows of the head (fused_draft_layer)
        tp = TensorParallel()
        self.fuse = ColumnParallelLinear(2 * t.hidden_size, [t.hidden_size], tp, dtype)
        # Both fuse inputs are normalised first: target states are ~15x the embeddings' scale here.
        self.hidden_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype)
        self.embed_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype)
        self.input_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype)
        q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
        self.qkv_proj = ColumnParallelLinear(t.hidden_size, [q, kv, kv], tp, dtype)
        self.o_proj = RowParallelLinear(q, t.hidden_size, tp, dtype)
        self.post_attn_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype)
        self.mlp = MLP(t, tp, dtype)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(replace(t, num_layers=1))
        vocab_out = cfg.draft_vocab or embedding.shape[0]  # token info lives in the drafter's logit space
        self.token_info = TokenInfoEmbedding(embedding, cfg.token_info_rank, vocab_out) if cfg.use_token_info else None
        if cfg.chain_fusion and not cfg.use_fusion:
            raise ValueError("chain_fusion feeds the later steps through the fuse projection: it needs use_fusion")
        # The later steps' stand-in for a token: one learned vector, so the trajectory stays token-free.
        self.chain_embed = nn.Parameter(embedding.float().mean(0).to(dtype)) if cfg.chain_fusion else None
        self.reset_parameters()
        if final_norm is not None:
            # Start the output norm at the target's final norm: the states it predicts carry the same
            # per-dimension scales (a few dimensions are 10-20x the rest), which plain unit init
            # would need tens of thousands of Adam steps to reach.
            with torch.no_grad():
                self.norm.weight.copy_(final_norm)

    def _head_rows(self) -> torch.Tensor:
        return self.lm_head_full if self.d2t is None else self.lm_head_full[self.d2t]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.d2t is not None:  # the hot-token map arrived: restrict the head to it
            self.lm_head = self._head_rows().to(self.embed.device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Small random projections, unit norms; every parameter trainable."""
        for p in (
            self.fuse.weight,
            self.qkv_proj.weight,
            self.o_proj.weight,
            self.mlp.gate_up_proj.weight,
            self.mlp.down_proj.weight,
        ):
            p.normal_(0.0, p.shape[1] ** -0.5)
        for p in self.parameters():
            p.requires_grad_(True)

    # ---- pieces -----------------------------------------------------------------------------
    def fused_input(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """fuse(H_j, E(t_{j+1})) for each position ([n, hidden], [n] -> [n, hidden])."""
        if not self.cfg.use_fusion:
            return hidden
        return self.fuse_pair(hidden, next_tokens)

    def fuse_pair(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fuse(h, E(t)) = W_fuse [norm(h); norm(E(t))]."""
        return self._fuse(hidden, self.embed[tokens])

    def _fuse(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return self.fuse(torch.cat([self.hidden_norm(hidden), self.embed_norm(embeddings)], dim=-1))

    def chain_input(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's input at draft steps >= 2 from the previous step's output and the token drafted
        there. No token enters Lyanna's trajectory: it reads the hidden state alone, or with `chain_fusion`
        fuse(h, the learned token-free embedding), the projection step 1 reads (target state, token) through."""
        if self.chain_embed is None:
            return h
        return self._fuse(h, self.chain_embed.expand_as(h))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(self.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = self.rotary(positions, x.dtype)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residuals, MLP and the output norm: the predicted (post-norm) target hidden state."""
        x = x + self.o_proj(attn.reshape(x.shape[0], -1))
        return self.norm(x + self.mlp(self.post_attn_norm(x)))

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:  # [..., kv_heads, d] -> [..., heads, d]
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=-2)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Raw draft logits of hidden states, one GEMM for all steps ([n, hidden] -> [n, draft vocab] fp32).
        Column i is target token `d2t[i]` with a hot vocabulary, token i otherwise."""
        if self.lm_head_quant is not None:
            return self.lm_head_quant.matmul(h, torch.float32)
        return onednn_linear.linear(h, self.lm_head, self.lm_head_packed).float()

    def prepack(self) -> None:
        """For inference only: lay the projections out for the CPU's fastest kernel (packed copies
        take no gradients, so training never calls this)."""
        for m in self.modules():
            if isinstance(m, PackableLinear):
                m.prepack()
        self.lm_head_packed = onednn_linear.prepack(self.lm_head)

    # ---- training: every anchor's chain at once --------------------------------------------------
    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Predictions of every chain anchored at positions 0..n-2 for `steps` steps.

        hidden: [n, hidden] the target's hidden states H_0..H_{n-1}; tokens: [n] t_0..t_{n-1}.
        Returns [h^1, .., h^steps], each [n-1, hidden]; h^s[j] predicts H_{j+s}.
        """
        n = hidden.shape[0] - 1
        pos = torch.arange(n, device=hidden.device)
        x = self.fused_input(hidden[:-1], tokens[1:])
        q, k1, v1 = self._qkv(x, pos)
        ctx_k, ctx_v = self._expand_kv(k1).transpose(0, 1), self._expand_kv(v1).transpose(0, 1)  # [heads, n, d]
        causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1), ctx_k, ctx_v, attn_mask=causal)
        h = self._finish(x, out.transpose(0, 1))
        preds = [h]
        diag_k: list[torch.Tensor] = []  # [n, heads, d] per step >= 2: chain j's own keys
        diag_v: list[torch.Tensor] = []
        scale = 1.0 / math.sqrt(self.head_dim)
        for s in range(2, steps + 1):
            next_tokens = torch.cat([tokens[s:], tokens.new_zeros(s - 1)])  # t_{j+s} (padding past the end)
            x = self.chain_input(h, next_tokens)
            q, k, v = self._qkv(x, pos + s - 1)
            diag_k.append(self._expand_kv(k))
            diag_v.append(self._expand_kv(v))
            qh = q.transpose(0, 1)  # [heads, n, d]
            ctx_scores = (qh @ ctx_k.transpose(1, 2)) * scale  # [heads, n, n]
            ctx_scores = ctx_scores.masked_fill(~causal, float("-inf"))
            own = torch.stack([(q * dk).sum(-1) for dk in diag_k], dim=-1).transpose(0, 1) * scale  # [heads, n, s-1]
            weights = torch.softmax(torch.cat([ctx_scores, own], dim=-1).float(), dim=-1).to(q.dtype)
            out = weights[..., :n] @ ctx_v  # [heads, n, d]
            own_v = torch.stack(diag_v, dim=-2).transpose(0, 1)  # [heads, n, s-1, d]
            out = out + (weights[..., n:].unsqueeze(-1) * own_v).sum(-2)
            h = self._finish(x, out.transpose(0, 1))
            preds.append(h)
        return preds

    # ---- inference: one chain over a context -------------------------------------------------
    @torch.no_grad()
    def draft_chain(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """The trajectory h_1..h_steps after a context.

        hidden: [p, hidden] H_0..H_{p-1}; tokens: t_0..t_p (t_p: the bonus token), followed by the
        chain's own tokens t_{p+1}..t_{p+steps-1} for models whose later steps take a token (EAGLE).
        Returns [steps, hidden]; h_i predicts H_{p-1+i}.
        """
        p = hidden.shape[0]
        x = self.fused_input(hidden, tokens[1 : p + 1])  # the last row is the first draft step
        q, k, v = self._qkv(x, torch.arange(p, device=hidden.device))
        keys, values = [self._expand_kv(k)], [self._expand_kv(v)]
        causal = torch.ones(p, p, dtype=torch.bool, device=hidden.device).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1), attn_mask=causal
        )
        h = self._finish(x, out.transpose(0, 1))[-1:]
        traj = [h]
        for i in range(1, steps):
            x = self.chain_input(h, tokens[p + i : p + i + 1])
            q, k, v = self._qkv(x, torch.tensor([p - 1 + i], device=hidden.device))
            keys.append(self._expand_kv(k))
            values.append(self._expand_kv(v))
            K, V = torch.cat(keys).transpose(0, 1), torch.cat(values).transpose(0, 1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), K, V)
            h = self._finish(x, out.transpose(0, 1))
            traj.append(h)
        return torch.cat(traj)


MAX_DRAFT_DEPTH = 64  # SpecParams' largest depth


def fused_draft_layer(model: LyannaDraftModel, kv_cache, max_seqs: int) -> FusedDraftLayer:
    """Quantize the drafter's projections and LM head to int8 (groups of 32, as the target's kernels take them)
    and return its decoder layer in one call over a cache of one layer beside the target's `kv_cache`
    (the same block tables)."""
    from lyanna_kernels.fused_decoder import FusedDraftLayer, LayerWeights

    for linear in (model.fuse, model.qkv_proj, model.o_proj, model.mlp.gate_up_proj, model.mlp.down_proj):
        linear.quantize("int8")
    model.lm_head_quant = quantize_int8(model.lm_head)
    layer = LayerWeights(model.input_norm.weight, model.post_attn_norm.weight, model.qkv_proj, model.o_proj,
                         model.mlp.gate_up_proj, model.mlp.down_proj)  # fmt: skip
    bs = kv_cache.block_size
    # The later draft steps' positions past a request's full context blocks (a copy of its partial last
    # block, then up to MAX_DRAFT_DEPTH positions: EAGLE's frontier paths).
    scratch = -(-(MAX_DRAFT_DEPTH + bs - 1) // bs)
    return FusedDraftLayer(model.cfg.target, model.rotary, layer, kv_cache.num_blocks, bs, kv_cache.value_dtype,
                           scratch, max_seqs)  # fmt: skip
