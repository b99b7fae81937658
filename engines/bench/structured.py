"""Structured outputs under speculation: JSON-schema outputs against free text on the same prompts.

    python -m engines.bench.structured --num-prompts 50 --drafter lyanna [--spec-policy adaptive]
    python -m engines.bench.structured --libraries   # xgrammar against llguidance (both installed)

Every prompt asks for a JSON record of one subject (`SUBJECTS`); the constrained side decodes it under
`SCHEMA` (`response_format: json_schema`), the free side decodes the same prompt without a constraint,
both on one engine with the same speculation, wave by wave (`--batch-size` prompts) in alternating
order, so machine noise hits both alike. Reported: the share of constrained outputs that parse and
validate against the schema, each side's tokens/s, the ratio (constrained / free: whole run and
median of waves) and the speculation counters. `--libraries` measures the grammar libraries on the
embedded model's tokenizer instead: vocabulary set-up, compiling `SCHEMA`, the per-token mask along a
valid document, and the masks of a 7-node draft tree filled with accept/rollback.
The last line of stdout is one JSON object.
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

from engines.engine import LLMEngine
from engines.engine_config import add_engine_args, engine_config_from_args
from engines.sampling import SamplingParams
from engines.spec_decode.stats import SpecStats
from engines.structured_params import StructuredOutputParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "kind": {"type": "string", "enum": ["person", "place", "animal", "food", "object", "idea"]},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["name", "kind", "summary"],
    "additionalProperties": False,
}
# The same with shorter caps on the name and the tags: xgrammar's slow case (masks of milliseconds near them)
CAPPED = json.loads(json.dumps(SCHEMA))
CAPPED["properties"]["name"]["maxLength"] = 40
CAPPED["properties"]["tags"]["items"] = {"type": "string", "maxLength": 20}
SUBJECTS = [
    "Marie Curie", "the Eiffel Tower", "a red panda", "sourdough bread", "the compass", "democracy",
    "Ada Lovelace", "Mount Everest", "the octopus", "sushi", "the printing press", "gravity",
    "Nelson Mandela", "the Amazon river", "the honeybee", "pizza", "the telescope", "music",
    "Leonardo da Vinci", "the Sahara desert", "the blue whale", "chocolate", "the bicycle", "friendship",
    "Albert Einstein", "Tokyo", "the penguin", "coffee", "the light bulb", "justice",
    "Frida Kahlo", "the Great Wall of China", "the elephant", "apple pie", "the wheel", "time",
    "Isaac Newton", "Venice", "the owl", "ice cream", "the telephone", "freedom",
    "Cleopatra", "the Moon", "the dolphin", "rice", "the clock", "kindness",
    "William Shakespeare", "Antarctica",
]  # fmt: skip
TEMPLATE = (
    "Write a JSON record about {subject} with the fields name, kind (person, place, animal, food, object "
    "or idea), year (if one applies), tags and a one-sentence summary."
)
# Schemas the library measurement compiles, each with a document valid against it (whose tokens it walks):
# the benchmark's record (its summary's length capped) and the record with every string capped, a person
# with a nested address, an enum and a pattern, and an order: an array of objects with numbers.
RECORD = {
    "name": "Ada Lovelace",
    "kind": "person",
    "year": 1843,
    "tags": ["mathematics", "computing"],
    "summary": "An English mathematician who wrote the first published algorithm for a machine.",
}
LIBRARY_SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "record": (SCHEMA, RECORD),
    "record-capped": (CAPPED, RECORD),
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "format": "email"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city"],
                },
                "status": {"enum": ["active", "inactive", "pending"]},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "status"],
        },
        {
            "name": "Grace Hopper",
            "age": 85,
            "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22202"},
            "status": "active",
            "score": 9.5,
        },
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                    "minItems": 1,
                },
                "express": {"type": "boolean"},
            },
            "required": ["order_id", "items"],
        },
        {
            "order_id": "A-1042",
            "items": [{"sku": "pen-blue", "quantity": 3, "price": 1.25}, {"sku": "pad", "quantity": 1, "price": 4.5}],
            "express": False,
        },
    ),
}


class GrammarTimer:
    """While entered, adds up the wall time of the engine's grammar work: pruning drafts and masking logits
    (the executor's two hooks) and advancing matchers (`GrammarState.advance`), by wrapping them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self._saved.append((owner, name, inner))
        setattr(owner, name, timed)

    def __enter__(self) -> GrammarTimer:
        import engines.spec_decode.executor as executor_module
        from engines.structured_output import GrammarState

        self._wrap(executor_module, "_prune_for_grammar")
        self._wrap(executor_module, "_mask_for_grammar")
        self._wrap(GrammarState, "advance")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, inner in reversed(self._saved):
            setattr(owner, name, inner)
        self._saved.clear()


@dataclass
class Side:
    """One side's tallies over the run."""

    name: str
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (all threads): less sensitive to other processes' load
    grammar_s: float = 0.0
    wave_s: list[float] = field(default_factory=list)
    wave_tokens: list[int] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s else 0.0,
            "tokens_per_cpu_s": self.tokens / self.cpu_s if self.cpu_s else 0.0,
            "output_tokens": self.tokens,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "grammar_s": self.grammar_s,
            "grammar_share": self.grammar_s / self.wall_s if self.wall_s else 0.0,
            "finish_reasons": {r: list(self.finish.values()).count(r) for r in sorted(set(self.finish.values()))},
        }
        if self.spec.num_steps:
            out.update(
                mean_accepted_tokens=self.spec.mean_accepted_tokens,
                draft_tokens=self.spec.num_draft_tokens,
                accepted_tokens=self.spec.num_accepted_tokens,
            )
        return out


