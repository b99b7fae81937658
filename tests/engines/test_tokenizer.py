"""Chat template, stop tokens and streaming detokenization on the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from engines.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(checkpoint):
    return Tokenizer(checkpoint)


def test_chat_template_and_stop_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.hf.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.stop_token_ids


def test_text_parts_are_joined(tok):
    a = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    )
    assert a == tok.apply_chat_template([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize("text", ["Ünïcode 世界 🎉 café — naïve", "```python\nprint('x')\n```", "  leading spaces"])
def test_incremental_detokenizer_never_splits_characters(tok, text):
    ids = tok.encode(text)
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}])
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push([t]) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Where a character's bytes span tokens, the first tokens emit nothing rather than a broken char.
    splits_a_char = any("\ufffd" in tok.decode(ids[: i + 1]) for i in range(len(ids)))
    assert splits_a_char == any(d == "" for d in deltas)
