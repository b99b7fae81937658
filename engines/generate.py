"""Generate one chat completion on the command line and report its speed.

python -m engines.generate --prompt "Explain speculative decoding."
python -m engines.generate --messages conversation.json --temperature 0.7 --seed 1
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from engines.engine import LLMEngine
from engines.engine_config import add_engine_args, engine_config_from_args
from engines.errors import InvalidRequestError
from engines.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, stream the completion to stdout, print tokens/s to stderr."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single user message")
    src.add_argument("--messages", help="JSON file with an OpenAI-style list of messages")
    ap.add_argument("--system", default=None, help="system message to put before --prompt")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(ap)  # every engine setting, with EngineConfig's defaults (--depth/--width/--budget: the tree)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    if args.prompt is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    else:
        messages = json.loads(Path(args.messages).read_text())
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    try:
        params.validate(vocab_size=sys.maxsize)  # fail fast, before the model loads
        config = engine_config_from_args(args)
    except ValueError as e:  # an impossible setting, before the model loads
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(config)
        req = engine.add_request(messages, params)
    except InvalidRequestError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    first = None
    n = 0
    reason = None
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            n = out.num_output_tokens
            last = out
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            reason = out.finish_reason
    end = time.perf_counter()
    decode_s = end - (first or end)
    print(file=sys.stdout)
    print(
        f"[{n} tokens, finish_reason={reason.value if reason else None}, prompt {req.num_prompt_tokens} tokens, "
        f"TTFT {((first or end) - start) * 1e3:.0f} ms, {n / (end - start):.1f} tokens/s overall, "
        f"{(n - 1) / decode_s if n > 1 and decode_s > 0 else 0:.1f} tokens/s decoding, "
        f"{last.num_forwards if last else 0} target forwards, "
        f"{last.num_accepted_tokens if last else 0}/{last.num_draft_tokens if last else 0} draft tokens accepted]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
