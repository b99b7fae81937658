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
Drafters that remember recent requests' outputs (suffix, n-gram) forget them before each repeat: the warm-up
and earlier repeats answered these same prompts. `served` (and `served#TAG`) runs exactly the engine settings
`make run` serves (the `engine:` block of serve_config.yaml, or of `--serve-config`), whatever they are, with
the benchmark's prefix-caching flag.
`name@adaptive` runs it under the adaptive speculation policy (engines/spec_decode/policy.py) with that
tree as the caps; `--policy adaptive` adds `DRAFTER@adaptive` to the comparison.
`eagle` and `lyanna` use the checkpoints shipped for the embedded target unless given. With `--compare-hf`,
transformers' `generate` (and, at batch size 1, its prompt-lookup decoding) run the same waves on
the same dequantized checkpoint, and every side produces exactly `--max-new-tokens` tokens (EOS
ignored) so all do equal work. `--compare-llamacpp` does the same with llama.cpp (llama-cpp-python, the
`peers` extra) on its fastest CPU format and as shipped: `llamacpp-q4_0` (the GGUF requantized to Q4_0,
every tensor, cached) and `llamacpp-q4_1` (the shipped GGUF), flash attention on, one sequence at a time
through its C API (`--llamacpp-formats` also takes `bf16`). `--compare-vllm` runs vLLM's CPU build
(`vllm`) on the same token-id prompts, waves and checkpoint folder, in bf16 (fp32 on CPUs without bf16
arithmetic, where vLLM's bf16 linears fall back to emulation: `--vllm-dtype`), from its own virtual
environment (scripts/vllm_cpu_env.sh makes it on demand; `--vllm-venv` or $LYANNA_VLLM_VENV names one),
bound to as many cores as torch uses. Every side reports end-to-end tokens/s (prefill included) and
decode-only tokens/s: the tokens after every sequence of a wave has its first token over the time after
that (llama-bench's `tg`; for llama.cpp, serving one sequence at a time, per sequence). `--repeat N` runs
the interleaved measurement N times and reports per configuration the median and range of tokens/s and
of every ratio (`repeats`). Prefix caching is off unless `--prefix-caching`: warm-up and repeats replay
the same prompts, which would otherwise skip their prefill. `NAME+QUANT` runs a configuration with other
target weights (`none+int8`, `lyanna+none`), and `NAME+eager` on the model's eager layers
(`enforce_eager`: no fused CPU decoder), e.g. `none+eager`, and `NAME+kv-int8` over an int8 KV cache
(`kv_cache_dtype: int8`; `--llamacpp-kv-type q8_0` gives llama.cpp its 8-bit cache), `NAME+deterministic` with
the batch-invariant kernels where Triton runs (`deterministic: true`: its cost on CUDA), and `NAME+steps1`
with one decode step per engine step (`multi_step: 1`; greedy decodes otherwise take up to `--multi-step` a
call). `NAME#TAG` runs a configuration again on another engine of the same settings: `none,none#2` shows how
far two identical engines differ on this machine (the noise floor of every ratio). The last line of stdout
is one JSON object; its top-level fields describe the first configuration, `configs` holds them all, each of
ours with `step_profile_ms`: per kind of engine step (`tree`: verified drafts, `plain`: one step without,
`multi`: several plain decode steps in one call) its count, tokens per step, and milliseconds per step of the
policy, the drafter's catch-up and drafting, the target forward, verification (sampling, the host copy), the
accepted paths' commit, and the engine's own time (`host`); stderr shows it as a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.bench.llamacpp_peer import DEFAULT_FORMATS, FORMATS
from engines.bench.wave import WaveTiming, cpu_info, spread
from engines.datasets import read_prompt_file
from engines.drafters.factory import DRAFTERS
from engines.engine import LLMEngine
from engines.engine_config import EngineConfig, add_engine_args, engine_config_from_args
from engines.kv_cache import cpu_has_half_precision_math
from engines.loader import parse_dtype
from engines.sampling import SamplingParams
from engines.spec_decode.stats import PHASES, SpecStats, StepProfile
from engines.spec_params import SpecParams
from lyanna_kernels import integer_dot


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
    """One decoding configuration's tallies over one repeat (or all of them, pooled)."""

    name: str
    wall_s: float = 0.0
    forwards: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)
    spec: SpecStats = field(default_factory=SpecStats)
    profile: StepProfile = field(default_factory=StepProfile)
    wave_s: list[float] = field(default_factory=list)
    output_tokens: int = 0  # every wave's, summed (outputs keeps the latest tokens per prompt)
    decode_tokens: int = 0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    prompt_tokens: int = 0  # every wave's prompts, summed

    def record(self, wave: list[int], timing: WaveTiming) -> None:
        """Add one wave's outputs and clocks."""
        self.wall_s += timing.wall_s
        self.wave_s.append(timing.wall_s)
        self.output_tokens += sum(len(o) for o in timing.outputs)
        self.decode_tokens += timing.decode_tokens
        self.decode_s += timing.decode_s
        self.first_token_s += timing.first_token_s
        for i, o in zip(wave, timing.outputs, strict=True):
            self.outputs[i] = o

    def merge(self, other: Side) -> None:
        """Pool another repeat's tallies into this one (outputs: the latest)."""
        self.wall_s += other.wall_s
        self.forwards += other.forwards
        self.outputs.update(other.outputs)
        self.spec.add(other.spec)
        self.profile.add(other.profile)
        self.wave_s += other.wave_s
        self.output_tokens += other.output_tokens
        self.decode_tokens += other.decode_tokens
        self.decode_s += other.decode_s
        self.first_token_s += other.first_token_s
        self.prompt_tokens += other.prompt_tokens


# Named configurations beyond the plain drafter names: (drafter, EngineConfig overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "lyanna-no-resampling": ("lyanna", {"lyanna_resampling": False}),
    "lyanna-no-fusion": ("lyanna", {"lyanna_fusion": False}),
    "lyanna-dense": ("lyanna", {"lyanna_token_info_rows": 0}),
    "lyanna-table": ("lyanna", {"lyanna_token_info_rows": 1024}),
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
    "kv_cache_dtype",
    "enforce_eager",
    "deterministic",
    "multi_step",
    "spec_depth",
    "spec_width",
    "spec_budget",
)


