"""The OpenAI API surface below HTTP: completions, n, logprobs, structured outputs and tools map onto
the engine's typed request; the replica's deltas become OpenAI's choices (whole and streamed); the
tool-call grammar and parser. The served versions, through the openai client, are in test_server.py."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
from pydantic import ValidationError

from engines.errors import InvalidRequestError
from engines.request import FinishReason
from engines.spec_params import SpecParams
from policies.slo import SLOSettings
from serve_app.choices import LOGPROB_FLOOR, ChatChoiceState, CompletionChoiceState
from serve_app.messages import INT64_MIN, LogprobEntry, StreamDelta, seed_of_choice
from serve_app.schemas import ChatCompletionRequest, CompletionRequest, error_param
from serve_app.tools import ToolCallParser, json_schema_grammar, parse_tool_calls, tool_choice_grammar

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


def typed(body: dict, kind: type = ChatCompletionRequest):
    return kind.model_validate(body).chat_request("req-1", SLOSettings(), SpecParams())


def param_of(body: dict, kind: type = ChatCompletionRequest) -> str | None:
    with pytest.raises(ValidationError) as err:
        kind.model_validate(body)
    return error_param(err.value.errors()[0])


# ---- completions -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("Once", "Once", None), (["Once"], "Once", None), ([5, 6], None, [5, 6]), ([[5, 6]], None, [5, 6])],
)
def test_a_completion_prompt_is_text_or_token_ids(prompt, text, ids):
    gen = typed({"model": MODEL, "prompt": prompt}, CompletionRequest).generation
    assert (gen.prompt, gen.prompt_token_ids, gen.messages) == (text, ids, None)
    assert gen.params.max_tokens == 16  # OpenAI's default for completions


def test_completion_fields_map_onto_the_engine():
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "logprobs": 3, "echo": True, "n": 2, "seed": 9}
    chat = typed(body | {"stop": ["\n"], "top_k": 4, "ignore_eos": True, "best_of": 2}, CompletionRequest)
    p = chat.generation.params
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs, p.stop, p.top_k, p.ignore_eos) == (5, 3, 3, ["\n"], 4, True)
    assert chat.echo and chat.n == 2
    plain = typed({"model": MODEL, "prompt": "x", "logprobs": 0}, CompletionRequest).generation.params
    assert plain.logprobs == 0 and plain.prompt_logprobs is None  # prompt logprobs only for echo


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "the end"}, "suffix"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),  # a chat field
    ],
)
def test_bad_completion_fields_are_named(extra, param):
    assert param_of({"model": MODEL, "prompt": "x"} | extra, CompletionRequest) == param


def test_suffix_is_accepted_only_when_it_asks_for_nothing():
    for neutral in (None, ""):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "suffix": neutral})


# ---- n, logprobs -------------------------------------------------------------------------------
def test_n_choices_fan_out_with_their_own_ids_and_seeds():
    chat = typed(CHAT | {"n": 3, "seed": 7})
    gens = chat.generations()
    assert [g.request_id for g in gens] == ["req-1-0", "req-1-1", "req-1-2"]
    assert [g.params.seed for g in gens] == [7, 8, 9] and chat.generation.params.seed == 7
    assert [g.params.seed for g in typed(CHAT | {"n": 2}).generations()] == [None, None]  # each draws its own
    assert typed(CHAT).generations() == [typed(CHAT).generation]  # one choice: the request itself
    assert seed_of_choice(2**63 - 1, 1) == INT64_MIN  # wraps within 64 bits


def test_chat_logprobs_map_onto_the_engine():
    assert typed(CHAT | {"logprobs": True}).generation.params.logprobs == 0
    assert typed(CHAT | {"logprobs": True, "top_logprobs": 20}).generation.params.logprobs == 20
    assert typed(CHAT | {"logprobs": False, "top_logprobs": 0}).generation.params.logprobs is None
    assert param_of(CHAT | {"top_logprobs": 3}) == "top_logprobs"


# ---- structured outputs -------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("extra", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            "response_format",
        ),
        ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
        ({"guided_regex": "[a-z]+"}, "regex", "guided_regex"),
        ({"guided_grammar": 'root ::= "yes"'}, "grammar", "guided_grammar"),
        ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ],
)
def test_output_constraints_map_onto_structured_params(extra, kind, param):
    for body, cls in ((CHAT, ChatCompletionRequest), ({"model": MODEL, "prompt": "x"}, CompletionRequest)):
        s = typed(body | extra, cls).generation.params.structured
        assert s.kind == kind and s.param == param
        if kind == "json_schema":
            assert json.loads(s.json_schema) == SCHEMA
    assert typed(CHAT | {"response_format": {"type": "text"}}).generation.params.structured is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)
def test_conflicting_or_broken_constraints_are_a_400_naming_the_field(extra, param):
    with pytest.raises(InvalidRequestError) as err:
        typed(CHAT | extra)
    assert err.value.param == param


def test_unknown_response_formats_and_extension_options_are_named():
    assert param_of(CHAT | {"response_format": {"type": "xml"}}) == "response_format"
    bad_name = {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}
    assert param_of(CHAT | {"response_format": bad_name}) == "response_format.json_schema.name"
    assert param_of(CHAT | {"structured_outputs": {"backend": "x"}}) == "structured_outputs.backend"
    assert param_of(CHAT | {"guided_choice": []}) == "guided_choice"


# ---- tools: the request -----------------------------------------------------------------------
def test_tools_are_offered_unless_tool_choice_is_none():
    gen = typed(CHAT | {"tools": [WEATHER, NOOP]}).generation
    assert [t["function"]["name"] for t in gen.tools] == ["get_weather", "noop"] and gen.params.structured is None
    assert typed(CHAT | {"tools": [WEATHER], "tool_choice": "none"}).generation.tools is None


def test_required_and_named_tool_choices_become_a_grammar():
    required = typed(CHAT | {"tools": [WEATHER, NOOP], "tool_choice": "required"}).generation.params.structured
    assert required.param == "tool_choice" and '"\\"get_weather\\""' in required.grammar and "noop" in required.grammar
    named = {"type": "function", "function": {"name": "noop"}}
    only = typed(CHAT | {"tools": [WEATHER, NOOP], "tool_choice": named}).generation.params.structured
    assert "noop" in only.grammar and "get_weather" not in only.grammar
    assert accepts(only.grammar, block("noop", "{}")) and not accepts(
        only.grammar, block("noop", "{}") + "\n" + block("noop", "{}")
    )
    assert param_of(CHAT | {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}) == (
        "tool_choice"
    )


def test_tool_turns_in_the_history_are_validated_and_passed_on():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    gen = typed(CHAT | {"messages": history, "tools": [WEATHER]}).generation
    assert gen.messages[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert gen.messages[2] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}
    for bad, param in (
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages[0].tool_calls[0].function"),
    ):
        assert param_of(CHAT | {"messages": [bad]}) == param, bad


# ---- tools: the grammar -----------------------------------------------------------------------
def accepts(grammar: str, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


def block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_the_required_grammar_accepts_exactly_calls_of_the_declared_functions():
    functions = [(t["function"]["name"], t["function"].get("parameters")) for t in (WEATHER, NOOP)]
    g = tool_choice_grammar(functions)
    assert accepts(g, block("get_weather", '{"city": "Paris"}'))
    assert accepts(g, block("get_weather", '{"city": "Paris", "unit": "c"}') + "\n" + block("noop", '{"x": [1]}'))
    assert not accepts(g, block("get_weather", '{"unit": "c"}'))  # city is required
    assert not accepts(g, block("get_weather", '{"city": 3}'))  # a string
    assert not accepts(g, block("get_weather", '{"city": "P", "unit": "k"}'))  # not in the enum
    assert not accepts(g, block("get_time", "{}"))  # not declared
    assert not accepts(g, "Sure! " + block("noop", "{}"))  # nothing before the call
    single = tool_choice_grammar(functions[1:], parallel=False)
    assert accepts(single, block("noop", "{}")) and not accepts(
        single, block("noop", "{}") + "\n" + block("noop", "{}")
    )


def test_the_schema_grammar_covers_nesting_arrays_refs_and_optional_members():
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "when": {"$ref": "#/$defs/date"},
            "n": {"type": ["integer", "null"]},
            "ok": {"type": "boolean"},
            "kind": {"const": "x"},
        },
        "$defs": {"date": {"type": "object", "properties": {"day": {"type": "integer"}}, "required": ["day"]}},
    }
    g = json_schema_grammar(schema)
    for good in ("{}", '{"n": null}', '{"ok": true, "kind": "x"}', '{"tags": ["a", "b"], "when": {"day": 3}, "n": -2}'):
        assert accepts(g, good), good
    for bad in ('{"tags": []}', '{"when": {}}', '{"n": 1.5}', '{"kind": "y"}', '{"ok": true "n": 1}', '{"extra": 1}'):
        assert not accepts(g, bad), bad


def test_schemas_it_does_not_understand_still_give_a_grammar():
    """Whatever a client sends as parameters (the fuzz test sends anything), the grammar compiles: what
    it cannot read allows any JSON value, deep nesting included."""
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(100):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    weird = [{"enum": []}, {"enum": 5}, {"type": []}, {"type": [["a"]]}, {"type": {"a": 1}}, {"$ref": {"a": 1}}]
    weird += [
        {"$ref": "#/nope"},
        {"required": "x", "properties": {"a": {}}},
        {"properties": {"a": {"type": "array", "minItems": "3"}}},
    ]
    weird += [{"properties": [1]}, {"anyOf": []}, {"type": "object", "properties": {"a": {"$ref": "#"}}}, deep]
    for schema in weird:
        assert accepts(tool_choice_grammar([("f", schema)]), block("f", "{}")), schema


# ---- tools: parsing the output ----------------------------------------------------------------
TOOL_NAMES = {"get_weather", "noop"}
OUTPUTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": {"a": [1, "}"]}}}\n'
    "</tool_call>\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "noop", "arguments": {}}\n</tool_call>',
    '<tool_call>\n[{"name": "noop", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]\n'
    "</tool_call>",  # SmolLM2's own list form, a 'parameters' key
    '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',  # keys in another order
    "No tools needed: 2 < 3 and <tool_c is not a tag.",
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # undeclared: stays text
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off
    '<tool_call>\n{"name": "get_weather", "arguments": { "city": "Paris" }}\n</tool_',  # cut off in the tag
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na',  # a cut-off extra call
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_tool_calls_add_up_to_the_parsed_whole(text):
    content, calls = parse_tool_calls(text, TOOL_NAMES)
    rng = random.Random(0)
    for _ in range(5):  # random chunkings, one character at a time included
        parser, events, i = ToolCallParser(TOOL_NAMES), [], 0
        while i < len(text):
            step = rng.choice([1, 1, 2, 5, 17])
            events += parser.push(text[i : i + step])
            i += step
        events += parser.finish()
        streamed_args: dict[int, str] = {}
        for e in events:
            if e.call is not None:
                streamed_args[e.call] = streamed_args.get(e.call, "") + e.arguments
        starts = [(e.call, e.name) for e in events if e.name is not None]
        assert starts == [(k, c.name) for k, c in enumerate(calls)]  # name first, once per call
        assert [streamed_args[k] for k in range(len(calls))] == [c.arguments for c in calls]
        streamed_text = "".join(e.content for e in events)
        assert (streamed_text.strip() or None if calls else streamed_text) == content


def test_parsed_calls_are_what_the_model_wrote():
    content, calls = parse_tool_calls(OUTPUTS[0], TOOL_NAMES)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "x": {"a": [1, "}"]}}
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(OUTPUTS[2], TOOL_NAMES)[1]] == [
        ("noop", {}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert parse_tool_calls(OUTPUTS[4], TOOL_NAMES) == (OUTPUTS[4], [])
    assert parse_tool_calls(OUTPUTS[5], TOOL_NAMES) == (OUTPUTS[5], [])
    assert json.loads(parse_tool_calls(OUTPUTS[7], TOOL_NAMES)[1][0].arguments) == {"city": "Paris"}
    cut = parse_tool_calls(OUTPUTS[8], TOOL_NAMES)
    assert cut[0] is None and [c.name for c in cut[1]] == ["noop"]
    assert len({c.id for c in parse_tool_calls(OUTPUTS[1], TOOL_NAMES)[1]}) == 2


# ---- choices from the replica's deltas --------------------------------------------------------
def entry(token: str, logprob: float | None, top: tuple = ()) -> LogprobEntry:
    return LogprobEntry(0, token, token.encode(), logprob, tuple(entry(t, p) for t, p in top))


def delta(text: str, index: int = 0, finish: FinishReason | None = None, tokens: int = 1, **kw) -> StreamDelta:
    return StreamDelta(
        new_text=text,
        finish_reason=finish,
        num_prompt_tokens=4,
        num_output_tokens=tokens,
        num_forwards=tokens,
        num_spec_steps=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
        tokens_per_step=1.0,
        num_preemptions=0,
        arrival_time=0.0,
        first_scheduled_time=0.0,
        first_token_time=0.1,
        finish_time=1.0 if finish else None,
        index=index,
        **kw,
    )


def test_a_chat_choice_streams_tool_calls_as_openai_does():
    state = ChatChoiceState(0, TOOL_NAMES, logprobs=False)
    pieces = ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}\n</tool_call>']
    chunks = [
        c for i, p in enumerate(pieces) for c in state.push(delta(p, finish=FinishReason.STOP if i == 3 else None))
    ]
    calls = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris"}'
    assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
    whole = state.choice()
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    assert whole.message.tool_calls[0].id == calls[0].id and whole.message.tool_calls[0].function.arguments == (
        '{"city": "Paris"}'
    )


def test_chat_logprobs_are_openais_format_and_streamed_with_their_text():
    state = ChatChoiceState(1, None, logprobs=True)
    a = state.push(delta("Hi", index=1, logprobs=(entry("Hi", -0.5, (("Hi", -0.5), ("Yo", -1.5))),)))
    b = state.push(delta(" é", index=1, finish=FinishReason.LENGTH, logprobs=(entry(" é", -math.inf),)))
    assert a[0].delta.content == "Hi" and a[0].index == 1
    assert a[0].logprobs.content[0].model_dump() == {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
        ],
    }
    assert b[0].logprobs.content[0].logprob == LOGPROB_FLOOR and b[0].logprobs.content[0].bytes == [32, 195, 169]
    assert b[-1].finish_reason == "length"
    whole = state.choice()
    assert whole.message.content == "Hi é" and [t.token for t in whole.logprobs.content] == ["Hi", " é"]


def test_completion_logprobs_are_the_legacy_format_with_the_echoed_prompt_first():
    state = CompletionChoiceState(0, echo=True, logprobs=True)
    prompt = (entry("The", None), entry(" sky", -7.0, (("-", -1.0),)))
    first = state.push(delta(" is", prompt_text="The sky", prompt_logprobs=prompt, logprobs=(entry(" is", -0.2),)))
    last = state.push(delta(" blue", finish=FinishReason.LENGTH, logprobs=(entry(" blue", -0.9, ((" blue", -0.9),)),)))
    assert first.text == "The sky is" and last.text == " blue" and last.finish_reason == "length"
    assert first.logprobs.text_offset == [0, 3, 7] and last.logprobs.text_offset == [10]  # offsets continue
    whole = state.choice()
    assert whole.text == "The sky is blue"
    assert whole.logprobs.model_dump() == {
        "tokens": ["The", " sky", " is", " blue"],
        "token_logprobs": [None, -7.0, -0.2, -0.9],
        "top_logprobs": [None, {"-": -1.0, " sky": -7.0}, {" is": -0.2}, {" blue": -0.9}],  # the sampled one too
        "text_offset": [0, 3, 7, 10],
    }
    plain = CompletionChoiceState(0, echo=False, logprobs=False)
    assert plain.push(delta("x", prompt_text="ignored")).text == "x" and plain.choice().logprobs is None


def test_the_outcome_of_n_choices_counts_the_prompt_once():
    a, b = delta("a", 0, FinishReason.STOP, tokens=3), delta("b", 1, FinishReason.LENGTH, tokens=5)
    both = StreamDelta.combined([a, b])
    assert (both.num_prompt_tokens, both.num_output_tokens, both.finish_time) == (4, 8, 1.0)
    assert StreamDelta.combined([a]) is a


# ---- the replica's fan-out, on the real engine (no Ray) -----------------------------------------
@pytest.fixture(scope="module")
def replica():
    """An LLM replica around a real engine, built by its own constructor outside Ray Serve."""
    from serve_app.replica import LLMReplica

    settings = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, "drafter": "none"}
    r = LLMReplica.func_or_class(settings)
    yield r
    r.async_engine.shutdown()


def collect(replica, chat, stop_after: int | None = None) -> list:
    import asyncio

    async def go() -> list:
        items = []
        stream = replica.generate(chat)
        async for item in stream:
            items.append(item)
            if stop_after is not None and len(items) >= stop_after:
                await stream.aclose()  # what Serve does when the client goes away
                break
        return items

    return asyncio.run(go())


@pytest.mark.slow
def test_the_replica_fans_n_choices_out_and_closing_the_stream_aborts_them_all(replica):
    free = replica.engine.kv_cache.allocator.num_free
    prompt = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who told stories. " * 2
    chat = typed({"model": MODEL, "prompt": prompt, "max_tokens": 6, "n": 3, "seed": 1}, CompletionRequest)
    hits = replica.engine.stats().prefix_cache_hits
    items = collect(replica, chat)
    assert replica.engine.stats().prefix_cache_hits - hits >= 2 * 32  # choices 1 and 2 read choice 0's prompt blocks
    assert items[0].replica == "local" and {i.index for i in items} == {0, 1, 2}
    lasts = {i.index: i for i in items if i.finished}
    assert sorted(lasts) == [0, 1, 2] and all(d.num_output_tokens == 6 for d in lasts.values())
    long = typed({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "n": 2}, CompletionRequest)
    assert len(collect(replica, long, stop_after=3)) == 3
    deadline = time.monotonic() + 10  # the engine's loop thread takes the aborts at its next step
    while replica.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not replica.engine.has_unfinished() and replica.engine.kv_cache.allocator.num_free == free
    too_long = typed({"model": MODEL, "prompt": "word " * 300, "n": 2}, CompletionRequest)
    (refused,) = collect(replica, too_long)
    assert refused.status == 400 and refused.param == "prompt" and not replica.engine.has_unfinished()


@pytest.mark.slow
def test_the_replica_echoes_a_token_id_prompt_with_its_logprobs(replica):
    ids = replica.engine.tokenizer.encode_prompt("The sky is")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    first = collect(replica, typed(body, CompletionRequest))[0]
    assert first.prompt_text == "The sky is" and [e.token_id for e in first.prompt_logprobs] == ids
    assert first.prompt_logprobs[0].logprob is None and all(e.logprob < 0 for e in first.prompt_logprobs[1:])
    assert all(len(e.top) == 2 for e in first.prompt_logprobs[1:]) and len(first.logprobs) >= 1
    chat = typed(CHAT | {"max_tokens": 40, "temperature": 0, "logprobs": True})
    items = collect(replica, chat)
    tokens = [e for i in items for e in i.logprobs]
    assert items[-1].finish_reason == FinishReason.STOP  # it answered "hi" briefly: the end-of-turn token came
    assert len(tokens) == items[-1].num_output_tokens - 1  # which is counted, not listed
    assert "".join(e.token for e in tokens) == "".join(i.new_text for i in items)
