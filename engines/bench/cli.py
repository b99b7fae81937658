"""Offline decoding benchmark: our engine's decoding configurations side by side, and transformers.

    python -m engines.bench --prompts FILE.jsonl --max-new-tokens 64 --batch-size 1 \\
        --compare none,ngram,ngram:6:3:16 [--compare-hf]

Prompts are served in waves of `--batch-size` conversations submitted together. Every
configuration runs every wave, in rotating order, in one process, so machine noise hits all of them
alike. A configuration is a drafter name (`none`, `ngram`, `draft-model`, `eagle`, `lyanna`) or a
Lyanna variant (`lyanna-no-resampling`, `lyanna-no-fusion`: re-sampled trees verified alone instead
of fused, `lyanna-dense`: token info from the low-rank product instead of the hot-token table,
`lyanna-eager-draft`: the drafter's layer eager in its own dtype, `draft_quantization: none`; and
`eagle-eager-draft`, the same for EAGLE),
optionally with its tree as `name:depth:width:budget` (default: `--depth`, `--width`, `--budget`).
`name@adaptive` runs it under the adaptive speculation policy (engines/spec_decode/policy.py) with that
tree as the caps; `--policy adaptive` adds `DRAFTER@adaptive` to the comparison.
`eagle` and `lyanna` use the checkpoints shipped for the embedded target unless given. With `--compare-hf`,
transformers' `generate` (and, at batch size 1, its prompt-lookup decoding) run the same waves on
the same dequantized checkpoint, and every side produces exactly `--max-new-tokens` tokens (EOS
ignored) so all do equal work. `--compare-llamacpp` does the same with llama.cpp (llama-cpp-python)
on the GGUF as shipped (`llamacpp`) and converted to bf16 (`llamacpp-bf16`); it serves one sequence
at a time. `NAME+QUANT` runs a configuration with other target weights (`none+int8`, `lyanna+none`), and
`NAME+eager` on the model's eager layers (`enforce_eager`: no fused CPU decoder), e.g. `none+eager`.
`NAME#TAG` runs a configuration again on another engine of the same settings: `none,none#2` shows
how far two identical engines differ on this machine (the noise floor of every ratio).
The last line of stdout is one JSON object; its top-level fields
describe the first configuration, `configs` holds them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.datasets import read_prompt_file
from engines.engine import LLMEngine
from engines.engine_config import EngineConfig, add_engine_args, engine_config_from_args
from engines.loader import parse_dtype
from engines.sampling import SamplingParams
from engines.spec_decode.stats import SpecStats
from engines.spec_params import SpecParams


class HFRunner:
    """transformers' LlamaForCausalLM.generate on the same checkpoint folder (left-padded batches)."""

    def __init__(self, engine: LLMEngine, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(engine.checkpoint), dtype=parse_dtype(dtype))
        self.model.to(engine.device).eval()
        self.device = engine.device
        self.pad = engine.tokenizer.hf.pad_token_id or 0

    @torch.inference_mode()
    def run(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, prompt_lookup: int | None = None
    ) -> list[list[int]]:
        """Generate exactly `max_new_tokens` tokens per prompt; returns the new token ids."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        if prompt_lookup:
            sampling["prompt_lookup_num_tokens"] = prompt_lookup
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=self.pad,
            **sampling,
        )
        return out[:, width:].tolist()


@dataclass
class Side:
    """One decoding configuration's tallies over the run."""

    name: str
    wall_s: float = 0.0
    forwards: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)
    spec: SpecStats = field(default_factory=SpecStats)
    wave_s: list[float] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())


# Named configurations beyond the plain drafter names: (drafter, EngineConfig overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "lyanna-no-resampling": ("lyanna", {"lyanna_resampling": False}),
    "lyanna-no-fusion": ("lyanna", {"lyanna_fusion": False}),
    "lyanna-dense": ("lyanna", {"lyanna_token_info_rows": 0}),
    "lyanna-eager-draft": ("lyanna", {"draft_quantization": "none"}),
    "eagle-eager-draft": ("eagle", {"draft_quantization": "none"}),
}


ENGINE_FLAGS = (
    "model",
    "dtype",
    "device",
    "tensor_parallel_size",
    "kernels",
    "quantization",
    "enforce_eager",
    "spec_depth",
    "spec_width",
    "spec_budget",
)


def engine_config(variant: str, args: argparse.Namespace, spec: SpecParams) -> EngineConfig:
    """The engine settings of a configuration name and tree; `NAME@adaptive` runs NAME under the
    adaptive speculation policy, its tree as the caps (and as the shape its start-up profile measures,
    as in serving, where the configured tree is the caps); a `#TAG` suffix names another engine of the
    same settings."""
    variant = variant.partition("#")[0]
    variant, _, policy = variant.partition("@")
    variant, *options = variant.split("+")
    quantization = next((o for o in options if o != "eager"), None)
    drafter, overrides = VARIANTS.get(variant, (variant, {}))
    checkpoint = {"draft-model": args.draft_model, "lyanna": args.lyanna, "eagle": args.eagle}.get(drafter)
    return engine_config_from_args(
        args,
        quantization=quantization or args.quantization,
        max_num_seqs=max(args.batch_size, 1),
        drafter=drafter,
        draft_model=checkpoint,
        spec_depth=spec.depth,
        spec_width=spec.width,
        spec_budget=spec.budget,
        spec_policy=policy or "fixed",
        enforce_eager=args.enforce_eager or "eager" in options,
        **overrides,
    )