JOINED_DRAFTERS = [name for name in DRAFTERS if "+" in name]
SERVE_CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"
REPLICA_ONLY = ("served_model_name", "cpus_per_rank")  # the `engine:` block's settings that are the replica's


def served_settings(path: str | Path = SERVE_CONFIG) -> dict[str, Any]:
    """The engine settings `make run` serves: the `engine:` block of the serve config's first application, less
    the replica's own settings."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    engine = dict(config["applications"][0].get("args", {}).get("engine", {}))
    return {k: v for k, v in engine.items() if k not in REPLICA_ONLY}


def served_engine_config(batch_size: int, prefix_caching: bool, path: str | Path = SERVE_CONFIG) -> EngineConfig:
    """Exactly the engine `make run` serves (`served_settings`), but for prefix caching and room for `batch_size`
    requests a step."""
    served = served_settings(path)
    max_num_seqs = max(served.get("max_num_seqs", 1), batch_size)
    return EngineConfig(**served | {"enable_prefix_caching": prefix_caching, "max_num_seqs": max_num_seqs})


def engine_config(variant: str, args: argparse.Namespace, spec: SpecParams) -> EngineConfig:
    """The engine settings of a configuration name and tree; `NAME@adaptive` runs NAME under the
    adaptive speculation policy, its tree as the caps (and as the shape its start-up profile measures,
    as in serving, where the configured tree is the caps); a `#TAG` suffix names another engine of the
    same settings; `+eager`, `+kv-int8` (an int8 KV cache), `+steps1` (one decode step per engine step:
    `multi_step: 1`), `+deterministic` and `+QUANTIZATION` override those settings."""
    variant = variant.partition("#")[0]
    if variant == "served":  # exactly what is served, but for prefix caching (the benchmark's flag) and batch room
        return served_engine_config(args.batch_size, args.prefix_caching, args.serve_config)
    variant, _, policy = variant.partition("@")
    joined = next((d for d in JOINED_DRAFTERS if variant == d or variant.startswith(d + "+")), None)
    if joined is not None:  # a drafter whose name holds a "+" (lyanna+suffix), options after it
        variant, *options = [joined, *variant[len(joined) + 1 :].split("+")] if variant != joined else [joined]
    else:
        variant, *options = variant.split("+")
    quantization = next((o for o in options if o not in ("eager", "kv-int8", "steps1", "deterministic")), None)
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
        enable_prefix_caching=args.prefix_caching,
        kv_cache_dtype="int8" if "kv-int8" in options else args.kv_cache_dtype,
        multi_step=1 if "steps1" in options else args.multi_step,
        deterministic=args.deterministic or "deterministic" in options,
        **overrides,
    )


def parse_config(text: str, args: argparse.Namespace) -> tuple[str, SpecParams]:
    """'ngram', 'ngram:depth:width:budget', either with a '#TAG' -> (engine name, tree settings); the
    engine name keeps the tag, so a tagged configuration runs on an engine of its own."""
    text, tag, label = text.partition("#")
    name, *nums = text.split(":")
    if name == "served":
        if nums:
            raise SystemExit("configuration 'served' takes its tree from the serve config: no :DEPTH:WIDTH:BUDGET")
        return name + tag + label, EngineConfig(**served_settings(args.serve_config)).spec
    if len(nums) not in (0, 3):
        raise SystemExit(f"bad configuration {text!r}: use NAME or NAME:DEPTH:WIDTH:BUDGET")
    depth, width, budget = (int(n) for n in nums) if nums else (args.spec_depth, args.spec_width, args.spec_budget)
    return name + tag + label, SpecParams(depth=depth, width=width, budget=budget)


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the peers (llama.cpp, vLLM) and of repeated measurement."""
    ap.add_argument(
        "--compare-llamacpp",
        action="store_true",
        help="also time llama.cpp on the GGUF in each of --llamacpp-formats (llama-cpp-python: the `peers` extra)",
    )
    ap.add_argument(
        "--llamacpp-formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated llama.cpp formats, peer llamacpp-FORMAT each (of {', '.join(FORMATS)})",
    )
    ap.add_argument(
        "--llamacpp-flash-attn", action=argparse.BooleanOptionalAction, default=True, help="llama.cpp's flash attention"
    )
    ap.add_argument("--llamacpp-kv-type", choices=("f16", "q8_0"), default="f16",
                    help="llama.cpp's KV cache type (q8_0: the peer of --kv-cache-dtype int8)")  # fmt: skip
    ap.add_argument(
        "--compare-vllm",
        action="store_true",
        help="also time vLLM's CPU build (own virtual environment) on the same checkpoint folder",
    )
    ap.add_argument(
        "--vllm-venv",
        default=None,
        help="vLLM's virtual environment (default $LYANNA_VLLM_VENV, else vllm-cpu in the cache directory; "
        "made by scripts/vllm_cpu_env.sh when it holds no vLLM)",
    )
    ap.add_argument("--vllm-kvcache-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE unless set")
    ap.add_argument(
        "--vllm-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="vLLM's weights and compute: auto = bfloat16 on CPUs with bf16 arithmetic (AVX512-BF16, AMX), else "
        "float32, its faster choice there",
    )
    ap.add_argument("--vllm-args", default=None, help="JSON object of further vllm.LLM arguments")
    ap.add_argument("--repeat", type=int, default=1, help="run the interleaved measurement N times (3+ for ratios)")
    ap.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefix caching in our engines and vLLM (off: repeats would skip the prompts' prefill)",
    )


