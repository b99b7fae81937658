"""torch.compile against eager for the target's decode forward, interleaved in one process.

    python scripts/compile_probe.py [--dtype bfloat16] [--batch 1] [--steps 40] [--mode default]

The attention call over the paged cache stays eager (its grouping is host data); every decoder
layer's dense part (norms, projections, RoPE, MLP) is compiled with dynamic shapes. Prints one JSON
line with the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args
from engines.model import MLP, RMSNorm
from engines.sampling import SamplingParams


def decode_times(engine: LLMEngine, batch: int, steps: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([{"role": "user", "content": f"Tell me story number {i} about a lighthouse."}], params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[4:]  # prefill and warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_engine_args(ap, ["dtype"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="default")
    args = ap.parse_args()
    eager = LLMEngine(EngineConfig(dtype=args.dtype, drafter="none"))
    compiled = LLMEngine(EngineConfig(dtype=args.dtype, drafter="none"))
    for m in compiled.model.modules():
        if isinstance(m, MLP | RMSNorm):
            m.forward = torch.compile(m.forward, dynamic=True, mode=args.mode)
    decode_times(compiled, args.batch, 8)  # compile
    runs: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        runs["eager"].extend(decode_times(eager, args.batch, args.steps))
        runs["compiled"].extend(decode_times(compiled, args.batch, args.steps))
    e, c = statistics.median(runs["eager"]), statistics.median(runs["compiled"])
    print(
        json.dumps(
            {
                "batch": args.batch,
                "dtype": args.dtype,
                "eager_step_ms": e * 1e3,
                "compiled_step_ms": c * 1e3,
                "compiled_over_eager": c / e,
            }
        )
    )


if __name__ == "__main__":
    main()
