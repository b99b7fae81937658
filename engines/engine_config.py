"""The engine's settings: one model, one default per setting.

`EngineConfig` is what `LLMEngine` takes; the replica's `engine:` block in serve_config.yaml is this
model plus the replica's own two fields (serve_app/replica.py `EngineSettings`, a subclass), and every
command line builds its engine flags from it (`add_engine_args`, `engine_config_from_args`), so a
setting has the same name, default and description everywhere. `python -m engines.engine_config`
prints the README's configuration table.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.loader import parse_dtype, parse_kv_cache_dtype
from engines.spec_decode.policy import AdaptiveSettings
from engines.spec_params import SpecParams
from lyanna_kernels.dispatch import default_kernel_mode

DrafterName = Literal["none", "ngram", "suffix", "draft-model", "lyanna", "eagle", "lyanna+suffix"]


class EngineConfig(BaseModel):
    """Every engine setting: which model, where, how much KV cache and batching, and how to speculate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="Target checkpoint: a Hugging Face folder or a .gguf file; null = the embedded SmolLM2-135M"
    )
    dtype: str = Field("bfloat16", description="Weights' and activations' dtype (bfloat16, float16, float32)")
    device: str = Field("cpu", description="cpu or cuda (cuda:N)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the target is split over; ranks 1..N-1 are Ray actors in the replica's bundles"
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache memory per rank when num_kv_blocks is not given")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV-cache blocks; null = from kv_cache_gib")
    enable_prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching: full KV blocks are shared by hash of their token chain and kept "
        "after their requests finish (least recently used evicted first)",
    )
    max_num_seqs: int = Field(64, ge=1, description="Requests running at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Tokens in one step's forward, drafts included")
    max_model_len: int | None = Field(
        None, ge=2, description="Prompt + completion tokens at most; null = the model's, capped by the KV cache"
    )
    prefill_chunk_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens per step while others decode; null = 256 on CPU, 2048 on GPU"
    )
    kv_cache_dtype: str = Field(
        "auto",
        description="auto = the model's dtype (on CPUs without bf16 arithmetic: bf16 where the fused CPU decoder "
        "takes every step, else fp32), a dtype name, or int8 (codes and a bf16 scale per 32 values: about half of "
        "bf16's bytes; fused CPU decoder only)",
    )
    drafter: DrafterName = Field(
        "lyanna",
        description="none, ngram, suffix (SuffixDecoding: drafts from the prompt, output and recent outputs), "
        "draft-model, lyanna, eagle, or lyanna+suffix (per request and step the suffix drafter's tree where it "
        "pays, else Lyanna's)",
    )
    draft_model: str | None = Field(
        None,
        description="The drafter's checkpoint; null = the one shipped for the embedded model (for another target, "
        "train one with `python -m engines.training --model <folder>`; ngram needs none)",
    )
    spec_depth: int = Field(SpecParams.depth, ge=1, le=64, description="Draft tree depth (a cap if adaptive)")
    spec_width: int = Field(SpecParams.width, ge=1, le=64, description="Children per draft node at most")
    spec_budget: int = Field(SpecParams.budget, ge=1, le=64, description="Draft tokens verified per step at most")
    spec_policy: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: every request's tree as configured; adaptive: goodput-maximising trees"
    )
    adaptive: AdaptiveSettings = Field(
        default_factory=AdaptiveSettings, description="The adaptive policy's knobs (engines/spec_decode/policy.py)"
    )
    chain_verifier: Literal["block", "rejection"] = Field(
        "block", description="Sampled chain drafts: block verification or token-wise rejection sampling"
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs",
        description="Returned log-probabilities: the model's (raw_logprobs) or after temperature/top-k/top-p/min-p",
    )
    lyanna_resampling: bool = Field(True, description="Lyanna re-samples after a rejection (Algorithm 2)")
    lyanna_token_info_rows: int = Field(
        0,
        ge=0,
        description="Lyanna's token info: 0 = every token's, as trained (the low-rank product); N = a table of the "
        "N most frequent tokens, none for others",
    )
    lyanna_fusion: bool = Field(True, description="Verify a re-sampled tree fused with the next draft")
    draft_quantization: Literal["auto", "none"] = Field(
        "auto", description="auto: the drafter's layer in int8, one call, where the target runs its fused decoder"
    )
    kernels: Literal["auto", "triton", "torch"] = Field(
        default_factory=default_kernel_mode,
        description="Hot paths: auto = Triton on CUDA, PyTorch on CPU; default $LYANNA_KERNELS",
    )
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = Field(
        "auto",
        description="Target weights on CPU; auto = a GGUF's own 4-bit blocks (the embedded model), int8 for another "
        "checkpoint in bf16/fp16, none in fp32 or on CUDA",
    )
    multi_step: int = Field(
        4,
        ge=1,
        le=16,
        description="Decode steps per engine step for greedy requests without log-probabilities or a grammar, in "
        "one call of the fused CPU decoder with the LM head and argmax (when no request reads a prompt or verifies "
        "a draft); 1 = one",
    )
    enforce_eager: bool = Field(
        False, description="The target's eager layers at every step (no fused CPU decoder, no CUDA graphs)"
    )
    deterministic: bool = Field(
        False,
        description="Where Triton kernels run (CUDA): batch-invariant products, norms and attention tiles, so an "
        "answer does not depend on what shares its steps (slower). The fused CPU decoder computes so always",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        parse_dtype(v)
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, v: str) -> str:
        parse_kv_cache_dtype(v)
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not v.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], not {v!r}")
        return v

    @model_validator(mode="after")
    def _draft_model_needed(self) -> EngineConfig:
        if self.drafter == "draft-model" and self.draft_model is None:
            raise ValueError("drafter 'draft-model' needs draft_model (a checkpoint sharing the target's tokenizer)")
        return self

    @property
    def spec(self) -> SpecParams:
        """The default speculation of a request that names none."""
        return SpecParams(depth=self.spec_depth, width=self.spec_width, budget=self.spec_budget)


