"""`python -m engines.training` end to end: in this process on the embedded target, and data-parallel on
two Ray Train CPU workers on a tiny target, with learning, resuming and a drafter the engine serves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engines.engine import EngineConfig, LLMEngine
from engines.sampling import SamplingParams
from engines.training.pipeline import main
from engines.training.report import tokens_before
from engines.training.train_drafter import training_weights
from tests.engines.helpers import tiny_llama_checkpoint

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A randomly initialised two-layer Llama checkpoint folder with the embedded model's tokenizer."""
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-target"), vocab_size=49152, max_positions=512)


def _state(out):
    return torch.load(out / "checkpoint" / "train_state.pt", weights_only=False)["progress"]


@pytest.mark.slow
def test_ray_train_two_workers_learn_and_resume(tiny_target, tmp_path):
    out = tmp_path / "run"
    common = [
        "--model", str(tiny_target), "--source", "sharegpt", "--num", "24", "--val-num", "4",
        "--max-seq", "128", "--draft-vocab", "512", "--lr", "3e-3", "--epochs", "8", "--batch-seqs", "2",
        "--eval-every", "8", "--checkpoint-every", "8", "--workers", "2", "--out", str(out),
    ]  # fmt: skip
    # An interrupted run: 5 of its optimizer steps, then it stops with a checkpoint.
    main([*common, "--features", "store", "--stop-after", "5"])
    first = _state(out)
    assert first["step"] == 5
    # Two workers taking a sequence each per step train what one process taking both would.
    local = tmp_path / "local"
    main([*common[:-4], "--out", str(local), "--features", "store", "--stop-after", "5"])
    ray_weights = training_weights(out / "checkpoint")  # at training precision (model.safetensors is bf16)
    local_weights = training_weights(local / "checkpoint")
    # Adam moves a weight by about lr on its first steps whatever its gradient's size, so the few weights
    # whose gradient sums to 0 in one order and to +-1e-12 in the other (two workers' all-reduce against
    # one process's batch) differ by ~lr; everything else agrees to rounding.
    for name, w in local_weights.items():
        off = ~torch.isclose(ray_weights[name], w, atol=2e-4, rtol=1e-3)
        assert off.float().mean() < 1e-2, f"{name}: {off.sum()} of {off.numel()} weights differ"
        assert (ray_weights[name] - w).abs().max() <= 2 * 5 * 3e-3, name  # 5 steps of about lr (3e-3) at most
    main([*common, "--features", "store"])
    done = _state(out)
    usable = json.loads((out / "checkpoint" / "config.json").read_text())["data"]["train_examples"]
    assert usable >= 8  # conversations with an answer inside the first 128 tokens
    assert done["step"] == 8 * (usable // 2)
    # It resumed: the points the first invocation recorded are kept as they were, and later ones follow.
    assert done["curve"][: len(first["curve"])] == first["curve"]
    steps = [p["step"] for p in done["curve"]]
    assert steps == sorted(set(steps)) and steps[-1] == done["step"]
    assert done["wall_s"] > first["wall_s"]
    start, end = done["curve"][0], done["curve"][-1]
    assert end["val_loss"] < 0.8 * start["val_loss"]  # it learns
    assert end["cond1"] > 0.1 and end["chain_tokens"] > 1.1  # far above chance (1 in 512 draft tokens)
    assert end["tokens"] > 8 * usable * 20
    card = (out / "checkpoint" / "README.md").read_text()
    assert "Learning curve" in card and "sharegpt" in card
    assert (out / "checkpoint" / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_trained_drafter_serves_losslessly_and_feature_modes_agree(tmp_path):
    """Both feature modes train the same drafter; the engine then loads it and greedy decoding with it
    equals plain decoding token for token."""
    common = ["--num", "6", "--val-num", "2", "--max-seq", "128", "--batch-seqs", "2", "--eval-every", "2"]
    finals = {}
    for mode in ("store", "on-the-fly"):
        out = tmp_path / mode
        finals[mode] = main([*common, "--features", mode, "--out", str(out)])
        config = json.loads((out / "checkpoint" / "config.json").read_text())
        assert config["features"]["mode"] == mode and config["kind"] == "lyanna"
    assert finals["store"]["val_loss"] == pytest.approx(finals["on-the-fly"]["val_loss"], rel=1e-3)
    params = SamplingParams(temperature=0, max_tokens=24)
    # The served configuration (bf16, the GGUF's int4 weights), whose verified rows equal decoded ones bit for bit.
    plain = LLMEngine(EngineConfig(drafter="none", num_kv_blocks=128)).generate(PROMPTS, params)
    ckpt = str(tmp_path / "store" / "checkpoint")
    spec_engine = LLMEngine(EngineConfig(drafter="lyanna", draft_model=ckpt, num_kv_blocks=128))
    spec = spec_engine.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_engine.stats().spec.num_steps > 0


@pytest.mark.slow
def test_fine_tuning_starts_from_a_drafter_on_conversations_it_has_not_seen(tmp_path):
    """`--init-from` starts from a trained drafter (its weights, head rows and shape) and `--skip` leaves
    out the conversations it was trained on; the model card says where it started."""
    common = ["--val-num", "2", "--max-seq", "128", "--batch-seqs", "2", "--eval-every", "2", "--features", "store"]
    first, tuned = tmp_path / "first", tmp_path / "tuned"
    before = main([*common, "--num", "6", "--draft-vocab", "1024", "--out", str(first)])
    main([*common, "--num", "12", "--skip", "6", "--init-from", str(first / "checkpoint"), "--out", str(tuned)])

    def ids(run, split):
        return {json.loads(line)["id"] for line in (run / "data" / f"{split}.jsonl").read_text().splitlines()}

    assert len(ids(tuned, "train")) == 6 and not ids(tuned, "train") & ids(first, "train")
    assert ids(tuned, "val") == ids(first, "val")
    # Step 0 of the fine-tuning run evaluates the first run's final weights on the same held-out data.
    start = json.loads((tuned / "checkpoint" / "curve.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and start["val_loss"] == pytest.approx(before["val_loss"], rel=1e-5)
    weights = {run: load_file(str(run / "checkpoint" / "model.safetensors")) for run in (first, tuned)}
    assert torch.equal(weights[first]["d2t"], weights[tuned]["d2t"])  # the head keeps its 1,024 rows
    assert not torch.equal(weights[first]["fuse.weight"], weights[tuned]["fuse.weight"])  # and it trained
    card = (tuned / "checkpoint" / "README.md").read_text()
    assert f"started from `{first / 'checkpoint'}`" in card
    assert tokens_before(tuned / "checkpoint") == before["tokens"] > 0  # where its curve continues the first's
    with pytest.raises(SystemExit, match="holds a 'lyanna' drafter"):
        main([*common, "--kind", "eagle", "--num", "12", "--skip", "6", "--init-from", str(first / "checkpoint"),
              "--out", str(tmp_path / "wrong")])  # fmt: skip
    # A larger --rank grows the token info with zero offsets (step 0 is the first run's drafter exactly);
    # --chain-fusion adds the chain embedding to a drafter without one.
    again = [*common, "--num", "12", "--skip", "6", "--init-from", str(first / "checkpoint"), "--stop-after", "1"]
    main([*again, "--rank", "96", "--out", str(tmp_path / "grown")])
    start = json.loads((tmp_path / "grown" / "checkpoint" / "curve.jsonl").read_text().splitlines()[0])
    assert start["val_loss"] == pytest.approx(before["val_loss"], rel=1e-5)
    grown = load_file(str(tmp_path / "grown" / "checkpoint" / "model.safetensors"))
    assert grown["token_info.w1"].shape[1] == grown["token_info.w2"].shape[0] == 96
    main([*again, "--chain-fusion", "--out", str(tmp_path / "chained")])
    config = json.loads((tmp_path / "chained" / "checkpoint" / "config.json").read_text())
    assert config["draft"]["chain_fusion"] and config["draft"]["token_info_rank"] == 64
    assert "chain_embed" in load_file(str(tmp_path / "chained" / "checkpoint" / "model.safetensors"))


def test_self_distilled_data_skips_prompts_before_answering(tmp_path):
    """`--source self --skip N` answers the split's prompts after the first N (none generated and thrown
    away), with the served target's own greedy answers."""
    from engines.training.data import ExampleFile, self_distilled_examples
    from engines.training.pipeline import parse_args, prepare_examples

    args = parse_args(["--source", "self", "--num", "3", "--skip", "1", "--max-new-tokens", "6", "--gen-batch", "2",
                       "--max-seq", "256", "--out", str(tmp_path)])  # fmt: skip
    got = prepare_examples(args, "train", args.num, tmp_path)
    engine = LLMEngine(EngineConfig(drafter="none", max_num_seqs=2))
    want = list(self_distilled_examples(engine, "train", 3, max_new_tokens=6, batch_size=2))
    assert [e.id for e in got] == [e.id for e in want[1:]]
    assert [e.token_ids for e in got] == [e.token_ids for e in want[1:]]
    assert len(ExampleFile(tmp_path / "data" / "train.jsonl").read()) == 2
