"""Tokenizer, chat template and stop tokens from the model's checkpoint folder (via transformers),
plus incremental detokenization for streaming."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from engines.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant")
# A template that renders speaker names reads `message['name']` or `message.name`.
TEMPLATE_NAME_FIELD = re.compile(r"""message\s*\[\s*['"]name['"]\s*\]|message\.name\b""")


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check OpenAI-style chat messages and flatten text-part content to plain strings.

    OpenAI's `developer` role is its newer name for `system` instructions: it is rendered as `system`.
    A message's optional `name` is kept (the template decides whether it can render it)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {ROLES}, got {role!r}", param=f"{where}.role")
        if isinstance(content, list):  # OpenAI text parts: [{"type": "text", "text": "..."}]
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"{where}.content parts must be {{'type': 'text', 'text': str}}", param=f"{where}.content"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
            )
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
        rendered = {"role": "system" if role == "developer" else role, "content": content}
        out.append(rendered if name is None else rendered | {"name": name})
    return out


class Tokenizer:
    """Encodes chat messages with the model's template and names the tokens that end a turn."""

    def __init__(self, folder: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(folder))
        if not self.hf.chat_template:
            raise ValueError(f"tokenizer in {folder} has no chat template")
        self.vocab_size = len(self.hf)
        self.stop_token_ids = self._stop_tokens()

    def _stop_tokens(self) -> frozenset[int]:
        ids = set()
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        # The chat template's end-of-turn marker ends generation even where it is not the EOS token.
        vocab = self.hf.get_vocab()
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<|endoftext|>", "</s>"):
            if tok in vocab:
                ids.add(vocab[tok])
        return frozenset(ids)

    def apply_chat_template(self, messages: Any) -> list[int]:
        """Token ids of the rendered conversation, ending with the assistant's generation prompt."""
        msgs = validate_messages(messages)
        named = next((i for i, m in enumerate(msgs) if "name" in m), None)
        template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else ""
        if named is not None and not TEMPLATE_NAME_FIELD.search(template):
            raise InvalidRequestError(
                f"messages[{named}].name is not supported: this model's chat template has no speaker names",
                param=f"messages[{named}].name",
            )
        text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of already-templated text (no extra special tokens added)."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.hf.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    It decodes a short window of tokens twice (with and without the newest ones) and emits the
    difference, holding back while the window ends in an incomplete byte sequence (U+FFFD). Seeding
    the window with the last prompt tokens keeps tokenizers that drop a leading space honest.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""
