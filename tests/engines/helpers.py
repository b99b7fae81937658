"""Small helpers the engine tests share: a KV cache for a model, one-sequence forwards over it, one request's
deltas and a check that it resumes exactly from any cut, a tiny random target checkpoint, and randomly
initialised draft-model checkpoints."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from engines.attention import SequenceLayout, build_attention_metadata
from engines.drafters.checkpoint import save_draft_model
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.kv_cache import PagedKVCache
from engines.loader import resolve_checkpoint
from engines.model import LlamaModel
from engines.request import GenerationRequest


def new_cache(model: LlamaModel, num_blocks: int = 64, block_size: int = 16, dtype=torch.float32) -> PagedKVCache:
    """A KV cache shaped for `model` (this rank's KV heads)."""
    cfg = model.cfg
    return PagedKVCache(cfg.num_layers, model.attn_kv_heads, cfg.head_dim, num_blocks, block_size, dtype, "cpu")


def forward_one(
    model: LlamaModel,
    kv: PagedKVCache,
    seq_id: str,
    tokens: list[int],
    num_cached: int,
    positions: list[int] | None = None,
    tree_parents: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one sequence's new tokens on top of `num_cached` cached ones; logits for every new token.
    `tree_parents` makes them a draft tree (each sees itself and its ancestors), else they are causal."""
    n = len(tokens)
    kv.allocate(seq_id, num_cached + n)
    layout = SequenceLayout(kv.block_tables[seq_id], num_cached, n, tree_parents)
    meta = build_attention_metadata([layout], kv.block_size, "cpu")
    pos = torch.tensor(positions) if positions is not None else torch.arange(num_cached, num_cached + n)
    return model(torch.tensor(tokens), pos, meta, kv)


def deltas(engine, request: GenerationRequest) -> list:
    """Every delta of one request, run alone to its end in `engine` (an `LLMEngine`)."""
    engine.add(engine.admit(request))
    out = []
    while engine.has_unfinished():
        out += [d for d in engine.step() if d.request_id == request.request_id]
    return out


def assert_resumes_exactly(engine, base: GenerationRequest) -> None:
    """`base` run whole, then resumed from cuts after its first delta, its middle one and its last but one
    (mid-word cuts among them): every resumed run gives the rest of the whole run's tokens and text."""
    params = base.params
    whole = deltas(engine, base)
    tokens = [t for d in whole for t in d.new_token_ids]
    text = "".join(d.new_text for d in whole)
    assert len(whole) > 3 and engine.stats().spec.num_steps > 0
    for cut in sorted({1, len(whole) // 2, len(whole) - 1}):
        done = [t for d in whole[:cut] for t in d.new_token_ids]
        sent = "".join(d.new_text for d in whole[:cut])
        resumed = dataclasses.replace(
            base, request_id=f"resumed-{base.request_id}-{cut}", resume_token_ids=done, resume_text_sent=len(sent)
        )
        rest = deltas(engine, resumed)
        assert done + [t for d in rest for t in d.new_token_ids] == tokens, f"cut after {len(done)} tokens"
        assert sent + "".join(d.new_text for d in rest) == text
        assert rest[-1].num_output_tokens == len(tokens) and rest[-1].finish_reason == whole[-1].finish_reason
        if params.logprobs is not None:  # the new tokens' log-probabilities, one each
            want = [lp for d in whole[cut:] for lp in d.logprobs]
            assert [lp.token_id for d in rest for lp in d.logprobs] == [lp.token_id for lp in want]


def random_draft_checkpoint(model_class: type[LyannaDraftModel], engine, folder, **switches) -> str:
    """A seeded random draft model (Lyanna or EAGLE; `switches`: LyannaConfig's) over `engine`'s target, saved
    in `folder`."""
    torch.manual_seed(0)
    target = engine.model
    cfg = LyannaConfig(engine.model_config, token_info_rank=8, **switches)
    save_draft_model(model_class(cfg, target.embed_tokens.weight.data, target.lm_head_weight.data), folder)
    return str(folder)


def tiny_llama_checkpoint(
    folder: Path,
    vocab_size: int,
    max_positions: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
) -> Path:
    """A seeded random Llama (by default 2 layers, GQA: 4 query heads over 2 KV heads, hidden 64; MLP twice
    the hidden size) saved in `folder`, with the embedded model's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (resolve_checkpoint() / name).exists():
            shutil.copy(resolve_checkpoint() / name, folder / name)
    return folder
