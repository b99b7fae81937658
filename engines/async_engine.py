"""Asyncio front of the engine: `generate()` yields deltas, `abort()` stops a request.

The engine's step loop runs in one background thread (model forwards release the GIL, so the event
loop stays responsive). Requests come typed (`GenerationRequest`, fields validated by their maker);
they are admitted and tokenized in the caller, handed to the loop thread through a locked inbox, and
their deltas come back through per-request asyncio queues; deltas that piled up while a consumer was
busy come out merged, so a slow consumer costs fewer messages. A consumer that stops iterating (a
client that disconnects) aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from engines.engine import LLMEngine
from engines.errors import EngineDeadError, InvalidRequestError
from engines.request import GenerationRequest, Request, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `LLMEngine` in a background thread and serves many concurrent async consumers."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive and healthy."""
        return self._thread.is_alive() and self._error is None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit, queue and stream one request's deltas until it finishes.

        Raises InvalidRequestError before anything is queued when the engine refuses the request (its
        prompt does not fit the context, say), TypeError for anything but a GenerationRequest.
        """
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"AsyncEngine.generate takes a GenerationRequest, got {type(request).__name__}")
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running: {self._error!r}")
        req = self.engine.admit(request)
        rid = req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._new.append(req)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    later = queue.get_nowait()  # deltas that piled up while the consumer was busy: send one
                    item = later if isinstance(later, BaseException) else item.merged_with(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Ask the loop to stop a request and free its blocks (no-op if it already finished)."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the loop thread (pending consumers get EngineDeadError)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- loop thread ---------------------------------------------------------------------------
    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                for req in new:
                    self.engine.add(req)
                for rid in aborts:
                    out = self.engine.abort(rid)
                    if out is not None:
                        self._deliver(rid, out)
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # a fault in the model or scheduler: fail every waiter loudly
            log.exception("engine loop crashed")
            self._error = exc
        finally:
            err = EngineDeadError(f"engine loop stopped: {self._error!r}" if self._error else "engine shut down")
            with self._lock:
                streams = list(self._streams.items())
            for _rid, (loop, queue) in streams:
                loop.call_soon_threadsafe(queue.put_nowait, err)
