"""Data-parallel drafter training on Ray Train: the same loop on N `TorchTrainer` workers.

Each worker builds the target and the drafter from the run's recipe, takes every N-th sequence,
and averages gradients with the others (one all-reduce of the flattened gradients per optimizer
step over torch.distributed, gloo on CPU, NCCL on GPU, and one of the step's token count). Rank 0
validates and reports checkpoints to Ray Train; a run started again with the same storage folder
and name resumes from the latest one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.training.train_drafter import Progress, Run, TrainConfig, train

log = logging.getLogger(__name__)


class RayRun(Run):
    """A Ray Train worker's side of the loop: rank, gradient averaging, checkpoints through Ray."""

    def __init__(self):
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()  # where collectives run: the GPU under NCCL, else the CPU
        self._restored: tempfile.TemporaryDirectory | None = None

    def restore(self) -> Path | None:
        """The latest checkpoint Ray Train holds for this run, copied to a local folder."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        self._restored = tempfile.TemporaryDirectory(prefix="drafter-restore-")
        return Path(checkpoint.to_directory(self._restored.name))

    def share_weights(self, params: list[torch.nn.Parameter]) -> None:
        """Every worker starts from rank 0's weights."""
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Mean of every parameter's gradient over the workers, in one all-reduce."""
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def total(self, count: int) -> int:
        """The sum of a count over the workers."""
        t = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(t)
        return int(t.item())

    def save(self, write, metrics: dict[str, float]) -> None:
        """Every worker reports; rank 0's report carries the checkpoint folder."""
        import ray.train

        metrics = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        if self.rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="drafter-ckpt-") as tmp:
            write(Path(tmp))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _worker(config: dict[str, Any]) -> None:
    """The per-worker training function: build from the recipe, train, report."""
    torch.set_num_threads(config["threads"])
    model, data, val, cfg, card = config["build"](config["recipe"])
    train(model, data, cfg, val, RayRun(), card, progress_bar=False)


def fit_on_ray(
    build: Callable[[dict], tuple],
    recipe: dict[str, Any],
    workers: int,
    storage: Path,
    name: str,
    out: Path,
    use_gpu: bool = False,
    threads: int = 1,
) -> Progress:
    """Train on `workers` Ray Train workers; resume the run `name` under `storage` if it exists; copy
    the final checkpoint to `out` and return its progress.

    `build(recipe)` runs on each worker and returns (drafter, train data, val data, TrainConfig, card)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = not ray.is_initialized()
    if started:  # a cluster when RAY_ADDRESS names one, else a local instance sized for the workers
        ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": workers * threads}), include_dashboard=False)
    try:
        trainer = TorchTrainer(
            _worker,
            train_loop_config={"build": build, "recipe": recipe, "threads": threads},
            # rank 0 validates while the others wait in the next all-reduce: allow it time
            torch_config=TorchConfig(timeout_s=4 * 3600),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": threads}),
            run_config=RunConfig(
                name=name,
                storage_path=str(storage.resolve()),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                failure_config=FailureConfig(max_failures=2),
            ),
        )
        result = trainer.fit()
    finally:
        if started:
            ray.shutdown()
    if result.checkpoint is None:
        raise RuntimeError(f"the Ray Train run {name!r} ended without a checkpoint: {result.error}")
    if out.exists():
        shutil.rmtree(out)
    result.checkpoint.to_directory(str(out))
    state = torch.load(out / "train_state.pt", weights_only=False)
    return Progress(**state["progress"])


__all__ = ["RayRun", "TrainConfig", "fit_on_ray"]
