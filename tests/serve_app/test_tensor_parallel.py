"""Tensor-parallel replicas through real Ray Serve on loopback, real HTTP and the openai client.

Each LLM replica of these applications runs the embedded target over 2 ranks (gloo, fp32): the replica
process and a Ray actor in the replica's placement group. Greedy completions must equal single-process
plain decoding, for plain requests, Lyanna and EAGLE, mixed in one batch, streamed and not.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engines.sampling import SamplingParams
from serve_app.app import SERVE_RUNTIME_ENV, build_app
from tests.conftest import CHAT_PROMPTS
from tests.serve_app.test_reliability import BackgroundStream, free_port, poll_health, stream_text

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
ENGINE = {"dtype": "float32", "num_kv_blocks": 96, "max_model_len": 512, "tensor_parallel_size": 2, "max_num_seqs": 8}
APPS = {
    "tpl": ENGINE | {"drafter": "lyanna"},
    "tpe": ENGINE | {"drafter": "eagle"},
}


@pytest.fixture(scope="module")
def base_url():
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env=SERVE_RUNTIME_ENV)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, engine in APPS.items():
        serve.run(
            build_app({"engine": engine, "ingress": {"health_timeout_s": 1.0}}), name=name, route_prefix=f"/{name}"
        )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(engine_fp32) -> list[str]:
    """Single-process plain greedy completions."""
    outs = engine_fp32.generate(CHAT_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.text for o in outs]


def rank_actors() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("lyanna-tp::")]


def complete(client: openai.OpenAI, i: int) -> str:
    """Prompt i: streamed when i is even; speculation off for prompt 2 (a plain request in the batch)."""
    extra = {"speculation": {"enabled": False}} if i == 2 else None
    kwargs = {"model": MODEL, "messages": CHAT_PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0}
    if i % 2:
        return client.chat.completions.create(**kwargs, extra_body=extra).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, extra_body=extra, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("app", ["tpl", "tpe"])
def test_two_ranks_serve_the_single_rank_greedy_completions(base_url, reference, app):
    client = openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="none", timeout=120)
    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:  # one batch: all four at once
        got = list(pool.map(lambda i: complete(client, i), range(len(CHAT_PROMPTS))))
    assert got == reference
    stats = httpx.get(f"{base_url}/{app}/debug/engine", timeout=10).json()
    assert stats["replicas"][0]["tensor_parallel_size"] == 2


def test_a_disconnected_stream_frees_its_blocks(base_url):
    url = f"{base_url}/tpl"
    body = {"model": MODEL, "messages": CHAT_PROMPTS[3], "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as res:
        lines = res.iter_lines()
        for _ in range(4):
            next(lines)
    # Blocks are allocated on rank 0 only: rank 1 has no allocator, its cache is addressed by each plan.
    deadline, free = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        (replica,) = httpx.get(f"{url}/debug/engine", timeout=10).json()["replicas"]
        free = replica["kv_free_blocks"]
        if free == ENGINE["num_kv_blocks"] and replica["num_running"] == 0:
            break
        time.sleep(0.5)
    assert free == ENGINE["num_kv_blocks"]


def test_a_request_whose_rank_one_is_killed_resumes_on_the_replacement_as_if_undisturbed(base_url):
    """Rank 1 dies mid-stream: the replica's engine stops, its health check fails, Serve replaces it (with a
    new rank 1), and the ingress resumes the stream there; the answer equals an undisturbed run's."""
    import ray

    url = f"{base_url}/tpe"  # the last test: it leaves the EAGLE app's replica replaced
    assert poll_health(url, 200, 60)[-1][1] == 200
    before = set(rank_actors())
    body = {"model": MODEL, "messages": CHAT_PROMPTS[3], "max_tokens": 160, "temperature": 0, "stream": True}

    undisturbed = BackgroundStream(url, body).join()
    stream = BackgroundStream(url, body)
    assert stream.started.wait(60)
    (mine,) = [n for n in before if _serves(n, url)]
    killed = time.monotonic()
    ray.kill(ray.get_actor(mine, namespace="lyanna"))
    events = stream.join()
    resumed = time.monotonic() - killed
    assert events[-1] == "data: [DONE]", events[-3:]
    text, _ = stream_text(events)
    assert text == stream_text(undisturbed)[0] and len(text) > 100
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    resumptions = [line for line in metrics.splitlines() if line.startswith("lyanna_resumptions_total")]
    assert [line.split('reason="')[1] for line in resumptions] == ['engine_failed"} 1.0'], resumptions
    # Serve replaced the replica, with a new rank 1.
    assert poll_health(url, 200, 60)[-1][1] == 200
    assert mine not in rank_actors() and len(set(rank_actors()) - before) == 1
    print(f"rank 1 killed -> the stream finished on the replacement {resumed:.1f} s later")


def _serves(actor_name: str, url: str) -> bool:
    """Whether the rank actor belongs to the app at `url` (its replica reports the group id)."""
    replicas = httpx.get(f"{url}/debug/engine", timeout=10).json()["replicas"]
    return any(actor_name.split("::")[1] == r.get("tensor_parallel_group") for r in replicas)
