"""EAGLE-2-style draft model, the baseline Lyanna is measured against.

    h_1     = Layer(fuse(H_0, E(t_1)))       the same first step as Lyanna
    h_{i+1} = Layer(fuse(h_i, E(t_{i+1})))   every later step takes the token drafted before it
    l_i     = h_i · W_head                   one LM-head GEMM per step, over that step's frontier

Because the token enters every step, a tree needs one drafter forward per depth over all frontier
nodes (each with its own token), and the LM head runs once per depth. It shares the decoder layer,
the hot-vocabulary head and the training unroll with `LyannaDraftModel`; only the recurrence
differs. There is no token info: the token is in the hidden state already.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel


class EagleDraftModel(LyannaDraftModel):
    """One decoder layer over fuse(feature, token embedding) at every step."""

    kind = "eagle"

    def __init__(
        self,
        cfg: LyannaConfig,
        embedding: torch.Tensor,
        lm_head: torch.Tensor,
        hot_tokens: torch.Tensor | None = None,
        final_norm: torch.Tensor | None = None,
    ):
        cfg = replace(cfg, use_fusion=True, use_token_info=False, chain_fusion=False)
        super().__init__(cfg, embedding, lm_head, hot_tokens, final_norm)

    def chain_input(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fuse(h_i, E(t_{i+1})): the previous step's output with the token drafted from it."""
        return self.fuse_pair(h, tokens)
