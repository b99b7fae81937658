"""Offline decoding benchmark of our engine, optionally against transformers' `generate`.

    python -m engines.bench --prompts FILE.jsonl --max-new-tokens 64 --batch-size 4 [--compare-hf]

Prompts are served in waves of `--batch-size` conversations submitted together. With
`--compare-hf`, transformers' `generate` runs the same waves on the same dequantized checkpoint,
dtype and settings in the same process, alternating which side goes first, and both sides produce
exactly `--max-new-tokens` tokens per prompt (EOS ignored) so they do equal work. The last line
of stdout is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from engines.datasets import read_prompt_file
from engines.engine import EngineConfig, LLMEngine
from engines.loader import parse_dtype
from engines.sampling import SamplingParams


class HFRunner:
    """transformers' LlamaForCausalLM.generate on the same checkpoint folder (left-padded batches)."""

    def __init__(self, engine: LLMEngine, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(engine.checkpoint), dtype=parse_dtype(dtype))
        self.model.to(engine.device).eval()
        self.device = engine.device
        self.pad = engine.tokenizer.hf.pad_token_id or 0

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
        """Generate exactly `max_new_tokens` tokens per prompt; returns the new token ids."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=self.pad,
            **sampling,
        )
        return out[:, width:].tolist()


def run_ours(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """One wave on our engine; returns output ids and the target forwards it took."""
    before = engine.num_forwards
    done = engine.generate(prompts, params)
    return [c.token_ids for c in done], engine.num_forwards - before


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its JSON summary as the last line of stdout."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSON Lines file, one {'id', 'messages'} per line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compare-hf", action="store_true", help="time transformers' generate on the same waves")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up waves per side")
    args = ap.parse_args(argv)

    records = read_prompt_file(args.prompts)[: args.num_prompts]
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_size, 1))
    )
    prompts = [engine.tokenizer.apply_chat_template(r["messages"]) for r in records]
    ignore_eos = args.ignore_eos or args.compare_hf
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_new_tokens, ignore_eos=ignore_eos
    )
    waves = [list(range(i, min(i + args.batch_size, len(prompts)))) for i in range(0, len(prompts), args.batch_size)]
    hf = HFRunner(engine, args.dtype) if args.compare_hf else None

    for w in waves[: args.warmup]:
        run_ours(engine, [prompts[i] for i in w], params)
        if hf:
            hf.run([prompts[i] for i in w], args.max_new_tokens, args.temperature)

    outputs: list[list[int]] = [[] for _ in prompts]
    hf_outputs: list[list[int]] = [[] for _ in prompts]
    ours_s = hf_s = 0.0
    forwards = 0
    ratios = []
    for k, w in enumerate(waves):
        batch = [prompts[i] for i in w]
        sides = ["ours", "hf"] if k % 2 == 0 else ["hf", "ours"]
        times = {}
        for side in sides:
            if side == "hf" and hf is None:
                continue
            t0 = time.perf_counter()
            if side == "ours":
                outs, f = run_ours(engine, batch, params)
                forwards += f
                for i, o in zip(w, outs, strict=True):
                    outputs[i] = o
            else:
                for i, o in zip(w, hf.run(batch, args.max_new_tokens, args.temperature), strict=True):
                    hf_outputs[i] = o
            times[side] = time.perf_counter() - t0
        ours_s += times["ours"]
        if hf:
            hf_s += times["hf"]
            ratios.append(times["hf"] / times["ours"])
        print(f"wave {k + 1}/{len(waves)}: " + ", ".join(f"{s} {t:.2f}s" for s, t in times.items()), file=sys.stderr)

    n_out = sum(len(o) for o in outputs)
    result: dict[str, Any] = {
        "tokens_per_s": n_out / ours_s,
        "output_tokens": n_out,
        "wall_s": ours_s,
        "target_forwards": forwards,
        "batch_size": args.batch_size,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "dtype": str(parse_dtype(args.dtype)).removeprefix("torch."),
        "device": str(engine.device),
        "torch_threads": torch.get_num_threads(),
    }
    if hf:
        hf_tokens = sum(len(o) for o in hf_outputs)
        result.update(
            {
                "hf_tokens_per_s": hf_tokens / hf_s,
                "hf_wall_s": hf_s,
                "speedup_vs_hf": (n_out / ours_s) / (hf_tokens / hf_s),
                "speedup_vs_hf_median_wave": statistics.median(ratios),
                "identical_to_hf": sum(a == b for a, b in zip(outputs, hf_outputs, strict=True)) / len(prompts),
            }
        )
    result["outputs"] = [{"id": r["id"], "token_ids": o} for r, o in zip(records, outputs, strict=True)]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
