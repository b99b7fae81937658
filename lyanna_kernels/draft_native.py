"""A drafter's host-heavy pieces in native calls (lyanna_kernels/csrc/draft_native.c), for Lyanna beside the fused CPU
decoder: `DraftFuse`, its input fusion W_fuse [norm(h); norm(E(t))], and `DraftChains`, the LM head over every
request's trajectory and token-info tree sampling at width 1 (the width-1 trees the policy asks for on CPU).

They compute what `LyannaDraftModel._fuse`, `LyannaDraftModel.logits` and `build_subtrees` at width 1 compute (the
fusion and the logits the same numbers, up to the order of a norm's sum; tokens and scores up to the rounding of
token information's sums), each in one call instead of some tens of tensor operations: on a CPU those run in an
interpreter the target's forward has just pushed out of the caches, and cost more than the drafter's layer.
"""

from __future__ import annotations

import ctypes

import torch

from lyanna_kernels import integer_dot
from lyanna_kernels.quantized_linear import QuantizedWeight

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _DraftFuse(ctypes.Structure):
    _fields_ = [
        ("hidden_norm", _p),
        ("embed_norm", _p),
        ("embed", _p),
        ("vocab", _i64),
        ("hidden", _i64),
        ("eps", ctypes.c_float),
        ("codes", _p),
        ("scales", _p),
        ("mins", _p),
        ("bits", _i64),
    ]


class _ChainHead(ctypes.Structure):
    _fields_ = [
        ("codes", _p),
        ("scales", _p),
        ("mins", _p),
        ("bits", _i64),
        ("vocab", _i64),
        ("hidden", _i64),
        ("projected", _p),
        ("gram", _p),
        ("w2", _p),
        ("rank", _i64),
        ("target_vocab", _i64),
        ("eps", ctypes.c_float),
        ("d2t", _p),
    ]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous()


class DraftFuse:
    """W_fuse [norm_h(h); norm_e(e)] in one call (LyannaDraftModel._fuse): norms' weights, the embeddings the token
    rows read and the interleaved int8 projection. Holds every tensor the C view points into."""

    def __init__(self, hidden_norm: torch.Tensor, embed_norm: torch.Tensor, eps: float, embed: torch.Tensor,
                 fuse: QuantizedWeight):  # fmt: skip
        if fuse.layout != "vnni" or fuse.mins is None:
            raise ValueError(f"the fusion needs its projection in the interleaved layout, not {fuse.layout!r}")
        vocab, hidden = embed.shape
        if fuse.in_features != 2 * hidden or fuse.out_features != hidden:
            raise ValueError(f"a fusion of {fuse.in_features} -> {fuse.out_features} does not fit rows of {hidden}")
        self.hidden = hidden
        self._held = held = [_bf16(hidden_norm), _bf16(embed_norm), _bf16(embed), fuse.data, fuse.scales, fuse.mins]
        self.struct = _DraftFuse(
            held[0].data_ptr(), held[1].data_ptr(), held[2].data_ptr(), vocab, hidden, eps, fuse.data.data_ptr(),
            fuse.scales.data_ptr(), fuse.mins.data_ptr(), fuse.bits,
        )  # fmt: skip

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden] and each row's next token [rows] (CPU tensors) -> the fused rows [rows, hidden]
        fp32 (bf16 values)."""
        rows = hidden.shape[0]
        if hidden.shape != (rows, self.hidden) or tokens.shape != (rows,):
            raise ValueError(f"hidden {list(hidden.shape)} and tokens must hold the same rows of {self.hidden}")
        if hidden.device.type != "cpu" or tokens.device.type != "cpu":
            raise ValueError(f"the native fusion reads CPU tensors, not {hidden.device} and {tokens.device}")
        x, ids = _bf16(hidden), tokens.to(torch.int64).contiguous()
        out = torch.empty(rows, self.hidden)
        code = integer_dot.library().draft_fuse_rows(
            ctypes.byref(self.struct), x.data_ptr(), ids.data_ptr(), rows, out.data_ptr(), torch.get_num_threads()
        )
        if code == -1:
            raise MemoryError("draft_fuse_rows: out of memory")
        if code > 0:
            raise IndexError(f"token {int(ids[code - 1])} has no embedding")
        return out


class DraftChains:
    """A drafter's LM head (the interleaved int8 layout) with its token information (`DenseTokenInfo`'s tensors,
    or none) and hot-token map, for `__call__`. Holds every tensor the C view points into."""

    def __init__(self, head: QuantizedWeight, target_vocab: int, token_info=None, d2t: torch.Tensor | None = None):
        if head.layout != "vnni" or head.mins is None:
            raise ValueError(f"draft chains need the head in the interleaved layout, not {head.layout!r}")
        self.vocab, self.hidden = head.out_features, head.in_features
        held = [head.data, head.scales, head.mins]
        projected = gram = w2 = None
        rank, eps = 0, 0.0
        if token_info is not None:
            tensors = (token_info.projected, token_info.gram, token_info.w2)
            projected, gram, w2 = (t.float().contiguous() for t in tensors)
            rank, eps = projected.shape[1], token_info.eps
            if w2.shape != (rank, self.vocab) or projected.shape[0] != target_vocab:
                raise ValueError(f"token information {list(w2.shape)} does not fit a head of {self.vocab} rows")
            held += [projected, gram, w2]
        self.d2t = None if d2t is None else d2t.to(torch.int64).contiguous()
        if self.d2t is not None:
            if self.d2t.shape != (self.vocab,):
                raise ValueError(f"d2t must have the head's {self.vocab} entries, not {list(self.d2t.shape)}")
            held.append(self.d2t)
        self._held = held
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.struct = _ChainHead(
            head.data.data_ptr(), head.scales.data_ptr(), head.mins.data_ptr(), head.bits, self.vocab, self.hidden,
            ptr(projected), ptr(gram), ptr(w2), rank, target_vocab, eps, ptr(self.d2t),
        )  # fmt: skip

    def __call__(
        self, hidden: torch.Tensor, steps: list[int], roots: list[int]
    ) -> tuple[torch.Tensor, list[int], list[float]]:
        """hidden [rows, hidden] (each request's trajectory, request after request: steps[b] rows for request b)
        -> the raw logits [rows, vocab] fp32, and each row's drafted target token and its chain's joint
        probability up to it."""
        rows = sum(steps)
        if hidden.shape != (rows, self.hidden) or len(steps) != len(roots) or min(steps, default=0) < 0:
            raise ValueError(f"hidden {list(hidden.shape)} must hold the {rows} rows of steps {steps}")
        if hidden.device.type != "cpu":
            raise ValueError(f"native draft chains read CPU tensors, not {hidden.device}")
        x = hidden.to(torch.bfloat16).contiguous()
        logits = torch.empty(rows, self.vocab)
        tokens = torch.empty(rows, dtype=torch.int64)
        scores = torch.empty(rows)
        meta = torch.tensor([*steps, *roots], dtype=torch.int64)
        n = len(steps)
        code = integer_dot.library().draft_chains(
            ctypes.byref(self.struct), x.data_ptr(), n, meta.data_ptr(), meta.data_ptr() + 8 * n, logits.data_ptr(),
            tokens.data_ptr(), scores.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise MemoryError("draft_chains: out of memory")
        if code > 0:
            root = roots[code - 1]
            raise IndexError(f"request {code - 1}'s root {root} (or a token its head maps to) is not a target token")
        return logits, tokens.tolist(), scores.tolist()  # the trees are built on the host (CPU tensors only)
