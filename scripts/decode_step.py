"""Median plain-decoding step time of a batch, through the public engine API (so it also times an older
checkout: `PYTHONPATH=/path/to/checkout python scripts/decode_step.py 1`).

    python scripts/decode_step.py BATCH [DTYPE]
    python scripts/decode_step.py --linear-share [ROUNDS]

Two rounds of BATCH chat requests, 70 greedy tokens each (EOS ignored); prints the faster round's
median step (prefill steps excluded) as one JSON line.

`--linear-share` (this checkout only) times, interleaved in one process, a batch-1 decode step of the
default engine and the same step's linear layers alone: the 120 projections and the LM head through
the raw integer-dot kernels (activations already quantized, outputs allocated). It prints the medians
and the share of the step the linears take.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams


def linear_share(rounds: int) -> None:
    """Median batch-1 step against its linears alone, interleaved (integer-dot layouts only)."""
    import torch

    from engines.parallel import PackableLinear
    from lyanna_kernels import integer_dot

    engine = LLMEngine(EngineConfig(drafter="none"))
    weights = [m.quant for m in engine.model.modules() if isinstance(m, PackableLinear)]
    weights.append(engine.model.lm_head_quant)
    calls = []
    for w in weights:
        assert w is not None and w.layout in ("integer_dot", "vnni"), "needs the integer-dot kernels"
        xq, dx, sx = integer_dot._quantized_activations(torch.randn(1, w.in_features).bfloat16())
        out = torch.empty(1, w.out_features)
        calls.append((w, xq, dx, sx, out))
    lib, threads = integer_dot.library(), torch.get_num_threads()

    def linears() -> None:
        for w, xq, dx, sx, out in calls:
            xq_p, dx_p, sx_p, out_p = (t.data_ptr() for t in (xq, dx, sx, out))
            n, k = w.out_features, w.in_features
            if w.layout == "vnni":
                lib.vnni_gemm(w.data.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), w.bits, n, k, xq_p, dx_p,
                              sx_p, 1, out_p, threads)  # fmt: skip
            elif w.kind == "int8":
                lib.q8_gemm(w.data.data_ptr(), w.scales.data_ptr(), n, k, xq_p, dx_p, 1, out_p, 1, threads)
            else:
                lib.q4_gemm(w.data.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), n, k, xq_p, dx_p, sx_p, 1,
                            out_p, 1, threads)  # fmt: skip

    params = SamplingParams(max_tokens=rounds + 10, temperature=0.0, ignore_eos=True)
    engine.add_request([{"role": "user", "content": "Write a long story about a dragon."}], params)
    for _ in range(5):
        engine.step()
    linear_s, step_s = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        linears()
        linear_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    lin, step = statistics.median(linear_s), statistics.median(step_s)
    print(json.dumps({"linears_ms": lin * 1e3, "step_ms": step * 1e3, "linear_share": lin / step}))


def main() -> None:
    if sys.argv[1] == "--linear-share":
        linear_share(int(sys.argv[2]) if len(sys.argv) > 2 else 100)
        return
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
