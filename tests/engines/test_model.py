"""Our model against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engines.loader import load_model
from tests.engines.helpers import forward_one, new_cache


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(model, kv, seq_id, tokens, num_cached):
    return forward_one(model, kv, seq_id, tokens, num_cached)


def test_prompt_and_decode_match_transformers_fp32(engine_fp32, hf_fp32):
    model = engine_fp32.model
    prompt = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about paged attention."}])
    kv = new_cache(model)
    logits, hidden = run(model, kv, "s", prompt, 0)
    ref = hf_fp32(torch.tensor([prompt]), output_hidden_states=True)
    assert rel_err(logits, ref.logits[0]) < 1e-4
    assert rel_err(hidden, ref.hidden_states[-1][0]) < 1e-4

    # One decode step on top of the cache versus a full forward over prompt + token.
    nxt = int(logits[-1].argmax())
    step_logits, step_hidden = run(model, kv, "s", [nxt], len(prompt))
    full = hf_fp32(torch.tensor([[*prompt, nxt]]), output_hidden_states=True)
    assert rel_err(step_logits[0], full.logits[0, -1]) < 1e-4
    assert rel_err(step_hidden[0], full.hidden_states[-1][0, -1]) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tracks_fp32(engine_fp32, dtype):
    """bf16/fp16 models load and stay close to fp32 (their error is precision, not a wrong layout)."""
    prompt = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, how are you?"}])
    ref, _ = run(engine_fp32.model, new_cache(engine_fp32.model), "s", prompt, 0)
    low = load_model(None, dtype=dtype).model
    logits, hidden = run(low, new_cache(low, dtype=dtype), "s", prompt, 0)
    assert hidden.dtype == dtype
    assert rel_err(logits, ref) < 0.05
    assert (logits[-1].argmax() == ref[-1].argmax()).item()


def test_bf16_weights_with_fp32_compute_track_fp32(engine_fp32):
    """The AVX2 CPU mode: bf16 weights, fp32 residual stream, norms, attention and cache, and fp32 weight
    copies for GEMMs of many rows. Prefill (many rows) and decode (one row) both stay close to fp32."""
    prompt = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, how are you?"}])
    kv32 = new_cache(engine_fp32.model)
    ref, _ = run(engine_fp32.model, kv32, "s", prompt, 0)
    nxt = int(ref[-1].argmax())
    ref_step, _ = run(engine_fp32.model, kv32, "s", [nxt], len(prompt))
    low = load_model(None, dtype=torch.bfloat16).model
    low.compute_in(torch.float32)
    kv = new_cache(low, dtype=torch.float32)
    logits, hidden = run(low, kv, "s", prompt, 0)
    step, _ = run(low, kv, "s", [nxt], len(prompt))
    assert hidden.dtype == torch.bfloat16
    assert rel_err(logits, ref) < 0.05 and rel_err(step, ref_step) < 0.05
    assert (logits[-1].argmax() == ref[-1].argmax()).item() and (step[0].argmax() == ref_step[0].argmax()).item()


def test_loads_hf_checkpoint_folder_untied_with_llama3_rope(tmp_path):
    """A plain Hugging Face checkpoint folder, untied LM head, llama3 RoPE scaling, odd GQA ratio."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500000.0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype="float32").model
    assert ours.lm_head is not None
    ids = torch.randint(0, 97, (100,)).tolist()  # long enough for the scaled low frequencies to matter
    logits, _ = run(ours, new_cache(ours, block_size=8, num_blocks=32), "s", ids, 0)
    ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(logits, ref) < 1e-5


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope"))