def vllm_dtype(setting: str) -> str:
    """vLLM's dtype for `--vllm-dtype`: "auto" is bfloat16 where this CPU has bf16 arithmetic, else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if cpu_has_half_precision_math(torch.bfloat16) else "float32"


def make_peers(args: argparse.Namespace, first: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, Any], dict]:
    """The peers the flags ask for (name -> runner with `run(prompts, max_new_tokens, temperature, seed)`)
    and what the JSON records about them."""
    peers: dict[str, Any] = {}
    info: dict[str, Any] = {}
    threads = torch.get_num_threads()
    context = max(len(p) for p in prompts) + args.max_new_tokens
    if args.compare_llamacpp:
        from engines.bench.llamacpp_peer import LlamaCppRunner, format_gguf, llamacpp_system_info
        from engines.loader import gguf_source

        source = gguf_source(args.model)
        if source is None:
            raise SystemExit("--compare-llamacpp needs a GGUF model (the default or a .gguf file)")
        formats = [f for f in args.llamacpp_formats.split(",") if f]
        info["llamacpp"] = {**llamacpp_system_info(), "threads": threads, "flash_attn": args.llamacpp_flash_attn}
        for fmt in formats:
            runner = LlamaCppRunner(
                format_gguf(source, fmt, threads),
                n_ctx=max(4096, context),
                threads=threads,
                flash_attn=args.llamacpp_flash_attn,
                kv_type=args.llamacpp_kv_type,
            )
            peers[f"llamacpp-{fmt}"] = runner
            info[f"llamacpp-{fmt}"] = {"format": FORMATS[fmt], **runner.settings()}
    if args.compare_vllm:
        from engines.bench.vllm_peer import VllmPeer, default_venv, ensure_venv

        venv = ensure_venv(Path(args.vllm_venv).expanduser() if args.vllm_venv else default_venv())
        peer = VllmPeer(
            first.checkpoint,
            venv,
            max_num_seqs=max(args.batch_size, 1),
            max_model_len=-(-context // 256) * 256,
            threads=threads,
            seed=args.seed,
            kvcache_gib=args.vllm_kvcache_gib,
            dtype=vllm_dtype(args.vllm_dtype),
            enable_prefix_caching=args.prefix_caching,
            llm_kwargs=json.loads(args.vllm_args) if args.vllm_args else None,
        )
        peers["vllm"] = peer
        info["vllm"] = {
            "format": f"{peer.settings['dtype']} weights",
            "version": peer.version,
            "threads": threads,
            "omp_threads_bind": peer.bind,
            **peer.settings,
        }
    return peers, info


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
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
    ap.add_argument(
        "--compare",
        default=None,
        help="comma-separated configurations, e.g. none,ngram,ngram:6:3:16; `served` is the served default",
    )
    ap.add_argument(
        "--serve-config",
        default=str(SERVE_CONFIG),
        help="the serve config whose `engine:` block the `served` configuration runs",
    )
    ap.add_argument("--draft-model", default=None, help="checkpoint of the draft model (drafter draft-model)")
    ap.add_argument("--lyanna", default=None, help="Lyanna checkpoint (default: the shipped one)")
    ap.add_argument("--eagle", default=None, help="EAGLE checkpoint (default: the shipped one)")
    # The engine's own settings: flags, defaults and help from EngineConfig (--depth/--width/--budget
    # are the tree of a configuration given without one).
    add_engine_args(ap, [*ENGINE_FLAGS])
    add_peer_args(ap)
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate (+ prompt lookup)")
    ap.add_argument("--hf-prompt-lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up waves per side")
    ap.add_argument(
        "--policy",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="adaptive: also run DRAFTER@adaptive (--drafter, caps --depth/--width/--budget) beside the others",
    )
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its JSON summary as the last line of stdout."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
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
    ignore_eos = args.ignore_eos or args.compare_hf or args.compare_llamacpp or args.compare_vllm
    hf = HFRunner(first, args.dtype) if args.compare_hf else None
    peers, peer_info = make_peers(args, first, prompts)

    def run_ours(name: str, drafter: str, spec: SpecParams, wave: list[int], side: Side | None) -> None:
        engine = engines[drafter]
        params = SamplingParams(
            temperature=args.temperature, seed=args.seed, max_tokens=args.max_new_tokens, ignore_eos=ignore_eos
        )
        executor = engine.executor  # its counters are swapped for this wave's
        before_forwards, before_spec, before_profile = executor.num_forwards, executor.stats, executor.profile
        executor.stats, executor.profile = SpecStats(), StepProfile()
        t0 = time.perf_counter()
        reqs = [engine.add_request(prompt_token_ids=prompts[i], params=params, spec=spec) for i in wave]
        # Decode-only starts after the step at which every request has its first token: checked on the
        # host-side token lists the engine keeps anyway (no device sync), only until that step.
        waiting, t_first, at_first = reqs, None, 0
        while engine.has_unfinished():
            engine.step()
            if waiting:
                waiting = [r for r in waiting if not r.output_token_ids]
                if not waiting:
                    t_first, at_first = time.perf_counter(), sum(len(r.output_token_ids) for r in reqs)
        t_end = time.perf_counter()
        t_first = t_end if t_first is None else t_first
        if side is not None:
            outs = [list(r.output_token_ids) for r in reqs]
            total = sum(len(o) for o in outs)
            side.record(wave, WaveTiming(outs, t_end - t0, total - at_first, t_end - t_first, t_first - t0))
            side.forwards += executor.num_forwards - before_forwards
            side.spec.add(executor.stats)
            side.profile.add(executor.profile)
        executor.stats, executor.profile = before_spec, before_profile

    def run_hf(name: str, wave: list[int], side: Side | None) -> None:
        lookup = args.hf_prompt_lookup if name == "hf-prompt-lookup" else None
        t0 = time.perf_counter()
        outs = hf.run([prompts[i] for i in wave], args.max_new_tokens, args.temperature, lookup)
        if side is not None:  # transformers' generate gives no first-token time: end to end only
            side.record(wave, WaveTiming(outs, time.perf_counter() - t0, 0, 0.0))

    def run_peer(name: str, wave: list[int], side: Side | None) -> None:
        timing = peers[name].run([prompts[i] for i in wave], args.max_new_tokens, args.temperature, args.seed)
        if side is not None:
            side.record(wave, timing)

    runners = [
        (n, lambda w, s, d=d, sp=sp, n=n: run_ours(n, d, sp, w, s)) for n, (d, sp) in zip(names, configs, strict=True)
    ]
    runners += [(n, lambda w, s, n=n: run_peer(n, w, s)) for n in peers]
    if hf:
        runners.append(("hf", lambda w, s: run_hf("hf", w, s)))
        if args.batch_size == 1:  # transformers' assisted generation takes one sequence at a time
            runners.append(("hf-prompt-lookup", lambda w, s: run_hf("hf-prompt-lookup", w, s)))
    waves = [list(range(i, min(i + args.batch_size, len(prompts)))) for i in range(0, len(prompts), args.batch_size)]
    try:
        for w in waves[: args.warmup]:
            for _, run in runners:
                run(w, None)
        repeats: list[dict[str, Side]] = []
        for rep in range(args.repeat):
            for engine in engines.values():  # the warm-up's and earlier repeats' answers to these same prompts
                if engine.executor.drafter is not None:
                    engine.executor.drafter.forget_recent()
            sides = {n: Side(n) for n, _ in runners}
            for k, w in enumerate(waves):
                shift = (k + rep) % len(runners)
                order = runners[shift:] + runners[:shift]
                for n, run in order:
                    run(w, sides[n])
                    sides[n].prompt_tokens += sum(len(prompts[i]) for i in w)
                print(
                    f"repeat {rep + 1}/{args.repeat} wave {k + 1}/{len(waves)}: "
                    + ", ".join(f"{n} {sides[n].wave_s[-1]:.2f}s" for n, _ in order),
                    file=sys.stderr,
                )
            repeats.append(sides)
    finally:
        for peer in peers.values():
            if hasattr(peer, "close"):
                peer.close()

    pooled = {n: Side(n) for n in repeats[0]}
    for sides in repeats:
        for n, side in sides.items():
            pooled[n].merge(side)
    ours = [n for n in names if n in pooled]
    per_config = summarize(pooled, ours, list(peers), len(prompts))
    runs = [summarize(sides, ours, list(peers), len(prompts)) for sides in repeats]
    for n, out in per_config.items():
        ratio_prefixes = ("speedup_vs_", "decode_speedup", "prefill_speedup")
        metrics = [k for k in runs[0][n] if k in SPREAD_METRICS or k.startswith(ratio_prefixes)]
        out["repeats"] = {
            k: spread([r[n][k] for r in runs]) for k in metrics if not k.endswith("_median_wave") and runs[0][n][k]
        }
        if n in ours:
            variant, spec = configs[names.index(n)]  # (configurations of one drafter share an engine)
            engine = engines[variant]
            out["format"] = our_format(engine)
            c = engine.config
            out["settings"] = {
                "drafter": c.drafter,
                "spec_policy": c.spec_policy,
                "tree": [spec.depth, spec.width, spec.budget],
                "multi_step": c.multi_step,
                "quantization": c.quantization,
                "dtype": c.dtype,
            }
        elif n in peer_info:
            out["format"] = peer_info[n]["format"]
    if "hf-prompt-lookup" in per_config:
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
        "repeat": args.repeat,
        "prefix_caching": args.prefix_caching,
        "dtype": str(parse_dtype(args.dtype)).removeprefix("torch."),
        "device": str(first.device),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "kernel_paths": integer_dot.kernel_paths(),  # the integer-dot path each class of row counts took
        "peers": peer_info,
        "configs": per_config,
    }
    if hf:
        h = pooled["hf"]
        ratios = [h_s / o_s for h_s, o_s in zip(h.wave_s, pooled[names[0]].wave_s, strict=True)]
        result.update(
            {
                "hf_tokens_per_s": per_config["hf"]["tokens_per_s"],
                "hf_wall_s": h.wall_s,
                "speedup_vs_hf": primary["tokens_per_s"] / per_config["hf"]["tokens_per_s"],
                "speedup_vs_hf_median_wave": statistics.median(ratios),
                "identical_to_hf": sum(pooled[names[0]].outputs[i] == h.outputs[i] for i in h.outputs) / len(prompts),
            }
        )
    result["outputs"] = [{"id": r["id"], "token_ids": pooled[names[0]].outputs[i]} for i, r in enumerate(records)]
    for n in ours:
        print(profile_table(n, pooled[n].profile), file=sys.stderr)
    print(json.dumps(result))
    return result


def profile_table(name: str, profile: StepProfile) -> str:
    """A configuration's step profile as text: per kind of engine step, milliseconds per step by phase."""
    columns = ("steps", "tokens_per_step", *PHASES, "total", "per_token")
    lines = [f"step profile of {name} (ms per step; per_token: ms per emitted token)"]
    lines.append("  " + f"{'kind':<6}" + "".join(f"{c:>16}" for c in columns))
    for kind, row in profile.breakdown().items():
        cells = [f"{row[c]:>16d}" if c == "steps" else f"{row[c]:>16.2f}" for c in columns]
        lines.append("  " + f"{kind:<6}" + "".join(cells))
    return "\n".join(lines)


