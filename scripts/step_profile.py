"""Where an engine step's time goes: wall time and tokens/s per step, each phase of the steps (the executor's step
profile: scheduler and engine updates, policy, drafting, the forward's launch and the forward itself, verification,
KV commit) and the share outside the forward, device time, kernel launches and host-device copies per step, the
Python lines that wait on the device, and the top operators. On CPU the forward is the fused decoder's native calls.

    python scripts/step_profile.py --device cuda --configs none:1,none:16,lyanna:1,lyanna:16 [--eager-too]
    python scripts/step_profile.py --device cpu --configs none:32,served:16,served:64

Each configuration is DRAFTER:BATCH (trees 3:2:6 under the fixed policy; `served`: the serve config's engine);
`--eager-too` runs each again with `enforce_eager` (no CUDA graphs). `--check` first compares greedy outputs with
and without CUDA graphs.
Prompts: a prompts file (`--prompts`, engines.datasets' format) or ShareGPT's held-out side.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

import torch

from engines.bench.cli import served_engine_config
from engines.datasets import read_prompt_file, sharegpt_prompts
from engines.engine import LLMEngine
from engines.engine_config import EngineConfig
from engines.sampling import SamplingParams
from engines.spec_decode.stats import PHASES, StepProfile

TREES = {"spec_policy": "fixed", "spec_depth": 3, "spec_width": 2, "spec_budget": 6}


def make_engine(args: argparse.Namespace, drafter: str, eager: bool, dtype: str | None = None,
                batch: int = 1) -> LLMEngine:  # fmt: skip
    """An engine of the profiled settings; drafter "served" runs the serve config's `engine:` block."""
    if drafter == "served":
        # (prefix caching as the other configurations have it: the engine's default)
        served = served_engine_config(batch, EngineConfig.model_fields["enable_prefix_caching"].default)
        return LLMEngine(served.model_copy(update={"enforce_eager": eager}))
    extra = TREES if drafter != "none" else {}
    dtype = dtype or args.dtype
    return LLMEngine(EngineConfig(device=args.device, dtype=dtype, drafter=drafter, enforce_eager=eager, **extra))


def generate(engine: LLMEngine, prompts: list, n: int, tokens: int) -> list:
    """Greedy requests of `tokens` tokens for the first n prompts (cycled), queued."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [engine.add_request(prompts[i % len(prompts)], params) for i in range(n)]


def sync(device: str) -> None:
    """Wait for the device."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check(args: argparse.Namespace, prompts: list) -> None:
    """Greedy outputs with CUDA graphs against the eager forward, fp32 and the profiled dtype."""
    for drafter, dtype, n in [("none", "float32", 3), ("none", args.dtype, 16), ("lyanna", "float32", 3)]:
        outs = []
        for eager in (False, True):
            engine = make_engine(args, drafter, eager, dtype)
            reqs = generate(engine, prompts, n, 24)
            while any(not r.finished for r in reqs):
                engine.step()
            outs.append([r.output_token_ids for r in reqs])
            engine.shutdown()
        same = sum(a == b for a, b in zip(*outs, strict=True))
        what = "with and without CUDA graphs" if args.device.startswith("cuda") else "fused and eager layers"
        print(f"{drafter} {dtype} batch {n}: {same}/{n} outputs identical, {what}")


def profile(args: argparse.Namespace, prompts: list, drafter: str, batch: int, eager: bool) -> None:
    """One configuration: timed steps, then profiled steps, then steps under the sync debug mode."""
    start = time.perf_counter()
    engine = make_engine(args, drafter, eager, batch=batch)
    build = time.perf_counter() - start
    reqs = generate(engine, prompts, batch, 2000)
    for _ in range(args.warmup):  # the prompts, and first compilations
        engine.step()
    sync(args.device)
    emitted = sum(len(r.output_token_ids) for r in reqs)
    engine.executor.profile = StepProfile()  # the timed steps' phases alone
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(args.device)
    wall = (time.perf_counter() - start) / args.steps
    phases = engine.executor.profile.breakdown()
    tokens = (sum(len(r.output_token_ids) for r in reqs) - emitted) / args.steps
    cuda = args.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            engine.step()
        sync(args.device)
    events = prof.key_averages()
    on_device = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    launches += sum(e.count for e in events if e.key == "cudaGraphLaunch")
    copies = sum(e.count for e in events if e.key == "cudaMemcpyAsync")
    waits: collections.Counter[str] = collections.Counter()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                engine.step()
        torch.cuda.set_sync_debug_mode("default")
        waits.update(f"{w.filename.rsplit('/', 2)[-2]}/{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught)
    print(
        f"\n== {drafter} batch {batch}{' eager' if eager else ''}: build {build:.1f} s; {wall * 1e3:.2f} ms a step, "
        f"{tokens / wall:.0f} tokens/s; device {on_device / 10 / 1e3:.2f} ms a step; {launches / 10:.0f} launches and "
        f"{copies / 10:.0f} copies a step; {sum(waits.values()) / 3:.0f} host waits a step"
    )
    for where, count in waits.most_common(8):
        print(f"   waits {count / 3:.0f} a step at {where}")
    print_phases(phases)
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.ops, max_name_column_width=48))
    engine.shutdown()


def print_phases(phases: dict[str, dict[str, float]]) -> None:
    """The timed steps' phases by kind of step (ms a step) and the share of their time outside the model's forward:
    the scheduler, the policy and drafters, the forward's launch, sampling and verification, the KV commit and the
    engine's updates (detokenizing, stop checks)."""
    columns = ("steps", "tokens_per_step", *PHASES, "total")
    print("   " + " ".join(f"{c:>9.9s}" for c in ("kind", *columns)) + "  outside the forward")
    for kind, row in phases.items():
        cells = " ".join(f"{row[c]:9d}" if c == "steps" else f"{row[c]:9.2f}" for c in columns)
        print(f"   {kind:>9s} {cells}  {100 * (1 - row['forward'] / row['total']):.1f}%")
    steps = sum(row["steps"] for row in phases.values())
    total = sum(row["steps"] * row["total"] for row in phases.values())
    forward = sum(row["steps"] * row["forward"] for row in phases.values())
    if steps and total:
        outside = 100 * (1 - forward / total)
        print(f"   all {steps} steps: {total / steps:.2f} ms a step, {outside:.1f}% outside the forward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default="none:1,none:16,lyanna:1,lyanna:16", help="DRAFTER:BATCH,...")
    p.add_argument("--eager-too", action="store_true", help="each configuration again with enforce_eager")
    p.add_argument("--check", action="store_true", help="greedy outputs with and without CUDA graphs first")
    p.add_argument("--prompts", default=None, help="a prompts file (default: ShareGPT's held-out side)")
    p.add_argument("--warmup", type=int, default=12, help="steps before timing")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--ops", type=int, default=10, help="operators listed")
    args = p.parse_args()
    records = read_prompt_file(args.prompts) if args.prompts else sharegpt_prompts(64, split="val")
    prompts = [r["messages"] for r in records]
    if args.check:
        check(args, prompts)
    for config in args.configs.split(","):
        drafter, batch = config.split(":")
        for eager in (False, True) if args.eager_too else (False,):
            profile(args, prompts, drafter, int(batch), eager)


if __name__ == "__main__":
    main()
