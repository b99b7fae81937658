"""Tokenizer, chat template and stop tokens from the model's checkpoint folder (via transformers),
plus incremental detokenization for streaming."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from engines.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
# A template that renders speaker names reads `message['name']` or `message.name`.
TEMPLATE_NAME_FIELD = re.compile(r"""message\s*\[\s*['"]name['"]\s*\]|message\.name\b""")
# A template that renders function tools reads the `tools` variable (Qwen2.5, Llama 3.1, Hermes...).
TEMPLATE_TOOLS = re.compile(r"\btools\b")

# The tool prompt injected into the system message for templates that do not render tools (the
# embedded SmolLM2's): Hermes style, the format Qwen2.5's template renders and `serve_app/tools.py`
# parses back. Tool results and earlier calls are rendered in the same style (`render_tool_turns`).
DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions you can call are \
described inside <tools></tools> tags, one JSON signature per line:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments inside \
<tool_call></tool_call> tags, one pair of tags per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-as-a-json-object>}}
</tool_call>"""


def _message_error(where: str, field: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}.{field} {msg}", param=f"{where}.{field}")


def _text_content(where: str, content: Any) -> str:
    """A message's content as one string (text parts joined)."""
    if isinstance(content, list):  # OpenAI text parts: [{"type": "text", "text": "..."}]
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _message_error(where, "content", "parts must be {'type': 'text', 'text': str}")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _message_error(where, "content", "must be a string or a list of text parts")
    return content


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool calls, with each call's arguments parsed from their JSON text (the
    object templates render; text that is not JSON stays text)."""
    if not isinstance(calls, list):
        raise _message_error(where, "tool_calls", "must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _message_error(
                where, f"tool_calls[{j}]", "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}"
            )
        try:
            arguments: Any = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = fn["arguments"]
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages and flatten text-part content to plain strings.

    OpenAI's `developer` role is its newer name for `system` instructions: it is rendered as `system`.
    A message's optional `name` is kept (the template decides whether it can render it). An assistant
    message may carry `tool_calls` (then its content may be null; the calls' arguments come back
    parsed); a `tool` message carries the result of the call named by its `tool_call_id`."""
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
        calls = msg.get("tool_calls") or None
        if calls is not None and role != "assistant":
            raise _message_error(where, "tool_calls", "is only allowed in assistant messages")
        rendered: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None and calls is not None else _text_content(where, content),
        }
        if calls is not None:
            rendered["tool_calls"] = _tool_calls(where, calls)
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _message_error(where, "tool_call_id", "must be the id of the call this message answers")
            rendered["tool_call_id"] = call_id
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
        out.append(rendered if name is None else rendered | {"name": name})
    return out


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the Hermes format writes it (what the tool prompt asks the model to answer)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls and tool results as plain turns, for templates that do not render them: an assistant
    message's calls are appended to its content as `<tool_call>` blocks; consecutive `tool` messages
    become one user message of `<tool_response>` blocks (what Qwen2.5's template renders)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        calls = m.get("tool_calls")
        if calls:
            texts = [m["content"]] if m["content"] else []
            texts += [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": "\n".join(texts)}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with `DEFAULT_TOOL_PROMPT` listing `tools` at the end of its system message (a
    system message is added first where there is none)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = messages[0] | {"content": (messages[0]["content"] + "\n\n" + prompt).lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet (bytes_to_unicode), reversed: the printable stand-in for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = _byte_level_table()


class Tokenizer:
    """Encodes chat messages with the model's template and names the tokens that end a turn."""

    def __init__(self, folder: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(folder))
        if not self.hf.chat_template:
            raise ValueError(f"tokenizer in {folder} has no chat template")
        self.vocab_size = len(self.hf)
        self.stop_token_ids = self._stop_tokens()
        self._token_bytes: dict[int, bytes] = {}
        # the Rust tokenizer's own decode where the wrapper would add nothing to it (no clean-up of
        # spaces): a streamed token is decoded twice per step per request, and the wrapper's checks
        # cost three times the decode
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._decode_ids = self.hf.decode
        if backend is not None and not getattr(self.hf, "clean_up_tokenization_spaces", False):
            self._decode_ids = backend.decode

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

    @property
    def renders_tools(self) -> bool:
        """Whether the model's chat template renders function tools itself (else `DEFAULT_TOOL_PROMPT`)."""
        template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else ""
        return bool(TEMPLATE_TOOLS.search(template))

    def apply_chat_template(self, messages: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation, ending with the assistant's generation prompt.

        `tools` (OpenAI function tools) go to a template that renders them; for one that does not,
        they are listed in `DEFAULT_TOOL_PROMPT` at the end of the system message, and tool calls and
        results in the history are rendered as Hermes-style turns (`render_tool_turns`)."""
        msgs = validate_messages(messages)
        named = next((i for i, m in enumerate(msgs) if "name" in m), None)
        template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else ""
        if named is not None and not TEMPLATE_NAME_FIELD.search(template):
            raise InvalidRequestError(
                f"messages[{named}].name is not supported: this model's chat template has no speaker names",
                param=f"messages[{named}].name",
            )
        if self.renders_tools:
            text = self.hf.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=True)
        else:
            msgs = render_tool_turns(msgs)
            if tools:
                msgs = with_tool_prompt(msgs, tools)
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw text prompt (completions): no template, with the special tokens the
        tokenizer adds to a sequence (a BOS token where the model expects one)."""
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        return self.hf.encode(text, add_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (the UTF-8 of a special token's text; a byte-level token
        may hold part of a character). Cached per token."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = _token_bytes(self.hf, token_id)
        return cached

    def encode(self, text: str) -> list[int]:
        """Token ids of already-templated text (no extra special tokens added)."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self._decode_ids(ids, skip_special_tokens=True)


def _token_bytes(hf: Any, token_id: int) -> bytes:
    piece = hf.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    if token_id in hf.added_tokens_decoder:  # special and added tokens: their text as is
        return piece.encode()
    if all(c in _BYTE_OF_CHAR for c in piece):  # byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2)
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()  # SentencePiece: U+2581 marks a space


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
