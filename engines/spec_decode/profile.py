"""Start-up profile: seed the speculation policy's cost models with a few real steps.

Target: prefill steps of 1, 2, 4, ... tokens (one request each, no speculation), each size once to
warm up and then `REPEATS` times, the fastest kept. Trees and drafter: short speculative decodes of
1, 2, 4 and 8 requests (`TREE_BATCHES`, as many as the engine runs at once) at the configured shape,
with a small and the full verification budget, so the verification overhead of each of these batch
buckets is fitted per tree and per draft token from the start (a decode before them warms up and is
forgotten). A bucket fitted from its first few online tree steps instead is priced by steps that are
noisy and slow (a new token count's first forward costs a few ms more on a CPU), and a high first
price stops drafting there until rare probes correct it: two greedy runs at batch 4 drafted in 332
of 544 and in 3 of 336 steps, as their first tree steps fell. Plain decodes of the same batches run
just before the trees, so the overhead is measured against typical decode steps of the same batch
(measured against the fastest prefill of one token, a tree step's ordinary noise and its context
counted as verification cost: two start-ups priced a batch-1 tree at 0 and at 14 ms, where online
steps say 1-2 ms). The profile's tree steps then weigh `TREE_WEIGHT` steps, so the first real tree
steps soon rule. What a step's attention context costs is measured too: plain decodes of the same
`CONTEXT_BATCH` requests with short and with long prompts give the seconds per attention key
(without it the slope waits for a settled bucket, and the first wave of a large batch, its decode
steps in a bucket whose profiled point is a short prefill, was priced at half its time: its trees'
draft tokens looked dear, and the shape table learned from trees cut to a few tokens). The acceptance
statistics of these synthetic prompts are dropped.

The profile's outcome (the fitted cost models) is kept in the cache folder, keyed by everything its
timings depend on (the machine's CPU, the thread count, the engine's settings, the checkpoints, this
package's code), so a second replica of the same settings on the same machine starts without it:
`profile_or_reuse`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.attention import attention_keys
from engines.sampling import SamplingParams
from engines.spec_decode.acceptance_model import AcceptanceModel
from engines.spec_decode.cost_model import DraftCostModel
from engines.spec_decode.policy import ShapeTable
from engines.spec_params import SpecParams

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engines.engine import LLMEngine
    from engines.spec_decode.policy import AdaptivePolicy

MAX_PROFILE_TOKENS = 256
REPEATS = 3  # timed runs per size; one slow run on a noisy machine must not set a bucket
TREE_STEPS = 6  # tokens per speculative decode (the synthetic prompts accept almost nothing: ~one per step)
TREE_BATCHES = (1, 2, 4, 8)  # batch sizes whose tree overhead is profiled (up to the engine's max_num_seqs)
TREE_WEIGHT = 2.0  # steps the profile's tree fit of a batch bucket weighs once online tree steps come in
CONTEXT_BATCH = 8  # requests of the plain decodes, short and long, that price a step's attention context
CONTEXT_WEIGHT = 20.0  # plain steps the profiled context slope weighs once online steps come in
CONTEXT_STEPS = 10  # decode steps of each (their median counts)


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, spec: SpecParams) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts:
        engine.add_request(prompt_token_ids=ids, params=params, spec=spec)
    while engine.has_unfinished():
        engine.step()


def _decode_step_s(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Median seconds of the plain decode steps of these prompts decoded together, and their mean
    attention keys."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    no_spec = SpecParams(enabled=False)
    reqs = [engine.add_request(prompt_token_ids=ids, params=params, spec=no_spec) for ids in prompts]
    times, keys = [], []
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 and not r.finished for r in reqs)
        context = attention_keys([(r.num_computed_tokens, 1) for r in reqs])
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
            keys.append(context)
    if not times:
        raise RuntimeError("the profile's requests never decoded together")
    return statistics.median(times), statistics.fmean(keys)


def profile_engine(engine: LLMEngine, policy: AdaptivePolicy) -> None:
    """Measure the target's step time by token count and the drafter's round time (a second or two)."""
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    limit = min(MAX_PROFILE_TOKENS, engine.config.max_num_batched_tokens, engine.max_model_len - 2)
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    no_spec = SpecParams(enabled=False)
    fastest: dict[int, float] = {}
    for n in sizes:  # one prefill step each; the first run warms up, the fastest of the rest counts
        for rep in range(1 + REPEATS):
            start = time.perf_counter()
            _run(engine, [[rng.randrange(vocab) for _ in range(n)]], 1, no_spec)
            if rep:
                fastest[n] = min(fastest.get(n, float("inf")), time.perf_counter() - start)
    batches = [b for b in TREE_BATCHES if b <= engine.config.max_num_seqs]
    prompts = [[rng.randrange(vocab) for _ in range(min(64, limit))] for _ in range(batches[-1])]
    full = dataclasses.replace(engine.config.spec, fixed=True)  # the drafter at its full shape
    _run(engine, prompts[:1], 4, full)  # warms the tree steps up
    policy.target_cost.reset()  # the steps above also reported themselves, warm-ups included
    policy.draft_cost = DraftCostModel()
    for n, seconds in fastest.items():
        policy.target_cost.observe(n, seconds, context=n)  # one sequence: its own n keys
    # plain decode steps of the batches whose tree overhead is measured next
    plain = {batch: _decode_step_s(engine, prompts[:batch], CONTEXT_STEPS) for batch in batches}
    # What a step's attention context costs: the same batch decoding short and long prompts.
    batch = min(CONTEXT_BATCH, batches[-1])
    long_len = min(limit, engine.max_model_len - CONTEXT_STEPS - 3)
    if long_len >= 2 * len(prompts[0]):
        short_s, short_keys = plain[batch]
        long_prompts = [[rng.randrange(vocab) for _ in range(long_len)] for _ in range(batch)]
        long_s, long_keys = _decode_step_s(engine, long_prompts, CONTEXT_STEPS)
        apart = long_keys - short_keys
        policy.target_cost.seed_context_slope((long_s - short_s) / apart, apart, CONTEXT_WEIGHT)
    for budget in sorted({max(1, full.budget // 4), full.budget}):
        for batch in batches:
            _run(engine, prompts[:batch], TREE_STEPS, dataclasses.replace(full, budget=budget))
    for fit in policy.target_cost.trees.values():
        fit.reweigh(TREE_WEIGHT)
    _forget_synthetic(policy)  # random prompts say nothing about real acceptance


PROFILE_FORMAT = 2  # bump when what a saved profile holds changes


@functools.cache
def _code_digest() -> str:
    """A digest of the engine's and kernels' source files (a step's cost follows the code)."""
    import engines
    import lyanna_kernels

    h = hashlib.sha256()
    for package in (engines, lyanna_kernels):
        root = Path(package.__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _file_identity(path: str | Path | None) -> list:
    """(path, size, mtime) of a checkpoint file or folder's weights: a re-converted or edited one is another."""
    if path is None:
        return []
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.exists()]


def profile_key(engine: LLMEngine) -> str:
    """What the start-up profile's timings depend on, as a short digest: the CPU, the thread count, the
    device, the engine's settings, the target and draft checkpoints, and the code."""
    parts = {
        "format": PROFILE_FORMAT,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "device": str(engine.device),
        "torch": torch.__version__,
        "config": engine.config.model_dump(mode="json"),
        "quantization": engine.quantization,
        "target": _file_identity(engine.checkpoint),
        "draft": _file_identity(engine.config.draft_model),
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _forget_synthetic(policy: AdaptivePolicy) -> None:
    policy.acceptance = AcceptanceModel()
    policy.shapes = ShapeTable()
    policy.requests.clear()


def profile_or_reuse(engine: LLMEngine, policy: AdaptivePolicy, folder: Path | None) -> bool:
    """Seed `policy` from the saved profile of an engine of the same settings on this machine, or run
    `profile_engine` and save its outcome under `folder` (None: neither read nor write). True if reused."""
    path = None if folder is None else folder / f"{profile_key(engine)}.pkl"
    if path is not None and path.exists():
        try:
            with open(path, "rb") as f:  # our own cache folder, written below
                policy.target_cost, policy.draft_cost = pickle.load(f)
            _forget_synthetic(policy)
            log.info("start-up profile reused from %s", path)
            return True
        except Exception as e:  # a truncated or stale file: profile again and overwrite it
            log.warning("start-up profile %s unreadable (%s); profiling again", path, e)
    profile_engine(engine, policy)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((policy.target_cost, policy.draft_cost), f)
            os.replace(tmp, path)  # atomic: another replica never reads half a file
        except OSError as e:
            log.warning("start-up profile not saved to %s: %s", path, e)
    return False
