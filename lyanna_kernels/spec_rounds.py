"""Rounds of Lyanna's width-1 speculation beside the fused CPU decoder, several in one call (csrc/spec_rounds.c).

A round drafts a chain for every sequence (the drafter's trajectory, its hot-vocabulary head and token-info
sampling), verifies the chains in one forward of the target (its final norm, LM head and argmax in the call),
accepts what the argmax confirms plus the bonus token, and runs the drafter's catch-up over the committed
positions: what `LyannaDrafter` and the executor do in a step, without returning to the interpreter between
rounds. On a CPU each return costs more than the drafter's layer: the target's forward has pushed the
interpreter's code and data out of the caches. Greedy answers are the target's, whatever the drafts.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from lyanna_kernels import integer_dot
from lyanna_kernels.draft_native import DraftChains, DraftFuse
from lyanna_kernels.fused_decoder import FusedDecoder, FusedDraftLayer, GreedyHead, _Layers, _native_seconds

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Rounds(ctypes.Structure):
    _fields_ = [
        ("target", _p),
        ("head", _p),
        ("draft", _p),
        ("fuse", _p),
        ("chain", _p),
        ("norm", _p),
        ("eps", ctypes.c_float),
        ("scratch_first", _i64),
        ("scratch_per_seq", _i64),
    ]


@dataclass
class RoundsResult:
    """What a call of `SpecRounds` committed."""

    tokens: list[list[int]]  # per sequence, its committed tokens in order (accepted drafts and bonus tokens)
    accepted: list[list[int]]  # per sequence, the drafts each round it ran accepted
    hidden: torch.Tensor  # [seqs, rounds * (depth + 1), hidden] bf16: the target's normed rows of those positions


PHASES = ("trajectory", "chains", "forward", "head", "accept", "catch_up")  # csrc/spec_rounds.c's, in order


def phase_seconds() -> dict[str, float]:
    """Seconds every call of the rounds has spent in each phase since start (the drafter's trajectory, its chains,
    the target's forward, its LM head and argmax, acceptance, the drafter's catch-up)."""
    out = (ctypes.c_double * len(PHASES))()
    integer_dot.library().spec_rounds_profile(out)
    return dict(zip(PHASES, out, strict=True))


def _current(layers: _Layers) -> _Layers:
    """The view, rebuilt where the model's tensors were swapped since it was built."""
    if layers._sources() != layers._sources_at_build:
        layers._build()
    return layers


class SpecRounds:
    """Lyanna's fused layer, fusion, chains and output norm, for rounds beside a target (`__call__`). Holds the
    tensors its C view points into."""

    def __init__(self, draft: FusedDraftLayer, fuse: DraftFuse, chains: DraftChains, norm_weight: torch.Tensor,
                 eps: float):  # fmt: skip
        self.draft, self.fuse, self.chains = draft, fuse, chains
        self.norm = norm_weight.detach().to(torch.bfloat16).contiguous()
        self.eps = eps

    def __call__(self, target: FusedDecoder, head: GreedyHead, roots: list[int], lengths: list[int],
                 rooms: list[int], tables: torch.Tensor, last_out: torch.Tensor, depth: int, rounds: int,
                 stops: list[int] | tuple[int, ...] = ()) -> RoundsResult:  # fmt: skip
        """Up to `rounds` rounds of `depth`-token chains, verified by `target` (a fused decoder with its final norm)
        and its LM head `head`, for each sequence: its root (last token, not yet computed) at position lengths[b] - 1,
        `rooms[b]` positions from there granted in its block-table row (`tables` [seqs, blocks] int32), and the
        drafter's normed output at position lengths[b] - 2 in `last_out` [seqs, hidden] bf16, which is updated to
        the last committed position's. A sequence runs the rounds that fit in its room, and none after it commits one
        of the tokens `stops`."""
        if not target.final_norm:
            raise ValueError("speculative rounds need the fused decoder built with the final norm")
        B, H = len(roots), head.head.in_features
        if not (len(lengths) == len(rooms) == B and last_out.shape == (B, H) and last_out.dtype == torch.bfloat16):
            raise ValueError(f"roots, lengths, rooms and last_out [{B}, {H}] bf16 must describe the same sequences")
        if depth < 1 or rounds < 1:
            raise ValueError(f"depth and rounds must be positive, not {depth} and {rounds}")
        if tables.dim() != 2 or tables.shape[0] < B or tables.dtype != torch.int32 or tables.stride(1) != 1:
            raise ValueError(f"block tables must be an int32 [{B}, blocks] tensor with contiguous rows")
        if not last_out.is_contiguous():
            raise ValueError("last_out must be contiguous: it is updated in place")
        self.draft.reserve(B)
        layers, draft = _current(target._layers), _current(self.draft._layers)
        first_scratch = self.draft.scratch(0)[0] if self.draft.scratch_per_seq else self.draft.num_blocks
        struct = _Rounds(
            ctypes.addressof(layers.decoder), ctypes.addressof(head.struct), ctypes.addressof(draft.decoder),
            ctypes.addressof(self.fuse.struct), ctypes.addressof(self.chains.struct), self.norm.data_ptr(), self.eps,
            first_scratch, self.draft.scratch_per_seq,
        )  # fmt: skip
        span = rounds * (depth + 1)
        meta = torch.tensor([*roots, *lengths, *rooms, *stops], dtype=torch.int64)
        # one buffer, one copy to Python: tokens [B, span], accepted [B, rounds] (-1: not run), committed [B]
        ints = torch.empty(B * (span + rounds + 1), dtype=torch.int64)
        hidden = torch.empty(B, span, H, dtype=torch.bfloat16)
        at = ints.data_ptr()
        start = time.perf_counter()
        code = integer_dot.library().spec_rounds(
            ctypes.byref(struct), B, meta.data_ptr(), meta.data_ptr() + 8 * B, meta.data_ptr() + 16 * B,
            tables.data_ptr(), tables.stride(0), tables.shape[1], last_out.data_ptr(), depth, rounds,
            meta.data_ptr() + 24 * B, len(stops), torch.get_num_threads(), at, hidden.data_ptr(),
            at + 8 * B * span, at + 8 * B * (span + rounds),
        )  # fmt: skip
        _native_seconds[0] += time.perf_counter() - start
        if code == -1:
            raise MemoryError("spec_rounds: out of memory")
        if code:
            raise RuntimeError(f"spec_rounds failed with code {code} (a block table or token out of range)")
        host = ints.tolist()
        counts, committed = host[B * span : B * (span + rounds)], host[B * (span + rounds) :]
        accepted = [[a for a in counts[b * rounds : (b + 1) * rounds] if a >= 0] for b in range(B)]
        tokens = [host[b * span : b * span + committed[b]] for b in range(B)]
        return RoundsResult(tokens, accepted, hidden)