# Per-configuration metrics that `repeats` gives as median and range (with every speedup_* ratio).
SPREAD_METRICS = ("tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s")


def our_format(engine: LLMEngine) -> str:
    """What our engine's weights run as, for the JSON."""
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    return f"{engine.quantization} weights, {dtype}"


def summarize(sides: dict[str, Side], ours: list[str], peers: list[str], num_prompts: int) -> dict[str, dict]:
    """Each side's figures and its ratios: ours against `none` (speedup_vs_none) and against each peer
    (speedup_vs_PEER end to end, decode_speedup_vs_PEER decode-only)."""
    base = sides.get("none")
    per: dict[str, dict[str, Any]] = {}
    for n, side in sides.items():
        out: dict[str, Any] = {
            "tokens_per_s": side.output_tokens / side.wall_s,
            "output_tokens": side.output_tokens,
            "wall_s": side.wall_s,
            "decode_tokens_per_s": side.decode_tokens / side.decode_s if side.decode_tokens and side.decode_s else None,
            "decode_tokens": side.decode_tokens,
            "decode_s": side.decode_s,
            "first_token_s": side.first_token_s,
            # prompt tokens read per second until each wave's sequences all had their first token
            "prefill_tokens_per_s": side.prompt_tokens / side.first_token_s if side.first_token_s > 0 else None,
        }
        if n in ours:
            out.update(
                {
                    "target_forwards": side.forwards,
                    "mean_accepted_tokens": side.spec.mean_accepted_tokens if side.spec.num_steps else 1.0,
                    "acceptance_by_depth": side.spec.acceptance_by_depth,
                    "draft_tokens": side.spec.num_draft_tokens,
                    "accepted_tokens": side.spec.num_accepted_tokens,
                    # per kind of engine step (tree, plain, multi): milliseconds per step by phase
                    "step_profile_ms": side.profile.breakdown(),
                }
            )
        if base is not None and not n.startswith("hf"):
            out["speedup_vs_none"] = out["tokens_per_s"] / (base.output_tokens / base.wall_s)
            # robust to a machine whose speed drifts between waves: the waves are interleaved
            out["speedup_vs_none_median_wave"] = statistics.median(
                b / s for b, s in zip(base.wave_s, side.wave_s, strict=True)
            )
            if out["decode_tokens_per_s"] and base.decode_tokens and base.decode_s > 0:
                out["decode_speedup_vs_none"] = out["decode_tokens_per_s"] / (base.decode_tokens / base.decode_s)
            out["identical_to_none"] = sum(side.outputs[i] == base.outputs[i] for i in base.outputs) / num_prompts
        per[n] = out
    for p in peers:  # our configurations against each peer on the same waves
        for n in ours:
            out, peer = per[n], per[p]
            out[f"speedup_vs_{p}"] = out["tokens_per_s"] / peer["tokens_per_s"]
            out[f"speedup_vs_{p}_median_wave"] = statistics.median(
                a / b for a, b in zip(sides[p].wave_s, sides[n].wave_s, strict=True)
            )
            if out["decode_tokens_per_s"] and peer["decode_tokens_per_s"]:
                out[f"decode_speedup_vs_{p}"] = out["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
            if out["prefill_tokens_per_s"] and peer["prefill_tokens_per_s"]:
                out[f"prefill_speedup_vs_{p}"] = out["prefill_tokens_per_s"] / peer["prefill_tokens_per_s"]
            out[f"identical_to_{p}"] = sum(sides[n].outputs[i] == sides[p].outputs[i] for i in sides[p].outputs) / (
                num_prompts
            )
    return per


if __name__ == "__main__":
    main()