def parse_config(text: str, args: argparse.Namespace) -> tuple[str, SpecParams]:
    """'ngram', 'ngram:depth:width:budget', either with a '#TAG' -> (engine name, tree settings); the
    engine name keeps the tag, so a tagged configuration runs on an engine of its own."""
    text, tag, label = text.partition("#")
    name, *nums = text.split(":")
    if len(nums) not in (0, 3):
        raise SystemExit(f"bad configuration {text!r}: use NAME or NAME:DEPTH:WIDTH:BUDGET")
    depth, width, budget = (int(n) for n in nums) if nums else (args.spec_depth, args.spec_width, args.spec_budget)
    return name + tag + label, SpecParams(depth=depth, width=width, budget=budget)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its JSON summary as the last line of stdout."""
    ap = argparse.ArgumentParser(
        prog="python -m engines.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", required=True, help="JSON Lines file, one {'id', 'messages'} per line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--drafter", default="none", help="drafter when --compare is not given")
    ap.add_argument("--compare", default=None, help="comma-separated configurations, e.g. none,ngram,ngram:6:3:16")
    ap.add_argument("--draft-model", default=None, help="checkpoint of the draft model (drafter draft-model)")
    ap.add_argument("--lyanna", default=None, help="Lyanna checkpoint (default: the shipped one)")
    ap.add_argument("--eagle", default=None, help="EAGLE checkpoint (default: the shipped one)")
    # The engine's own settings: flags, defaults and help from EngineConfig (--depth/--width/--budget
    # are the tree of a configuration given without one).
    add_engine_args(ap, [*ENGINE_FLAGS])
    ap.add_argument(
        "--compare-llamacpp",
        action="store_true",
        help="also time llama.cpp on the same GGUF as shipped and converted to bf16 (the `peers` extra)",
    )
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate (+ prompt lookup)")
    ap.add_argument("--hf-prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up waves per side")
    ap.add_argument(
        "--policy",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="adaptive: also run DRAFTER@adaptive (--drafter, caps --depth/--width/--budget) beside the others",
    )
    args = ap.parse_args(argv)
    if args.policy == "adaptive":
        adaptive = f"{args.drafter}@adaptive:{args.spec_depth}:{args.spec_width}:{args.spec_budget}"
        args.compare = f"{args.compare},{adaptive}" if args.compare else adaptive

    records = read_prompt_file(args.prompts)[: args.num_prompts]
    configs = [parse_config(c, args) for c in (args.compare or args.drafter).split(",")]
    names = (args.compare or args.drafter).split(",")
    engines: dict[str, LLMEngine] = {}
    for variant, spec in configs:
        if variant not in engines:
            engines[variant] = LLMEngine(engine_config(variant, args, spec))
    first = next(iter(engines.values()))
    prompts = [first.tokenizer.apply_chat_template(r["messages"]) for r in records]
    ignore_eos = args.ignore_eos or args.compare_hf or args.compare_llamacpp
    hf = HFRunner(first, args.dtype) if args.compare_hf else None
    peers: dict[str, Any] = {}
    if args.compare_llamacpp:
        from engines.bench.llamacpp_peer import LlamaCppRunner, bf16_gguf
        from engines.loader import gguf_source

        source = gguf_source(args.model)
        if source is None:
            raise SystemExit("--compare-llamacpp needs a GGUF model (the default or a .gguf file)")
        peers = {"llamacpp": LlamaCppRunner(source), "llamacpp-bf16": LlamaCppRunner(bf16_gguf(source))}

    def run_ours(name: str, drafter: str, spec: SpecParams, wave: list[int], side: Side | None) -> None:
        engine = engines[drafter]
        params = SamplingParams(
            temperature=args.temperature, seed=args.seed, max_tokens=args.max_new_tokens, ignore_eos=ignore_eos
        )
        executor = engine.executor  # its counters are swapped for this wave's
        before_forwards, before_spec = executor.num_forwards, executor.stats
        executor.stats = SpecStats()
        reqs = [engine.add_request(prompt_token_ids=prompts[i], params=params, spec=spec) for i in wave]
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t0
        if side is not None:
            side.wall_s += dt
            side.wave_s.append(dt)
            side.forwards += executor.num_forwards - before_forwards
            side.spec.add(executor.stats)
            for i, r in zip(wave, reqs, strict=True):
                side.outputs[i] = list(r.output_token_ids)
        executor.stats = before_spec

    def run_other(generate, wave: list[int], side: Side | None) -> None:
        """Time another system's `generate(prompts)` on a wave and record its outputs."""
        t0 = time.perf_counter()
        outs = generate([prompts[i] for i in wave])
        dt = time.perf_counter() - t0
        if side is not None:
            side.wall_s += dt
            side.wave_s.append(dt)
            for i, o in zip(wave, outs, strict=True):
                side.outputs[i] = o

    def run_hf(name: str, wave: list[int], side: Side | None) -> None:
        lookup = args.hf_prompt_lookup if name == "hf-prompt-lookup" else None
        run_other(lambda ps: hf.run(ps, args.max_new_tokens, args.temperature, lookup), wave, side)

    def run_peer(name: str, wave: list[int], side: Side | None) -> None:
        run_other(lambda ps: peers[name].run(ps, args.max_new_tokens, args.temperature, args.seed), wave, side)

    runners = [
        (n, lambda w, s, d=d, sp=sp, n=n: run_ours(n, d, sp, w, s)) for n, (d, sp) in zip(names, configs, strict=True)
    ]
    runners += [(n, lambda w, s, n=n: run_peer(n, w, s)) for n in peers]
    if hf:
        runners.append(("hf", lambda w, s: run_hf("hf", w, s)))
        if args.batch_size == 1:  # transformers' assisted generation takes one sequence at a time
            runners.append(("hf-prompt-lookup", lambda w, s: run_hf("hf-prompt-lookup", w, s)))
    sides = {n: Side(n) for n, _ in runners}
    waves = [list(range(i, min(i + args.batch_size, len(prompts)))) for i in range(0, len(prompts), args.batch_size)]
    for w in waves[: args.warmup]:
        for _, run in runners:
            run(w, None)
    for k, w in enumerate(waves):
        order = runners[k % len(runners) :] + runners[: k % len(runners)]
        for _, run in order:
            run(w, sides[_])
        print(
            f"wave {k + 1}/{len(waves)}: " + ", ".join(f"{n} {sides[n].wave_s[-1]:.2f}s" for n, _ in order),
            file=sys.stderr,
        )

    def summary(side: Side, base: Side | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens_per_s": side.output_tokens / side.wall_s,
            "output_tokens": side.output_tokens,
            "wall_s": side.wall_s,
        }
        if not side.name.startswith(("hf", "llamacpp")):
            out.update(
                {
                    "target_forwards": side.forwards,
                    "mean_accepted_tokens": side.spec.mean_accepted_tokens if side.spec.num_steps else 1.0,
                    "acceptance_by_depth": side.spec.acceptance_by_depth,
                    "draft_tokens": side.spec.num_draft_tokens,
                    "accepted_tokens": side.spec.num_accepted_tokens,
                }
            )
        if base is not None:
            out["speedup_vs_none"] = out["tokens_per_s"] / (base.output_tokens / base.wall_s)
            # robust to a machine whose speed drifts between waves: the waves are interleaved
            out["speedup_vs_none_median_wave"] = statistics.median(
                b / s for b, s in zip(base.wave_s, side.wave_s, strict=True)
            )
            out["identical_to_none"] = sum(side.outputs[i] == base.outputs[i] for i in base.outputs) / len(prompts)
        return out

    base = sides.get("none")
    per_config = {n: summary(sides[n], base if not n.startswith("hf") else None) for n in sides}
    for n in peers:  # our configurations against llama.cpp's plain decoding of the same GGUF
        for ours in names:
            per_config[ours][f"speedup_vs_{n}"] = per_config[ours]["tokens_per_s"] / per_config[n]["tokens_per_s"]
            per_config[ours][f"speedup_vs_{n}_median_wave"] = statistics.median(
                p / o for p, o in zip(sides[n].wave_s, sides[ours].wave_s, strict=True)
            )
    if "hf-prompt-lookup" in sides:
        per_config["hf-prompt-lookup"]["speedup_vs_hf"] = (
            per_config["hf-prompt-lookup"]["tokens_per_s"] / per_config["hf"]["tokens_per_s"]
        )
    primary = per_config[names[0]]
    result: dict[str, Any] = {
        **primary,
        "config": names[0],
        "batch_size": args.batch_size,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "dtype": str(parse_dtype(args.dtype)).removeprefix("torch."),
        "device": str(first.device),
        "torch_threads": torch.get_num_threads(),
        "configs": per_config,
    }
    if hf:
        h = sides["hf"]
        ratios = [h_s / o_s for h_s, o_s in zip(h.wave_s, sides[names[0]].wave_s, strict=True)]
        result.update(
            {
                "hf_tokens_per_s": per_config["hf"]["tokens_per_s"],
                "hf_wall_s": h.wall_s,
                "speedup_vs_hf": primary["tokens_per_s"] / per_config["hf"]["tokens_per_s"],
                "speedup_vs_hf_median_wave": statistics.median(ratios),
                "identical_to_hf": sum(sides[names[0]].outputs[i] == h.outputs[i] for i in h.outputs) / len(prompts),
            }
        )
    result["outputs"] = [{"id": r["id"], "token_ids": sides[names[0]].outputs[i]} for i, r in enumerate(records)]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
