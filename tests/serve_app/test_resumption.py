"""`ResumableStream` against scripted replica calls: what it re-submits after a failure, how often, and
what it never resumes. (The served path, with a replica really killed, is in test_reliability.py.)"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from engines.errors import EngineDeadError
from engines.request import FinishReason, GenerationRequest
from engines.sampling import SamplingParams
from serve_app.messages import ChatRequest, StreamDelta
from serve_app.resumption import ResumableStream, resumption_reason
from tests.serve_app.test_openai_api import delta as stream_delta


def delta(index: int, tokens: tuple[int, ...], text: str, total: int, done: bool = False) -> StreamDelta:
    """Choice `index`'s delta: `tokens` (spelling `text`), `total` output tokens so far."""
    finish = FinishReason.LENGTH if done else None
    return stream_delta(text, index, finish, tokens=total, new_token_ids=tokens)


class Call:
    """A scripted replica call: its items, then an exception (or the end)."""

    def __init__(self, items: list, error: BaseException | None = None):
        self.items, self.error, self.cancelled = list(items), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Replicas:
    """Hands out scripted calls in order and keeps what each was asked."""

    def __init__(self, *calls: Call):
        self.calls, self.asked = list(calls), []

    def __call__(self, chat: ChatRequest) -> Call:
        self.asked.append(chat)
        return self.calls.pop(0)


def chat(n: int = 1, temperature: float = 0.0) -> ChatRequest:
    params = SamplingParams(temperature=temperature, max_tokens=10)
    return ChatRequest(GenerationRequest(request_id="chatcmpl-abc", prompt="hi", params=params), n=n)


def drain(stream: ResumableStream, first) -> list[StreamDelta]:
    async def go():
        items = [first]
        while not items[-1].finished:
            items.append(await stream.next())
        return items

    return asyncio.run(go())


def test_a_failed_replica_call_is_resumed_after_the_delivered_tokens():
    replicas = Replicas(
        Call([delta(0, (1, 2), "ab", 2), delta(0, (3,), "c", 3)], ActorDiedError()),
        Call([delta(0, (4, 5), "de", 5, done=True)]),
    )
    reasons: list[str] = []
    stream = ResumableStream(replicas, chat(), max_resumptions=2, resume_wait_s=5, on_resume=reasons.append)
    first = asyncio.run(stream.start())
    items = drain(stream, first)
    assert "".join(d.new_text for d in items) == "abcde" and items[-1].num_output_tokens == 5
    resumed = replicas.asked[1]
    ((index, generation),) = resumed.choices()
    assert index == 0 and generation.resume_token_ids == [1, 2, 3] and generation.resume_text_sent == 3
    assert generation.request_id == "chatcmpl-abc-r1" and generation.params == replicas.asked[0].generation.params
    assert reasons == ["replica_died"] and stream.resumptions == 1


def test_finished_choices_are_not_run_again():
    replicas = Replicas(
        Call([delta(0, (1,), "a", 1, done=True), delta(1, (7,), "x", 1)], ActorUnavailableError("gone", None)),
        Call([delta(1, (8,), "y", 2, done=True)]),
    )
    stream = ResumableStream(replicas, chat(n=2), max_resumptions=2, resume_wait_s=5)
    first = asyncio.run(stream.start())
    assert first.index == 0

    async def rest():
        return [await stream.next(), await stream.next()]

    second, third = asyncio.run(rest())
    assert (second.index, third.index, third.finished) == (1, 1, True)
    assert [(i, g.resume_token_ids) for i, g in replicas.asked[1].choices()] == [(1, [7])]


def test_after_max_resumptions_the_failure_reaches_the_caller():
    error = EngineDeadError("rank 1 died")
    replicas = Replicas(
        Call([delta(0, (1,), "a", 1)], ActorDiedError()),
        Call([delta(0, (2,), "b", 2)], error),
    )
    stream = ResumableStream(replicas, chat(), max_resumptions=1, resume_wait_s=5)
    asyncio.run(stream.start())

    async def rest():
        await stream.next()
        await stream.next()

    with pytest.raises(EngineDeadError):
        asyncio.run(rest())
    assert stream.resumptions == 1 and replicas.calls == []


def test_only_replica_failures_are_resumed():
    assert resumption_reason(ActorDiedError()) == "replica_died"
    assert resumption_reason(ActorUnavailableError("gone", None)) == "replica_unavailable"
    assert resumption_reason(EngineDeadError("x")) == "engine_failed"
    assert resumption_reason(ValueError("ours")) is None
    replicas = Replicas(Call([delta(0, (1,), "a", 1)], ValueError("a bug")), Call([]))
    stream = ResumableStream(replicas, chat(), max_resumptions=2, resume_wait_s=5)
    first = asyncio.run(stream.start())
    with pytest.raises(ValueError):
        asyncio.run(stream.next())
    assert stream.resumptions == 0 and len(replicas.asked) == 1 and first.new_text == "a"


def test_a_resumed_request_waits_for_a_replica_that_takes_it():
    replicas = Replicas(
        Call([delta(0, (1,), "a", 1)], ActorDiedError()),
        Call([], ActorDiedError()),  # the dead replica, still routed to
        Call([], BackPressureError(num_queued_requests=1, max_queued_requests=1)),  # the others saturated
        Call([delta(0, (2,), "b", 2, done=True)]),
    )
    stream = ResumableStream(replicas, chat(), max_resumptions=1, resume_wait_s=10)
    items = drain(stream, asyncio.run(stream.start()))
    assert "".join(d.new_text for d in items) == "ab" and stream.resumptions == 1 and len(replicas.asked) == 4


def test_a_cancelled_request_is_not_resumed():
    class Hanging(Call):
        async def __anext__(self):
            if self.items:
                return self.items.pop(0)
            await asyncio.sleep(3600)

    first_call = Hanging([delta(0, (1,), "a", 1)])
    replicas = Replicas(first_call, Call([delta(0, (2,), "b", 2, done=True)]))

    async def client_goes_away():
        stream = ResumableStream(replicas, chat(), max_resumptions=2, resume_wait_s=5)
        await stream.start()
        task = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream.cancel()
        return stream

    stream = asyncio.run(client_goes_away())
    assert stream.resumptions == 0 and len(replicas.asked) == 1 and first_call.cancelled


def test_unseeded_sampled_requests_get_a_seed_before_they_are_sent():
    assert chat(temperature=0.0).with_fixed_seed().generation.params.seed is None  # greedy: nothing to fix
    seeded = chat(temperature=0.7).with_fixed_seed()
    assert seeded.generation.params.seed is not None
    assert seeded.with_fixed_seed() is seeded
