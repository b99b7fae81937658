"""Model architecture config for the decoder families we serve, read from a Hugging Face `config.json`.

Three architectures share one layout (RMSNorm, RoPE, grouped-query attention, SwiGLU, `engines/model.py`):

- `LlamaForCausalLM` (model_type llama): no biases;
- `MistralForCausalLM` (mistral): Llama's layout, `head_dim` from the config, and a sliding attention
  window (`sliding_window`);
- `Qwen2ForCausalLM` (qwen2, Qwen2.5 too): biases on the q, k and v projections (none on o_proj), and a
  sliding window on its upper layers only when `use_sliding_window` is true.

A sliding window of W tokens lets a query see the W keys ending at itself; over a sequence of at most W
tokens that is full attention. So a windowed model serves contexts up to W tokens, exactly
(`max_position_embeddings` is capped to the window: every position past it is refused by the model's
rotary table, the engine's `max_model_len` follows); a longer window-limited context is not implemented.
Any other architecture is refused at load with `UnsupportedModelError`, naming it and the supported ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Hugging Face architecture class -> its model_type.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ACTIVATIONS = ("silu",)


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or settings this engine does not implement (raised at load)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Positions the model serves: the config's max_position_embeddings, capped to a sliding window.
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    sliding_window: int | None = None  # the attention window some layer uses (None: full attention)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face Llama, Mistral or Qwen2 config (transformers 4.x or 5.x
        field names); `UnsupportedModelError` for another architecture or a setting we do not implement."""
        arch = architecture_of(cfg)
        num_heads = cfg["num_attention_heads"]
        # transformers 5 nests theta and scaling in `rope_parameters`; 4.x has `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
        rope["rope_type"] = rope_type
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                f"{arch} with attention_bias or mlp_bias (biases on every projection) is not supported"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported ({SUPPORTED_ACTIVATIONS})")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_positions = cfg.get("max_position_embeddings", 2048)
        window = sliding_window_of(arch, cfg)
        if window is not None and window < max_positions:
            log.warning(
                "%s attends within a sliding window of %d tokens: contexts are capped to %d tokens (of its %d), "
                "where the window covers the whole sequence",
                arch,
                window,
                window,
                max_positions,
            )
            max_positions = window
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),  # transformers' default for all three
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            qkv_bias=arch == "Qwen2ForCausalLM",
            sliding_window=window,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face `config.json`."""
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def architecture_of(cfg: dict[str, Any]) -> str:
    """The config's architecture class (`architectures[0]`, else the one of its `model_type`; a config with
    neither is taken as Llama's); `UnsupportedModelError` naming it and the supported ones otherwise."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if archs:
        arch = archs[0]
    elif model_type is None:
        return "LlamaForCausalLM"
    else:
        arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type), f"model_type {model_type!r}")
    expected = SUPPORTED_ARCHITECTURES.get(arch)
    if expected is None or (model_type is not None and model_type != expected):
        what = arch if model_type is None or arch.startswith("model_type") else f"{arch} (model_type {model_type!r})"
        supported = ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedModelError(f"unsupported model architecture {what}; supported: {supported}")
    return arch


def sliding_window_of(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window some layer of the model uses, None when every layer attends to all keys.

    Mistral slides every layer when `sliding_window` is set. Qwen2 slides only with `use_sliding_window`,
    and then only its layers from `max_window_layers` on (transformers 5 writes this as `layer_types`)."""
    window = cfg.get("sliding_window")
    if window is None or arch == "LlamaForCausalLM":
        return None
    if arch == "Qwen2ForCausalLM":
        types = cfg.get("layer_types")
        if types is not None:
            return window if "sliding_attention" in types else None
        layers = cfg["num_hidden_layers"]
        slides = cfg.get("use_sliding_window", False) and cfg.get("max_window_layers", layers) < layers
        return window if slides else None
    return window
