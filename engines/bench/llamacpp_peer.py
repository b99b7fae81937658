"""llama.cpp as a peer in our benchmark (llama-cpp-python, the optional `peers` extra).

`LlamaCppRunner` decodes token-id prompts greedily (or with its sampler at temperature > 0) on a GGUF,
one sequence at a time (llama-cpp-python's high-level API serves one sequence per context), with as
many threads as torch uses. `bf16_gguf` writes a GGUF's weights dequantized to bf16 (same metadata and
tokenizer), so llama.cpp can also run at our dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engines.loader import cache_root


def bf16_gguf(source: Path) -> Path:
    """A copy of the GGUF `source` with every quantized tensor stored as bf16 (cached beside our converted
    checkpoints; written once)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    out = cache_root() / f"{source.stem}-{source.stat().st_size}.bf16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(32)  # LLAMA_FTYPE_MOSTLY_BF16
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape.tolist())]  # numpy order: rows first
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or len(shape) < 2:
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            writer.add_tensor(t.name, data if len(shape) < 2 else data.astype(np.float16))
            continue
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        packed = quantize(values, GGMLQuantizationType.BF16)
        writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


class LlamaCppRunner:
    """llama.cpp on a GGUF file: exactly `max_new_tokens` new tokens per prompt (EOS ignored)."""

    def __init__(self, gguf: Path, n_ctx: int = 4096, threads: int | None = None):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise SystemExit("--compare-llamacpp needs llama-cpp-python: pip install -e '.[peers]'") from e
        threads = threads or torch.get_num_threads()
        self.path = gguf
        self.llm = Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
        )

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
        """Generate for each prompt in turn; returns the new token ids."""
        outs = []
        for prompt in prompts:
            self.llm.reset()
            self.llm.set_seed(seed)
            tokens = []
            for token in self.llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, reset=True):
                tokens.append(int(token))
                if len(tokens) == max_new_tokens:
                    break
            outs.append(tokens)
        return outs
