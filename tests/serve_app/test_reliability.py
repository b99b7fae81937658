"""Hostile input, failures and readiness, through real Ray Serve on loopback and real HTTP.

Each case of the hostile-input table is a request a careless or malicious client sends; every one
gets OpenAI's error body with the right status, is counted on /metrics, and leaves the server
serving. The replica-kill test kills the LLM replica under a stream and a non-streaming request.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_app.app import SERVE_RUNTIME_ENV, build_app, build_app_with_options

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
OK = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
# Small context: any request the fuzzer invents finishes in a few seconds.
ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128, "drafter": "none"}

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_health(url: str, until: int, timeout_s: float, path: str = "/health") -> list[tuple[float, int]]:
    """GET `path` every 0.25 s until it answers `until` (or time runs out); (seconds, status) seen."""
    start, seen = time.monotonic(), []
    while time.monotonic() - start < timeout_s:
        try:
            status = httpx.get(f"{url}{path}", timeout=10).status_code
        except httpx.HTTPError:
            status = 0  # no answer at all
        seen.append((round(time.monotonic() - start, 2), status))
        if status == until:
            break
        time.sleep(0.25)
    return seen


@pytest.fixture(scope="module")
def base_url():
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    # A replica that loads its model slowly enough to be seen loading: the ingress comes up first.
    seen: dict[str, list[tuple[float, int]]] = {"/health": [], "/v1/models": []}
    watchers = [
        threading.Thread(target=lambda p=path: seen[p].extend(poll_health(f"{url}/rel", 200, 180, p))) for path in seen
    ]
    for watcher in watchers:
        watcher.start()
    serve.run(build_app({"engine": ENGINE, "ingress": {"health_timeout_s": 1.0}}), name="rel", route_prefix="/rel")
    for watcher in watchers:
        watcher.join()
    # Killed under requests: with resumption (speculation on), and with resumption off.
    spec = ENGINE | {"drafter": "lyanna", "spec_depth": 3, "spec_width": 2, "spec_budget": 6}
    serve.run(build_app({"engine": spec, "ingress": {"health_timeout_s": 1.0}}), name="kill", route_prefix="/kill")
    no_resume = {"health_timeout_s": 1.0, "max_resumptions": 0}
    serve.run(build_app({"engine": ENGINE, "ingress": no_resume}), name="kill0", route_prefix="/kill0")
    yield url, seen
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def url(base_url) -> str:
    return f"{base_url[0]}/rel"


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"} | (headers or {})
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=60)


def with_(**fields) -> dict:
    return OK | fields


# (label, body, extra headers, status, param): the hostile-input table in docs/serving.md.
HOSTILE = [
    (
        "lone surrogate in content",
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800 hi"}]}' % MODEL.encode(),
        {},
        400,
        None,
    ),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', {}, 400, None),
    ("JSON nested 10,000 deep", b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", {}, 400, None),
    ("not JSON", b"{not json", {}, 400, None),
    ("JSON array, not an object", b"[]", {}, 400, None),
    ("seed = 2**70", with_(seed=2**70), {}, 400, "seed"),
    ('max_tokens = "10"', with_(max_tokens="10"), {}, 400, "max_tokens"),
    ("max_tokens = 0", with_(max_tokens=0), {}, 400, "max_tokens"),
    ('stream = "yes"', with_(stream="yes"), {}, 400, "stream"),
    ("temperature = 2.5", with_(temperature=2.5), {}, 400, "temperature"),
    ("top_p = 0", with_(top_p=0), {}, 400, "top_p"),
    ("stream_options without stream", with_(stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("five stop strings", with_(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("n = 17", with_(n=17), {}, 400, "n"),
    ("unknown field", with_(logprobs_please=True), {}, 400, "logprobs_please"),
    (
        "tool role without tool_call_id",
        with_(messages=[{"role": "tool", "content": "x"}]),
        {},
        400,
        "messages[0].tool_call_id",
    ),
    ("function role", with_(messages=[{"role": "function", "content": "x"}]), {}, 400, "messages[0].role"),
    (
        "image part",
        with_(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        {},
        400,
        "messages[0].content",
    ),
    (
        "message name (template has none)",
        with_(messages=[{"role": "user", "content": "hi", "name": "bob"}]),
        {},
        400,
        "messages[0].name",
    ),
    ("presence_penalty = 1", with_(presence_penalty=1), {}, 400, "presence_penalty"),
    ("top_logprobs = 21", with_(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    (
        "tool_choice names no tool",
        with_(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        {},
        400,
        "tool_choice",
    ),
    ("unknown response_format", with_(response_format={"type": "xml"}), {}, 400, "response_format"),
    (
        "JSON schema and a regex",
        with_(response_format={"type": "json_object"}, guided_regex="a+"),
        {},
        400,
        "guided_regex",
    ),
    ("a regex that does not compile", with_(guided_regex="[a-"), {}, 400, "guided_regex"),
    ("prompt over the context", with_(messages=[{"role": "user", "content": "word " * 400}]), {}, 400, "messages"),
    ("max_tokens over the context", with_(max_tokens=100_000), {}, 400, "max_tokens"),
    ("unknown model", with_(model="gpt-9"), {}, 404, "model"),
    ("unknown SLO class", with_(slo={"class": "gold"}), {}, 400, "slo.class"),
    ("text/plain body", OK, {"content-type": "text/plain"}, 415, None),
    (
        "3 MiB body",
        b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 3 * 2**20 + b'"}]}',
        {},
        413,
        None,
    ),
]


@pytest.mark.parametrize(("label", "body", "headers", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_an_openai_error(url, label, body, headers, status, param):
    start = time.monotonic()
    res = post(url, body, headers)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert time.monotonic() - start < 10  # rejected up front, not after parsing or tokenizing at length


COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
HOSTILE_COMPLETIONS = [
    ("suffix", COMPLETION | {"suffix": "The end."}, 400, "suffix"),
    ("two prompts", COMPLETION | {"prompt": ["a", "b"]}, 400, "prompt"),
    ("negative token id", COMPLETION | {"prompt": [1, -2]}, 400, "prompt"),
    ("token id past the vocabulary", COMPLETION | {"prompt": [1, 10**9]}, 400, "prompt"),
    ("logprobs = 21", COMPLETION | {"logprobs": 21}, 400, "logprobs"),
    ("best_of = 3", COMPLETION | {"best_of": 3}, 400, "best_of"),
    ("prompt over the context", COMPLETION | {"prompt": "word " * 400}, 400, "prompt"),
    ("a chat body", OK, 400, "messages"),  # not a completions field
]


@pytest.mark.parametrize(
    ("label", "body", "status", "param"), HOSTILE_COMPLETIONS, ids=[h[0] for h in HOSTILE_COMPLETIONS]
)
def test_hostile_completion_input_gets_an_openai_error(url, label, body, status, param):
    res = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert res.status_code == status, res.text
    assert res.json()["error"]["param"] == param


def test_a_streamed_oversized_body_without_content_length_is_cut_at_the_limit(url):
    def chunks():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"a" * 2**16  # 4 MiB in all, sent chunked
        yield b'"}]}'

    res = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=60)
    assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"


def test_wrong_method_and_unknown_path_are_openai_errors(url):
    res = httpx.get(f"{url}/v1/chat/completions")
    assert res.status_code == 405 and res.json()["error"]["code"] == "method_not_allowed"
    res = httpx.get(f"{url}/v1/nothing-here")
    assert res.status_code == 404 and res.json()["error"]["type"] == "not_found_error"


def test_current_clients_fields_are_honoured_or_neutral(url):
    # `developer` is OpenAI's newer name for system instructions: rendered as the system message.
    as_system = post(url, with_(messages=[{"role": "system", "content": "Answer in French."}, *MESSAGES]))
    as_developer = post(url, with_(messages=[{"role": "developer", "content": "Answer in French."}, *MESSAGES]))
    assert as_developer.status_code == as_system.status_code == 200
    content = [r.json()["choices"][0]["message"]["content"] for r in (as_system, as_developer)]
    assert content[0] == content[1]
    # Neutral values of unsupported features ask for nothing and are accepted.
    neutral = with_(
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        store=False,
        user="u-1",
        max_completion_tokens=4,
    )
    assert post(url, neutral).status_code == 200


def test_every_status_is_counted_and_the_server_keeps_serving(url):
    for body, headers in ((OK, {"content-type": "text/plain"}), (b"{", {}), (OK, {})):
        post(url, body, headers)
    httpx.get(f"{url}/v1/chat/completions")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("lyanna_req")}
    for status in ("200", "400", "405", "415"):
        assert counts[f'lyanna_requests_total{{drafter="none",model="{MODEL}",status="{status}"}}'] >= 1, status
    assert httpx.get(f"{url}/health").status_code == 200


def test_openapi_describes_the_generation_requests_and_their_errors(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    props = doc["components"]["schemas"][body]["properties"]
    assert {"model", "messages", "temperature", "max_tokens", "stream", "seed"} <= set(props)
    (number,) = [t for t in props["temperature"]["anyOf"] if t["type"] == "number"]  # or null
    assert number["maximum"] == 2 and props["model"]["enum"] == [MODEL]
    assert {"200", "400", "404", "413", "415", "503"} <= set(chat["responses"])
    completions = doc["paths"]["/v1/completions"]["post"]
    body = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    props = doc["components"]["schemas"][body]["properties"]
    assert {"prompt", "echo", "logprobs", "suffix", "max_tokens"} <= set(props)
    assert {"200", "400", "404", "413", "415", "503"} <= set(completions["responses"])
    assert httpx.get(f"{url}/docs").status_code == 200


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_readiness_is_red_until_the_model_is_loaded(base_url, path):
    seen = base_url[1][path]  # polled while the application was deployed
    statuses = [s for _, s in seen]
    assert statuses[-1] == 200
    first_ok = statuses.index(200)
    assert 503 in statuses[:first_ok], seen  # the ingress was up and said "not ready" while the model loaded


def test_schemathesis_finds_no_server_error_or_schema_violation(url, tmp_path):
    """A bounded fuzzing run against the served OpenAPI document (every operation, negative data too)."""
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance,negative_data_rejection",
        "--max-examples", "10", "--max-time", "60", "--seed", "1", "--request-timeout", "60",
        "--phases", "examples,coverage,fuzzing", "--exclude-path", "/debug/replicas",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def _kill_llm_replica(app: str) -> None:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    (name,) = [n for n in names if n.startswith(f"SERVE_REPLICA::{app}#LLMReplica#")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


LONG = with_(max_tokens=80, messages=[{"role": "user", "content": "Tell a long story about the sea."}])


class BackgroundStream:
    """A streamed chat completion read in a thread: `events` are its SSE lines as they arrive, `started` is
    set once there are three."""

    def __init__(self, url: str, body: dict, timeout_s: float = 240):
        self.events: list[str] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body, timeout_s))
        self.thread.start()

    def _read(self, url: str, body: dict, timeout_s: float) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s) as res:
            for line in res.iter_lines():
                if line:
                    self.events.append(line)
                if len(self.events) >= 3:
                    self.started.set()

    def join(self, timeout_s: float = 240) -> list[str]:
        """Wait for the stream's end; its events."""
        self.thread.join(timeout_s)
        return self.events


