"""`python -m lyanna_kernels.bench --device cuda`: time each Triton kernel against its PyTorch reference.

Shapes follow the embedded model (9 query heads over 3 KV heads of 64, 30 layers, a 49,152-token
vocabulary) at a serving batch; `--scale` shrinks the batch and lengths (Triton's interpreter, which
runs the kernels on CPU tensors, is for correctness, not speed). Each kernel is checked against its
reference on the same inputs before it is timed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compare(name: str, run: Callable[[], object], check: Callable[[object, object], float], device, reps: int) -> dict:
    """Run `run` with the kernels and with the references: timings, speed-up, and the check's error."""
    from lyanna_kernels.dispatch import set_kernel_mode

    set_kernel_mode("triton")
    got = run()
    kernel_ms = timed(run, device, reps)
    set_kernel_mode("torch")
    want = run()
    reference_ms = timed(run, device, reps)
    set_kernel_mode("auto")
    return {
        "kernel": name,
        "triton_ms": round(kernel_ms, 4),
        "reference_ms": round(reference_ms, 4),
        "speedup": round(reference_ms / kernel_ms, 3),
        "max_error": check(got, want),
    }


def attention_case(kind: str, scale: float, dtype: torch.dtype, device: torch.device):
    """A ragged batch: 'decode' (32 sequences of 1 new token), 'prefill' (one 512-token chunk after 512
    cached, beside 15 decodes) or 'tree' (16 sequences verifying 16-node trees)."""
    from engines.attention import SequenceLayout, build_attention_metadata, paged_attention

    n = max(1, int(32 * scale))
    ctx = max(8, int(1024 * scale))
    if kind == "decode":
        specs = [(ctx + 7 * i, 1, None) for i in range(n)]
    elif kind == "prefill":
        specs = [(ctx // 2, ctx // 2, None)] + [(ctx + i, 1, None) for i in range(max(1, n // 2))]
    else:
        parents = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 9]
        specs = [(ctx + 3 * i, 16, parents) for i in range(max(1, n // 2))]
    block_size, heads, kv_heads, dim = 16, 9, 3, 64
    blocks = sum(-(-(c + m) // block_size) for c, m, _ in specs)
    order = torch.randperm(blocks).tolist()
    seqs = []
    for cached, new, parents in specs:
        need = -(-(cached + new) // block_size)
        seqs.append(SequenceLayout(order[:need], cached, new, parents))
        order = order[need:]
    T = sum(s.num_new for s in seqs)
    k = torch.randn(blocks * block_size, kv_heads, dim, device=device).to(dtype)
    v = torch.randn(blocks * block_size, kv_heads, dim, device=device).to(dtype)
    q = torch.randn(T, heads, dim, device=device).to(dtype)

    def run():
        meta = build_attention_metadata(seqs, block_size, device)
        return paged_attention(q, k, v, meta, dim**-0.5)

    return run


def max_abs(got, want) -> float:
    if isinstance(got, tuple):
        return max(max_abs(g, w) for g, w in zip(got, want, strict=True))
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


def walk_case(scale: float, device: torch.device):
    """32 trees of 16 nodes (widths 2-4), the target agreeing with a child most of the time."""
    from engines.verification import walk_trees

    n = max(1, int(32 * scale))
    g = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 9]
    tokens = torch.randint(0, 50, (n, 16), generator=g)
    target = torch.randint(0, 50, (n, 16), generator=g)
    agree = torch.rand(n, 16, generator=g) < 0.8
    first_child = torch.tensor([1, 3, 5, 7, 9, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0])
    target = torch.where(agree & (first_child > 0), tokens[:, first_child.clamp_max(15)], target)
    flat = [x.flatten().to(device) for x in (target, tokens, torch.tensor(parents).repeat(n))]
    offsets = torch.arange(0, 16 * n + 1, 16, device=device)
    return lambda: walk_trees(*flat, offsets, 5, 16)


def expansion_case(scale: float, device: torch.device):
    """One depth of Algorithm 1 for 32 requests: width 4, the full vocabulary, a 1,024-row table."""
    from engines.drafters.token_info import TokenInfoTable
    from engines.drafters.token_info_sampling import expand_depth

    n, vocab, k = max(1, int(32 * scale)), 49152, 4
    table = TokenInfoTable(
        torch.cat([torch.randn(1024, vocab, device=device), torch.zeros(1, vocab, device=device)]),
        torch.where(torch.arange(vocab, device=device) < 1024, torch.arange(vocab, device=device), -1),
    )
    raw = torch.randn(n, vocab, device=device)
    frontier = torch.randint(0, 2048, (n, k), device=device)
    scores = torch.rand(n, k, device=device)
    return lambda: expand_depth(raw, frontier, scores, table, k)


def commit_case(scale: float, dtype: torch.dtype, device: torch.device):
    """The accepted paths of 32 requests (3 moves each) in a 30-layer cache (no move reads another's
    destination, so repeating them changes nothing)."""
    from engines.kv_cache import copy_slots

    n = max(1, int(32 * scale))
    k = torch.randn(30, 4096, 3, 64, device=device).to(dtype)
    v = torch.randn_like(k)
    base = torch.arange(n, device=device) * 64
    src = torch.stack([base + 5, base + 6, base + 9], 1).flatten()
    dst = torch.stack([base + 1, base + 2, base + 3], 1).flatten()

    def run():
        copy_slots(k, v, src, dst)
        return k[:, :: max(1, 4096 // 512)]

    return run


def main(argv: list[str] | None = None) -> None:
    """Time every kernel against its reference on one device; one JSON line."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--scale", type=float, default=None, help="batch/length scale (default 1 on CUDA, 1/16 on CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per kernel (default 50 on CUDA, 2 on CPU)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 1 / 16)
    reps = args.reps if args.reps is not None else (50 if device.type == "cuda" else 2)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = [
        compare(f"paged_attention_{kind}", attention_case(kind, scale, dtype, device), max_abs, device, reps)
        for kind in ("decode", "prefill", "tree")
    ]
    rows.append(compare("tree_walk", walk_case(scale, device), max_abs, device, reps))
    rows.append(compare("token_info_expansion", expansion_case(scale, device), max_abs, device, reps))
    rows.append(compare("kv_commit", commit_case(scale, dtype, device), max_abs, device, reps))
    from lyanna_kernels.dispatch import interpreting

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {"device": name, "interpreter": interpreting(), "dtype": args.dtype, "scale": scale, "reps": reps}
    print(json.dumps(info | {"kernels": rows}))


if __name__ == "__main__":
    main()
