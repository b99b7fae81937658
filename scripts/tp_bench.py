"""Tensor-parallel size 2 (one thread per rank) against size 1 (two threads) on this machine, in one process.

    python scripts/tp_bench.py [--batches 1,16] [--drafters none,lyanna] [--tokens 48] [--rounds 3]

For each drafter, a single-rank engine and a two-rank engine (rank 1 a Ray actor) run the same waves of
held-out ShareGPT prompts (greedy, EOS ignored), interleaved round by round; each wave runs with its
engine's rank-0 thread count. Prints one JSON line per (drafter, batch): median tokens/s of each, their
ratio, and the two-rank engine's per-step communication on rank 0: time inside all-reduces made from
Python (the eager layers'; the fused CPU decoder sums from C, inside its forward, and this reads 0 there),
broadcasting the step, and each rank's time waiting for the other in all-reduces of either kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ray
import torch

from engines.datasets import sharegpt_prompts
from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args
from engines.parallel import TensorParallel
from engines.sampling import SamplingParams

COMM = {"all_reduce_s": 0.0}
_all_reduce = TensorParallel.all_reduce


def timed_all_reduce(self: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    start = time.perf_counter()
    try:
        return _all_reduce(self, x)
    finally:
        COMM["all_reduce_s"] += time.perf_counter() - start


def rank_waits(engine: LLMEngine) -> list[float]:
    """Seconds each rank has spent waiting for the other in all-reduces (shared-memory path)."""
    if engine.workers is None:
        return [0.0, 0.0]
    own = getattr(engine.workers.tp.reducer, "wait_seconds", 0.0)
    return [own] + [s["all_reduce_wait_s"] or 0.0 for s in engine.workers.states()]


def wave(engine: LLMEngine, prompts: list[dict], tokens: int) -> tuple[float, int]:
    """(tokens/s, steps) of one wave."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p["messages"], params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return len(prompts) * tokens / (time.perf_counter() - start), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--drafters", default="none,lyanna")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    add_engine_args(ap, ["dtype"])
    args = ap.parse_args()
    TensorParallel.all_reduce = timed_all_reduce
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    # Ray runs its workers (the rank actors, and a Serve replica) at niceness 15; rank 0 runs here, in
    # the driver: give it the same priority, as it has in a Serve replica, or the kernel starves rank 1.
    os.nice(ray.get(ray.remote(lambda: os.nice(0)).remote()) - os.nice(0))
    batches = [int(b) for b in args.batches.split(",")]
    prompts = sharegpt_prompts(max(batches), max_chars=600, split="val")
    for drafter in args.drafters.split(","):
        engines = {}
        for tp, threads in ((1, 2), (2, 1)):
            torch.set_num_threads(threads)
            cfg = EngineConfig(dtype=args.dtype, drafter=drafter, tensor_parallel_size=tp, max_num_seqs=max(batches))
            engines[tp] = (LLMEngine(cfg), threads)
        for batch in batches:
            rates: dict[int, list[float]] = {1: [], 2: []}
            comm, sends, steps, waits = 0.0, 0.0, 0, [0.0, 0.0]
            for r in range(args.rounds + 1):  # the first round warms up
                for tp, (engine, threads) in engines.items():
                    torch.set_num_threads(threads)
                    COMM["all_reduce_s"], sent = 0.0, getattr(engine.runner, "send_seconds", 0.0)
                    before = rank_waits(engine)
                    rate, n = wave(engine, prompts[:batch], args.tokens)
                    after = rank_waits(engine)
                    if r == 0:
                        continue
                    rates[tp].append(rate)
                    if tp == 2:
                        comm += COMM["all_reduce_s"]
                        sends += engine.runner.send_seconds - sent
                        steps += n
                        waits = [w + a - b for w, a, b in zip(waits, after, before, strict=True)]
            one, two = statistics.median(rates[1]), statistics.median(rates[2])
            row = {
                "drafter": drafter,
                "batch": batch,
                "tp1_tokens_per_s": round(one, 2),
                "tp2_tokens_per_s": round(two, 2),
                "tp2_over_tp1": round(two / one, 3),
                "tp2_python_all_reduce_ms_per_step": round(comm / steps * 1e3, 2),
                "tp2_broadcast_ms_per_step": round(sends / steps * 1e3, 2),
                "tp2_wait_for_other_rank_ms_per_step": [round(w / steps * 1e3, 2) for w in waits],
            }
            print(json.dumps(row), flush=True)
        for engine, _ in engines.values():
            engine.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
