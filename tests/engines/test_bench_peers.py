"""`python -m engines.bench`'s repeated measurement (medians and ranges of tokens/s and ratios, decode-only
clocks) and its peers: llama.cpp (llama-cpp-python, the `peers` extra) and vLLM's CPU build (its own
virtual environment). The peer tests skip where the peer is not installed (CI has neither); none asserts
a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.bench.cli import main
from engines.bench.vllm_peer import cpu_bind, default_venv, venv_has_vllm
from engines.datasets import sharegpt_prompts, write_prompt_file
from engines.engine import EngineConfig, LLMEngine
from engines.loader import embedded_gguf_path, resolve_checkpoint
from engines.sampling import SamplingParams

MAX_NEW = 6


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "val.jsonl"
    write_prompt_file(sharegpt_prompts(2, max_chars=300, split="val"), path)
    return path


def bench(capsys, prompt_file: Path, *flags: str) -> dict:
    """Run the benchmark in this process; the JSON on the last line of stdout (checked to be what it returns)."""
    argv = ["--prompts", str(prompt_file), "--max-new-tokens", str(MAX_NEW), "--warmup", "0", *flags]
    result = main(argv)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == json.loads(json.dumps(result))
    return result


def check_spread(stats: dict, repeat: int) -> None:
    assert len(stats["runs"]) == repeat
    assert stats["min"] == min(stats["runs"]) and stats["max"] == max(stats["runs"])
    assert stats["min"] <= stats["median"] <= stats["max"]


@pytest.mark.slow
def test_repeat_reports_median_and_range_of_every_ratio_and_decode_only_rates(capsys, prompt_file):
    # one decode step per engine step (`--multi-step 1`): one target forward per token
    flags = ["--compare", "none,none#2", "--batch-size", "2", "--repeat", "2", "--multi-step", "1"]
    out = bench(capsys, prompt_file, *flags)
    assert out["repeat"] == 2 and out["prefix_caching"] is False and out["config"] == "none"
    assert out["cpu"]["model"] and out["cpu"]["logical_cpus"] >= 1 and out["torch_threads"] >= 1
    assert out["peers"] == {} and set(out["configs"]) == {"none", "none#2"}
    for cfg in out["configs"].values():
        # pooled over both repeats: 2 prompts x 6 tokens each time; one wave of 2 whose prompts are read in
        # one step, so every token after the first of each sequence is decode-only
        assert cfg["output_tokens"] == 2 * 2 * MAX_NEW
        assert cfg["decode_tokens"] == 2 * 2 * (MAX_NEW - 1)
        assert cfg["decode_s"] > 0 and cfg["first_token_s"] > 0
        assert cfg["decode_s"] + cfg["first_token_s"] == pytest.approx(cfg["wall_s"])
        assert cfg["decode_tokens_per_s"] == pytest.approx(cfg["decode_tokens"] / cfg["decode_s"])
        assert cfg["format"].startswith(("gguf weights", "int4 weights")), cfg["format"]
        for key in ("tokens_per_s", "decode_tokens_per_s", "speedup_vs_none", "decode_speedup_vs_none"):
            check_spread(cfg["repeats"][key], 2)
        assert cfg["identical_to_none"] == 1.0 and cfg["target_forwards"] == 2 * MAX_NEW
    assert out["configs"]["none"]["repeats"]["speedup_vs_none"]["runs"] == [1.0, 1.0]
    # top-level fields are still the first configuration's pooled figures
    assert out["tokens_per_s"] == out["configs"]["none"]["tokens_per_s"]
    assert [len(o["token_ids"]) for o in out["outputs"]] == [MAX_NEW] * 2


def test_vllm_binding_follows_this_process_cores():
    bind = cpu_bind(1)
    assert bind.isdigit()
    parts = [p.split("-") for p in cpu_bind(4096).split(",")]
    assert all(int(p[0]) <= int(p[-1]) for p in parts)


# ---- llama.cpp ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peers` extra) is not installed")


@pytest.mark.slow
def test_llamacpp_q4_0_is_requantized_pure_and_cached(llama_cpp, tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType, GGUFReader

    from engines.bench.llamacpp_peer import q4_0_gguf

    monkeypatch.setenv("LYANNA_CACHE_DIR", str(tmp_path))
    out = q4_0_gguf(embedded_gguf_path())
    assert out.parent == tmp_path and q4_0_gguf(embedded_gguf_path()) == out  # written once
    reader = GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert matrices and all(t.tensor_type == GGMLQuantizationType.Q4_0 for t in matrices)


@pytest.mark.slow
def test_llamacpp_runner_generates_exactly_and_agrees_with_our_engine_on_the_same_weights(llama_cpp):
    from engines.bench.llamacpp_peer import LlamaCppRunner

    engine = LLMEngine(EngineConfig(drafter="none", num_kv_blocks=64))
    assert engine.quantization == "gguf"
    records = sharegpt_prompts(3, max_chars=200, split="val")
    prompts = [engine.tokenizer.apply_chat_template(r["messages"]) for r in records]
    runner = LlamaCppRunner(embedded_gguf_path(), n_ctx=1024, threads=1)
    wave = runner.run(prompts, 12, temperature=0.0, seed=0)
    assert [len(o) for o in wave.outputs] == [12] * 3  # EOS ignored
    assert wave.decode_tokens == 3 * 11 and 0 < wave.decode_s < wave.wall_s and wave.first_token_s > 0
    assert runner.run(prompts, 12, temperature=0.0, seed=0).outputs == wave.outputs  # cache cleared between runs
    assert runner.settings()["flash_attn"] is True
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # the same Q4_1 weights: the first greedy token agrees (later ones may part on near ties)
    assert [o.token_ids[0] for o in ours] == [o[0] for o in wave.outputs]
    sampled = runner.run(prompts[:1], 12, temperature=0.8, seed=3).outputs
    assert len(sampled[0]) == 12 and runner.run(prompts[:1], 12, temperature=0.8, seed=3).outputs == sampled
    # with its 8-bit KV cache (the peer of kv_cache_dtype int8): still exactly the tokens asked for
    q8 = LlamaCppRunner(embedded_gguf_path(), n_ctx=1024, threads=1, kv_type="q8_0")
    assert q8.settings()["kv_type"] == "q8_0"
    assert [len(o) for o in q8.run(prompts, 12, temperature=0.0, seed=0).outputs] == [12] * 3
    with pytest.raises(ValueError, match="q8_0"):
        LlamaCppRunner(embedded_gguf_path(), n_ctx=1024, threads=1, kv_type="q4_0")


def test_a_configuration_name_can_ask_for_an_int8_kv_cache():
    from engines.bench.cli import build_parser, engine_config
    from engines.spec_params import SpecParams

    args = build_parser().parse_args(["--prompts", "unused.jsonl"])
    assert engine_config("none+kv-int8", args, SpecParams()).kv_cache_dtype == "int8"
    assert engine_config("none", args, SpecParams()).kv_cache_dtype == "auto"
    assert engine_config("none+int8+kv-int8", args, SpecParams()).quantization == "int8"


@pytest.mark.slow
def test_bench_compares_with_llamacpp_fastest_format_and_as_shipped(llama_cpp, capsys, prompt_file):
    out = bench(capsys, prompt_file, "--num-prompts", "1", "--compare", "none", "--compare-llamacpp", "--repeat", "2")
    assert set(out["configs"]) == {"none", "llamacpp-q4_0", "llamacpp-q4_1"}
    info = out["peers"]
    assert info["llamacpp"]["system_info"] and info["llamacpp"]["threads"] == out["torch_threads"]
    assert info["llamacpp"]["flash_attn"] is True
    assert "Q4_0" in info["llamacpp-q4_0"]["format"] and "Q4_1" in info["llamacpp-q4_1"]["format"]
    for peer in ("llamacpp-q4_0", "llamacpp-q4_1"):
        cfg = out["configs"][peer]
        assert cfg["output_tokens"] == 2 * MAX_NEW and cfg["decode_tokens"] == 2 * (MAX_NEW - 1)
        assert cfg["format"] == info[peer]["format"]
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            check_spread(cfg["repeats"][key], 2)
        for key in (f"speedup_vs_{peer}", f"decode_speedup_vs_{peer}"):
            check_spread(out["configs"]["none"]["repeats"][key], 2)


# ---- vLLM ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    venv = default_venv()
    if not venv_has_vllm(venv):
        pytest.skip(f"no vLLM environment at {venv} (scripts/vllm_cpu_env.sh; LYANNA_VLLM_VENV)")
    return venv


@pytest.mark.slow
def test_vllm_worker_generates_exactly_and_agrees_with_our_engine(vllm_venv):
    from engines.bench.vllm_peer import VllmPeer

    engine = LLMEngine(EngineConfig(drafter="none", quantization="none", num_kv_blocks=64))
    records = sharegpt_prompts(3, max_chars=200, split="val")
    prompts = [engine.tokenizer.apply_chat_template(r["messages"]) for r in records]
    peer = VllmPeer(resolve_checkpoint(), vllm_venv, max_num_seqs=3, max_model_len=512, threads=2)
    try:
        assert peer.settings["dtype"] == "bfloat16" and peer.settings["enable_prefix_caching"] is False
        assert peer.settings["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        wave = peer.run(prompts, 10, temperature=0.0, seed=0)
        assert [len(o) for o in wave.outputs] == [10] * 3  # EOS ignored
        assert 0 < wave.decode_tokens <= 3 * 9 and 0 < wave.decode_s < wave.wall_s
        assert peer.run(prompts, 10, temperature=0.0, seed=0).outputs == wave.outputs
    finally:
        peer.close()
    assert peer.proc.returncode == 0
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    # the same checkpoint in bf16: the first greedy token agrees (later ones may part on near ties)
    assert [o.token_ids[0] for o in ours] == [o[0] for o in wave.outputs]


@pytest.mark.slow
def test_bench_compares_with_vllm_on_the_same_waves(vllm_venv, capsys, prompt_file):
    out = bench(capsys, prompt_file, "--compare", "none", "--batch-size", "2", "--compare-vllm")
    assert set(out["configs"]) == {"none", "vllm"}
    vllm = out["configs"]["vllm"]
    assert vllm["output_tokens"] == 2 * MAX_NEW and vllm["decode_tokens_per_s"] > 0
    assert out["peers"]["vllm"]["version"] and out["peers"]["vllm"]["checkpoint"] == str(resolve_checkpoint())
    assert out["configs"]["none"]["speedup_vs_vllm"] > 0 and "decode_speedup_vs_vllm" in out["configs"]["none"]
