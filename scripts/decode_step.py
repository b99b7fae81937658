"""Median plain-decoding step time of a batch, through the public engine API (so it also times an older
checkout: `PYTHONPATH=/path/to/checkout python scripts/decode_step.py 1`).

    python scripts/decode_step.py BATCH [DTYPE]

Two rounds of BATCH chat requests, 70 greedy tokens each (EOS ignored); prints the faster round's
median step (prefill steps excluded) as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams


def main() -> None:
    batch = int(sys.argv[1])
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    engine = LLMEngine(EngineConfig(drafter="none", dtype=dtype, max_num_seqs=64))
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    rounds = []
    for _ in range(2):
        for i in range(batch):
            engine.add_request([{"role": "user", "content": f"Write a long story number {i} about a dragon."}], params)
        times, k = [], 0
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            k += 1
            if k > 5:
                times.append(time.perf_counter() - start)
        rounds.append(statistics.median(times))
    best = min(rounds)
    print(json.dumps({"batch": batch, "step_ms": best * 1e3, "tokens_per_s": batch / best}))


if __name__ == "__main__":
    main()
