"""Which replica holds a conversation's prefix in its KV cache: keys for conversation prefixes, and the
replica's record of the prefixes it served whose blocks are still cached.

The router does not tokenize, so it cannot name KV blocks. It names conversation prefixes instead: key j
of a conversation is a hash chained over its first j messages (role and content), so a conversation
that grows by appending messages keeps the keys of its earlier prefixes. A replica remembers, for the
requests it served, the keys of the prompt's message prefixes and of prompt + answer (the next turn's
history), each with the chain hash of the last KV block it computed for them (its anchor); it reports
the keys whose anchor block is still in its prefix cache. The router scores a replica by the longest
prefix of the request it holds: approximate (a key counts as held while its last block is cached, and
the cache evicts a sequence's tail first), cheap, and blind to the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefixKey:
    """One conversation prefix: its chained key and its length in content characters (a proxy for tokens)."""

    key: int
    chars: int


def conversation_keys(messages: list[dict[str, Any]] | None) -> list[PrefixKey]:
    """Keys of the conversation's prefixes of 1, 2, ... messages ([] without messages)."""
    out: list[PrefixKey] = []
    parent, chars = b"", 0
    for message in messages or ():
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)
        part = json.dumps([message.get("role"), text], ensure_ascii=False)
        # surrogatepass: a str from JSON may hold a lone surrogate, which strict UTF-8 cannot encode.
        parent = hashlib.blake2b(parent + part.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        chars += len(text)
        out.append(PrefixKey(int.from_bytes(parent, "little"), chars))
    return out


def request_messages(request: Any) -> list[dict[str, Any]] | None:
    """The messages a routed request's prefix keys hash: a chat's conversation, or a text completion's
    prompt as one message."""
    messages = getattr(request, "messages", None)
    if messages:
        return messages
    prompt = getattr(request, "prompt", None)
    return [{"role": "prompt", "content": prompt}] if isinstance(prompt, str) and prompt else None


@dataclass
class HeldPrefixes:
    """A replica's record of conversation prefixes it served and the KV block that anchors each."""

    max_keys: int = 8192
    anchors: OrderedDict[int, int] = field(default_factory=OrderedDict)  # key -> anchor block hash; oldest first
    _lock: threading.Lock = field(default_factory=threading.Lock)  # requests and stats polls may differ in thread

    def record(self, keys: list[PrefixKey], anchor: int | None) -> None:
        """Remember prefix keys whose KV ends in the block with chain hash `anchor` (None: nothing cached)."""
        if anchor is None:
            return
        with self._lock:
            for k in keys:
                self.anchors[k.key] = anchor
                self.anchors.move_to_end(k.key)
            while len(self.anchors) > self.max_keys:
                self.anchors.popitem(last=False)

    def report(self, is_cached: Callable[[int], bool], limit: int = 1024) -> list[int]:
        """The most recent keys (at most `limit`) whose anchor block is still cached; forgets evicted ones."""
        live, gone = [], []
        with self._lock:
            for key, anchor in reversed(self.anchors.items()):
                if not is_cached(anchor):
                    gone.append(key)
                elif len(live) < limit:
                    live.append(key)
            for key in gone:
                del self.anchors[key]
        return live


def remember_served(
    held: HeldPrefixes,
    messages: list[dict[str, Any]] | None,
    answer: str | None,
    anchors: tuple[int | None, int | None],
) -> None:
    """Record a finished request: its prompt's message prefixes (up to the last eight, and the first
    one, often a shared system prompt) anchored at the prompt's last cached block, and prompt + answer
    (the next turn's history) at the request's last cached block."""
    keys = conversation_keys(messages)
    if not keys:
        return
    prompt_anchor, full_anchor = anchors
    held.record([keys[0], *keys[-8:]], prompt_anchor)
    if answer:
        history = [*(messages or []), {"role": "assistant", "content": answer}]
        held.record(conversation_keys(history)[-1:], full_anchor)
