"""The served API end to end: real Ray Serve on loopback, real HTTP, the openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from serve_app.app import SERVE_RUNTIME_ENV, build_app
from serve_app.ingress import Ingress
from serve_app.replica import LLMReplica

MODEL = "smollm2-135m-instruct"
ENGINE = {"dtype": "float32", "num_kv_blocks": 256}
MESSAGES = [{"role": "user", "content": "Name three colours."}]

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_logs(tmp_path_factory) -> Path:
    """Where the main application's JSON logs go."""
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="module")
def base_url(serve_logs):
    import ray
    from ray import serve

    port = free_port()
    # logical CPUs: 5 replicas
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    logging_config = {"encoding": "JSON", "logs_dir": str(serve_logs)}  # as serve_config.yaml, in a temp dir
    serve.run(build_app({"engine": ENGINE}), name="llm", route_prefix="/", logging_config=logging_config)
    # A second application with two LLM replicas behind one ingress, for the concurrency test.
    two = Ingress.bind(LLMReplica.options(num_replicas=2).bind(ENGINE), MODEL)
    serve.run(two, name="two", route_prefix="/two")
    # A replica that takes one request and queues one more, for the saturation test.
    tiny = Ingress.bind(LLMReplica.options(max_ongoing_requests=1, max_queued_requests=1).bind(ENGINE), MODEL)
    serve.run(tiny, name="tiny", route_prefix="/tiny")
    # The shipped speculation (Lyanna drafter, adaptive policy), for seeded reproducibility.
    spec = build_app({"engine": ENGINE | {"spec_policy": "adaptive"}})
    serve.run(spec, name="spec", route_prefix="/spec")
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
        ({"model": MODEL, "messages": MESSAGES, "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, None),
        ({"model": MODEL, "messages": MESSAGES, "slo": {"class": "gold"}}, 400, "slo.class"),
        ({"model": MODEL, "messages": MESSAGES, "slo": {"tpot_ms": -5}}, 400, "slo.tpot_ms"),
        # this server runs the fixed policy: asking for the adaptive one is an error, not a silent no-op
        ({"model": MODEL, "messages": MESSAGES, "speculation": {"policy": "adaptive"}}, 400, "speculation.policy"),
        ({"model": MODEL, "messages": MESSAGES, "speculation": {"policy": "greedy"}}, 400, "speculation.policy"),
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


def engine_load(base_url: str) -> dict:
    """The load fields of /debug/engine (summed over replicas, as they last reported)."""
    now = httpx.get(f"{base_url}/debug/engine", timeout=10).json()
    return {k: now[k] for k in ("num_replicas", "num_running", "num_waiting", "kv_free_blocks", "kv_cache_usage")}


def wait_for_load(base_url: str, want, timeout_s: float = 30) -> dict:
    """Poll /debug/engine until `want(load)` holds (replicas report every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = engine_load(base_url)
        if want(load) or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def test_client_disconnect_mid_stream_frees_the_kv_blocks(base_url):
    idle = wait_for_load(base_url, lambda load: load["num_running"] == 0)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "temperature": 0.8, "seed": 1}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as res:
        lines = res.iter_lines()
        for _ in range(6):  # a few events in: the request holds KV blocks now
            next(lines)
        busy = wait_for_load(base_url, lambda load: load["num_running"] == 1)
    assert busy["num_running"] == 1 and busy["kv_free_blocks"] < idle["kv_free_blocks"]
    now = wait_for_load(base_url, lambda load: load == idle)
    assert now == idle


def test_sixteen_concurrent_streams_across_two_replicas_match_offline(base_url):
    prompts = [[{"role": "user", "content": f"Give me fact number {i} about the sea."}] for i in range(16)]
    client = openai.AsyncOpenAI(base_url=f"{base_url}/two/v1", api_key="none")

    async def one(messages) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(m) for m in prompts))

    got = asyncio.run(all_of_them())
    offline = LLMEngine(EngineConfig(**ENGINE)).generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert got == [o.text for o in offline]


def test_replica_header_and_replica_counts(base_url):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "speculation": {"policy": "fixed"}}
    res = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert res.status_code == 200 and len(res.headers["x-lyanna-replica"]) > 4
    assert httpx.get(f"{base_url}/debug/replicas", timeout=30).json() == {"Ingress": 1, "LLMReplica": 1}
    assert httpx.get(f"{base_url}/two/debug/replicas", timeout=30).json()["LLMReplica"] == 2


def test_metrics_expose_the_listed_series_after_traffic(base_url, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"slo": {"class": "batch"}}
    )  # 20 s TTFT, 0.4 s TPOT: met
    httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 17})
    deadline = time.monotonic() + 15  # replica gauges are as of each replica's last report (every second)
    while "lyanna_slo_attainment{" not in (text := httpx.get(f"{base_url}/metrics").text):
        assert time.monotonic() < deadline, "no replica reported its SLO attainment"
        time.sleep(0.2)
    labels = f'drafter="lyanna",model="{MODEL}"'
    for name in (
        "lyanna_ttft_seconds_count",
        "lyanna_tpot_seconds_count",
        "lyanna_e2e_seconds_count",
        "lyanna_prompt_tokens_total",
        "lyanna_generated_tokens_total",
        "lyanna_accepted_tokens_per_step_count",
        "lyanna_draft_tokens_total",
        "lyanna_draft_tokens_accepted_total",
        "lyanna_itl_seconds_count",
        "lyanna_queue_time_seconds_count",
        "lyanna_preemptions_total",
        "lyanna_replicas",
    ):
        assert f"{name}{{{labels}}}" in text, name
    for name in ("lyanna_batch_size", "lyanna_queue_length", "lyanna_kv_cache_usage"):
        assert f'{name}{{{labels},replica="' in text, name
    count = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("lyanna_")}
    assert count[f'lyanna_requests_total{{{labels},status="200"}}'] >= 1
    assert count[f'lyanna_requests_total{{{labels},status="400"}}'] >= 1
    assert count[f"lyanna_generated_tokens_total{{{labels}}}"] >= 8
    assert count[f'lyanna_slo_requests_total{{drafter="lyanna",met="true",model="{MODEL}",slo_class="batch"}}'] >= 1
    assert any(k.startswith("lyanna_slo_attainment{") and v == 1.0 for k, v in count.items())


def test_engine_gauges_and_debug_engine_cover_every_replica(base_url):
    load = wait_for_load(f"{base_url}/two", lambda load: load["num_replicas"] == 2)
    assert load["num_replicas"] == 2 and load["num_running"] == 0
    replicas = httpx.get(f"{base_url}/two/debug/engine", timeout=10).json()["replicas"]
    text = httpx.get(f"{base_url}/two/metrics", timeout=10).text
    gauges = [line for line in text.splitlines() if line.startswith("lyanna_kv_cache_usage{")]
    assert sorted(g.split('replica="')[1].split('"')[0] for g in gauges) == sorted(r["replica"] for r in replicas)
    assert f'lyanna_replicas{{drafter="none",model="{MODEL}"}} 2.0' in text


def test_seeded_requests_reproduce_with_the_shipped_adaptive_speculation(base_url):
    """Three identical seeded requests, and one with speculation off, give one completion."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0.8, "seed": 42}
    url = f"{base_url}/spec/v1/chat/completions"
    texts = [httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"] for _ in range(3)]
    off = httpx.post(url, json=body | {"speculation": {"enabled": False}}, timeout=60).json()
    assert texts == [texts[0]] * 3 and off["choices"][0]["message"]["content"] == texts[0]
    other = httpx.post(url, json=body | {"seed": 43}, timeout=60).json()["choices"][0]["message"]["content"]
    assert other != texts[0]


def test_saturated_replica_sheds_load_with_503_and_retry_after(base_url):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 48}

    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(f"{base_url}/tiny/v1/chat/completions", json=body, timeout=120)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(one(http) for _ in range(6)))

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1 and set(statuses) <= {200, 503}, statuses
    shed = next(r for r in asyncio.run(burst()) if r.status_code == 503)
    assert shed.headers["retry-after"] == "1" and shed.json()["error"]["code"] == "server_overloaded"
    ok = httpx.post(f"{base_url}/tiny/v1/chat/completions", json=body | {"max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def json_log_lines(folder: Path) -> list[dict]:
    """Every JSON log line the application's components wrote."""
    lines = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
    return lines


def test_structured_logs_carry_request_ids_across_ingress_and_replica(client, serve_logs):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    res = raw.parse()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = [r for r in json_log_lines(serve_logs) if r.get("chat_id") == res.id]
        if len(mine) >= 2:
            break
        time.sleep(0.2)
    by_message = {r["message"]: r for r in mine}
    ingress, replica = by_message["chat completion finished"], by_message["request finished"]
    assert ingress["deployment"] == "llm_Ingress" and replica["deployment"] == "llm_LLMReplica"
    # Serve's request id, also the response's x-request-id header, ties the two components' lines.
    assert ingress["request_id"] == replica["request_id"] == raw.headers["x-request-id"]
    # one name per counter in both components' lines (the engine's), OpenAI's names in the response
    assert ingress["num_output_tokens"] == replica["num_output_tokens"] == res.usage.completion_tokens
    assert ingress["num_prompt_tokens"] == replica["num_prompt_tokens"] == res.usage.prompt_tokens
    assert replica["aborted"] is False and ingress["ttft_ms"] > 0
    assert replica["queue_ms"] >= 0 and replica["prefill_ms"] > 0 and ingress["e2e_ms"] > 0


# ---- the OpenAI API surface through the openai client: completions, logprobs, n, structured outputs,
# tools; and speculation on vs off giving the same outputs for each ----------------------------------
PROMPT = "The capital of France is"
OFF = {"speculation": {"enabled": False}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city"}}
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True}}


def test_completions_take_text_or_token_ids_and_equal_the_offline_engine(client, checkpoint):
    from engines.tokenizer import Tokenizer

    ids = Tokenizer(checkpoint).encode_prompt(PROMPT)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    tokens = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == tokens.choices[0].text and text.usage == tokens.usage
    assert text.usage.prompt_tokens == len(ids) and text.choices[0].finish_reason == "length"
    offline = LLMEngine(EngineConfig(**ENGINE)).generate([ids], SamplingParams(temperature=0, max_tokens=12))
    assert text.choices[0].text == offline[0].text and text.usage.completion_tokens == len(offline[0].token_ids)


def test_completions_stop_and_stream(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["\n"])
    assert "\n" in whole.choices[0].text  # the stop string is there to be found
    assert stopped.choices[0].text == whole.choices[0].text.split("\n")[0]
    assert stopped.choices[0].finish_reason == "stop"
    usage = {"include_usage": True}
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    chunks = list(client.completions.create(**kw, stream=True, stream_options=usage))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_echo_with_logprobs_gives_the_prompt_and_its_logprobs_in_the_legacy_format(client):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=3)
    choice, lp = res.choices[0], res.choices[0].logprobs
    n_prompt = res.usage.prompt_tokens
    assert choice.text.startswith(PROMPT) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + res.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for i in range(1, len(lp.tokens)):
        top = lp.top_logprobs[i]
        assert lp.token_logprobs[i] <= 0 and top[lp.tokens[i]] == lp.token_logprobs[i] and 3 <= len(top) <= 4
        if i >= n_prompt:  # greedy: each generated token is the most likely at its position
            assert lp.token_logprobs[i] == max(top.values())
    # a prompt token's log-probability is the one the model gives it when it generates it
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    word = answer.choices[0].text
    again = client.completions.create(model=MODEL, prompt=PROMPT + word, max_tokens=1, echo=True, logprobs=0)
    assert again.choices[0].logprobs.tokens[n_prompt] == word
    assert again.choices[0].logprobs.token_logprobs[n_prompt] == pytest.approx(
        answer.choices[0].logprobs.token_logprobs[0], abs=1e-4
    )


def test_a_completion_suffix_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="def f():", suffix="    return 1")
    assert err.value.body["param"] == "suffix" and "suffix" in err.value.body["message"]