def stream_and_post(url: str, stream_body: dict, post_body: dict, kill: str | None) -> tuple[list[str], httpx.Response]:
    """A stream and a non-streaming request at once; with `kill`, that app's LLM replica is killed once the
    stream has had three events. The stream's events and the other's response."""
    unary: list[httpx.Response] = []
    whole = threading.Thread(
        target=lambda: unary.append(httpx.post(f"{url}/v1/chat/completions", json=post_body, timeout=240))
    )
    whole.start()
    stream = BackgroundStream(url, stream_body)
    assert stream.started.wait(60)
    if kill is not None:
        _kill_llm_replica(kill)
    events = stream.join()
    whole.join(240)
    return events, unary[0]


def stream_text(events: list[str]) -> tuple[str, dict | None]:
    """A chat stream's text and its usage chunk."""
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    assert all("error" not in c for c in chunks), chunks[-2:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, next((c["usage"] for c in chunks if c.get("usage")), None)


def test_requests_whose_replica_is_killed_resume_on_its_replacement_and_answer_as_if_undisturbed(base_url):
    """Greedy (streamed) and seeded sampled (not streamed) requests, speculation on: the replica dies under
    them, Serve replaces it, and both answers equal those of an undisturbed run, usage included."""
    url = f"{base_url[0]}/kill"
    assert poll_health(url, 200, 60)[-1][1] == 200
    streamed = LONG | {"stream": True, "stream_options": {"include_usage": True}}
    seeded = LONG | {"temperature": 0.8, "seed": 5}
    start = time.monotonic()
    events, unary = stream_and_post(url, streamed, seeded, kill=None)
    undisturbed = time.monotonic() - start
    want_text, want_usage = stream_text(events)
    assert unary.status_code == 200, unary.text
    want_answer = unary.json()
    start = time.monotonic()
    events, unary = stream_and_post(url, streamed, seeded, kill="kill")
    resumed = time.monotonic() - start
    print(f"undisturbed {undisturbed:.1f} s; with the replica killed and resumed {resumed:.1f} s")
    assert events[-1] == "data: [DONE]"
    assert stream_text(events) == (want_text, want_usage) and want_usage["completion_tokens"] == 80
    assert unary.status_code == 200, unary.text
    answer = unary.json()
    assert answer["choices"][0]["message"] == want_answer["choices"][0]["message"]
    assert answer["usage"] == want_answer["usage"]
    text = httpx.get(f"{url}/metrics", timeout=10).text
    resumptions = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("lyanna_resumptions_total")]
    assert sum(resumptions) == 2, [line for line in text.splitlines() if "resumptions" in line]
    assert 'reason="replica_failed"' not in text  # no stream ended with an error


