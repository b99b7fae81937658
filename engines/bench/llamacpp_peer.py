"""llama.cpp as a peer in our benchmark (llama-cpp-python, the optional `peers` extra).

`LlamaCppRunner` decodes token-id prompts on a GGUF through llama.cpp's C API (llama-cpp-python's ctypes
bindings, not its high-level `Llama.generate`, which adds Python per token): one `llama_decode` for the
prompt (in `n_batch` chunks), then one per token, the next token picked by llama.cpp's own sampler
(greedy, or temperature + seeded distribution), exactly `max_new_tokens` tokens (EOS ignored), one
sequence at a time with the cache cleared between them, flash attention on, as many threads as torch
uses. That is the loop `llama-bench`'s `tg` times, plus sampling.

Formats (`FORMATS`): `q4_0`, the GGUF requantized to Q4_0 with every tensor in it (`--pure`; the format
llama.cpp repacks into its multi-row x86 kernels, its fastest 4-bit path on CPU), made with
`llama_model_quantize` and cached beside our converted checkpoints; `q4_1`, the embedded GGUF as
shipped; `bf16`, its weights dequantized to bf16 (our dtype; slow, not run by default).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
import torch

from engines.bench.wave import WaveTiming
from engines.loader import cache_root

# Peer name suffix -> what the file holds (reported in the JSON).
FORMATS = {
    "q4_0": "Q4_0, every tensor (requantized --pure from the shipped GGUF; llama.cpp repacks it for its multi-row "
    "kernels)",
    "q4_1": "the GGUF as shipped (Q4_1)",
    "bf16": "bf16 (the GGUF dequantized)",
}
DEFAULT_FORMATS = ("q4_0", "q4_1")
LLAMA_FTYPE_MOSTLY_Q4_0 = 2
# llama.cpp's AMX kernels (built in by -march=native on Intel CPUs with AMX) crash reading any prompt of this
# model (llama.cpp#20824; llama-bench -p 64 too): on such CPUs llama-cpp-python is built for the same
# AVX512 kernels without them (scripts/setup.sh does it).
NO_AMX_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
)


def _llama_cpp():
    """The llama_cpp module, or a SystemExit saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit("--compare-llamacpp needs llama-cpp-python: pip install -e '.[peers]'") from e
    return llama_cpp


def llamacpp_system_info() -> dict[str, str]:
    """llama-cpp-python's version and llama.cpp's `llama_print_system_info()` (the CPU features it uses)."""
    lc = _llama_cpp()
    return {"version": lc.__version__, "system_info": lc.llama_print_system_info().decode().strip()}


def q4_0_gguf(source: Path, threads: int | None = None) -> Path:
    """`source` requantized to Q4_0 with every tensor in Q4_0 (`llama-quantize --allow-requantize --pure
    ... Q4_0`) through llama.cpp's `llama_model_quantize`; cached beside our converted checkpoints."""
    lc = _llama_cpp()
    out = cache_root() / f"{source.stem}-{source.stat().st_size}.q4_0.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.pure = True
    params.nthread = threads or torch.get_num_threads()
    tmp = out.with_suffix(".tmp")
    if lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    tmp.rename(out)
    return out


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


def format_gguf(source: Path, fmt: str, threads: int | None = None) -> Path:
    """The GGUF file of a format in `FORMATS` made from `source` (the shipped one for `q4_1`)."""
    if fmt == "q4_0":
        return q4_0_gguf(source, threads)
    if fmt == "bf16":
        return bf16_gguf(source)
    if fmt == "q4_1":
        return source
    raise SystemExit(f"unknown llama.cpp format {fmt!r}: choose from {sorted(FORMATS)}")


# llama.cpp's KV cache types (`llama-bench -ctk/-ctv`): f16, its default, and q8_0 (blocks of 32 int8 codes and a
# scale; needs flash attention for V), the peer of `kv_cache_dtype: int8`
KV_TYPES = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0"}


