"""Tensor-parallel engines: rank 0 in this process, rank 1 a Ray actor (the embedded model).

The embedded model has 3 KV heads, so two ranks hold 1 and 2 of them (an uneven split). In fp32 the ranks
run the eager layers; with the served settings (4-bit weights, bf16) both run the fused CPU decoder, which
sums through shared memory from C.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from engines.engine import EngineConfig, LLMEngine
from engines.parallel import TensorParallel
from engines.request import GenerationRequest
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams
from tests.conftest import CHAT_PROMPTS
from tests.engines.helpers import assert_resumes_exactly, deltas

MAX_NEW = 24


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def worker_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("lyanna-tp::")]


def engine(tp: int, drafter: str, quantization: str = "auto", dtype: str = "float32") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype=dtype,
            num_kv_blocks=128,
            drafter=drafter,
            tensor_parallel_size=tp,
            max_num_seqs=8,
            quantization=quantization,
        )
    )


def served_engine(tp: int, kv_cache_dtype: str = "auto") -> LLMEngine:
    """The served settings (4-bit weights, bf16, the fused CPU decoder) with Lyanna drafting 3:2:6 trees, and
    room for a long prompt in one step."""
    config = EngineConfig(
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=384,
        drafter="lyanna",
        spec_depth=3,
        spec_width=2,
        spec_budget=6,
        tensor_parallel_size=tp,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def served_pair(local_ray):
    """(one rank, two ranks) with the served settings."""
    one, two = served_engine(1), served_engine(2)
    yield one, two
    two.shutdown()


def run_mixed_batch(e: LLMEngine) -> dict[str, list[int]]:
    """Greedy outputs of a batch that changes as it runs: two requests first, two more joining mid-run,
    one of them with speculation off."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got: dict[str, list[int]] = {}
    for i in (0, 1):
        e.add_request(CHAT_PROMPTS[i], params, request_id=f"r{i}")
    steps = 0
    while e.has_unfinished():
        if steps == 3:
            e.add_request(CHAT_PROMPTS[2], params, request_id="r2", spec=SpecParams(enabled=False))
            e.add_request(CHAT_PROMPTS[3], params, request_id="r3")
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    return got


@pytest.mark.slow
def test_each_rank_quantizes_its_shard_as_one_rank_would(local_ray):
    """int4 per shard (fp32: the quantized values exactly): the shards hold whole groups of the full
    weight, so two ranks compute the single rank's quantized model and give its greedy outputs."""
    params = SamplingParams(temperature=0, max_tokens=16)
    want = engine(1, "none", "int4").generate(CHAT_PROMPTS[:2], params)
    e = engine(2, "none", "int4")
    try:
        assert e.model.layers[0].mlp.down_proj.quant_kind == "int4"
        assert [g.token_ids for g in e.generate(CHAT_PROMPTS[:2], params)] == [w.token_ids for w in want]
    finally:
        e.shutdown()


def test_split_is_balanced_and_covers_every_unit():
    for units in (1, 3, 7, 9, 1536):
        for world in range(1, min(units, 5) + 1):
            shares = [TensorParallel(world_size=world, rank=r).split(units, "x") for r in range(world)]
            assert [s for s, _ in shares] == [sum(c for _, c in shares[:r]) for r in range(world)]
            counts = [c for _, c in shares]
            assert sum(counts) == units and max(counts) - min(counts) <= 1 and counts == sorted(counts)
    with pytest.raises(ValueError, match="fewer than the tensor-parallel size"):
        TensorParallel(world_size=4, rank=0).split(3, "num_kv_heads")


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lyanna"])  # plain requests ride along; EAGLE: tests/serve_app/
def test_two_ranks_give_the_single_rank_greedy_outputs(local_ray, drafter):
    want = run_mixed_batch(engine(1, drafter))
    e = engine(2, drafter)
    try:
        assert e.model.attn_kv_heads == 1 and e.kv_cache.k.shape[2] == 1  # rank 0's share of 3 KV heads
        assert len(worker_names()) == 1
        got = run_mixed_batch(e)
        assert got == want
        assert sorted(got) == ["r0", "r1", "r2", "r3"] and all(got.values())
        if drafter != "none":  # accepted paths were moved in the cache on both ranks
            assert e.stats().spec.num_accepted_tokens > 0
        assert e.stats().kv_free_blocks == 128
        e.check_health()
    finally:
        e.shutdown()
    deadline = time.monotonic() + 30
    while worker_names() and time.monotonic() < deadline:  # no stray ranks
        time.sleep(0.2)
    assert worker_names() == []


