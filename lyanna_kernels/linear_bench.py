"""`python -m lyanna_kernels.linear_bench`: time the embedded model's linear layers under each weight layout.

For each row count (the tokens of one step: 1 for a decode, a few for a verification, many for a
prefill chunk), the 120 projections of the 30 layers and, separately, the LM head run under:
- `bf16`: the dense weights, prepacked for oneDNN (quantization `none`);
- `fp32`: dense fp32 copies (what CPUs without bf16 arithmetic use for GEMMs of many rows);
- `<setting>/<layout>`: a quantized setting (`gguf`, `int8`, `int4`) packed for the `integer_dot`, `vnni`
  (AVX512-VNNI CPUs) or `torch` layout (lyanna_kernels/quantized_linear.py), called directly (no fp32 copy).
Configurations are interleaved repetition by repetition and medians reported. One JSON line:
milliseconds per configuration and row count, and the path (`kernel_paths`: avx2, vnni or amx) each
class of row counts took through the interleaved layouts, measured at start-up. The thresholds in
lyanna_kernels/onednn_linear.py and lyanna_kernels/quantized_linear.py (`WIDE_MIN_ROWS`) come from runs of this
benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lyanna_kernels import integer_dot, onednn_linear
from lyanna_kernels.dispatch import set_kernel_mode
from lyanna_kernels.quantized_linear import INTEGER_LAYOUTS, relayout

Linear = tuple[int, Callable[[torch.Tensor], torch.Tensor]]  # (input features, x -> x @ W.T)


def model_linears(setting: str, layout: str | None) -> tuple[list[Linear], Linear]:
    """The embedded model's projections and LM head as one configuration computes them."""
    from engines.loader import load_model
    from engines.parallel import PackableLinear

    set_kernel_mode("torch" if layout == "torch" else "auto")
    try:
        model = load_model(
            None, "bfloat16", "cpu", quantization="none" if setting in ("bf16", "fp32") else setting
        ).model
    finally:
        set_kernel_mode("auto")
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    head_weight = model.lm_head_weight.data
    if setting == "fp32":
        dense = [(m.weight.shape[1], m.weight.data.float()) for m in layers] + [(0, head_weight.float())]
        fns: list[Linear] = [(k, lambda x, w=w: F.linear(x.float(), w)) for k, w in dense[:-1]]
        return fns, (head_weight.shape[1], lambda x, w=dense[-1][1]: F.linear(x.float(), w))
    if setting == "bf16":
        fns = [(m.weight.shape[1], lambda x, m=m: onednn_linear.linear(x, m.weight, m.packed)) for m in layers]
        packed = onednn_linear.prepack(head_weight)
        return fns, (head_weight.shape[1], lambda x: onednn_linear.linear(x, head_weight, packed))
    if layout in INTEGER_LAYOUTS and model.lm_head_quant is not None and model.lm_head_quant.layout in INTEGER_LAYOUTS:
        for m in layers:
            m.quant = relayout(m.quant, layout)
        model.lm_head_quant = relayout(model.lm_head_quant, layout)
    fns = [(m.quant.in_features, m.quant.matmul) for m in layers]
    head = model.lm_head_quant
    assert head is not None
    return fns, (head.in_features, lambda x: head.matmul(x, torch.float32))


def main(argv: list[str] | None = None) -> dict:
    """Time every configuration at every row count; print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts (tokens per step)")
    ap.add_argument("--configs", default="bf16,fp32,gguf/integer_dot,gguf/torch,int8/integer_dot,int8/torch")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    if not integer_dot.available():
        configs = [c for c in configs if not c.endswith("/integer_dot")]
    linears = {c: model_linears(*[*c.split("/"), None][:2]) for c in configs}
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, str, int], list[float]] = {}
    torch.manual_seed(0)
    with torch.inference_mode():
        for m in rows:
            inputs = {k: torch.randn(m, k).bfloat16() for k in {k for fns, _ in linears.values() for k, _ in fns}}
            for _ in range(args.reps + 1):  # the first repetition warms up
                for config, (fns, (head_k, head)) in linears.items():
                    start = time.perf_counter()
                    for k, fn in fns:
                        fn(inputs[k])
                    mid = time.perf_counter()
                    head(inputs[head_k])
                    end = time.perf_counter()
                    times.setdefault((config, "projections", m), []).append((mid - start) * 1e3)
                    times.setdefault((config, "lm_head", m), []).append((end - mid) * 1e3)
    paths = integer_dot.kernel_paths()  # the interleaved layouts' path per class of row counts
    result: dict = {"threads": torch.get_num_threads(), "reps": args.reps, "kernel_paths": paths, "ms": {}}
    for (config, part, m), ts in times.items():
        result["ms"].setdefault(config, {}).setdefault(part, {})[m] = round(statistics.median(ts[1:]), 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
