"""`python -m loadtest --url http://127.0.0.1:8000 --stages 30x4 --out-dir /tmp/lt`: a bounded headless
load test against an OpenAI-compatible endpoint; prints the JSON summary as its last line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from loadtest.runner import LoadTestConfig, check_target, parse_stages, run_load_test, slo_settings


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the test, print the summary."""
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--stages",
        default="30x4",
        help="comma-separated stages: SECONDSxUSERS (closed loop, fixed concurrency) or SECONDS@RATE "
        "(Poisson arrivals per second), e.g. 20x1,60x12,60x0",
    )
    ap.add_argument("--max-requests", type=int, default=None, help="start at most this many requests")
    ap.add_argument("--prompts", default="sharegpt", help="sharegpt, synthetic, or a JSON Lines prompt file")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-words", type=int, default=64, help="length of synthetic prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slo-mix", default=None, help="SLO classes and weights, e.g. interactive:0.5,batch:0.5")
    ap.add_argument(
        "--slo-config", default=None, help="serve config whose args.slo classes define goodput (default: built-in)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    ap.add_argument(
        "--sample-interval-s",
        type=float,
        default=5.0,
        help="how often to sample replica counts (each sample costs the ingress a `serve.status()`)",
    )
    ap.add_argument("--allow-remote", action="store_true", help="allow a target that is not a loopback address")
    ap.add_argument("--out-dir", default=None, help="write summary.json, requests.jsonl and PNG plots here")
    args = ap.parse_args(argv)
    try:
        check_target(args.url, args.allow_remote)
        cfg = LoadTestConfig(
            url=args.url.rstrip("/"),
            model=args.model,
            stages=parse_stages(args.stages),
            max_requests=args.max_requests,
            prompts=args.prompts,
            num_prompts=args.num_prompts,
            input_words=args.input_words,
            max_tokens=args.max_tokens,
            slo_mix=args.slo_mix,
            seed=args.seed,
            request_timeout_s=args.timeout_s,
            sample_interval_s=args.sample_interval_s,
            allow_remote=args.allow_remote,
            out_dir=args.out_dir,
            slo=slo_settings(args.slo_config),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = asyncio.run(run_load_test(cfg))
    print(json.dumps(summary))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
