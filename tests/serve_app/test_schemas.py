"""The API edge: request bodies parse, map onto the typed request the replica and the engine take as it
is, and bad ones fail with the field named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engines.errors import InvalidRequestError
from engines.spec_params import SpecParams
from policies.slo import SLOSettings, SLOTarget
from serve_app.responses import ChatCompletionChunk, ErrorResponse
from serve_app.schemas import ChatCompletionRequest, error_param

BASE = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]}


def test_full_request_maps_onto_engine_settings():
    req = ChatCompletionRequest.model_validate(
        BASE
        | {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]},
            ],
            "max_tokens": 50,
            "max_completion_tokens": 20,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "stop": "\n\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "speculation": {"depth": 2, "budget": 4},
            "slo": {"class": "tight", "tpot_ms": 50},
        }
    )
    p = req.sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 7)
    assert p.max_tokens == 20 and p.stop == ["\n\n"]  # max_completion_tokens wins over max_tokens
    assert req.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, you"},
    ]
    assert req.spec_params(SpecParams(depth=3, width=2, budget=6)) == SpecParams(depth=2, width=2, budget=4)
    assert req.slo.slo_class == "tight" and req.stream_options.include_usage


def test_a_valid_body_becomes_one_typed_request():
    settings = SLOSettings(classes={"tight": {"ttft_ms": 500, "tpot_ms": 80}}, tight_classes=["tight"])
    body = BASE | {"temperature": 0, "max_tokens": 9, "speculation": {"budget": 4}, "slo": {"class": "tight"}}
    chat = ChatCompletionRequest.model_validate(body).chat_request("chatcmpl-1", settings, SpecParams(depth=4))
    gen = chat.generation
    assert chat.request_id == gen.request_id == "chatcmpl-1"
    assert gen.messages == chat.messages == [{"role": "user", "content": "hi"}] and gen.prompt_token_ids is None
    assert gen.params.temperature == 0 and gen.params.max_tokens == 9
    assert gen.spec == SpecParams(depth=4, budget=4)  # the engine's default, completed with the overrides
    assert chat.slo == SLOTarget("tight", 0.5, 0.08) and gen.tpot_target_s == 0.08 and chat.slo_class == "tight"
    plain = ChatCompletionRequest.model_validate(BASE).chat_request("chatcmpl-2", SLOSettings(), SpecParams())
    assert plain.generation.spec is None and not plain.slo.has_target  # the engine applies its default
    # what depends on the server's settings is checked at the ingress too
    gold = ChatCompletionRequest.model_validate(BASE | {"slo": {"class": "gold"}})
    with pytest.raises(InvalidRequestError) as err:
        gold.chat_request("c", settings, SpecParams())
    assert err.value.param == "slo.class"
    adaptive = ChatCompletionRequest.model_validate(BASE | {"speculation": {"policy": "adaptive"}})
    with pytest.raises(InvalidRequestError) as err:
        adaptive.chat_request("c", settings, SpecParams(), spec_policy="fixed")
    assert err.value.param == "speculation.policy"
    assert adaptive.chat_request("c", settings, SpecParams(), spec_policy="adaptive").generation.spec.fixed is False


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},  # no messages
        BASE | {"messages": []},
        BASE | {"messages": [{"role": "tool", "content": "x"}]},
        BASE | {"messages": "hi"},
        BASE | {"temperature": "hot"},
        BASE | {"stop": 3},
        BASE | {"stop": ""},
        BASE | {"logprobs_please": True},  # unknown field
        BASE | {"speculation": {"depth": "deep"}},
        BASE | {"slo": {"tpot_ms": -5}},
        BASE | {"n": 17},
        BASE | {"temperature": -1},
        BASE | {"temperature": 2.01},
        BASE | {"top_p": 0},
        BASE | {"max_tokens": 0},
        BASE | {"max_tokens": "10"},  # no coercion, as OpenAI
        BASE | {"stream": "yes"},
        BASE | {"stream": 1},
        BASE | {"seed": 2**63},
        BASE | {"stop": ["a", "b", "c", "d", "e"]},
        BASE | {"stream_options": {"include_usage": True}},  # without stream
        BASE | {"presence_penalty": 0.5},
        BASE | {"logit_bias": {"42": 1.0}},
        BASE | {"response_format": {"type": "xml"}},
        BASE | {"top_logprobs": 2},  # without logprobs
        BASE | {"tool_choice": "auto"},  # without tools
        BASE | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ],
)
def test_malformed_bodies_are_rejected_by_the_schema(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_errors_name_the_field_as_clients_write_it():
    cases = {
        '{"model": "m", "messages": [{"role": "user", "content": 3}]}': "messages[0].content",
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 3}': "stop",
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "zzz": 1}': "zzz",
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "slo": {"class": 1}}': "slo.class",
        "[]": None,
    }
    for raw, param in cases.items():
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate_json(raw)
        assert error_param(err.value.errors()[0]) == param, raw


def test_current_client_fields_are_accepted_at_neutral_values_and_developer_is_system():
    req = ChatCompletionRequest.model_validate(
        BASE
        | {
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "a"}],
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": False,
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
            "store": False,
            "stream": True,
            "stream_options": {"include_usage": False},
            "seed": -(2**63),
        }
    )
    assert req.conversation() == [
        {"role": "developer", "content": "Be brief."},  # the engine renders it as the system message
        {"role": "user", "content": "hi", "name": "a"},  # the engine refuses it where the template has no names
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"speculation": {"depth": 0}}, "speculation.depth"),
        ({"speculation": {"width": 65}}, "speculation.width"),
        ({"speculation": {"budget": True}}, "speculation.budget"),
        ({"stop": ""}, "stop"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
    ],
)
def test_impossible_values_are_rejected_by_the_schema_naming_their_field(extra, param):
    """The schema is the one validation: what the engine used to re-check is refused here."""
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(BASE | extra)
    assert error_param(err.value.errors()[0]) == param


def test_response_bodies_serialise_like_openai():
    chunk = ChatCompletionChunk(id="c1", created=1, model="m", choices=[{"delta": {"content": "x"}}])
    assert chunk.model_dump(exclude_none=True)["choices"][0] == {"index": 0, "delta": {"content": "x"}}
    err = ErrorResponse.model_validate({"error": {"message": "bad", "type": "invalid_request_error", "param": "n"}})
    assert err.model_dump()["error"]["code"] is None


def test_nulls_and_replayed_assistant_messages_are_accepted():
    """What the openai client sends for `temperature=None` etc., and for `message.model_dump()` replayed."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "top_k", "min_p", "max_tokens", "seed", "stop"])
    replayed = {
        "role": "assistant",
        "content": "Hi!",
        "refusal": None,
        "tool_calls": [],
        "function_call": None,
        "audio": None,
        "annotations": None,
    }
    req = ChatCompletionRequest.model_validate(BASE | nulls | {"messages": [*BASE["messages"], replayed]})
    p = req.sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1.0, 1.0, 0, 0.0, None, None)
    with pytest.raises(ValidationError):  # a tool call is not something to replay here
        ChatCompletionRequest.model_validate(BASE | {"messages": [replayed | {"tool_calls": [{"id": "x"}]}]})
