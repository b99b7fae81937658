"""Asyncio front of the engine: `generate()` yields deltas, `abort()` stops a request.

The engine's step loop runs in one background thread (model forwards release the GIL, so the event
loop stays responsive). Given a factory, the loop thread also builds the engine, so that it is the one
thread in the process that runs OpenMP regions: GNU OpenMP counts the threads of every team, and once
two exist (the model loaded in one thread, stepped in another) they outnumber the cores, its threads
stop spinning at barriers and sleep in the kernel instead, and a step gets much slower
(docs/serving.md, "Served under load"). Requests come typed (`GenerationRequest`, fields validated by
their maker); they are admitted and tokenized in the caller, handed to the loop thread through a
locked inbox, and their deltas come back through per-request asyncio queues; deltas that piled up
while a consumer was busy come out merged, so a slow consumer costs fewer messages. A consumer that
stops iterating (a client that disconnects) aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from engines.engine import LLMEngine
from engines.errors import EngineDeadError, InvalidRequestError
from engines.request import GenerationRequest, Request, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `LLMEngine` in a background thread and serves many concurrent async consumers."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        """`engine`, or a factory the loop thread calls to build it (returns once it is built; raises
        what the factory raised)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._built = threading.Event()
        factory = None if isinstance(engine, LLMEngine) else engine
        if factory is None:
            self.engine = engine
            self._built.set()
        self._thread = threading.Thread(target=self._loop, args=(factory,), name="engine-loop", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error

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
    def _deliver(self, items: list[RequestOutput]) -> None:
        """Hand a step's deltas to their consumers: one wake-up per event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for item in items:
                target = self._streams.get(item.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _loop(self, factory: Callable[[], LLMEngine] | None) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as exc:  # the constructor re-raises it
                self._error = exc
                return
            finally:
                self._built.set()
        try:
            while not self._stopped:
                with self._lock:
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                for req in new:
                    self.engine.add(req)
                aborted = [out for out in map(self.engine.abort, aborts) if out is not None]
                if aborted:
                    self._deliver(aborted)
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:  # a fault in the model or scheduler: fail every waiter loudly
            log.exception("engine loop crashed")
            self._error = exc
        finally:
            err = EngineDeadError(f"engine loop stopped: {self._error!r}" if self._error else "engine shut down")
            with self._lock:
                streams = list(self._streams.items())
            for _rid, (loop, queue) in streams:
                loop.call_soon_threadsafe(queue.put_nowait, err)


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)
