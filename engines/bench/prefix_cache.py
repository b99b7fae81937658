"""What a prefix-cache hit saves and what the drafter pays for it: `python -m engines.bench.prefix_cache`.

For each prefix length, one request reads a prompt cold and a second request with the same prompt then
takes every full block from the cache. Timed: the cold request's prefill (what a hit saves the target),
the hit request's prefill step, and the drafter's side of the hit, which rebuilds its context: the
hidden states read from the store beside the cache (`on_cached_prefix`) and its layer's pass over the
prefix at its first catch-up (Lyanna's and EAGLE's K/V over the context; a cold request's first
catch-up reads the same), and what keeping the store costs a step (the cold prefill's hidden states
written to it). Medians of `--repeats` runs
on fresh prompts; one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args, engine_config_from_args
from engines.sampling import SamplingParams


def _timed_methods(engine: LLMEngine) -> dict[str, list[float]]:
    """Wrap the drafter's hit hook and catch-up so each call's seconds are recorded."""
    drafter = engine.executor.drafter
    times: dict[str, list[float]] = {"on_cached_prefix": [], "catch_up": [], "_flush_store": []}
    for name in times:
        method = getattr(drafter, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            out = _method(*args, **kwargs)
            times[_name].append(time.perf_counter() - start)
            return out

        setattr(drafter, name, timed)
    return times


def _prefill_s(engine: LLMEngine, prompt: list[int]) -> tuple[float, Any]:
    """Seconds of the step that reads the request's prompt (up to its first token), and the request."""
    req = engine.add_request(
        prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    start = time.perf_counter()
    while not req.output_token_ids:
        engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return seconds, req


def measure(engine: LLMEngine, lengths: list[int], repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per prefix length: median cold prefill, hit prefill, and the drafter's rebuild (store read + first
    catch-up of the hit request)."""
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    times = _timed_methods(engine) if engine.executor.drafter is not None else None
    rows = []
    for n in lengths:
        cold, hit, store, read, write = [], [], [], [], []
        for _ in range(repeats + 1):  # the first run warms this length up
            prompt = [rng.randrange(vocab) for _ in range(n)]
            if times is not None:
                times["_flush_store"].clear()
            c, _ = _prefill_s(engine, prompt)
            if times is not None:
                write.append(sum(times["_flush_store"]))  # its verified steps' hidden-state writes
                for v in times.values():
                    v.clear()
            h, req = _prefill_s(engine, prompt)
            if req.num_preemptions:
                raise RuntimeError("the measurement needs a cache holding both requests")
            cold.append(c)
            hit.append(h)
            if times is not None:
                store.append(sum(times["on_cached_prefix"]))
                read.append(times["catch_up"][0] if times["catch_up"] else 0.0)
        keep = slice(1, None)
        row = {
            "prefix_tokens": n,
            "cold_prefill_s": statistics.median(cold[keep]),
            "hit_prefill_s": statistics.median(hit[keep]),
        }
        if times is not None:
            row |= {
                "drafter_store_write_s": statistics.median(write[keep]),  # the cold request's held-back writes
                "drafter_store_read_s": statistics.median(store[keep]),
                "drafter_first_catch_up_s": statistics.median(read[keep]),
            }
            row["drafter_rebuild_share_of_saved"] = (
                row["drafter_store_read_s"] + row["drafter_first_catch_up_s"]
            ) / max(1e-9, row["cold_prefill_s"] - row["hit_prefill_s"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse the engine flags and the lengths, measure, print one JSON object."""
    ap = argparse.ArgumentParser(prog="python -m engines.bench.prefix_cache", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048", help="comma-separated prefix lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    add_engine_args(ap)
    args = ap.parse_args(argv)
    config: EngineConfig = engine_config_from_args(args)
    if config.num_kv_blocks is None:
        config = config.model_copy(update={"num_kv_blocks": 1024})
    engine = LLMEngine(config)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = measure(engine, lengths, args.repeats)
    print(json.dumps({"drafter": config.drafter, "dtype": config.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
