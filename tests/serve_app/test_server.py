"""The served API end to end: real Ray Serve on loopback, real HTTP, the openai client."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from serve_app.app import build_app

MODEL = "smollm2-135m-instruct"
ENGINE = {"dtype": "float32", "num_kv_blocks": 256}
MESSAGES = [{"role": "user", "content": "Name three colours."}]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"engine": ENGINE}), name="llm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")


def test_greedy_completion_equals_offline_engine(client):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    offline = LLMEngine(EngineConfig(**ENGINE)).generate([MESSAGES], SamplingParams(temperature=0, max_tokens=24))
    assert res.choices[0].message.content == offline[0].text
    assert res.usage.completion_tokens == len(offline[0].token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert res.choices[0].finish_reason in ("stop", "length") and res.model == MODEL


def test_streaming_deltas_add_up_to_the_completion(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "n": 3}, 400, "n"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(base_url, client, body, status, param):
    res = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4)
    assert ok.choices[0].message.content


def test_malformed_json_is_a_400(base_url):
    res = httpx.post(
        f"{base_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert res.status_code == 400 and "JSON" in res.json()["error"]["message"]


def test_models_and_health(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert [m["id"] for m in httpx.get(f"{base_url}/v1/models").json()["data"]] == [MODEL]
