"""Training data for hidden-state drafters: conversations rendered with the target's chat template,
assistant-token loss masks, a deterministic train/validation split, and the target's last-layer
hidden states written once to disk in resumable shards.

Two sources: the dataset's own assistant turns (`sharegpt`, and `sharegpt-parts` for the records that
continue a conversation split in parts), and `self`-distilled turns where the target answers the same
first user turn (what the target actually says is what a drafter must
predict). Target logits are not stored: they are `lm_head(hidden)`, recomputed from the frozen head.

    python -m engines.training.data --source self --split train --num 2000 --out data/self-train
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engines.datasets import iter_sharegpt, sharegpt_messages, split_of
from engines.engine_config import add_engine_args
from engines.model import LlamaModel
from engines.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Example:
    """One rendered conversation: token ids and which of them the drafter learns to predict."""

    id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (including their end-of-turn token)


def render(tokenizer: Tokenizer, conv_id: str, messages: list[dict[str, str]], max_len: int) -> Example | None:
    """Token ids of the whole conversation and a mask over its assistant turns, cut to `max_len`.

    Each assistant turn's span is what the template adds between the conversation up to the turn
    (with the generation prompt) and the conversation including it.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i]) if i else []
        after = tokenizer.encode(tokenizer.hf.apply_chat_template(messages[: i + 1], tokenize=False))
        if after[: len(before)] != before or len(before) < len(ids):
            return None  # the template is not prefix-stable here; skip rather than mislabel
        mask += [0] * (len(before) - len(ids)) + [1] * (len(after) - len(before))
        ids = after
    if not any(mask):
        return None
    return Example(conv_id, ids[:max_len], mask[:max_len])


CONTINUE_TURN = {"role": "user", "content": "Continue."}


def sharegpt_examples(
    tokenizer: Tokenizer, split: str, max_len: int = 1024, val_fraction: float = 0.02, parts: bool = False
) -> Iterator[Example]:
    """ShareGPT conversations of one split with the dataset's assistant turns.

    With `parts`, instead the records that open with an assistant turn: the later parts of conversations
    the dataset split in several records (a third of them), each behind a "Continue." user turn."""
    for rec in iter_sharegpt():
        if split_of(rec["id"], val_fraction) != split:
            continue
        msgs = sharegpt_messages(rec)
        if parts:
            msgs = [CONTINUE_TURN, *msgs] if msgs and msgs[0]["role"] == "assistant" else []
        if msgs and msgs[0]["role"] == "user":
            ex = render(tokenizer, rec["id"], msgs, max_len)
            if ex is not None:
                yield ex


