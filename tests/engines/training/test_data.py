"""Drafter training data: rendering, split, shards with resume, self-distillation, hot tokens."""

from __future__ import annotations

import json

import torch

from engines.datasets import iter_sharegpt, split_of
from engines.sampling import SamplingParams
from engines.training.data import (
    Example,
    hot_token_counts,
    load_shard,
    render,
    self_distilled_examples,
    sharegpt_examples,
    target_hidden_states,
    write_features,
)

CONV = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Green, like grass."},
]


def test_split_is_deterministic_and_small_for_validation():
    ids = [rec["id"] for _, rec in zip(range(3000), iter_sharegpt(), strict=False)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert 0.005 < splits.count("val") / len(ids) < 0.05
    # Turns of one conversation (id suffixes _0, _1, ...) never straddle the split.
    assert split_of("abc_0") == split_of("abc_7")


def test_render_masks_exactly_the_assistant_turns(engine_fp32):
    tok = engine_fp32.tokenizer
    ex = render(tok, "c", CONV, max_len=10_000)
    assert ex.token_ids == tok.encode(tok.hf.apply_chat_template(CONV, tokenize=False))
    spans, cur = [], []
    for t, m in zip(ex.token_ids, ex.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [tok.decode(s).strip() for s in spans] == ["Blue.", "Green, like grass."]
    cut = render(tok, "c", CONV, max_len=20)
    assert len(cut.token_ids) == len(cut.loss_mask) == 20


def test_sharegpt_examples_come_from_one_split(engine_fp32):
    exs = [ex for _, ex in zip(range(5), sharegpt_examples(engine_fp32.tokenizer, "val", max_len=256), strict=False)]
    assert len(exs) == 5 and all(split_of(ex.id) == "val" for ex in exs)
    assert all(len(ex.token_ids) <= 256 and any(ex.loss_mask) for ex in exs)


def test_sharegpt_parts_are_the_records_that_continue_a_conversation(engine_fp32):
    """`parts` yields the records that open with an answer (later parts of a split conversation), behind a
    "Continue." turn."""
    tok = engine_fp32.tokenizer
    take = 8
    parts = [ex for _, ex in zip(range(take), sharegpt_examples(tok, "val", max_len=256, parts=True), strict=False)]
    assert len(parts) == take
    first = tok.decode(parts[0].token_ids[: parts[0].loss_mask.index(1)])
    assert first.count("Continue.") == 1 and "assistant" in first.split("Continue.")[1]  # the answer follows it
    assert all(split_of(ex.id) == "val" and any(ex.loss_mask) for ex in parts)


def test_shards_hold_target_hidden_states_and_resume(engine_fp32, tmp_path):
    tok = engine_fp32.tokenizer
    exs = [
        render(
            tok,
            f"ex{i}",
            [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Answer " * (i + 1)}],
            10_000,
        )
        for i in range(4)
    ]
    index = write_features(engine_fp32.model, exs[:3], tmp_path, num=3, shard_tokens=60)
    assert index["num_examples"] == 3 and len(index["shards"]) >= 2
    # Resume: the first three are skipped, only the fourth is computed.
    calls = []

    def counting(examples):
        for ex in examples:
            calls.append(ex.id)
            yield ex

    index = write_features(engine_fp32.model, counting(exs), tmp_path, num=4, shard_tokens=60)
    assert index["num_examples"] == 4 and calls == ["ex0", "ex1", "ex2", "ex3"]
    stored = [e for s in index["shards"] for e in load_shard(tmp_path / s["file"])]
    assert len(stored) == 4
    for ex, rec in zip(exs, stored, strict=True):
        assert rec["input_ids"].tolist() == ex.token_ids and rec["loss_mask"].tolist() == ex.loss_mask
        want = target_hidden_states(engine_fp32.model, ex.token_ids).to(torch.bfloat16)
        assert rec["hidden"].dtype == torch.bfloat16 and torch.equal(rec["hidden"], want)
    counts = hot_token_counts(tmp_path)
    assert sum(counts.values()) == sum(sum(ex.loss_mask) for ex in exs)
    assert json.loads((tmp_path / "index.json").read_text())["num_tokens"] == sum(len(e.token_ids) for e in exs)


def test_self_distilled_examples_hold_the_targets_own_answers(engine_fp32):
    exs = list(self_distilled_examples(engine_fp32, "val", num=2, max_new_tokens=8, batch_size=2))
    assert len(exs) == 2 and all(isinstance(e, Example) for e in exs)
    for ex in exs:
        prompt_len = ex.loss_mask.index(1)
        answer = engine_fp32.generate([ex.token_ids[:prompt_len]], SamplingParams(temperature=0, max_tokens=8))[0]
        assert engine_fp32.tokenizer.decode(ex.token_ids[prompt_len:]).startswith(answer.text.strip()[:10])


def test_chat_file_examples_read_openai_and_sharegpt_lines(engine_fp32, tmp_path):
    from engines.training.data import chat_file_examples

    path = tmp_path / "chats.jsonl"
    lines = [{"id": f"chat_{i}", "messages": CONV} for i in range(300)] + [
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    tok = engine_fp32.tokenizer
    train = list(chat_file_examples(tok, path, "train", 10_000))
    val = list(chat_file_examples(tok, path, "val", 10_000))
    assert len(train) + len(val) == 301 and {e.id for e in train}.isdisjoint(e.id for e in val)
    # A user's ids are whole ids (not ShareGPT's conversation_turn): "chat_1" and "chat_2" split apart.
    assert 1 <= len(val) <= 20 and all(split_of(e.id, turns=False) == "val" for e in val)
    assert any(e.id == "line301" for e in train + val)  # no id: the line number
    assert render(tok, "x", CONV, 10_000).token_ids in [e.token_ids for e in train + val]
    path.write_text('{"prompt": "no chat here"}\n')
    try:
        list(chat_file_examples(tok, path, "train"))
    except ValueError as e:
        assert "chats.jsonl:1" in str(e) and "messages" in str(e)
    else:
        raise AssertionError("a line without a chat must be refused")


def test_example_file_resumes_after_a_cut_line(tmp_path):
    from engines.training.data import ExampleFile

    file = ExampleFile(tmp_path / "train.jsonl")
    made = [Example(f"c{i}", [1, 2, 3, i], [0, 0, 1, 1]) for i in range(6)]
    assert len(file.extend(iter(made[:3]), 3)) == 3
    with open(file.path, "a") as f:
        f.write('{"id": "c3", "token_ids": [1, 2')  # an interrupted write
    assert [e.id for e in file.read()] == ["c0", "c1", "c2"]
    seen = []

    def source():
        for e in made:
            seen.append(e.id)
            yield e

    got = file.extend(source(), 5)
    assert [e.id for e in got] == ["c0", "c1", "c2", "c3", "c4"]
    assert [e.id for e in file.read()] == ["c0", "c1", "c2", "c3", "c4"]
    assert seen == ["c0", "c1", "c2", "c3", "c4"]  # already-written ids are passed over, not duplicated


def test_a_complete_example_file_is_only_read(tmp_path):
    """A source with fewer examples than asked for leaves a complete file that later runs sharing the
    data folder (Lyanna's and EAGLE's, started together) only read: nothing rewrites or swaps it, so
    they cannot race on it. Two runs that did raced on a shared temporary file."""
    from engines.training.data import ExampleFile

    file = ExampleFile(tmp_path / "train.jsonl")
    made = [Example(f"c{i}", [1, 2, 3, i], [0, 0, 1, 1]) for i in range(3)]
    assert len(file.extend(iter(made), 10)) == 3  # the source ran out below num
    before = file.path.stat()
    again = file.extend(iter(made), 10)
    after = file.path.stat()
    assert [e.id for e in again] == ["c0", "c1", "c2"]
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert sorted(tmp_path.iterdir()) == [file.path, tmp_path / "train.jsonl.lock"]  # no temporary file left


def test_runs_sharing_an_example_file_take_turns(tmp_path):
    """Two processes extending one file at once (a slow source, as self-distillation is) write each
    example once, in whole lines: the second waits for the first and then finds the file complete."""
    import multiprocessing

    from engines.training.data import ExampleFile

    path = tmp_path / "train.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_extend_slowly, args=(path, 20)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    lines = path.read_text().splitlines()
    assert [e.id for e in ExampleFile(path).read()] == [f"c{i}" for i in range(20)] and len(lines) == 20


def _extend_slowly(path, num: int) -> None:
    import time

    from engines.training.data import ExampleFile

    def source():
        for i in range(num):
            time.sleep(0.01)
            yield Example(f"c{i}", [1, 2, 3] * 400, [0, 0, 1] * 400)  # lines longer than a write buffer

    ExampleFile(path).extend(source(), num)
