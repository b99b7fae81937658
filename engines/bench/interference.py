"""How much long prompts and long contexts disturb the other requests of a batch.

    python -m engines.bench.interference [--dtype bfloat16] [--long-prompt 6000] [--batch 32 --long-context 2000]

Two measurements, printed as one JSON line:

- `stream`: one request streams (greedy, EOS ignored) while a `--long-prompt`-token prompt arrives;
  reports the stream's longest gap between tokens while the prompt is read, its median gap before,
  and the long prompt's time to first token.
- `batch`: `--batch` requests decode together, all with short prompts, then the same with one of them
  holding a `--long-context`-token context; reports the median step time of each and their ratio.

Only the public engine API is used, so the same file can time an older engine checkout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time

import torch

from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args
from engines.sampling import SamplingParams


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def stream_beside_long_prompt(engine: LLMEngine, long_prompt: int, rng: random.Random) -> dict:
    """The stream's token gaps before and while a long prompt is prefilled."""
    vocab = engine.tokenizer.vocab_size
    stream = engine.add_request(
        prompt_token_ids=_prompt(rng, vocab, 64), params=SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    )
    times: list[float] = []
    while len(times) < 20:  # settle into decoding
        for out in engine.step():
            if out.request_id == stream.request_id and out.new_token_ids:
                times.append(time.perf_counter())
    before = statistics.median(b - a for a, b in itertools.pairwise(times))
    arrived = time.perf_counter()
    big = engine.add_request(
        prompt_token_ids=_prompt(rng, vocab, long_prompt), params=SamplingParams(temperature=0, max_tokens=2)
    )
    last, longest, first_token = times[-1], 0.0, None
    while first_token is None:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == stream.request_id and out.new_token_ids:
                longest, last = max(longest, now - last), now
            if out.request_id == big.request_id and out.new_token_ids:
                first_token = now - arrived
    longest = max(longest, time.perf_counter() - last)
    engine.abort(stream.request_id)
    while engine.has_unfinished():
        engine.step()
    return {
        "long_prompt": long_prompt,
        "gap_before_s": before,
        "longest_gap_s": longest,
        "long_prompt_ttft_s": first_token,
    }


def decode_step_s(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of the steps in which every one of these requests decodes."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    times = []
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 and not r.finished for r in reqs)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch_with_long_context(engine: LLMEngine, batch: int, long_context: int, rng: random.Random) -> dict:
    """Decode step time of `batch` short requests, and of the same with one long context among them."""
    vocab = engine.tokenizer.vocab_size
    short = [_prompt(rng, vocab, 64) for _ in range(batch)]
    runs: dict[str, list[float]] = {"short": [], "one_long": []}
    for _ in range(2):  # interleaved
        runs["short"].append(decode_step_s(engine, short, 8))
        runs["one_long"].append(decode_step_s(engine, [_prompt(rng, vocab, long_context), *short[1:]], 8))
    s, one = statistics.median(runs["short"]), statistics.median(runs["one_long"])
    return {"batch": batch, "long_context": long_context, "short_step_s": s, "one_long_step_s": one, "ratio": one / s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, ["dtype"])
    ap.add_argument("--long-prompt", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--long-context", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", choices=["stream", "batch"], default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, drafter="none", max_num_seqs=max(64, args.batch)))
    rng = random.Random(0)
    result: dict = {"dtype": args.dtype}
    if args.skip != "stream":
        result["stream"] = stream_beside_long_prompt(engine, args.long_prompt, rng)
    if args.skip != "batch":
        result["batch"] = batch_with_long_context(engine, args.batch, args.long_context, rng)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
