"""The command lines users run: generation and the benchmark (JSON on the last line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines.datasets import read_prompt_file, sharegpt_prompts, write_prompt_file


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, check=False)


def test_generate_cli_prints_completion_and_speed():
    res = run("engines.generate", "--prompt", "What is 2 + 2?", "--max-tokens", "12", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "tokens/s" in res.stderr and "finish_reason=" in res.stderr


def test_generate_cli_rejects_bad_sampling():
    res = run("engines.generate", "--prompt", "hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr


@pytest.mark.parametrize(
    ("module", "flag"),
    [("engines.bench", "--compare"), ("engines.acceptance", "--drafter"), ("engines.bench.quality", "--settings")],
)
def test_measurement_clis_answer_where_users_call_them(module, flag):
    # The tools live in engines/bench/; `python -m engines.bench` and `python -m engines.acceptance` keep working.
    res = run(module, "--help")
    assert res.returncode == 0, res.stderr
    assert flag in res.stdout


def test_acceptance_drafter_specs_name_kind_checkpoint_and_flags():
    from engines.bench.acceptance import parse_drafter

    label, cfg = parse_drafter("like-eagle=lyanna::dense:noresample")
    assert label == "like-eagle" and cfg.drafter == "lyanna" and cfg.draft_model is None
    assert cfg.lyanna_token_info_rows == 0 and not cfg.lyanna_resampling
    _, cfg = parse_drafter("l=lyanna:/ckpt:noresample")
    assert cfg.draft_model == "/ckpt" and not cfg.lyanna_resampling and cfg.lyanna_token_info_rows == 0
    _, cfg = parse_drafter("t=lyanna::table")
    assert cfg.lyanna_resampling and cfg.lyanna_token_info_rows == 1024
    _, cfg = parse_drafter("e=eagle")
    assert cfg.drafter == "eagle" and cfg.draft_model is None
    for bad in ("lyanna", "x=lyanna:/a:/b"):
        with pytest.raises(SystemExit):
            parse_drafter(bad)


def test_sharegpt_prompt_file_round_trip(tmp_path):
    records = sharegpt_prompts(5)
    assert len(records) == 5 and all(r["messages"][0]["role"] == "user" for r in records)
    path = tmp_path / "p.jsonl"
    write_prompt_file(records, path)
    assert read_prompt_file(path) == records
    from engines.datasets import split_of

    val = sharegpt_prompts(3, split="val")
    assert len(val) == 3 and all(split_of(r["id"]) == "val" for r in val)


@pytest.mark.slow
def test_a_long_prompt_file_and_its_prefill_rate(tmp_path):
    """`--long-prompt-tokens N` writes one held-out prompt of at most N tokens (and close to N); the bench
    reads it with one new token (nothing left to decode) and reports its prompt-reading rate."""
    from engines.loader import resolve_checkpoint
    from engines.tokenizer import Tokenizer

    path = tmp_path / "long.jsonl"
    res = run("engines.datasets", "--split", "val", "--long-prompt-tokens", "1200", "--out", str(path))
    assert res.returncode == 0, res.stderr
    (record,) = read_prompt_file(path)
    n = len(Tokenizer(resolve_checkpoint(None)).apply_chat_template(record["messages"]))
    assert 1150 <= n <= 1200
    res = run(
        "engines.bench", "--prompts", str(path), "--num-prompts", "1", "--max-new-tokens", "1",
        "--batch-size", "1", "--compare", "none,ngram", "--warmup", "0",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    none = out["configs"]["none"]
    assert none["output_tokens"] == 1 and none["decode_tokens_per_s"] is None
    assert none["prefill_tokens_per_s"] == pytest.approx(n / none["first_token_s"])
    assert "decode_speedup_vs_none" not in out["configs"]["ngram"]
    # several: each its own held-out conversations, each close below the length
    path = tmp_path / "ctx.jsonl"
    res = run("engines.datasets", "--split", "val", "--long-prompt-tokens", "256", "--num", "3", "--out", str(path))
    assert res.returncode == 0, res.stderr
    records = read_prompt_file(path)
    assert len({r["id"] for r in records}) == len({r["messages"][0]["content"] for r in records}) == 3
    tokenizer = Tokenizer(resolve_checkpoint(None))
    assert all(220 <= len(tokenizer.apply_chat_template(r["messages"])) <= 256 for r in records)


@pytest.mark.slow
def test_bench_reports_json_and_compares_with_transformers(tmp_path):
    path = tmp_path / "p.jsonl"
    write_prompt_file(sharegpt_prompts(2, max_chars=300), path)
    res = run(
        "engines.bench",
        "--prompts",
        str(path),
        "--max-new-tokens",
        "8",
        "--batch-size",
        "1",
        "--compare",
        "none,ngram:3:2:4,none#2",
        "--compare-hf",
        "--dtype",
        "float32",
        "--warmup",
        "0",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in (
        "tokens_per_s",
        "output_tokens",
        "wall_s",
        "target_forwards",
        "batch_size",
        "dtype",
        "device",
        "outputs",
        "hf_tokens_per_s",
        "speedup_vs_hf",
        "configs",
    ):
        assert key in out
    assert out["config"] == "none" and out["output_tokens"] == 2 * 8 and out["dtype"] == "float32"
    assert out["target_forwards"] == 16 and out["tokens_per_s"] > 0 and out["speedup_vs_hf"] > 0
    assert [len(o["token_ids"]) for o in out["outputs"]] == [8] * 2
    assert set(out["configs"]) == {"none", "ngram:3:2:4", "none#2", "hf", "hf-prompt-lookup"}
    twin = out["configs"]["none#2"]  # another engine of the same settings: the same tokens, its own timing
    assert twin["identical_to_none"] == 1.0 and twin["target_forwards"] == 16 and twin["tokens_per_s"] > 0
    ngram = out["configs"]["ngram:3:2:4"]
    for key in ("tokens_per_s", "mean_accepted_tokens", "acceptance_by_depth", "target_forwards", "speedup_vs_none"):
        assert key in ngram
    assert ngram["speedup_vs_none_median_wave"] > 0 and out["configs"]["none"]["speedup_vs_none_median_wave"] == 1.0
    assert ngram["output_tokens"] == 16 and ngram["target_forwards"] <= 16
    assert ngram["mean_accepted_tokens"] >= 1.0 and len(ngram["acceptance_by_depth"]) <= 3
    assert "speedup_vs_hf" in out["configs"]["hf-prompt-lookup"]
    # fp32 greedy on equal work: the implementations agree on most prompts.
    assert out["identical_to_hf"] >= 0.5 and ngram["identical_to_none"] >= 0.5


@pytest.mark.slow
def test_acceptance_and_draft_latency_clis_report_every_drafter(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompt_file(sharegpt_prompts(2, max_chars=300, split="val"), prompts)
    res = run(
        "engines.acceptance", "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12",
        "--drafter", "lyanna=lyanna", "--drafter", "table=lyanna::table", "--drafter", "eagle=eagle",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    assert set(rows) == {"lyanna", "table", "eagle"}
    assert all(1 <= len(r["acceptance_by_depth"]) <= 3 and r["mean_accepted_tokens"] >= 1.0 for r in rows.values())
    assert "| lyanna |" in res.stdout
    res = run("engines.bench.draft_latency", "--prompts", str(prompts), "--num-prompts", "1", "--rounds", "2")
    assert res.returncode == 0, res.stderr
    lat = json.loads(res.stdout.strip().splitlines()[-1])
    assert lat["lyanna.draft"] > 0 and lat["eagle.draft"] > 0 and lat["token_info"] == "dense"
    assert lat["lyanna.catch_up_batched"] > 0 and lat["catch_up_batched_vs_one_by_one"] > 0


def test_copy_prompts_ask_for_answers_that_copy_from_the_prompt():
    from engines.datasets import COPY_TASKS, copy_prompts

    records = copy_prompts(8)
    assert len(records) == 8 and len({r["id"] for r in records}) == 8
    for record, (name, instruction) in zip(records, COPY_TASKS * 2, strict=True):
        (message,) = record["messages"]
        assert record["id"].startswith(f"copy-{name}-") and message["content"].startswith(instruction)
        assert len(message["content"]) > len(instruction) + 100  # the text to copy from
    assert "def " in records[2]["messages"][0]["content"]  # a HumanEval function to edit


@pytest.mark.slow
def test_bench_runs_the_served_engine_settings_and_profiles_its_steps(tmp_path):
    """`served` runs the serve config's `engine:` block, whatever it holds; every configuration of ours reports
    where its steps' time went."""
    import yaml

    from engines.datasets import copy_prompts

    config = yaml.safe_load(open("serve_config.yaml").read())
    engine = config["applications"][0]["args"]["engine"]
    engine.update({"drafter": "lyanna+suffix", "spec_policy": "fixed", "spec_depth": 2, "spec_width": 1,
                   "spec_budget": 8, "num_kv_blocks": 128})  # fmt: skip
    serve_config = tmp_path / "serve.yaml"
    serve_config.write_text(yaml.safe_dump(config))
    prompts = tmp_path / "p.jsonl"
    write_prompt_file(copy_prompts(2), prompts)
    res = run("engines.bench", "--prompts", str(prompts), "--max-new-tokens", "24", "--compare", "none,served",
              "--serve-config", str(serve_config), "--warmup", "0")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    served = out["configs"]["served"]
    assert served["settings"] == {"drafter": "lyanna+suffix", "spec_policy": "fixed", "tree": [2, 1, 8],
                                  "multi_step": 4, "quantization": "auto", "dtype": "bfloat16"}  # fmt: skip
    assert served["identical_to_none"] == 1.0 and served["draft_tokens"] > 0
    tree = served["step_profile_ms"]["tree"]
    assert tree["steps"] > 0 and tree["forward"] > 0 and tree["tokens_per_step"] > 1
    assert tree["total"] >= tree["forward"] + tree["draft"] + tree["launch"]
    assert tree["launch"] > 0  # the step's plan and the Python around the fused decoder's native call
    multi = out["configs"]["none"]["step_profile_ms"]["multi"]  # plain decoding, four greedy steps a call
    assert multi["forward"] > 0 and multi["launch"] > 0 and multi["total"] >= multi["forward"] + multi["launch"]
    assert "step profile of served" in res.stderr
