"""Train a hidden-state drafter (Lyanna, or the EAGLE baseline) by distillation from the target.

    loss = step_decay^(s-1) * (alpha * MSE(h, H) + beta * CE(softmax(l'), softmax(L)))

over every unrolled step s of every chain anchor j: h = h^s_j predicts the target state H_{j+s},
l' = lm_head(h) + token_info(t_{j+s}) (Lyanna; EAGLE has no token info) and L = lm_head(H_{j+s})
(recomputed from the frozen head, so features are hidden states only). Positions count where the
token H_{j+s} predicts is an assistant token. Adam with a linearly decaying learning rate.

Both kinds train with the same unroll: each step runs on the previous step's own prediction, as
at inference (EAGLE's steps also take the true next token, which is what an accepted path holds).

The loop runs alone or as one of several data-parallel workers (`Run`): each worker takes every
world-th sequence, gradients are averaged over workers once per optimizer step, and rank 0
validates, records the learning curve and writes checkpoints. A checkpoint holds the weights, the
optimizer, the step and the curve, so a stopped run resumes at the step it last saved.
`python -m engines.training` is the command that drives it (data, features, training, card).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engines.drafters.checkpoint import SHIPPED_DTYPE, save_draft_model
from engines.drafters.lyanna_model import LyannaDraftModel

log = logging.getLogger(__name__)

# One training sequence: the target's hidden states [n, hidden], token ids [n], loss mask [n].
Sequence = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class TrainConfig:
    """Optimisation settings (defaults follow the paper where it gives them)."""

    steps: int = 3  # unrolled draft steps
    alpha: float = 1.0  # hidden-state regression weight
    beta: float = 0.1  # distribution distillation weight
    step_decay: float = 1.0  # unrolled step s weighs step_decay ** (s - 1) (1: every step alike)
    chain_alpha: float = -1.0  # the regression weight at steps >= 2 (negative: alpha)
    lr: float = 1e-3
    epochs: int = 1
    max_seq: int = 512  # tokens per training sequence (longer examples are cut)
    batch_seqs: int = 4  # sequences per optimizer step over all workers (rounded down to a multiple of them)
    seed: int = 0
    eval_every: int = 100  # optimizer steps between validations (points of the learning curve)
    checkpoint_every: int = 100  # optimizer steps between checkpoints
    val_limit: int = 64  # validation sequences
    max_examples: int = 0  # training sequences per epoch (0: all)
    stop_after: int = 0  # optimizer steps this invocation takes before it checkpoints and stops (0: none)


class SequenceSource(Protocol):
    """Training sequences with the target's hidden states, in a seeded order, split across workers."""

    def __len__(self) -> int: ...

    def sequences(self, seed: int | None, rank: int = 0, world: int = 1, skip: int = 0) -> Iterator[Sequence]:
        """This worker's share (every world-th sequence of the seeded order), after skipping `skip` of
        them without computing their features."""
        ...


