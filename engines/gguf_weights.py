"""A GGUF's linear weights as shipped: Q4_0/Q4_1 blocks as int4 codes, Q8_0 blocks as int8.

GGUF stores a [N, K] weight row by row in blocks of 32 inputs. Q4_1 block: fp16 d, fp16 m, then 16
bytes whose low nibbles are inputs 0-15 and high nibbles inputs 16-31; w = q * d + m. Q4_0: fp16 d and
the same nibbles; w = (q - 8) * d. Q8_0: fp16 d and 32 int8; w = q * d. llama.cpp's converter also
reorders the rows of the query and key projections within each head (its RoPE layout) for the "llama"
architecture (Llama and Mistral checkpoints), not for "qwen2"; `hf_rows` undoes that, so rows come out in
Hugging Face order.

Reading a GGUF's header with gguf's `GGUFReader` parses every metadata value (the tokenizer's 49,152
tokens and merges among them: 1.6 s for the embedded model); an index of where each tensor lies is
kept in the cache folder, so later loads of the same file map the tensors without parsing it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lyanna_kernels.quantized_linear import GROUP_SIZE, Int4Codes

log = logging.getLogger(__name__)

INDEX_FORMAT = 1  # bump when what an index holds changes

LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# GGUF architectures whose converter permutes the query and key rows (llama.cpp's LlamaModel and subclasses).
PERMUTED_ARCHITECTURES = ("llama",)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF linear weight ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.
    q_proj.weight"; "output.weight" -> "lm_head.weight"), None for other tensors."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
    return None


def hf_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Which GGUF row each Hugging Face row of a query/key projection is: within a head of 2 x half rows,
    GGUF interleaves the two halves (row 2 j + a holds HF row a * half + j)."""
    half = num_rows // num_heads // 2
    head, a, j = torch.meshgrid(torch.arange(num_heads), torch.arange(2), torch.arange(half), indexing="ij")
    return (head * 2 * half + j * 2 + a).flatten()


@dataclass
class GGUFTensor:
    """One stored tensor: its GGML type and its bytes or values (read-only, mapped from the file)."""

    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray


def _index_file(path: Path, folder: Path) -> Path:
    stat = path.stat()  # another size or modification time is another file
    return folder / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{INDEX_FORMAT}.json"


def read_gguf(path: Path, index_folder: Path | None = None) -> tuple[str, dict[str, GGUFTensor]]:
    """(architecture, linear weights by HF name) of a GGUF. With `index_folder`, the tensors' places are
    read from an index saved there by an earlier read of the same file, or saved there now."""
    from gguf import GGMLQuantizationType, GGUFReader

    index = None if index_folder is None else _index_file(path, index_folder)
    if index is not None and index.exists():
        try:
            saved = json.loads(index.read_text())
            mapped = np.memmap(path, dtype=np.uint8, mode="r")
            tensors = {
                name: GGUFTensor(GGMLQuantizationType(kind), np.ndarray(shape, dtype, buffer=mapped, offset=offset))
                for name, (kind, dtype, shape, offset) in saved["tensors"].items()
            }
            return saved["architecture"], tensors
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("GGUF index %s unreadable (%s); reading the file's header", index, e)
    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else "llama"
    found = [(name, t) for t in reader.tensors if (name := hf_name(t.name)) is not None]
    if index is not None:
        places = {n: [int(t.tensor_type), t.data.dtype.str, list(t.data.shape), int(t.data_offset)] for n, t in found}
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({"architecture": architecture, "tensors": places}, f)
            os.replace(tmp, index)  # atomic: another replica never reads half a file
        except OSError as e:
            log.warning("GGUF index not saved to %s: %s", index, e)
    return architecture, {name: GGUFTensor(t.tensor_type, t.data) for name, t in found}


class GGUFWeights:
    """The linear weights of a GGUF file by Hugging Face name, read lazily from its memory map."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int, index_folder: Path | None = None):
        self.path = Path(path)
        self.architecture, self.tensors = read_gguf(self.path, index_folder)
        permuted = self.architecture in PERMUTED_ARCHITECTURES
        self.heads = {"q_proj": num_heads, "k_proj": num_kv_heads} if permuted else {}

    def kind(self, name: str) -> str:
        """The stored type ("Q4_1", "Q8_0", "F16", ...)."""
        return self.tensors[name].tensor_type.name

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        proj = name.split(".")[-2]
        return hf_rows(rows, self.heads[proj]) if proj in self.heads else None

    def int4(self, name: str) -> Int4Codes:
        """A Q4_0/Q4_1 weight's codes, scales and zeros, exactly as stored, rows in HF order."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            raise ValueError(f"{name} is {kind}, not Q4_0/Q4_1")
        header = 4 if kind == "Q4_1" else 2
        raw = np.asarray(t.data).reshape(t.data.shape[0], -1, header + GROUP_SIZE // 2)  # [N, groups, bytes]
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., header:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
        if kind == "Q4_1":
            zeros = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
        else:
            zeros = np.zeros_like(d)
        out = Int4Codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros))
        order = self._row_order(name, out.codes.shape[0])
        return out if order is None else Int4Codes(out.codes[order], out.scales[order], out.zeros[order])

    def dequantized(self, name: str) -> torch.Tensor:
        """Any stored weight as fp32 [N, K], rows in HF order."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        w = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))).float()
        w = w.reshape(t.data.shape[0], -1)
        order = self._row_order(name, w.shape[0])
        return w if order is None else w[order]