# Flags that kept their older, shorter names on the command lines.
CLI_ALIASES = {"spec_depth": "--depth", "spec_width": "--width", "spec_budget": "--budget"}


def _scalar_type(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type of a field, whether it may be None)."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return rest[0], len(rest) < len(args)
    return annotation, False


def _none_or(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_engine_args(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """Add a `--flag` for each named EngineConfig setting (all scalar ones by default), with the
    model's default and description; `engine_config_from_args` reads them back."""
    fields = EngineConfig.model_fields
    for name in names if names is not None else [n for n in fields if n != "adaptive"]:
        info = fields[name]
        kind, nullable = _scalar_type(info.annotation)
        flags = [f"--{name.replace('_', '-')}"] + ([CLI_ALIASES[name]] if name in CLI_ALIASES else [])
        default = info.get_default(call_default_factory=True)
        text = f"{info.description} (default: {default})"
        if kind is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(*flags, dest=name, choices=typing.get_args(kind), default=default, help=text)
        else:
            parse = _none_or(kind) if nullable else kind
            parser.add_argument(*flags, dest=name, type=parse, default=default, help=text)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of the settings `add_engine_args` added to a parser (and `overrides`)."""
    values = {name: getattr(args, name) for name in EngineConfig.model_fields if hasattr(args, name)}
    return EngineConfig(**(values | overrides))


def config_table() -> str:
    """The configuration table in Markdown: setting, default, description (the README's)."""
    rows = ["| setting | default | description |", "| --- | --- | --- |"]
    for name, info in EngineConfig.model_fields.items():
        default = info.get_default(call_default_factory=False) if info.default_factory is None else None
        if name == "kernels":
            shown = "auto"
        elif name == "adaptive":
            shown = "(see description)"
        else:
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        rows.append(f"| `{name}` | `{shown}` | {info.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_table())
