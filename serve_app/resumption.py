"""A request's stream from the LLM replicas that survives the replica serving it.

Sampling noise is keyed by (seed, output index), verification is exact, and the fused CPU decoder's rows
do not depend on their batch, so a request's continuation from any prefix of its answer is what the
uninterrupted request would have produced (greedy and seeded; the ingress gives unseeded sampled
requests a seed at admission). When the replica serving a request dies or becomes unreachable, or its
engine stops, `ResumableStream` sends the request to a live replica again as its prompt plus the tokens
each choice has already delivered (`ChatRequest.resumed`), and its stream simply goes on: the new
replica's deltas continue the text (held-back text included), count the whole answer in their usage,
and keep their output indices. A request is resumed at most `max_resumptions` times; then, or when no
replica takes it within `resume_wait_s`, the failure reaches the caller as before. A client that goes
away cancels the stream, which is never resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from engines.errors import EngineDeadError
from serve_app.messages import ChatRequest, ChoiceProgress, StreamDelta, StreamError, StreamItem

log = logging.getLogger("ray.serve.lyanna.ingress")
RETRY_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)  # waits between submissions while no live replica takes the request


def resumption_reason(error: BaseException) -> str | None:
    """Why a replica call that raised is worth resuming elsewhere (the metric's label), or None: the
    replica's engine stopped (a tensor-parallel rank died), its process died, or it is unreachable."""
    if isinstance(error, EngineDeadError):
        return "engine_failed"
    if isinstance(error, ActorUnavailableError):
        return "replica_unavailable"
    if isinstance(error, RayActorError):
        return "replica_died"
    return None


class ResumeRefused(Exception):
    """A replica refused a resumed request (it cannot happen for a request a replica once admitted)."""

    def __init__(self, error: StreamError):
        super().__init__(error.message)
        self.error = error


class ResumableStream:
    """The `StreamItem`s of one request across replica failures (`start` for the first, then `next`).

    `call(chat)` starts a replica call (the ingress's `DeploymentHandle.generate.remote`); `on_resume`
    is told the reason of every resumption (metrics)."""

    def __init__(
        self,
        call: Callable[[ChatRequest], Any],
        chat: ChatRequest,
        max_resumptions: int,
        resume_wait_s: float,
        on_resume: Callable[[str], None] = lambda reason: None,
    ):
        self.call = call
        self.chat = chat
        self.max_resumptions = max_resumptions
        self.resume_wait_s = resume_wait_s
        self.on_resume = on_resume
        self.progress = [ChoiceProgress() for _ in range(chat.n)]
        self.resumptions = 0
        self.stream: Any = None

    async def start(self) -> StreamItem:
        """The request's first item: its first delta, or the engine's refusal. Raises what the first
        replica call raised when it cannot be resumed (`BackPressureError`: every replica is saturated)."""
        try:
            return self._took(await self._submit(self.chat))
        except BackPressureError:
            raise
        except Exception as e:
            return self._took(await self._resume(e))

    async def next(self) -> StreamDelta:
        """The next delta, from whichever replica serves the request now."""
        try:
            item = await anext(self.stream)
        except Exception as e:
            item = await self._resume(e)
        if isinstance(item, StreamError):
            raise ResumeRefused(item)
        return self._took(item)

    def cancel(self) -> None:
        """Cancel the current replica call (the replica aborts the request and frees its blocks)."""
        if self.stream is not None:
            self.stream.cancel()

    def _took(self, item: StreamItem) -> StreamItem:
        if isinstance(item, StreamDelta):
            self.progress[item.index] = self.progress[item.index].after(item)
        return item

    async def _submit(self, chat: ChatRequest) -> StreamItem:
        """Start a replica call and wait for its first item."""
        stream = self.call(chat)
        try:
            first = await anext(stream)
        except BaseException:
            stream.cancel()
            raise
        self.stream = stream
        return first

    async def _resume(self, error: Exception) -> StreamItem:
        """Re-submit the request after `error` from the replica serving it (or re-raise it) to a live
        replica; within `resume_wait_s` one must take it and answer (the prompt and the answer so far
        are read again), else `error` is raised."""
        reason = resumption_reason(error)
        if reason is None or self.resumptions >= self.max_resumptions:
            raise error
        self.cancel()
        self.resumptions += 1
        self.on_resume(reason)
        chat = self.chat.resumed(self.progress, self.resumptions)
        tokens = sum(len(p.token_ids) for p in self.progress)
        log.warning(
            "replica failed (%r); resuming after %d tokens (resumption %d of at most %d)",
            error,
            tokens,
            self.resumptions,
            self.max_resumptions,
            extra={"chat_id": self.chat.request_id, "reason": reason},
        )
        start, attempt = time.monotonic(), 0
        while True:  # retry while no live replica takes it: the dead one may still be routed to, or all saturated
            left = self.resume_wait_s - (time.monotonic() - start)
            try:
                return await asyncio.wait_for(self._submit(chat), max(left, 1e-3))
            except TimeoutError:
                raise error from None
            except Exception as e:
                if not (resumption_reason(e) or isinstance(e, BackPressureError)) or left <= 0:
                    raise
                await asyncio.sleep(min(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)], max(left, 0.0)))
                attempt += 1