def test_chat_logprobs_streamed_and_not_agree(client):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert bytes(b for t in content for b in t.bytes) == whole.choices[0].message.content.encode()
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.top_logprobs) for t in streamed] == [
        (t.token, t.logprob, t.top_logprobs) for t in content
    ]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_n_choices_are_seeded_per_choice_and_streamed_with_their_index(client):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 5}
    both = client.chat.completions.create(**kw, n=2)
    texts = [c.message.content for c in both.choices]
    assert [c.index for c in both.choices] == [0, 1] and texts[0] != texts[1]
    singles = [client.chat.completions.create(**kw | {"seed": 5 + i}) for i in range(2)]  # choice i: seed + i
    assert [s.choices[0].message.content for s in singles] == texts
    assert both.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    per_choice = {0: "", 1: ""}
    finished = []
    for chunk in client.chat.completions.create(**kw, n=2, stream=True):
        for c in chunk.choices:
            per_choice[c.index] += c.delta.content or ""
            finished += [c.index] if c.finish_reason else []
    assert [per_choice[0], per_choice[1]] == texts and sorted(finished) == [0, 1]


def test_json_schema_output_parses_and_follows_the_schema(client):
    import jsonschema

    messages = [{"role": "user", "content": "Describe today's weather in Paris as JSON."}]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        res = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, response_format=JSON_FORMAT, **extra
        )
        jsonschema.validate(json.loads(res.choices[0].message.content), WEATHER_SCHEMA)
        assert res.choices[0].finish_reason == "stop"