# ---- loss and validation ------------------------------------------------------------------------
def _step_logits(model: LyannaDraftModel, h: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    logits = model.logits(h)
    if model.token_info is not None:
        logits = logits + model.token_info(prev_tokens).float()
    return logits


def distill_loss(
    model: LyannaDraftModel,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int,
    alpha: float,
    beta: float,
    step_decay: float = 1.0,
    chain_alpha: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one sequence and, per step, the share of its positions where the drafter's top-1
    equals the target's over the drafter's vocabulary (a 0-d tensor each, not synchronised). Step s's
    loss weighs `step_decay ** (s - 1)`: a later step's draft counts only where the earlier ones were
    accepted. `chain_alpha` (None or negative: `alpha`) weighs the regression at steps >= 2, whose target
    state follows a token the drafter does not read."""
    n = hidden.shape[0]
    later_alpha = alpha if chain_alpha is None or chain_alpha < 0 else chain_alpha
    preds = model.unroll(hidden, tokens, steps)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats: dict[str, torch.Tensor] = {}
    for s, h in enumerate(preds, 1):
        anchors = torch.arange(n - 1, device=hidden.device)
        idx = anchors[anchors + s + 1 < n]  # H_{j+s} predicts t_{j+s+1}, which must exist
        idx = idx[loss_mask[idx + s + 1].bool()]
        if idx.numel() == 0:
            continue
        h_s, target = h[idx], hidden[idx + s]
        mse = F.mse_loss(h_s.float(), target.float())
        logits = _step_logits(model, h_s, tokens[idx + s])
        with torch.no_grad():  # over the drafter's (possibly hot) vocabulary: renormalised target
            target_probs = model.logits(target).softmax(-1)
        ce = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        total = total + step_decay ** (s - 1) * ((alpha if s == 1 else later_alpha) * mse + beta * ce)
        stats[f"acc{s}"] = (logits.argmax(-1) == target_probs.argmax(-1)).float().mean().detach()
    return total, stats


@torch.no_grad()
def chain_matches(
    model: LyannaDraftModel,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int,
    target_top1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the chains lying inside an answer, two [anchors, steps] bool tensors: whether the drafter's
    top-1 token at each step equals the target's top-1 (over the full vocabulary), and whether the data
    goes on with that token (so the next step's context is the one a greedy chain would have)."""
    n = hidden.shape[0]
    preds = model.unroll(hidden, tokens, steps)
    anchors = torch.arange(max(0, n - steps - 1), device=hidden.device)
    inside = torch.ones_like(anchors, dtype=torch.bool)
    for s in range(1, steps + 1):
        inside &= loss_mask[anchors + s + 1].bool()
    idx = anchors[inside]
    matches, follows = [], []
    for s, h in enumerate(preds, 1):
        top = _step_logits(model, h[idx], tokens[idx + s]).argmax(-1)
        if model.d2t is not None:
            top = model.d2t[top]
        matches.append(top == target_top1[idx + s])
        follows.append(tokens[idx + s + 1] == target_top1[idx + s])
    return torch.stack(matches, dim=1), torch.stack(follows, dim=1)


class Validator:
    """Held-out loss, per-step top-1 agreement and greedy-chain conditional acceptance.

    `cond{s}` = P(step s's top-1 equals the target's | steps 1..s-1 did), over chains inside answers
    whose earlier steps' tokens are also the data's (on other data the target's greedy path is not
    known); `chain_tokens` = 1 + expected accepted tokens of a width-1 chain (tokens per target
    forward). The target's own top-1 is computed once per sequence and kept."""

    def __init__(self, data: SequenceSource, cfg: TrainConfig):
        self.data, self.cfg = data, cfg
        self._held: list[tuple[Sequence, torch.Tensor]] = []  # sequences with the target's top-1

    @torch.no_grad()
    def __call__(self, model: LyannaDraftModel) -> dict[str, float]:
        cfg = self.cfg
        was_training = model.training
        model.eval()
        losses: list[float] = []
        accs: dict[str, list[float]] = {}
        matches = []
        if not self._held:  # features computed once (on the fly they cost a target forward)
            for k, (h, t, m) in enumerate(self.data.sequences(None)):
                if k == cfg.val_limit:
                    break
                device = model.embed.device
                h, t, m = (x[: cfg.max_seq].to(device) for x in (h, t.long(), m))
                top1 = (h.float() @ model.lm_head_full.float().T).argmax(-1)
                self._held.append(((h.to(torch.bfloat16), t, m), top1))
        for (h, t, m), top1 in self._held:
            h = h.float()
            with torch.autocast(h.device.type, dtype=torch.bfloat16):
                loss, stats = distill_loss(
                    model, h, t, m, cfg.steps, cfg.alpha, cfg.beta, cfg.step_decay, cfg.chain_alpha
                )
                matches.append(chain_matches(model, h, t, m, cfg.steps, top1))
            losses.append(loss.item())
            for key, v in stats.items():
                accs.setdefault(key, []).append(v.item())
        model.train(was_training)
        out = {"val_loss": sum(losses) / max(1, len(losses))}
        out |= {k: sum(v) / len(v) for k, v in accs.items()}
        both = [torch.cat(x) for x in zip(*matches, strict=True)]
        return out | acceptance_by_step(*both)


def acceptance_by_step(matches: torch.Tensor, follows: torch.Tensor | None = None) -> dict[str, float]:
    """Conditional acceptance per step and tokens per forward of greedy chains, from [chains, steps]
    matches; a chain counts at step s+1 only if it matched at s and (`follows`) the data went on with
    the matched token."""
    out: dict[str, float] = {}
    reached = torch.ones(matches.shape[0], dtype=torch.bool, device=matches.device)
    through, expected = 1.0, 1.0  # P(a chain accepts steps 1..s), 1 + sum of those
    for s in range(matches.shape[1]):
        cond = (reached & matches[:, s]).sum().item() / max(1, reached.sum().item())
        out[f"cond{s + 1}"] = cond
        through *= cond
        expected += through
        reached = reached & matches[:, s] & (follows[:, s] if follows is not None else True)
    out["chain_tokens"] = expected
    return out


# ---- where the loop runs ------------------------------------------------------------------------
class Run:
    """One process training alone, checkpointing to a folder (`ray_train.RayRun` is a Ray Train worker's)."""

    rank = 0
    world = 1

    def __init__(self, checkpoint_dir: str | Path):
        self.dir = Path(checkpoint_dir)

    def restore(self) -> Path | None:
        """The folder of the latest checkpoint, if there is one."""
        for folder in (self.dir, self._old):  # the old one stands in if a save was cut between its renames
            if (folder / "train_state.pt").exists():
                return folder
        return None

    @property
    def _old(self) -> Path:
        return self.dir.with_name(self.dir.name + ".old")

    def share_weights(self, params: list[torch.nn.Parameter]) -> None:
        """Give every worker rank 0's weights (nothing to do alone)."""

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average gradients over workers (nothing to do alone)."""

    def total(self, count: int) -> int:
        """The sum of a count over workers."""
        return count

    def save(self, write, metrics: dict[str, float]) -> None:
        """Persist a checkpoint: `write(folder)` fills a new folder, which then replaces the last one
        whole (an interruption leaves one complete checkpoint, never a mix of two)."""
        tmp = self.dir.with_name(self.dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        shutil.rmtree(self._old, ignore_errors=True)
        if self.dir.exists():
            self.dir.rename(self._old)
        tmp.rename(self.dir)
        shutil.rmtree(self._old, ignore_errors=True)


@dataclass
class Progress:
    """Where a run stands: optimizer steps taken and the learning curve so far."""

    step: int = 0
    curve: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0  # training wall time over all invocations
    tokens: int = 0  # training tokens consumed (all workers)
    layout: dict[str, int] = field(default_factory=dict)  # workers, sequences per step and per epoch


def _write_checkpoint(model, opt, progress: Progress, cfg: TrainConfig, card: dict):
    def write(folder: Path) -> None:
        # The drafter's weights in the shipped format (bf16); train_state.pt keeps them at training
        # precision beside the optimizer, so a resumed run continues exactly where it stopped.
        save_draft_model(model, folder, {"train": asdict(cfg)} | card, dtype=SHIPPED_DTYPE)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": asdict(progress)}
        torch.save(state, folder / "train_state.pt")
        (folder / "curve.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress.curve))

    return write


def training_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """A drafter folder's weights at training precision: train_state.pt's copy when the folder is a
    training checkpoint that has one, else model.safetensors (bf16 for a shipped drafter)."""
    state_path = Path(folder) / "train_state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if "model" in state:
            return state["model"]
    return load_file(str(Path(folder) / "model.safetensors"))


def _restore(model, opt, folder: Path) -> Progress:
    model.load_state_dict(training_weights(folder), strict=False)
    state = torch.load(folder / "train_state.pt", weights_only=False)
    opt.load_state_dict(state["optimizer"])
    return Progress(**state["progress"])


def train(
    model: LyannaDraftModel,
    data: SequenceSource,
    cfg: TrainConfig,
    val: SequenceSource | None = None,
    run: Run | None = None,
    card: dict | None = None,
    progress_bar: bool = False,
) -> Progress:
    """Train (resuming from the run's latest checkpoint); returns where the run stands at the end.

    `card` is written into every checkpoint's config.json beside the settings (data, target, command)."""
    run = run or Run("checkpoint")
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    opt = torch.optim.Adam(params, lr=cfg.lr)
    per_rank_batch = max(1, cfg.batch_seqs // run.world)
    per_epoch = min(len(data), cfg.max_examples or len(data)) // run.world  # this worker's sequences
    steps_per_epoch = per_epoch // per_rank_batch
    total = steps_per_epoch * cfg.epochs
    if total == 0:
        raise ValueError(f"{len(data)} sequences make no optimizer step of {cfg.batch_seqs} over {run.world} workers")
    layout = {"workers": run.world, "batch_seqs": per_rank_batch * run.world, "epoch_seqs": per_epoch * run.world}
    restored = run.restore()
    progress = _restore(model, opt, restored) if restored else Progress(layout=layout)
    if restored:
        if progress.layout != layout:  # the step count would point at other data and another learning rate
            raise ValueError(
                f"the checkpoint in {restored} was trained with {progress.layout}, this run has {layout}: "
                "resume with the same workers, --batch-seqs and data, or start a new run folder"
            )
        log.info("resumed at step %d of %d", progress.step, total)
    run.share_weights(params)
    first_step = progress.step  # the learning rate decays linearly from lr at step 0 to 0 at the last
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - (first_step + k) / total))
    validator = Validator(val, cfg) if val is not None and run.rank == 0 else None
    card = card or {}
    bar = None
    if progress_bar and run.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=progress.step, unit="step", desc=f"training {model.kind}", dynamic_ncols=True)
    start = time.monotonic()
    wall_before = progress.wall_s

    def checkpoint(metrics: dict[str, float]) -> None:
        progress.wall_s = wall_before + time.monotonic() - start
        run.save(_write_checkpoint(model, opt, progress, cfg, card), metrics)

    def validate(train_loss: float | None) -> dict[str, float]:
        point = {"step": progress.step, "tokens": progress.tokens, "wall_s": wall_before + time.monotonic() - start}
        point |= {} if train_loss is None else {"train_loss": train_loss}
        if validator is not None:
            point |= validator(model)
        progress.curve.append(point)
        if validator is not None:
            log.info("step %d: %s", progress.step, " ".join(f"{k} {v:.4g}" for k, v in point.items()))
        return point

    if progress.step == 0 and not progress.curve:
        validate(None)  # the untrained drafter: the curve's first point
    model.train()
    recent: list[float] = []
    taken = saved_at = 0

    def batches() -> Iterator[list[Sequence]]:
        while True:  # from the current step on, across epochs; each epoch has its own seeded order
            epoch, in_epoch = divmod(progress.step, steps_per_epoch)
            seqs = data.sequences(cfg.seed + epoch, run.rank, run.world, skip=in_epoch * per_rank_batch)
            for _ in range(in_epoch, steps_per_epoch):
                yield [next(seqs) for _ in range(per_rank_batch)]

    stream = batches()
    while progress.step < total and not (cfg.stop_after and taken >= cfg.stop_after):
        opt.zero_grad(set_to_none=False)
        loss_sum, tokens = 0.0, 0
        for h, t, m in next(stream):
            h, t, m = (x[: cfg.max_seq].to(device) for x in (h.float(), t.long(), m))
            with torch.autocast(h.device.type, dtype=torch.bfloat16):
                loss, _ = distill_loss(model, h, t, m, cfg.steps, cfg.alpha, cfg.beta, cfg.step_decay, cfg.chain_alpha)
            if loss.requires_grad:  # a sequence whose answer lies past max_seq has nothing to learn
                (loss / per_rank_batch).backward()
            loss_sum += loss.item()
            tokens += t.numel()
        for p in params:  # every worker all-reduces the same tensors, learnt from or not
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        run.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        progress.step += 1
        progress.tokens += run.total(tokens)
        taken += 1
        recent = [*recent[-49:], loss_sum / per_rank_batch]
        metrics = {"step": progress.step, "train_loss": sum(recent) / len(recent)}
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
        if progress.step % cfg.eval_every == 0 or progress.step == total:
            metrics = validate(metrics["train_loss"])
        if progress.step % cfg.checkpoint_every == 0 or progress.step == total:
            checkpoint(metrics)
            saved_at = progress.step
    if taken and saved_at != progress.step:  # stopped between checkpoints (stop_after)
        checkpoint({"step": progress.step, "train_loss": sum(recent) / len(recent)})
    if bar is not None:
        bar.close()
    return progress


def tokens_per_second(model: LyannaDraftModel, seq: Sequence, cfg: TrainConfig, reps: int = 2) -> float:
    """Training tokens per second of one process on a sequence like the data's (forward + backward)."""
    device = model.embed.device
    h, t, m = (x[: cfg.max_seq].to(device) for x in (seq[0].float(), seq[1].long(), seq[2]))
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        with torch.autocast(h.device.type, dtype=torch.bfloat16):
            loss, _ = distill_loss(model, h, t, m, cfg.steps, cfg.alpha, cfg.beta, cfg.step_decay, cfg.chain_alpha)
        if loss.requires_grad:
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return t.numel() / best