def chat_file_examples(
    tokenizer: Tokenizer, path: str | Path, split: str, max_len: int = 1024, val_fraction: float = 0.02
) -> Iterator[Example]:
    """A user's chats, one JSON object per line: {"messages": [{"role", "content"}, ...]} (OpenAI) or
    {"conversations": [{"from", "value"}, ...]} (ShareGPT), with an optional "id" (else the line number)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if "messages" in rec:
                msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
            elif "conversations" in rec:
                msgs = sharegpt_messages(rec)
            else:
                raise ValueError(f"{path}:{n}: a chat needs 'messages' or 'conversations'")
            conv_id = str(rec.get("id", f"line{n}"))
            if split_of(conv_id, val_fraction, turns=False) != split or not any(m["role"] == "assistant" for m in msgs):
                continue
            ex = render(tokenizer, conv_id, msgs, max_len)
            if ex is not None:
                yield ex


class ExampleFile:
    """Rendered examples (ids, token ids, loss masks) in a JSONL file, appended one by one, so that an
    interrupted preparation (self-distillation takes hours) resumes after the last written example."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self) -> list[Example]:
        """Every complete example written so far."""
        return self._read()[0]

    def _read(self) -> tuple[list[Example], bool]:
        """The complete examples, and whether anything else follows them (the rest of a cut line)."""
        if not self.path.exists():
            return [], False
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        out = []
        for line in lines:
            try:
                out.append(Example(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break  # a line cut by an interruption: everything before it stands
        return out, len(lines) > len(out) or (bool(text) and not text.endswith("\n"))

    def extend(self, examples: Iterable[Example], num: int) -> list[Example]:
        """Add examples (skipping ids already written) until the file holds `num`; returns them all.

        Runs sharing a data folder (Lyanna's and EAGLE's at an equal budget) take turns: the file is
        locked while one of them extends it, and a file already complete (a source with fewer examples
        than `num`) is only read."""
        if len(have := self.read()) >= num:
            return have
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            have, cut = self._read()  # with what an earlier holder of the lock wrote
            if len(have) >= num:
                return have
            done = {e.id for e in have}
            if cut:  # rewritten without the cut last line, then swapped in whole
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text("".join(json.dumps(e.__dict__) + "\n" for e in have), encoding="utf-8")
                tmp.replace(self.path)
            with open(self.path, "a", encoding="utf-8") as f:
                for ex in examples:  # stops as soon as it has enough (a source may be costly to draw from)
                    if ex.id in done:
                        continue
                    f.write(json.dumps(ex.__dict__) + "\n")
                    f.flush()
                    have.append(ex)
                    if len(have) >= num:
                        break
        return have


def self_distilled_examples(
    engine,
    split: str,
    num: int,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.0,
    max_prompt_chars: int = 2000,
    val_fraction: float = 0.02,
    skip: Iterable[str] = (),
    skip_first: int = 0,
) -> Iterator[Example]:
    """The target's own answers to the first user turn of ShareGPT conversations of one split
    (conversation ids in `skip` were answered before and are passed over, and so are the split's first
    `skip_first` usable prompts)."""
    from engines.sampling import SamplingParams

    skip = set(skip)
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=0 if temperature else None)
    pending: list[tuple[str, list[dict[str, str]]]] = []
    made = 0

    def flush() -> Iterator[Example]:
        outs = engine.generate([m for _, m in pending], params)
        for (cid, msgs), out in zip(pending, outs, strict=True):
            ex = render(engine.tokenizer, cid, [*msgs, {"role": "assistant", "content": out.text}], 10**9)
            if ex is not None:
                yield ex
        pending.clear()

    for rec in iter_sharegpt():
        if made >= num:
            break
        msgs = sharegpt_messages(rec)
        if split_of(rec["id"], val_fraction) != split or not msgs or msgs[0]["role"] != "user":
            continue
        if rec["id"] in skip:
            continue
        if not 0 < len(msgs[0]["content"]) <= max_prompt_chars:
            continue
        if skip_first > 0:
            skip_first -= 1
            continue
        pending.append((rec["id"], msgs[:1]))
        made += 1
        if len(pending) == batch_size:
            yield from flush()
    if pending:
        yield from flush()


@torch.inference_mode()
def target_hidden_states(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """[len, hidden] last-layer (post-norm) hidden states of one sequence, from a fresh cache."""
    from engines.attention import SequenceLayout, build_attention_metadata
    from engines.kv_cache import PagedKVCache

    cfg, n, block = model.cfg, len(token_ids), 16
    device = model.embed_tokens.weight.device
    kv = PagedKVCache(cfg.num_layers, model.attn_kv_heads, cfg.head_dim, -(-n // block), block, model.dtype, device)
    kv.allocate("x", n)
    meta = build_attention_metadata([SequenceLayout(kv.block_tables["x"], 0, n)], block, device)
    _, hidden = model(
        torch.tensor(token_ids, device=device),
        torch.arange(n, device=device),
        meta,
        kv,
        torch.zeros(0, dtype=torch.long, device=device),
    )
    return hidden


class ShardWriter:
    """Writes examples with their hidden states to `shard-NNNNN.safetensors` files plus `index.json`.

    Each shard holds the concatenated `input_ids`, `loss_mask` and `hidden` of whole examples and
    `offsets` (example boundaries). `index.json` records finished shards and the ids they hold, so an
    interrupted run resumes after its last finished shard.
    """

    def __init__(self, out_dir: str | Path, shard_tokens: int = 65_536):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_tokens = shard_tokens
        self.index_path = self.dir / "index.json"
        self.index: dict[str, Any] = (
            json.loads(self.index_path.read_text())
            if self.index_path.exists()
            else {"shards": [], "num_examples": 0, "num_tokens": 0}
        )
        self.done_ids = {i for s in self.index["shards"] for i in s["ids"]}
        self._buf: list[tuple[Example, torch.Tensor]] = []

    def add(self, ex: Example, hidden: torch.Tensor) -> None:
        """Buffer one example; a shard is written once the buffer reaches `shard_tokens` tokens."""
        self._buf.append((ex, hidden.to(torch.bfloat16).cpu()))
        if sum(len(e.token_ids) for e, _ in self._buf) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the buffered examples as one shard and record it in the index."""
        if not self._buf:
            return
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        lengths = [len(e.token_ids) for e, _ in self._buf]
        tensors = {
            "input_ids": torch.tensor([t for e, _ in self._buf for t in e.token_ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for e, _ in self._buf for m in e.loss_mask], dtype=torch.uint8),
            "hidden": torch.cat([h for _, h in self._buf]),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        }
        save_file(tensors, self.dir / name)
        ids = [e.id for e, _ in self._buf]
        self.index["shards"].append({"file": name, "ids": ids, "tokens": sum(lengths)})
        self.index["num_examples"] += len(ids)
        self.index["num_tokens"] += sum(lengths)
        tmp = self.index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.index))
        tmp.replace(self.index_path)  # the index never points at a half-written shard
        self.done_ids.update(ids)
        self._buf.clear()


def write_features(
    model: LlamaModel, examples: Iterable[Example], out_dir: str | Path, num: int, shard_tokens: int = 65_536
) -> dict[str, Any]:
    """Compute and store hidden states for up to `num` examples, skipping those already written."""
    writer = ShardWriter(out_dir, shard_tokens)
    start, count = time.monotonic(), writer.index["num_examples"]
    for ex in examples:
        if count >= num:
            break
        if ex.id in writer.done_ids:
            continue
        writer.add(ex, target_hidden_states(model, ex.token_ids))
        count += 1
        if count % 50 == 0:
            log.info("%d/%d examples, %.0f s", count, num, time.monotonic() - start)
    writer.flush()
    return writer.index


def load_shard(path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The examples of one shard: per example `input_ids`, `loss_mask` and `hidden`."""
    t = load_file(str(path))
    off = t["offsets"].tolist()
    return [{k: t[k][a:b] for k in ("input_ids", "loss_mask", "hidden")} for a, b in itertools.pairwise(off)]


def hot_token_counts(out_dir: str | Path) -> Counter:
    """How often each token appears in the assistant (target-generated) positions of a feature set."""
    counts: Counter = Counter()
    index = json.loads((Path(out_dir) / "index.json").read_text())
    for shard in index["shards"]:
        t = load_file(str(Path(out_dir) / shard["file"]))
        counts.update(t["input_ids"][t["loss_mask"].bool()].tolist())
    return counts


def main(argv: list[str] | None = None) -> None:
    """Prepare one split of drafter training data (resumable)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["sharegpt", "sharegpt-parts", "self"], default="self")
    ap.add_argument("--split", choices=["train", "val"], default="train")
    ap.add_argument("--num", type=int, default=2000, help="conversations to prepare")
    ap.add_argument("--max-len", type=int, default=1024, help="tokens per conversation at most (sharegpt)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length (self)")
    ap.add_argument("--batch-size", type=int, default=16, help="generation batch (self)")
    add_engine_args(ap, ["dtype"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from engines.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_num_seqs=args.batch_size, drafter="none"))
    if args.source != "self":
        parts = args.source == "sharegpt-parts"
        examples: Iterable[Example] = sharegpt_examples(engine.tokenizer, args.split, args.max_len, parts=parts)
    else:
        examples = self_distilled_examples(engine, args.split, args.num, args.max_new_tokens, args.batch_size)
    index = write_features(engine.model, examples, args.out, args.num)
    print(json.dumps({k: index[k] for k in ("num_examples", "num_tokens")} | {"shards": len(index["shards"])}))


if __name__ == "__main__":
    main()
