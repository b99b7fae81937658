"""End-to-end greedy generation against transformers, and batching invariance."""

from __future__ import annotations

import pytest
import torch

from engines.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS

MAX_NEW = 40


@pytest.mark.slow
def test_greedy_equals_transformers_generate(engine_fp32, hf_fp32):
    tok = engine_fp32.tokenizer
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    ours = engine_fp32.generate(CHAT_PROMPTS, params)
    for conv, got in zip(CHAT_PROMPTS, ours, strict=True):
        ids = tok.apply_chat_template(conv)
        ref = hf_fp32.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=sorted(tok.stop_token_ids),
            pad_token_id=0,
        )
        assert got.token_ids == ref[0, len(ids) :].tolist()
        assert got.text == tok.decode(got.token_ids)


@pytest.mark.slow
def test_batched_prompts_equal_each_alone(engine_fp32):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    lengths = {len(engine_fp32.tokenizer.apply_chat_template(c)) for c in CHAT_PROMPTS}
    assert len(lengths) == len(CHAT_PROMPTS)  # really different lengths
    together = engine_fp32.generate(CHAT_PROMPTS, params)
    for conv, batched in zip(CHAT_PROMPTS, together, strict=True):
        alone = engine_fp32.generate([conv], params)[0]
        assert batched.token_ids == alone.token_ids
        assert batched.finish_reason == alone.finish_reason
