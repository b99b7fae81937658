"""A request's choices as the ingress assembles them from the replica's deltas: OpenAI's chat choices
(text or parsed tool calls, log-probabilities as `{content: [{token, logprob, bytes, top_logprobs}]}`)
and text-completion choices (echo, log-probabilities in the legacy `{tokens, token_logprobs,
top_logprobs, text_offset}` format), whole or as stream chunks.

Log-probabilities are the engine's (`logprobs_mode`); one the engine reports as -inf (a token the
sampling settings rule out, in `processed_logprobs` mode) is sent as -9999.0, as vLLM does, since JSON
has no infinity.
"""

from __future__ import annotations

import math

from serve_app.messages import LogprobEntry, StreamDelta
from serve_app.responses import (
    AssistantMessage,
    ChatLogprobs,
    ChatTokenLogprob,
    Choice,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from serve_app.tools import ToolCallParser, ToolEvent

LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    """OpenAI's chat format of output tokens' log-probabilities."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=_finite(e.logprob if e.logprob is not None else LOGPROB_FLOOR),
                bytes=list(e.token_bytes),
                top_logprobs=[
                    TopLogprob(token=t.token, logprob=_finite(t.logprob or 0.0), bytes=list(t.token_bytes))
                    for t in e.top
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[LogprobEntry], offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """The legacy format of tokens' log-probabilities, their text offsets counted from `offset`; and the
    offset after them. Each position's top map holds the most likely tokens and the sampled one."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
        if e.logprob is None:  # the prompt's first token: nothing predicts it
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_finite(e.logprob))
        top = {t.token: _finite(t.logprob or 0.0) for t in e.top}
        top.setdefault(e.token, _finite(e.logprob))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets), offset


class ChatChoiceState:
    """One chat choice being assembled. With tools offered (`tool_names`), its text goes through the
    tool-call parser; with `logprobs`, the entries are kept (and streamed with the text)."""

    def __init__(self, index: int, tool_names: set[str] | None, logprobs: bool):
        self.index = index
        self.parser = ToolCallParser(tool_names) if tool_names else None
        self.want_logprobs = logprobs
        self.content = ""  # the text that is not tool calls
        self.entries: list[LogprobEntry] = []
        self.last: StreamDelta | None = None

    def _events(self, delta: StreamDelta) -> list[ToolEvent]:
        text = delta.new_text
        if self.parser is None:
            return [ToolEvent(content=text)] if text else []
        events = self.parser.push(text)
        return events + self.parser.finish() if delta.finished else events

    def push(self, delta: StreamDelta) -> list[ChunkChoice]:
        """Take a delta; return its stream updates (the last one carries the finish reason)."""
        self.last = delta
        if delta.logprobs:
            self.entries += delta.logprobs
        chunks = []
        for e in self._events(delta):
            if e.call is None:
                self.content += e.content
                if e.content:
                    chunks.append(ChunkChoice(index=self.index, delta=DeltaMessage(content=e.content)))
                continue
            start = e.name is not None
            call = ToolCallDelta(
                index=e.call,
                id=e.id if start else None,
                type="function" if start else None,
                function=FunctionCallDelta(name=e.name, arguments=e.arguments),
            )
            chunks.append(ChunkChoice(index=self.index, delta=DeltaMessage(tool_calls=[call])))
        if self.want_logprobs and delta.logprobs:
            if not chunks:
                chunks.append(ChunkChoice(index=self.index, delta=DeltaMessage()))
            chunks[0].logprobs = chat_logprobs(list(delta.logprobs))
        if delta.finished:
            chunks.append(ChunkChoice(index=self.index, delta=DeltaMessage(), finish_reason=self.finish_reason))
        return chunks

    @property
    def finish_reason(self) -> str | None:
        """The engine's, or `tool_calls` when the model stopped after calling tools."""
        if self.last is None or self.last.finish_reason is None:
            return None
        reason = self.last.finish_reason.value
        return "tool_calls" if self.parser is not None and self.parser.calls and reason == "stop" else reason

    def choice(self) -> Choice:
        """The whole choice (after its last delta)."""
        content: str | None = self.content
        calls = None
        if self.parser is not None and self.parser.calls:
            content = self.content.strip() or None
            calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in self.parser.calls
            ]
        return Choice(
            index=self.index,
            message=AssistantMessage(content=content, tool_calls=calls),
            logprobs=chat_logprobs(self.entries) if self.want_logprobs else None,
            finish_reason=self.finish_reason,
        )


class CompletionChoiceState:
    """One text-completion choice being assembled: with `echo` the prompt comes first (text, and with
    logprobs its tokens, the first with a null log-probability)."""

    def __init__(self, index: int, echo: bool, logprobs: bool):
        self.index = index
        self.echo = echo
        self.want_logprobs = logprobs
        self.text = ""
        self.entries: list[LogprobEntry] = []
        self.offset = 0
        self.finish_reason: str | None = None

    def push(self, delta: StreamDelta) -> CompletionChoice | None:
        """Take a delta; return its stream update (None when it adds nothing)."""
        text, entries = delta.new_text, list(delta.logprobs or ())
        if self.echo and delta.prompt_text is not None:
            text = delta.prompt_text + text
            entries = list(delta.prompt_logprobs or ()) + entries
        self.text += text
        self.entries += entries
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.value
        logprobs = None
        if self.want_logprobs and entries:
            logprobs, self.offset = completion_logprobs(entries, self.offset)
        if not text and logprobs is None and not delta.finished:
            return None
        return CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=self.finish_reason)

    def choice(self) -> CompletionChoice:
        """The whole choice (after its last delta)."""
        logprobs = completion_logprobs(self.entries)[0] if self.want_logprobs else None
        return CompletionChoice(index=self.index, text=self.text, logprobs=logprobs, finish_reason=self.finish_reason)
