"""Builds the configured drafter for an engine: n-gram, suffix, a separate draft model, Lyanna or EAGLE, or Lyanna
with the suffix drafter beside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.drafters.base import Drafter

if TYPE_CHECKING:
    from engines.engine import EngineConfig, LLMEngine


def _ngram(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.ngram import NgramDrafter

    return NgramDrafter()


def _suffix(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.suffix import SuffixDrafter

    return SuffixDrafter()


def _lyanna_suffix(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.suffix import SuffixDrafter
    from engines.drafters.text_first import TextFirstDrafter

    return TextFirstDrafter(_lyanna(config, engine), SuffixDrafter())


def _draft_model(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.draft_model import DraftModelDrafter

    if config.draft_model is None:
        raise ValueError("drafter 'draft-model' needs draft_model (a checkpoint sharing the target's tokenizer)")
    return DraftModelDrafter(config.draft_model, engine)


def _drafter_checkpoint(config: EngineConfig, kind: str) -> str:
    """The configured checkpoint, or the one shipped for the embedded target."""
    from engines.drafters.checkpoint import SHIPPED

    if config.draft_model is not None:
        return config.draft_model
    if config.model not in (None, "smollm2-135m-instruct"):
        raise ValueError(
            f"drafter {kind!r} needs draft_model, a checkpoint trained for this target (the shipped one fits the "
            f"embedded model only): train one with `python -m engines.training --kind {kind} --model "
            f"{config.model} --out RUN` and set draft_model to RUN/checkpoint, or use drafter 'ngram' or 'none'"
        )
    return str(SHIPPED[kind])


def _lyanna(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.checkpoint import load_draft_model, token_info_table
    from engines.drafters.lyanna import LyannaDrafter

    checkpoint = _drafter_checkpoint(config, "lyanna")
    model = load_draft_model(checkpoint, engine, kind="lyanna")
    table = token_info_table(model, checkpoint, config.lyanna_token_info_rows)
    return LyannaDrafter(
        model,
        table,
        resample=config.lyanna_resampling,
        fusion=config.lyanna_fusion,
        fused_layer=_fused_draft_layer(config, engine, model),
        kv_cache=engine.kv_cache,
    )


def _fused_draft_layer(config: EngineConfig, engine: LLMEngine, model):
    """The drafter's layer in one int8 call where the target runs its fused CPU decoder and
    `draft_quantization` allows it; else None (the eager layer)."""
    from engines.drafters.lyanna_model import fused_draft_layer

    if config.draft_quantization == "auto" and engine.model.fused_decoder(engine.kv_cache, 1) is not None:
        return fused_draft_layer(model, engine.kv_cache, config.max_num_seqs)
    return None


def _eagle(config: EngineConfig, engine: LLMEngine) -> Drafter:
    from engines.drafters.checkpoint import load_draft_model
    from engines.drafters.eagle import EagleDrafter

    model = load_draft_model(_drafter_checkpoint(config, "eagle"), engine, kind="eagle")
    return EagleDrafter(model, _fused_draft_layer(config, engine, model), engine.kv_cache)


DRAFTERS: dict[str, Callable[[EngineConfig, LLMEngine], Drafter] | None] = {
    "none": None,
    "ngram": _ngram,
    "draft-model": _draft_model,
    "lyanna": _lyanna,
    "eagle": _eagle,
    "suffix": _suffix,
    "lyanna+suffix": _lyanna_suffix,
}


def make_drafter(config: EngineConfig, engine: LLMEngine) -> Drafter | None:
    """The drafter named by the config (built for this engine's target and KV cache), or None."""
    factory = DRAFTERS[config.drafter]
    return None if factory is None else factory(config, engine)