class LlamaCppRunner:
    """llama.cpp on a GGUF file: exactly `max_new_tokens` new tokens per prompt (EOS ignored), one sequence
    at a time, through its C API."""

    def __init__(self, gguf: Path, n_ctx: int = 4096, threads: int | None = None, flash_attn: bool = True,
                 kv_type: str = "f16"):  # fmt: skip
        lc = _llama_cpp()
        if "AMX_INT8 = 1" in lc.llama_print_system_info().decode():
            raise SystemExit(
                "this llama-cpp-python was built with llama.cpp's AMX kernels, which crash on this model's prompts "
                f"(llama.cpp#20824); rebuild it without: CMAKE_ARGS='{NO_AMX_CMAKE_ARGS}' "
                "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python"
            )
        self.lc = lc
        self.path = gguf
        self.threads = threads or torch.get_num_threads()
        self.flash_attn = flash_attn
        if kv_type not in KV_TYPES:
            raise ValueError(f"llama.cpp's KV cache type is one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        self.kv_type = kv_type
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = params.type_v = getattr(lc, KV_TYPES[kv_type])
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {gguf}")
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.n_batch = lc.llama_n_batch(self.ctx)
        self.memory = lc.llama_get_memory(self.ctx)
        self.token = (lc.llama_token * 1)()

    def settings(self) -> dict[str, object]:
        """What this runner runs with, for the JSON."""
        return {"gguf": str(self.path), "threads": self.threads, "flash_attn": self.flash_attn, "n_ctx": self.n_ctx,
                "kv_type": self.kv_type}  # fmt: skip

    def _sampler(self, temperature: float, seed: int):
        lc = self.lc
        if temperature <= 0:
            return lc.llama_sampler_init_greedy()
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temperature))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain

    def _decode(self, tokens: list[int]) -> None:
        """Feed `tokens` to the context (in n_batch chunks); logits of the last one stay for sampling."""
        lc = self.lc
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            ids = (lc.llama_token * len(chunk))(*chunk)
            if lc.llama_decode(self.ctx, lc.llama_batch_get_one(ids, len(chunk))) != 0:
                raise RuntimeError("llama_decode failed")

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> WaveTiming:
        """Generate for each prompt in turn; the new token ids and the clocks (decode-only: after each
        sequence's first token)."""
        lc = self.lc
        if max(len(p) for p in prompts) + max_new_tokens > self.n_ctx:
            raise ValueError(f"prompt + {max_new_tokens} new tokens exceed llama.cpp's context of {self.n_ctx}")
        outs: list[list[int]] = []
        first_s = decode_s = 0.0
        decode_tokens = 0
        token, decode, sample, ctx = self.token, lc.llama_decode, lc.llama_sampler_sample, self.ctx
        t_wave = time.perf_counter()
        for prompt in prompts:
            t0 = time.perf_counter()
            lc.llama_memory_clear(self.memory, True)
            sampler = self._sampler(temperature, seed)
            try:
                self._decode(prompt)
                tokens = [sample(sampler, ctx, -1)]
                t1 = time.perf_counter()
                while len(tokens) < max_new_tokens:
                    token[0] = tokens[-1]
                    if decode(ctx, lc.llama_batch_get_one(token, 1)) != 0:
                        raise RuntimeError("llama_decode failed")
                    tokens.append(sample(sampler, ctx, -1))
                t2 = time.perf_counter()
            finally:
                lc.llama_sampler_free(sampler)
            outs.append(tokens)
            first_s += t1 - t0
            decode_s += t2 - t1
            decode_tokens += len(tokens) - 1
        wall = time.perf_counter() - t_wave
        return WaveTiming(outs, wall, decode_tokens, decode_s, first_s)

    def close(self) -> None:
        """Free the context and the model."""
        if getattr(self, "ctx", None):
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lc.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        self.close()