def test_killing_the_replica_fails_health_ends_requests_cleanly_and_recovers(base_url):
    """With `max_resumptions: 0` a request whose replica dies fails as OpenAI's error."""
    url = f"{base_url[0]}/kill0"
    assert poll_health(url, 200, 60)[-1][1] == 200
    killed = time.monotonic()
    events, response = stream_and_post(url, LONG | {"stream": True}, LONG, kill="kill0")
    unary = [response]
    # The stream ends with an error event and [DONE], not a cut connection.
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    # The non-streaming request gets OpenAI's error body: retry later.
    assert unary[0].status_code == 503, unary[0].text
    assert unary[0].json()["error"]["code"] == "replica_failed" and unary[0].headers["retry-after"] == "1"
    # Health goes red, then green once Serve has replaced the replica, and requests are served again.
    seen = poll_health(url, 503, 60) + poll_health(url, 200, 180)
    assert 503 in [s for _, s in seen] and seen[-1][1] == 200, seen
    recovered = time.monotonic() - killed
    res = post(url, OK)
    assert res.status_code == 200, res.text
    print(f"replica killed -> healthy again in {recovered:.1f} s; health seen: {seen[:3]} ... {seen[-2:]}")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'lyanna_stream_errors_total{{drafter="none",model="{MODEL}",reason="replica_failed"}} 1.0' in text


