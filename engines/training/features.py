"""The target's hidden states for drafter training: stored once in shards, or computed on the fly.

Stored features cost disk (hidden size x 2 bytes a token) and one target pass over the data; on the
fly they cost no disk and one target pass per epoch, spread over the data-parallel workers.
`choose_features` decides per run from the disk's free space and the measured speeds.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engines.model import LlamaModel
from engines.training.data import Example, target_hidden_states, write_features
from engines.training.train_drafter import Sequence

log = logging.getLogger(__name__)


def _share(order: list, seed: int | None, rank: int, world: int, skip: int) -> list:
    """This worker's items of a (seeded) order, after its first `skip`."""
    if seed is not None:
        order = list(order)
        random.Random(seed).shuffle(order)
    return order[rank::world][skip:]


class StoredFeatures:
    """Feature shards written by `data.write_features` (an `index.json` plus safetensors shards); each
    example is read alone (its rows of the shard), so a shuffled order costs no whole-shard reads."""

    def __init__(self, folder: str | Path):
        self.dir = Path(folder)
        self.index = json.loads((self.dir / "index.json").read_text())
        # (shard file, first row, end row) of every example, in writing order
        self._where: list[tuple[str, int, int]] = []
        for shard in self.index["shards"]:
            with safe_open(self.dir / shard["file"], framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            self._where += [(shard["file"], a, b) for a, b in itertools.pairwise(offsets)]

    def __len__(self) -> int:
        return len(self._where)

    def sequences(self, seed: int | None, rank: int = 0, world: int = 1, skip: int = 0) -> Iterator[Sequence]:
        """Examples in a seeded order over all shards."""
        for file, a, b in _share(self._where, seed, rank, world, skip):
            with safe_open(self.dir / file, framework="pt") as f:
                rows = {k: f.get_slice(k)[a:b] for k in ("hidden", "input_ids", "loss_mask")}
            yield rows["hidden"], rows["input_ids"].long(), rows["loss_mask"]


class OnTheFlyFeatures:
    """Examples whose hidden states the target computes as training reaches them."""

    def __init__(self, target: LlamaModel, examples: list[Example]):
        self.target, self.examples = target, examples

    def __len__(self) -> int:
        return len(self.examples)

    def sequences(self, seed: int | None, rank: int = 0, world: int = 1, skip: int = 0) -> Iterator[Sequence]:
        """Examples in a seeded order; a skipped example costs nothing."""
        for ex in _share(self.examples, seed, rank, world, skip):
            hidden = target_hidden_states(self.target, ex.token_ids)
            yield hidden, torch.tensor(ex.token_ids), torch.tensor(ex.loss_mask, dtype=torch.uint8)


def feature_tokens_per_second(target: LlamaModel, examples: list[Example], reps: int = 3) -> float:
    """The target's hidden-state throughput on the first few examples (one process)."""
    probe = examples[:reps]
    start = time.perf_counter()
    for ex in probe:
        target_hidden_states(target, ex.token_ids)
    return sum(len(e.token_ids) for e in probe) / (time.perf_counter() - start)


@dataclass
class FeaturePlan:
    """Where features come from in one run, and why."""

    mode: str  # "store" or "on-the-fly"
    reason: str
    bytes_needed: int
    estimate_s: dict[str, float]  # estimated wall time of each mode


def choose_features(
    setting: str,
    num_tokens: int,
    hidden_size: int,
    epochs: int,
    workers: int,
    folder: Path,
    feature_rate: float | None = None,
    train_rate: float | None = None,
) -> FeaturePlan:
    """Store or compute on the fly: a `setting` other than "auto" is obeyed; "auto" computes on the fly
    when stored shards would take more than half the free disk, else picks the faster estimate
    (stored: one target pass in this process, then `epochs` of training over the workers; on the fly:
    `epochs` of target pass + training, both spread over the workers)."""
    need = num_tokens * hidden_size * 2  # bf16
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    est: dict[str, float] = {}
    if feature_rate and train_rate:
        est["store"] = num_tokens / feature_rate + epochs * num_tokens / (workers * train_rate)
        est["on-the-fly"] = epochs * num_tokens * (1 / feature_rate + 1 / train_rate) / workers
    if setting in ("store", "on-the-fly"):
        return FeaturePlan(setting, "as set", need, est)
    if setting != "auto":
        raise ValueError(f"features must be 'auto', 'store' or 'on-the-fly', not {setting!r}")
    if need > free // 2:
        return FeaturePlan("on-the-fly", f"shards need {need / 1e9:.1f} GB of {free / 1e9:.1f} GB free", need, est)
    if est:
        mode = min(est, key=est.get)
        return FeaturePlan(mode, f"faster by estimate ({est['store']:.0f} s vs {est['on-the-fly']:.0f} s)", need, est)
    return FeaturePlan("store", "disk allows it", need, est)


def stored_features(target: LlamaModel, examples: list[Example], folder: Path) -> StoredFeatures:
    """Shards for `examples` in `folder`, written (or finished, after an interruption) as needed."""
    write_features(target, examples, folder, len(examples))
    return StoredFeatures(folder)
