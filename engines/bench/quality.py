"""How much each weight setting changes the model: held-out ShareGPT answers scored token by token.

    python -m engines.bench.quality --num 32 --settings none,int8,int4,gguf [--kernels torch] [--numerics prompt]
        [--kv-cache-dtypes auto,int8]

For each validation-split conversation (the first user turn and the assistant's answer, rendered with
the chat template, capped at `--max-tokens`), every setting computes the log-likelihood of each answer
token given what precedes it, in one forward over the sequence whose every row runs through the quantized
kernels, as decoding's steps do (`decode_numerics`). The reference is the fp32 model on the
dequantized checkpoint. Per setting: the mean log-likelihood per answer token, its relative change
against the reference, and how often the setting's argmax equals the reference's (greedy agreement,
teacher-forced). With `--kv-cache-dtypes`, each setting is scored over each KV cache dtype (`auto`: the
model's; a setting over another is reported as `<setting>/kv:<dtype>`). One JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from engines.attention import SequenceLayout, build_attention_metadata
from engines.datasets import iter_sharegpt, sharegpt_messages
from engines.engine_config import add_engine_args
from engines.kv_cache import PagedKVCache, kv_cache_dtype
from engines.loader import load_model, parse_kv_cache_dtype
from engines.model import LlamaModel
from engines.tokenizer import Tokenizer
from lyanna_kernels import fused_decoder
from lyanna_kernels.dispatch import set_kernel_mode


def scored_conversations(tokenizer: Tokenizer, num: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the answer's first token) for `num` validation conversations with an answer."""
    from engines.datasets import split_of

    out = []
    for rec in iter_sharegpt():
        if split_of(rec["id"]) != "val":
            continue
        msgs = sharegpt_messages(rec)
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(msgs[:1])
        full = tokenizer.encode(tokenizer.hf.apply_chat_template(msgs[:2], tokenize=False))
        if full[: len(prompt)] != prompt or len(prompt) >= max_tokens - 8:
            continue
        out.append((full[:max_tokens], len(prompt)))
        if len(out) == num:
            break
    return out