def test_only_a_dead_or_unreachable_replica_is_worth_a_retry():
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from serve_app.ingress import _replica_failure

    assert _replica_failure(ActorDiedError(), "mid-stream")[:2] == (503, "replica_failed")
    assert _replica_failure(ActorUnavailableError("gone", None), "mid-stream")[:2] == (503, "replica_failed")
    assert _replica_failure(RuntimeError("engine bug"), "mid-stream")[:2] == (500, "internal_error")


def test_a_redeploy_drains_the_replica_and_hands_its_stream_over(base_url):
    """A new version of the application while a long stream runs: Serve drains the old LLM replica (1 s
    graceful shutdown here), its engine stops under the stream, and the ingress resumes the stream on the
    new replica; the answer equals an undisturbed run's."""
    from ray import serve

    url = f"{base_url[0]}/drain"
    engine = {"dtype": "float32", "num_kv_blocks": 128, "max_model_len": 1024, "drafter": "none"}
    # the LLM replica drains for 1 s; the ingress waits for its streams (as serve_config.yaml's does)
    drain = {"LLMReplica": {"graceful_shutdown_timeout_s": 1}, "Ingress": {"graceful_shutdown_timeout_s": 180}}
    serve.run(build_app_with_options({"engine": engine}, drain), name="drain", route_prefix="/drain")
    body = with_(max_tokens=400, messages=[{"role": "user", "content": "Write a long story about a lighthouse."}])
    body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    undisturbed, _ = stream_and_post(url, body, OK, kill=None)
    want, usage = stream_text(undisturbed)
    assert usage["completion_tokens"] == 400
    stream = BackgroundStream(url, body, timeout_s=300)
    assert stream.started.wait(60)
    redeployed = engine | {"max_num_seqs": 31}  # a new version of LLMReplica
    serve.run(build_app_with_options({"engine": redeployed}, drain), name="drain", route_prefix="/drain")
    events = stream.join(300)
    assert events[-1] == "data: [DONE]"
    assert stream_text(events) == (want, usage)
    # It was handed over (the old ingress, whose counter saw it, is gone: its log says so).
    logs = Path("/tmp/ray/session_latest/logs/serve").glob("replica_drain_Ingress_*.log")
    assert any("resuming after" in path.read_text(errors="replace") for path in logs)
