"""Hidden-state drafter checkpoints (Lyanna and EAGLE): save, load, and the ones shipped in git.

A checkpoint is a folder with `model.safetensors` (the trainable weights, plus the hot-vocabulary
map when the LM head is restricted) and `config.json` (`kind`, the drafter's switches, and whatever
training wrote: settings, wall time, validation metrics), and `hot_tokens.json` (the training data's
most frequent generated tokens, for the collapsed token-info table). The frozen embedding and LM head come
from the target at load time, so a checkpoint only fits the target it was trained for.

Weights are stored in bf16 (`SHIPPED_DTYPE`: half the bytes in git, and what the drafter serves in by
default); loading casts them to the dtype the target runs in.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engines.drafters.eagle_model import EagleDraftModel
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.drafters.token_info import TokenInfoTable, tokens_by_frequency

MODEL_CLASSES: dict[str, type[LyannaDraftModel]] = {"lyanna": LyannaDraftModel, "eagle": EagleDraftModel}

SHIPPED_DIR = Path(__file__).parent / "checkpoints"
# Drafters trained for the embedded target, by drafter kind.
SHIPPED = {"lyanna": SHIPPED_DIR / "lyanna-smollm2-135m", "eagle": SHIPPED_DIR / "eagle-smollm2-135m"}
# The dtype a drafter's floating weights are written in (training keeps its own dtype).
SHIPPED_DTYPE = torch.bfloat16


def new_draft_model(kind: str, cfg: LyannaConfig, target, hot_tokens: torch.Tensor | None = None) -> LyannaDraftModel:
    """An untrained drafter of `kind` over a target `LlamaModel` (its embedding and LM head, frozen)."""
    if kind not in MODEL_CLASSES:
        raise ValueError(f"unknown drafter kind {kind!r}; choose one of {sorted(MODEL_CLASSES)}")
    embed, head, norm = target.embed_tokens.weight.data, target.lm_head_weight.data, target.norm.weight.data
    return MODEL_CLASSES[kind](cfg, embed, head, hot_tokens, norm)


def save_draft_model(
    model: LyannaDraftModel, folder: str | Path, extra: dict | None = None, dtype: torch.dtype | None = None
) -> None:
    """Write the drafter's weights (safetensors, optionally cast to `dtype`) and its config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        tensors[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
    save_file(tensors, folder / "model.safetensors")
    draft = {k: v for k, v in asdict(model.cfg).items() if k != "target"}
    (folder / "config.json").write_text(json.dumps({"kind": model.kind, "draft": draft} | (extra or {}), indent=2))


def save_hot_tokens(folder: str | Path, counts: Counter, limit: int = 8192) -> None:
    """The `limit` most frequent target-generated tokens of the training data, most frequent first
    (what the collapsed token-info table is built over)."""
    top = tokens_by_frequency(counts, limit)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "hot_tokens.json").write_text(json.dumps({"by_frequency": top}))


def hot_tokens_by_frequency(checkpoint: str | Path) -> list[int] | None:
    """The checkpoint's hot tokens, most frequent first, or None when it has no list."""
    path = Path(checkpoint) / "hot_tokens.json"
    return json.loads(path.read_text())["by_frequency"] if path.exists() else None


def token_info_table(model: LyannaDraftModel, checkpoint: str | Path, rows: int) -> TokenInfoTable | None:
    """The collapsed token-info lookup over the checkpoint's `rows` most frequent tokens, or None
    (use the dense low-rank product) when rows is 0 or the model/checkpoint has nothing to collapse."""
    hot = hot_tokens_by_frequency(checkpoint)
    if rows <= 0 or model.token_info is None or hot is None:
        return None
    return model.token_info.collapse(torch.tensor(hot[:rows], device=model.embed.device))


def read_config(checkpoint: str | Path) -> dict:
    """A checkpoint folder's config.json."""
    path = Path(checkpoint) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{checkpoint} is not a drafter checkpoint (no config.json)")
    return json.loads(path.read_text())


def load_draft_model(checkpoint: str | Path, engine, kind: str | None = None) -> LyannaDraftModel:
    """A trained drafter folder on top of the engine's target, ready for inference (eval, prepacked).

    `kind`, when given, must match the checkpoint's."""
    meta = read_config(checkpoint)
    found = meta.get("kind", "lyanna")
    if kind is not None and found != kind:
        raise ValueError(f"{checkpoint} holds a {found!r} drafter, not {kind!r}")
    cfg = LyannaConfig(engine.model_config, **meta.get("draft", {}))  # a hot vocabulary's map comes with the weights
    target = engine.model
    model = new_draft_model(found, cfg, target)
    weights = load_file(str(Path(checkpoint) / "model.safetensors"))
    dtype = target.embed_tokens.weight.dtype
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}, strict=True)
    model = model.to(target.embed_tokens.weight.device).eval().requires_grad_(False)
    model.prepack()
    return model