@torch.inference_mode()
def answer_logprobs(
    model: LlamaModel, tokens: list[int], start: int, as_prompt: bool = False, kv_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-likelihoods of tokens[start:] given their prefixes ([n] fp32), and the argmax before each. The
    conversation is read in chunks of `fused_decoder.MAX_ROWS` tokens, the steps a decode or a verified
    draft takes (on the fused CPU decoder a row's result does not depend on its chunk, so each token is
    scored exactly as decoding it would compute it), or, `as_prompt`, as prompt tokens (the numerics a
    prompt is read with: on AMX CPUs bf16 projections and attention runs). `kv_dtype`: the cache's (None: the
    model's)."""
    cfg, n, block = model.cfg, len(tokens), 16
    if kv_dtype is None:
        kv_dtype = torch.float32 if model.compute_dtype == torch.float32 else model.dtype
    kv = PagedKVCache(cfg.num_layers, model.attn_kv_heads, cfg.head_dim, -(-n // block), block, kv_dtype, "cpu")
    kv.allocate("x", n)
    logits = []
    for first in range(0, n - 1, fused_decoder.MAX_ROWS):
        end = min(first + fused_decoder.MAX_ROWS, n - 1)
        layout = SequenceLayout(kv.block_tables["x"], first, end - first, num_prompt=end - first if as_prompt else 0)
        meta = build_attention_metadata([layout], block, "cpu")
        rows = torch.arange(min(max(first, start - 1), end), end) - first
        out, _ = model(torch.tensor(tokens[first:end]), torch.arange(first, end), meta, kv, rows)
        logits.append(out)
    logprobs = torch.cat(logits).float().log_softmax(-1)
    target = torch.tensor(tokens[start:])
    return logprobs.gather(1, target[:, None])[:, 0], logprobs.argmax(-1)


def decode_numerics(model: LlamaModel) -> None:
    """Make every row of a forward run through the quantized kernels, as decoding's few-row steps do: a
    forward over a whole conversation would otherwise take the fp32 copy of the quantized values that
    many-row GEMMs use on CPUs without bf16 arithmetic."""
    from engines.parallel import PackableLinear

    for m in model.modules():
        if isinstance(m, PackableLinear) and m.quant is not None:
            m.wide = None
    if model.lm_head_quant is not None:
        model.lm_head_wide = None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Score every setting against the fp32 reference; print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, ["model", "dtype", "kernels"])
    ap.add_argument("--num", type=int, default=32, help="validation conversations")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens per conversation at most")
    ap.add_argument("--settings", default="none,int8,int4,gguf", help="quantization settings to score (bf16)")
    ap.add_argument("--numerics", choices=["decode", "prompt"], default="decode",
                    help="score every token as decoding computes it, or as a prompt's token is read")  # fmt: skip
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="KV caches to score each setting over: auto (the engine's), bfloat16, int8")  # fmt: skip
    args = ap.parse_args(argv)
    kv_dtypes = {name: parse_kv_cache_dtype(name) for name in args.kv_cache_dtypes.split(",")}  # checked up front
    set_kernel_mode(args.kernels)
    reference = load_model(args.model, "float32", "cpu", quantization="none")
    tokenizer = Tokenizer(reference.checkpoint)
    convs = scored_conversations(tokenizer, args.num, args.max_tokens)
    ref = [answer_logprobs(reference.model, t, s) for t, s in convs]
    ref_ll = torch.cat([lp for lp, _ in ref])
    del reference
    result: dict[str, Any] = {
        "conversations": len(convs),
        "answer_tokens": int(ref_ll.numel()),
        "reference": {"setting": "fp32, dequantized", "mean_loglik": float(ref_ll.mean())},
        "kernels": args.kernels,
        "numerics": args.numerics,
        "settings": {},
    }
    for setting in args.settings.split(","):
        loaded = load_model(args.model, args.dtype, "cpu", quantization=setting)
        # the cache `auto` gives in the engine, and the engine's arithmetic beside an fp32 one
        auto = kv_cache_dtype(
            None, loaded.model.dtype, torch.device("cpu"), fused_decoder.applies_to_model(loaded.model)
        )
        if auto == torch.float32 and loaded.model.dtype != torch.float32:
            loaded.model.compute_in(torch.float32)
        decode_numerics(loaded.model)
        for kv_name, kv_dtype in kv_dtypes.items():
            kv_dtype = auto if kv_dtype is None else kv_dtype
            got = [answer_logprobs(loaded.model, t, s, args.numerics == "prompt", kv_dtype) for t, s in convs]
            ll = torch.cat([lp for lp, _ in got])
            agree = torch.cat([a == b for (_, a), (_, b) in zip(got, ref, strict=True)]).float().mean()
            result["settings"][setting if kv_name == "auto" else f"{setting}/kv:{kv_name}"] = {
                "mean_loglik": float(ll.mean()),
                "relative_change": float((ll.mean() - ref_ll.mean()) / ref_ll.mean().abs()),
                "mean_abs_token_diff": float((ll - ref_ll).abs().mean()),
                "greedy_agreement": float(agree),
                "weight_bytes": sum(_weight_bytes(loaded.model)),
            }
    print(json.dumps(result))
    return result


def _weight_bytes(model: LlamaModel):
    """Bytes of every projection and the LM head as they are computed with."""
    from engines.parallel import PackableLinear

    for m in model.modules():
        if isinstance(m, PackableLinear):
            yield m.quant.nbytes if m.quant is not None else m.weight.numel() * m.weight.element_size()
    head = model.lm_head_quant
    yield head.nbytes if head is not None else model.lm_head_weight.numel() * model.lm_head_weight.element_size()


if __name__ == "__main__":
    main()