@pytest.mark.slow
def test_fused_ranks_compute_each_row_whatever_its_batch(served_pair):
    """Both ranks run the fused decoder; a request's greedy tokens are the same alone as in a batch that
    changes under it (drafts verified on both ranks), as on one rank."""
    _, two = served_pair
    mixed = run_mixed_batch(two)
    assert two.model.fused_decoder(two.kv_cache, 1) is not None
    assert [s["fused_decoder"] for s in two.workers.states()] == [True]  # (known once rank 1 has set up)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    alone = {f"r{i}": two.generate([CHAT_PROMPTS[i]], params)[0].token_ids for i in range(4)}
    assert mixed == alone
    assert two.stats().spec.num_accepted_tokens > 0


@pytest.mark.slow
def test_two_ranks_read_an_int8_cache(local_ray):
    """With `kv_cache_dtype: int8` each rank holds codes and scales for its KV heads: greedy outputs in a batch
    that changes under them equal each request's alone, with drafts verified (and accepted paths moved, codes
    with their scales) on both ranks."""
    two = served_engine(2, "int8")
    try:
        assert two.kv_cache.k.dtype == torch.int8 and two.kv_cache.k_scale is not None
        mixed = run_mixed_batch(two)
        assert [s["fused_decoder"] for s in two.workers.states()] == [True]
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        alone = {f"r{i}": two.generate([CHAT_PROMPTS[i]], params)[0].token_ids for i in range(4)}
        assert mixed == alone
        assert two.stats().spec.num_accepted_tokens > 0
    finally:
        two.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [None, 5])
def test_fused_ranks_resume_a_request_exactly(served_pair, seed):
    """What a replica whose rank died hands over: the prompt plus the tokens sent, read as a prompt, continues
    as the uninterrupted run did (greedy, and seeded sampling)."""
    _, two = served_pair
    params = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=32, ignore_eos=True)
    assert_resumes_exactly(two, GenerationRequest(request_id=f"tp-{seed}", messages=CHAT_PROMPTS[2], params=params))