def test_the_openai_tool_calling_example(client):
    """tools + auto, a call, then the tool's result sent back (the openai client's objects replayed)."""
    messages = list(WEATHER_QUESTION)
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=24, temperature=0
    )
    first = auto.choices[0]  # this small model decides for itself; either way the answer is well formed
    assert (first.finish_reason == "tool_calls") == bool(first.message.tool_calls)
    assert first.message.tool_calls or first.message.content
    # `required` makes it call (the grammar): one call, parallel calls off
    res = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    choice = res.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str) and call.id.startswith("call_")
    messages.append(choice.message)  # as the example does: the client's message object
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 22, "sky": "sunny"})})
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > res.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_a_named_tool_choice_streams_its_call_as_openai_sends_it(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": [TIME_TOOL, WEATHER_TOOL], "tool_choice": named}
    kw |= {"max_tokens": 40, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id == whole.message.tool_calls[0].id or deltas[0].id.startswith("call_")
    assert deltas[0].type == "function" and deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason == "tool_calls"


def comparable(res: dict) -> list:
    """A response's choices without what differs between identical requests (ids)."""
    out = []
    for c in res["choices"]:
        c = dict(c)
        msg = c.get("message")
        if msg and msg.get("tool_calls"):
            c["message"] = msg | {"tool_calls": [t["function"] for t in msg["tool_calls"]]}
        out.append(c)
    return out


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "echo": True, "logprobs": 2}),
        ("completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 3, "n": 2}),
        ("chat/completions", {"messages": MESSAGES, "temperature": 0.8, "seed": 11, "n": 2, "logprobs": True}),
        ("chat/completions", {"messages": WEATHER_QUESTION, "response_format": JSON_FORMAT, "temperature": 0}),
        ("chat/completions", {"messages": WEATHER_QUESTION, "response_format": JSON_FORMAT, "seed": 2}),
        (
            "chat/completions",
            {"messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL], "tool_choice": "required", "seed": 5},
        ),
    ],
    ids=["completion-echo-logprobs", "completion-n-seeded", "chat-n-logprobs", "json-greedy", "json-seeded", "tools"],
)
def test_speculation_on_and_off_give_the_same_outputs(base_url, path, body):
    """The shipped Lyanna drafter (fixed tree) against no speculation: greedy and seeded outputs, their
    log-probabilities (to numerical tolerance), constrained or not, are the same."""
    on, off = on_and_off(f"{base_url}/v1/{path}", body)
    assert on["speculation"]["draft_tokens"] > 0 and off["speculation"]["draft_tokens"] == 0
    assert_same_outputs(on, off)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("completions", {"prompt": PROMPT, "temperature": 0.9, "seed": 4, "n": 2, "logprobs": 1}),
        ("chat/completions", {"messages": WEATHER_QUESTION, "response_format": JSON_FORMAT, "seed": 3}),
        (
            "chat/completions",
            {"messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL], "tool_choice": "required", "seed": 5},
        ),
    ],
    ids=["completion-n-seeded-logprobs", "json-seeded", "tools"],
)
def test_the_adaptive_policy_gives_the_same_outputs_as_no_speculation(base_url, path, body):
    """The shipped speculation (Lyanna under the adaptive policy), which drafts as its goodput model says."""
    assert_same_outputs(*on_and_off(f"{base_url}/spec/v1/{path}", body))


def on_and_off(url: str, body: dict) -> tuple[dict, dict]:
    """The same request with the server's speculation, and with speculation off. A first request
    warms the prefix cache, so both read the same cached prompt blocks: in bf16, K/V computed in
    another step differ by rounding, which could flip a near-tie (docs/prefix-caching.md)."""
    request = {"model": MODEL, "max_tokens": 24} | body
    httpx.post(url, json=request | OFF, timeout=120).raise_for_status()
    on = httpx.post(url, json=request, timeout=120).json()
    off = httpx.post(url, json=request | OFF, timeout=120).json()
    return on, off


def assert_same_outputs(on: dict, off: dict) -> None:
    """Equal choices (text, tool calls, finish reasons), log-probabilities to numerical tolerance."""
    got, want = comparable(on), comparable(off)
    for a, b in zip(got, want, strict=True):
        lp_a, lp_b = a.pop("logprobs"), b.pop("logprobs")
        assert a == b
        assert_close(lp_a, lp_b)
    assert on["usage"] == off["usage"]


def assert_close(a, b, tol: float = 1e-4) -> None:
    """Equal JSON values, floats (log-probabilities) to `tol`."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=tol)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_close(a[k], b[k], tol)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_close(x, y, tol)
    else:
        assert a == b
