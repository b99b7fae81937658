"""Chat template, stop tokens and streaming detokenization on the embedded model's tokenizer."""

from __future__ import annotations

import random

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


def test_decode_equals_the_transformers_tokenizers_decode(tok):
    rng = random.Random(0)
    special = sorted(tok.hf.added_tokens_decoder)
    for _ in range(500):  # pieces of words, bytes of characters, special tokens among them
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size) for _ in range(8)]
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_a_template_without_tools_gets_the_default_hermes_tool_prompt(tok):
    assert not tok.renders_tools  # the embedded SmolLM2's template
    text = tok.hf.decode(tok.apply_chat_template(HISTORY, [WEATHER]))
    system, user, assistant, results, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\n# Tools") and '"name": "get_weather"' in system and "<tool_call>" in system
    assert user == "user\nWeather in Paris?<|im_end|>\n"
    # the earlier call in the format the model is asked to answer in, its arguments as an object
    assert (
        assistant
        == 'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )
    # consecutive tool results become one user turn of <tool_response> blocks
    assert (
        results == "user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    )
    assert prompt == "assistant\n"
    # no tools (tool_choice none): no tool prompt, the history still renders
    plain = tok.hf.decode(tok.apply_chat_template(HISTORY))
    assert "# Tools" not in plain and "<tool_response>\n22 C" in plain
    # an existing system message keeps its text, the tool prompt follows it
    with_system = tok.hf.decode(
        tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *HISTORY], [WEATHER])
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_a_template_that_renders_tools_gets_them_and_parsed_arguments(checkpoint):
    tok = Tokenizer(checkpoint)
    # the parts of Qwen2.5's template that matter here: tools listed, calls' arguments through tojson
    tok.hf.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert tok.renders_tools
    text = tok.hf.decode(tok.apply_chat_template(HISTORY, [WEATHER]))
    assert text == (
        'TOOLS:get_weather;[user]Weather in Paris?[assistant]CALL get_weather {"city": "Paris"}'
        "[tool]22 C[tool]sunny[assistant]"
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "22 C"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], "messages[0].tool_calls[0]"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
    ],
)
def test_malformed_tool_turns_name_the_field(tok, messages, param):
    from engines.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        tok.apply_chat_template(messages)
    assert err.value.param == param


def test_a_text_prompt_is_encoded_without_template_and_tokens_give_their_bytes(tok):
    text = "Once upon a time, héllo 日本 😀"
    ids = tok.encode_prompt(text)
    assert ids == tok.hf.encode(text, add_special_tokens=True) and tok.decode(ids) == text
    # byte-level tokens may hold part of a character: their bytes concatenate to the text's UTF-8
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(tok.token_bytes(i).decode(errors="replace").count("\ufffd") for i in ids)
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