@pytest.mark.slow
def test_fused_ranks_compute_the_single_rank_model(served_pair):
    """Two ranks' sums differ from one rank's only in rounding: for a short prompt and one of about 4,700
    tokens (whose partial sums exceed a shared-memory slot, so each all-reduce goes in pieces), the same first
    token, and top log-probabilities that differ about as much as the single rank's eager and fused layers do
    (0.05-0.18 on average here; a wrong shard or sum is off by whole units)."""
    one, two = served_pair
    long_prompt = [{"role": "user", "content": " ".join(f"item {i}," for i in range(800)) + " What comes next?"}]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    # prompts whose first token leads the second by over 1 nat here: another CPU's rounding keeps it first
    for i, messages in enumerate((CHAT_PROMPTS[2], long_prompt)):
        request = GenerationRequest(request_id=f"first-{i}", messages=messages, params=params)
        (a,), (b,) = (deltas(e, request) for e in (one, two))
        assert a.num_prompt_tokens == b.num_prompt_tokens > (4000 if messages is long_prompt else 0)
        assert a.new_token_ids == b.new_token_ids
        want, got = dict(a.logprobs[0].top), dict(b.logprobs[0].top)
        common = [t for t in want if t in got]
        assert len(common) >= 3
        assert sum(abs(got[t] - want[t]) for t in common) / len(common) < 0.25


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the eager layers, the fused decoder
def test_a_dead_rank_fails_the_step_and_the_health_check(local_ray, dtype):
    others = set(worker_names())  # (the served pair's rank 1 lives on)
    e = engine(2, "none", dtype=dtype)
    try:
        e.add_request(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        e.step()
        e.check_health()
        (name,) = set(worker_names()) - others
        ray.kill(ray.get_actor(name, namespace="lyanna"))
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            for _ in range(100):
                e.step()
        assert time.monotonic() - start < 10  # a closed connection, not the collective timeout
        with pytest.raises(RuntimeError, match=r"died|not running"):
            e.check_health()
    finally:
        e.shutdown()


def _shared_memory_rank(rank: int, prefix: str, port: int, out: str) -> None:
    import torch

    from engines.tensor_parallel import connect

    torch.manual_seed(rank)
    tp, channel = connect(rank, 2, "127.0.0.1", port, torch.device("cpu"), prefix)
    results = {}
    for rows in (1, 7, 4000):  # 4,000 fp32 rows of 576 exceed a slot: the gloo fallback
        x = torch.randn(rows, 576, dtype=torch.float32)
        results[rows] = (x.clone(), tp.all_reduce(x).clone())
    big = {"blob": b"x" * (5 * 2**20)}  # over the command buffer: the gloo fallback
    if rank == 0:
        for command in (("step", [1, 2]), big, ("stop",)):
            channel.send(command)
    else:
        results["commands"] = [channel.recv() for _ in range(3)]
    torch.save(results, f"{out}/rank{rank}.pt")


def test_shared_memory_sums_and_commands_match_across_ranks(tmp_path):
    import multiprocessing
    import socket

    import torch
    import torch.distributed as dist

    from engines.tensor_parallel import create_shared_files

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = str(tmp_path / "lyanna-tp-test")
    create_shared_files(prefix, 2)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # rank 0's store
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_shared_memory_rank, args=(r, prefix, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    del store
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for rows in (1, 7, 4000):
        (a0, s0), (a1, s1) = r0[rows], r1[rows]
        assert torch.equal(s0, s1)  # bit-identical on both ranks
        torch.testing.assert_close(s0, a0 + a1)
    assert r1["commands"] == [("step", [1, 2]), {"blob": b"x" * (5 * 2**20)}, ("stop",)]


def test_stale_shared_files_are_swept(tmp_path):
    import os

    from engines.tensor_parallel import create_shared_files

    stale, fresh = tmp_path / "lyanna-tp-000000000000-sum", tmp_path / "lyanna-tp-111111111111-sum"
    stale.touch()
    fresh.touch()
    os.utime(stale, (time.time() - 1000, time.time() - 1000))
    made = create_shared_files(str(tmp_path / "lyanna-tp-222222222222"), 2)
    assert not stale.exists() and fresh.exists() and all(os.path.exists(f) for f in made)


def test_mlp_channels_even_out_an_uneven_head_split(checkpoint):
    from engines.config import ModelConfig
    from engines.model import mlp_shares

    cfg = ModelConfig.from_json_file(checkpoint / "config.json")  # 3 KV heads
    assert mlp_shares(cfg, TensorParallel(world_size=1)) is None
    assert mlp_shares(cfg, TensorParallel(world_size=3)) is None  # one head each: even
    shares = mlp_shares(cfg, TensorParallel(world_size=2))
    assert sum(shares) == cfg.intermediate_size and shares[0] > shares[1]  # rank 0 holds 1 head, rank 1 2
    group = cfg.num_heads // cfg.num_kv_heads
    per_head = (2 * group + 2) * cfg.head_dim * cfg.hidden_size
    weights = [h * per_head + c * 3 * cfg.hidden_size for h, c in zip([1, 2], shares, strict=True)]
    assert abs(weights[0] - weights[1]) <= 3 * cfg.hidden_size * 32  # within one group of 32 channels
    assert all(n % 32 == 0 for n in shares)  # quantized shards hold whole int4 groups
