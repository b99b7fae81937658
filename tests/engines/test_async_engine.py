"""The asyncio front: concurrent streams, abort on disconnect, errors before queueing, typed input."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engines.async_engine import AsyncEngine
from engines.engine import EngineConfig, LLMEngine
from engines.errors import ContextLengthError, InvalidRequestError
from engines.request import FinishReason, GenerationRequest
from engines.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS


@pytest.fixture(scope="module")
def engine():
    """An engine of its own: once the loop thread drives it, no other thread may step it."""
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, drafter="none"))


@pytest.fixture(scope="module")
def async_engine(engine):
    eng = AsyncEngine(engine)
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_concurrent_streams_match_offline(async_engine, engine_fp32):
    """engine_fp32 (a different engine, same weights) gives the offline reference."""
    params = SamplingParams(temperature=0, max_tokens=16)

    async def collect(conv):
        text, ids, last = "", [], None
        async for out in async_engine.generate(GenerationRequest(messages=conv, params=params)):
            text += out.new_text
            ids += out.new_token_ids
            last = out
        return text, ids, last

    async def main():
        return await asyncio.gather(*(collect(c) for c in CHAT_PROMPTS))

    results = asyncio.run(main())
    for conv, (text, ids, last) in zip(CHAT_PROMPTS, results, strict=True):
        alone = engine_fp32.generate([conv], params)[0]
        assert ids == alone.token_ids and text == alone.text
        assert last.finished and last.num_output_tokens == len(ids)
        # one clock: arrival <= first scheduled <= first token <= finish, all the engine's
        assert last.arrival_time <= last.first_scheduled_time <= last.first_token_time <= last.finish_time


def test_consumer_that_stops_early_aborts_and_frees_blocks(async_engine, engine):
    free = engine.kv_cache.allocator.num_free

    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = async_engine.generate(GenerationRequest(messages=CHAT_PROMPTS[3], params=params))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break  # like a client disconnecting mid-stream
        await stream.aclose()
        for _ in range(100):
            if engine.kv_cache.allocator.num_free == free and not engine.has_unfinished():
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_what_only_the_engine_checks_raises_before_anything_is_queued(async_engine, engine):
    """The typed request's fields were validated by its maker; admission still checks the tokenized
    prompt against the context and token ids against the vocabulary."""

    async def main(request):
        async for _ in async_engine.generate(request):
            pass

    too_long = GenerationRequest(messages=[{"role": "user", "content": "word " * 9000}])
    with pytest.raises(ContextLengthError) as err:
        asyncio.run(main(too_long))
    assert err.value.param == "messages"
    out_of_vocab = GenerationRequest(prompt_token_ids=[1, engine.tokenizer.vocab_size])
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(main(out_of_vocab))
    assert err.value.param == "prompt_token_ids"
    with pytest.raises(TypeError, match="takes a GenerationRequest, got dict"):
        asyncio.run(main({"messages": CHAT_PROMPTS[0]}))  # a wrong object is a clear error, not a crash inside
    assert not engine.has_unfinished()


def test_explicit_abort(async_engine):
    async def main():
        outs = []
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        async for out in async_engine.generate(
            GenerationRequest(request_id="to-abort", messages=CHAT_PROMPTS[3], params=params)
        ):
            outs.append(out)
            if len(outs) == 2:
                async_engine.abort("to-abort")
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.finish_reason is FinishReason.ABORT


def test_a_slow_consumer_gets_merged_deltas_that_add_up(async_engine, engine_fp32):
    """Deltas that pile up while the consumer sleeps come out as one: fewer items, same tokens and text."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    conv = CHAT_PROMPTS[0]

    async def slow():
        items = []
        async for out in async_engine.generate(GenerationRequest(messages=conv, params=params)):
            items.append(out)
            await asyncio.sleep(0.3)  # several engine steps pass while this consumer is busy
        return items

    items = asyncio.run(slow())
    alone = engine_fp32.generate([conv], params)[0]
    assert len(items) < 24
    assert max(len(o.new_token_ids) for o in items) > 1
    assert [t for o in items for t in o.new_token_ids] == alone.token_ids
    assert "".join(o.new_text for o in items) == alone.text
    assert items[-1].finished and items[-1].num_output_tokens == 24


def test_a_factory_builds_the_engine_in_the_loop_thread_that_steps_it():
    """The loop thread that steps the engine builds it (one OpenMP thread team per process); what the
    factory raises comes out of the constructor."""
    built_in = []

    def build() -> LLMEngine:
        built_in.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, drafter="none"))

    eng = AsyncEngine(build)
    try:
        assert built_in == ["engine-loop"] and isinstance(eng.engine, LLMEngine) and eng.is_running

        async def main():
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            return [out async for out in eng.generate(GenerationRequest(messages=CHAT_PROMPTS[0], params=params))]

        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].num_output_tokens == 4
    finally:
        eng.shutdown()

    def broken() -> LLMEngine:
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        AsyncEngine(broken)