def validate(text: str, schema: dict[str, Any]) -> str | None:
    """None if `text` is a JSON document valid against `schema`, else why not."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0]
    return None


def run_wave(
    engine: LLMEngine, prompts: list[list[dict[str, str]]], wave: list[int], params: SamplingParams, side: Side | None
) -> None:
    """Decode `wave`'s prompts together; record time, tokens, texts and speculation counters on `side`."""
    executor = engine.executor
    before = executor.stats
    executor.stats = SpecStats()
    reqs = [engine.add_request(prompts[i], params) for i in wave]
    cpu, start = time.process_time(), time.perf_counter()
    with GrammarTimer() as grammar:
        while engine.has_unfinished():
            engine.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if side is not None:
        side.wall_s += elapsed
        side.cpu_s += cpu
        side.grammar_s += grammar.seconds
        side.wave_s.append(elapsed)
        n = sum(len(r.output_token_ids) for r in reqs)
        side.wave_tokens.append(n)
        side.tokens += n
        side.spec.add(executor.stats)
        for i, r in zip(wave, reqs, strict=True):
            side.texts[i] = r.output_text
            side.finish[i] = str(r.finish_reason)
    executor.stats = before


def bench_outputs(args: argparse.Namespace) -> dict[str, Any]:
    """The constrained and free sides on one engine, interleaved wave by wave."""
    engine = LLMEngine(engine_config_from_args(args, max_num_seqs=max(args.batch_size, 1)))
    prompts = [[{"role": "user", "content": TEMPLATE.format(subject=s)}] for s in SUBJECTS]
    prompts = (prompts * (1 + args.num_prompts // len(prompts)))[: args.num_prompts]
    schema = SCHEMA if args.schema == "record" else CAPPED
    structured = StructuredOutputParams(json_schema=json.dumps(schema))
    base = {"temperature": args.temperature, "seed": args.seed, "max_tokens": args.max_new_tokens}
    sides = {
        "json_schema": (Side("json_schema"), SamplingParams(**base, structured=structured)),
        "free": (Side("free"), SamplingParams(**base)),
    }
    compile_start = time.perf_counter()
    engine.structured.compile(structured)  # the first request's compile, outside the timed waves
    compile_s = time.perf_counter() - compile_start
    waves = [list(range(i, min(i + args.batch_size, len(prompts)))) for i in range(0, len(prompts), args.batch_size)]
    for w in waves[: args.warmup]:
        for _, params in sides.values():
            run_wave(engine, prompts, w, params, None)
    order = list(sides)
    for k, w in enumerate(waves):
        for name in order if k % 2 == 0 else order[::-1]:
            side, params = sides[name]
            run_wave(engine, prompts, w, params, side)
        done, free_side = sides["json_schema"][0], sides["free"][0]
        valid = sum(validate(done.texts[i], schema) is None for i in done.texts)
        ratio = (done.tokens / done.wall_s) / (free_side.tokens / free_side.wall_s)
        print(
            f"wave {k + 1}/{len(waves)}: "
            + ", ".join(f"{n} {sides[n][0].wave_s[-1]:.2f}s" for n in order)
            + f"; so far {valid}/{len(done.texts)} valid, tokens/s ratio {ratio:.3f}",
            file=sys.stderr,
        )
    constrained, free = sides["json_schema"][0], sides["free"][0]
    errors = {i: validate(t, schema) for i, t in constrained.texts.items()}
    invalid = {i: e for i, e in errors.items() if e is not None}
    wave_ratios = [
        (ct / cs) / (ft / fs)
        for ct, cs, ft, fs in zip(
            constrained.wave_tokens, constrained.wave_s, free.wave_tokens, free.wave_s, strict=True
        )
        if ft and ct
    ]
    result = {
        "drafter": args.drafter,
        "spec_policy": args.spec_policy,
        "spec": [args.spec_depth, args.spec_width, args.spec_budget],
        "schema": args.schema,
        "num_prompts": len(prompts),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "schema_compile_s": compile_s,
        "valid": (len(prompts) - len(invalid)) / len(prompts),
        "invalid": {str(i): e for i, e in invalid.items()},
        "free_parses_as_json": sum(_parses(t) for t in free.texts.values()) / len(prompts),
        "tokens_per_s_ratio": constrained.summary()["tokens_per_s"] / free.summary()["tokens_per_s"],
        "tokens_per_s_ratio_median_wave": statistics.median(wave_ratios) if wave_ratios else None,
        "tokens_per_cpu_s_ratio": constrained.summary()["tokens_per_cpu_s"] / free.summary()["tokens_per_cpu_s"],
        "configs": {"json_schema": constrained.summary(), "free": free.summary()},
        "examples": [constrained.texts[i] for i in range(min(3, len(prompts)))],
    }
    return result


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _timed(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


class _Library:
    """One grammar library behind the few calls measured: a fresh matcher, accept, roll back, fill a mask."""

    def __init__(self, make, accept, rollback, fill):
        self.make, self.accept, self.rollback, self.fill = make, accept, rollback, fill

    def tree7(self, m, tree: list[int], bits) -> None:
        """Masks of a 7-node tree (root -> tree[0..2], tree[0] -> tree[3..5]) by accept/rollback: each
        child whose bit is set in its parent's mask is accepted, its mask filled, and rolled back."""

        def allowed(row: int, token: int) -> bool:
            return bool((int(bits[row, token // 32]) >> (token % 32)) & 1)

        self.fill(m, bits, 0)
        for k, child in enumerate(tree[:3]):
            if allowed(0, child) and self.accept(m, child):
                self.fill(m, bits, 1 + k)
                if k == 0:
                    for j, grandchild in enumerate(tree[3:]):
                        if allowed(1, grandchild) and self.accept(m, grandchild):
                            self.fill(m, bits, 4 + j)
                            self.rollback(m, 1)
                self.rollback(m, 1)


def bench_libraries(args: argparse.Namespace) -> dict[str, Any]:
    """xgrammar against llguidance on the embedded model's tokenizer (each where installed), per schema of
    `LIBRARY_SCHEMAS`: compile time, per-token mask time along its document, a 7-node tree's masks."""
    from engines.loader import resolve_checkpoint
    from engines.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_checkpoint(args.model))
    hf, vocab = tokenizer.hf, tokenizer.vocab_size
    stops = sorted(tokenizer.stop_token_ids)
    # a 7-node tree at each position of a document: the next token with two siblings, and under it
    # the token after with two siblings (the document's tokens are allowed, the siblings mostly not)
    noise = hf.encode(" the 1{", add_special_tokens=False)[:2]
    words = (vocab + 31) // 32
    out: dict[str, Any] = {"vocab_size": vocab, "repeat": args.repeat}

    def measure(lib: _Library, ids: list[int]) -> dict[str, float]:
        mask_us, tree_us = [], []
        for _ in range(args.repeat):
            m = lib.make()
            bits = torch.zeros(7, words, dtype=torch.int32)
            for pos, token in enumerate(ids):
                mask_us.append(1e6 * _timed(lambda m=m, bits=bits: lib.fill(m, bits, 0)))
                if pos + 1 < len(ids):
                    tree = [ids[pos], *noise, ids[pos + 1], *noise]
                    tree_us.append(1e6 * _timed(lambda m=m, t=tree, bits=bits: lib.tree7(m, t, bits)))
                if not lib.accept(m, token):
                    raise RuntimeError(f"the library refused token {token} of a valid document")
        return {
            "mask_us_median": statistics.median(mask_us),
            "mask_us_mean": statistics.fmean(mask_us),
            "mask_us_max": max(mask_us),
            "tree7_us_median": statistics.median(tree_us),
            "tree7_us_mean": statistics.fmean(tree_us),
        }

    libraries: dict[str, Any] = {}
    try:
        import xgrammar as xgr

        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=stops)
        libraries["xgrammar"] = {"tokenizer_setup_s": time.perf_counter() - start}
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

        def xgrammar_library(schema: str) -> tuple[float, _Library]:
            compile_s = _timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False), args.repeat)
            grammar = compiler.compile_json_schema(schema, any_whitespace=False)
            lib = _Library(
                lambda: xgr.GrammarMatcher(grammar),
                lambda m, t: m.accept_token(t),
                lambda m, n: m.rollback(n),
                lambda m, bits, row: m.fill_next_token_bitmask(bits, row),
            )
            return compile_s, lib

        libraries["xgrammar"]["make"] = xgrammar_library
    except ImportError:
        out["xgrammar"] = "not installed"
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        start = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=stops)
        libraries["llguidance"] = {"tokenizer_setup_s": time.perf_counter() - start}
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        first = torch.zeros(1, words, dtype=torch.int32)

        def llguidance_library(schema: str) -> tuple[float, _Library]:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)

            def build() -> None:  # its parser is built lazily: its "compile" is a matcher and a first mask
                llguidance.torch.fill_next_token_bitmask(llguidance.LLMatcher(lltok, grammar), first, 0)

            lib = _Library(
                lambda: llguidance.LLMatcher(lltok, grammar),
                lambda m, t: m.consume_token(t),
                lambda m, n: m.rollback(n),
                lambda m, bits, row: llguidance.torch.fill_next_token_bitmask(m, bits, row),
            )
            return _timed(build, args.repeat), lib

        libraries["llguidance"]["make"] = llguidance_library
    except ImportError:
        out["llguidance"] = "not installed"
    for name, lib_info in libraries.items():
        make = lib_info.pop("make")
        out[name] = lib_info
        for schema_name, (schema, document) in LIBRARY_SCHEMAS.items():
            ids = hf.encode(json.dumps(document, separators=(", ", ": ")), add_special_tokens=False)
            compile_s, lib = make(json.dumps(schema))
            out[name][schema_name] = {"compile_s": compile_s, "document_tokens": len(ids)} | measure(lib, ids)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its JSON summary as the last line of stdout."""
    ap = argparse.ArgumentParser(
        prog="python -m engines.bench.structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up waves per side")
    ap.add_argument(
        "--schema",
        choices=("record", "record-capped"),
        default="record",
        help="SCHEMA, or CAPPED (xgrammar's slow case)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 keeps the timing sane on a machine shared with other jobs",
    )
    ap.add_argument("--libraries", action="store_true", help="measure the grammar libraries instead")
    ap.add_argument("--repeat", type=int, default=3, help="--libraries: passes over the document")
    add_engine_args(
        ap,
        [
            "model",
            "dtype",
            "device",
            "kernels",
            "quantization",
            "drafter",
            "spec_depth",
            "spec_width",
            "spec_budget",
            "spec_policy",
        ],
    )
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = bench_libraries(args) if args.libraries else bench_outputs(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
