"""Lyanna's token-info embedding E'(t) = RMSNorm(W_E[t] · W1 · W2), and its two inference forms.

W_E is the target's frozen input embedding; W1 [hidden, rank] and W2 [rank, vocab_out] are trained.
The result is an additive offset on the drafter's logits (vocab_out = the drafter's output
vocabulary: the full vocabulary, or a hot subset when the LM head is restricted).

At inference, `DenseTokenInfo` computes what training optimised for every token (fp32, with W_E · W1
precomputed: a row gather, one [F, rank] x [rank, vocab_out] product and the norm per call);
`TokenInfoTable` materialises the product for the most frequent ("hot") tokens only, a row lookup, and
gives other tokens no offset (cheaper, but it accepts less: docs/drafters.md).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from engines.model import RMSNorm


class TokenInfoEmbedding(nn.Module):
    """Trainable low-rank token → logit-offset map over the frozen target embedding."""

    def __init__(self, target_embedding: torch.Tensor, rank: int, vocab_out: int, eps: float = 1e-6):
        super().__init__()
        hidden = target_embedding.shape[1]
        self.register_buffer("w_e", target_embedding.detach(), persistent=False)  # [vocab, hidden], frozen
        self.w1 = nn.Parameter(torch.randn(hidden, rank, dtype=target_embedding.dtype) * hidden**-0.5)
        self.w2 = nn.Parameter(torch.randn(rank, vocab_out, dtype=target_embedding.dtype) * rank**-0.5)
        self.norm = RMSNorm(vocab_out, eps, target_embedding.dtype)
        self.norm.weight.requires_grad_(True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [F] -> [F, vocab_out]
        return self.norm(self.w_e[tokens] @ self.w1 @ self.w2)

    @torch.no_grad()
    def collapse(self, hot_tokens: torch.Tensor) -> TokenInfoTable:
        """The lookup table over `hot_tokens` ([K] token ids), rows equal to `forward` on them."""
        vocab = self.w_e.shape[0]
        row_of = torch.full((vocab,), -1, dtype=torch.long, device=hot_tokens.device)
        row_of[hot_tokens] = torch.arange(len(hot_tokens), device=hot_tokens.device)
        table = torch.cat(
            [self(hot_tokens), torch.zeros(1, self.w2.shape[1], dtype=self.w2.dtype, device=self.w2.device)]
        )
        return TokenInfoTable(table, row_of)


class DenseTokenInfo:
    """`TokenInfoEmbedding` for inference: every token's offsets as training computes them, in fp32, with the
    target-embedding half of the low-rank product precomputed ([vocab, rank]).

    The norm runs in rank space: for a row p of the projection, RMS(p · W2)^2 = p · G · p with
    G = W2 · W2^T / vocab_out [rank, rank], so RMSNorm(p · W2) = (p / RMS) · (W2 ⊙ weight): one product with
    the norm's weight folded into W2, and no pass over the vocabulary-wide rows."""

    def __init__(self, embedding: TokenInfoEmbedding):
        with torch.no_grad():
            self.projected = embedding.w_e.float() @ embedding.w1.float()  # [vocab, rank]
            w2 = embedding.w2.detach().float()  # [rank, vocab_out]
            self.gram = w2 @ w2.T / w2.shape[1]  # [rank, rank]
            self.w2 = w2 * embedding.norm.weight.detach().float()  # the norm's weight folded in
        self.eps = embedding.norm.eps

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:  # [F] -> [F, vocab_out] fp32
        p = self.projected[tokens]
        mean_square = ((p @ self.gram) * p).sum(-1, keepdim=True)  # of p · W2's entries
        return (p * torch.rsqrt(mean_square + self.eps)) @ self.w2

    @property
    def nbytes(self) -> int:
        """Memory of the precomputed product, W2 (with the norm's weight) and the Gram matrix."""
        return sum(t.numel() * t.element_size() for t in (self.projected, self.w2, self.gram))


class TokenInfoTable:
    """Collapsed token info: one precomputed row per hot token, zeros for every other token."""

    def __init__(self, table: torch.Tensor, row_of: torch.Tensor):
        self.table = table  # [K + 1, vocab_out]; the last row is the zero row for cold tokens
        self.row_of = row_of  # [vocab] row index, -1 for cold tokens

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:  # [F] -> [F, vocab_out]
        return self.table[self.row_of[tokens]]  # -1 picks the zero row

    @property
    def num_hot(self) -> int:
        """Tokens with a row."""
        return self.table.shape[0] - 1

    @property
    def nbytes(self) -> int:
        """Memory of the table and the index."""
        return self.table.numel() * self.table.element_size() + self.row_of.numel() * self.row_of.element_size()


def tokens_by_frequency(counts: Counter, k: int) -> list[int]:
    """The `k` most frequent token ids, most frequent first (ties broken by id)."""
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def hot_tokens(counts: Counter, k: int) -> torch.Tensor:
    """The `k` most frequent token ids, as a tensor sorted by id."""
    return torch.tensor(sorted(tokens_by_frequency(counts, k)), dtype=torch.long)
