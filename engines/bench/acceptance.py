"""Conditional acceptance by draft step for several drafters (the Lyanna paper's Table 1 layout).

    python -m engines.acceptance --prompts val.jsonl --num-prompts 16 --depth 3 --width 4 --budget 16 \\
        --drafter lyanna=lyanna:CKPT --drafter eagle=eagle:CKPT --drafter lyanna-table=lyanna:CKPT:table

Each `--drafter LABEL=KIND[:CHECKPOINT][:dense|:table][:noresample]` decodes the same prompts greedily with
the same tree settings; `dense` (the default) gives Lyanna the low-rank token info of every token, `table`
that of the 1,024 most frequent tokens only (a lookup table), `noresample` turns off its re-sampling
after a rejection (and so verification fusion: every verified draft is then a fresh one, as EAGLE's are).
Step d's conditional acceptance is P(the accepted path reaches depth d | it reached d-1 and the tree had a
node at depth d). Prints a markdown table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json

from engines.datasets import read_prompt_file
from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args
from engines.sampling import SamplingParams

FLAGS = {
    "dense": {"lyanna_token_info_rows": 0},
    "table": {"lyanna_token_info_rows": 1024},
    "noresample": {"lyanna_resampling": False},
}
SYNTAX = "LABEL=KIND[:CHECKPOINT][:dense|:table][:noresample]"


def parse_drafter(text: str, **settings) -> tuple[str, EngineConfig]:
    """'LABEL=KIND[:CHECKPOINT][:FLAG...]' -> (label, engine settings; `settings` adds the rest)."""
    label, _, rest = text.partition("=")
    if not rest:
        raise SystemExit(f"bad --drafter {text!r}: use {SYNTAX}")
    parts = rest.split(":")
    extra: dict = {}
    while len(parts) > 1 and parts[-1] in FLAGS:
        extra |= FLAGS[parts.pop()]
    if len(parts) > 2:
        raise SystemExit(f"bad --drafter {text!r}: use {SYNTAX}")
    kind, checkpoint = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
    return label, EngineConfig(drafter=kind, draft_model=checkpoint, **extra, **settings)


def main(argv: list[str] | None = None) -> dict:
    """Measure and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    add_engine_args(ap, ["spec_depth", "spec_width", "spec_budget", "dtype"])
    ap.add_argument("--drafter", action="append", required=True, help=SYNTAX)
    args = ap.parse_args(argv)
    records = read_prompt_file(args.prompts)[: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    rows: dict[str, dict] = {}
    for text in args.drafter:
        label, cfg = parse_drafter(
            text,
            dtype=args.dtype,
            spec_depth=args.spec_depth,
            spec_width=args.spec_width,
            spec_budget=args.spec_budget,
            max_num_seqs=args.batch_size,
        )
        engine = LLMEngine(cfg)
        engine.generate([r["messages"] for r in records], params)
        stats = engine.stats().spec
        rows[label] = {
            "acceptance_by_depth": stats.acceptance_by_depth,
            "mean_accepted_tokens": stats.mean_accepted_tokens,
            "steps": stats.num_steps,
        }
    print("| drafter | " + " | ".join(f"step {d}" for d in range(1, args.spec_depth + 1)) + " | tokens/step |")
    print("| --- " * (args.spec_depth + 2) + "|")
    for label, r in rows.items():
        acc = (r["acceptance_by_depth"] + [0.0] * args.spec_depth)[: args.spec_depth]
        print(f"| {label} | " + " | ".join(f"{a:.1%}" for a in acc) + f" | {r['mean_accepted_tokens']:.2f} |")
    result = {
        "depth": args.spec_depth,
        "width": args.spec_width,
        "budget": args.spec_budget,
        "prompts": len(records),
        "rows": rows,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
