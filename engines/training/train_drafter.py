"""Train a hidden-state drafter (Lyanna, or the EAGLE baseline) by distillation from the target.

    loss = alpha * MSE(h, H) + beta * CE(softmax(l'), softmax(L))

over every unrolled step s of every chain anchor j: h = h^s_j predicts the target state H_{j+s},
l' = lm_head(h) + token_info(t_{j+s}) (Lyanna; EAGLE has no token info) and L = lm_head(H_{j+s})
(recomputed from the frozen head, so shards store hidden states only). Positions count where the
token H_{j+s} predicts is an assistant token. Adam with a linearly decaying learning rate;
checkpoints hold model and optimizer state, so a stopped run resumes where it was.

    python -m engines.training.train_drafter --kind lyanna --data DIR [--val-data DIR] --out DIR --steps 3 --epochs 2

Both kinds train with the same unroll: each step runs on the previous step's own prediction, as
at inference (EAGLE's steps also take the true next token, which is what an accepted path holds).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engines.drafters.checkpoint import new_draft_model, save_draft_model, save_hot_tokens
from engines.drafters.lyanna_model import LyannaConfig, LyannaDraftModel
from engines.drafters.token_info import hot_tokens
from engines.training.data import hot_token_counts, load_shard

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Optimisation settings (defaults follow the paper where it gives them)."""

    steps: int = 4  # unrolled draft steps
    alpha: float = 1.0  # hidden-state regression weight
    beta: float = 0.1  # distribution distillation weight
    lr: float = 3e-4
    epochs: int = 1
    max_seq: int = 512  # tokens per training sequence (longer examples are cut)
    seed: int = 0
    log_every: int = 20
    checkpoint_every: int = 200
    max_examples: int = 0  # training sequences per epoch (0: all), for quick comparisons


def distill_loss(
    model: LyannaDraftModel,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int,
    alpha: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one sequence and per-step top-1 agreement with the target."""
    n = hidden.shape[0]
    preds = model.unroll(hidden, tokens, steps)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats: dict[str, float] = {}
    for s, h in enumerate(preds, 1):
        anchors = torch.arange(n - 1)
        valid = anchors + s + 1 < n  # H_{j+s} predicts t_{j+s+1}, which must exist
        idx = anchors[valid]
        if idx.numel() == 0:
            break
        keep = loss_mask[idx + s + 1].bool()
        idx = idx[keep]
        if idx.numel() == 0:
            continue
        h_s, target = h[idx], hidden[idx + s]
        mse = F.mse_loss(h_s.float(), target.float())
        logits = model.logits(h_s)
        if model.token_info is not None:
            logits = logits + model.token_info(tokens[idx + s]).float()
        with torch.no_grad():  # over the drafter's (possibly hot) vocabulary: renormalised target
            target_probs = model.logits(target).softmax(-1)
        ce = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        total = total + alpha * mse + beta * ce
        stats[f"acc{s}"] = (logits.argmax(-1) == target_probs.argmax(-1)).float().mean().item()
    return total, stats


def iter_sequences(data_dir: str | Path, max_seq: int, seed: int | None):
    """Examples of a feature set (shuffled when seeded), cut to `max_seq` tokens."""
    index = json.loads((Path(data_dir) / "index.json").read_text())
    files = [s["file"] for s in index["shards"]]
    rng = random.Random(seed)
    if seed is not None:
        rng.shuffle(files)
    for f in files:
        examples = load_shard(Path(data_dir) / f)
        if seed is not None:
            rng.shuffle(examples)
        for ex in examples:
            yield ex["hidden"][:max_seq], ex["input_ids"][:max_seq].long(), ex["loss_mask"][:max_seq]


@torch.no_grad()
def evaluate(model: LyannaDraftModel, data_dir: str | Path, cfg: TrainConfig, limit: int = 200) -> dict[str, float]:
    """Mean loss and per-step top-1 agreement on a feature set."""
    losses, accs = [], {}
    for k, (h, t, m) in enumerate(iter_sequences(data_dir, cfg.max_seq, None)):
        if k == limit:
            break
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.device.type == "cpu"):
            loss, stats = distill_loss(model, h.float(), t, m, cfg.steps, cfg.alpha, cfg.beta)
        losses.append(loss.item())
        for key, v in stats.items():
            accs.setdefault(key, []).append(v)
    return {"loss": sum(losses) / max(1, len(losses))} | {k: sum(v) / len(v) for k, v in accs.items()}


def save_checkpoint(
    model: LyannaDraftModel,
    opt: torch.optim.Optimizer,
    out: Path,
    step: int,
    seen: int,
    cfg: TrainConfig,
    extra: dict,
) -> None:
    """A loadable drafter folder (weights + config) with optimizer state and progress beside it:
    `step` optimizer steps taken, `seen` training sequences consumed (some take no step)."""
    save_draft_model(model, out, {"train": asdict(cfg)} | extra)
    torch.save({"optimizer": opt.state_dict(), "step": step, "seen": seen}, out / "train_state.pt")


def train(
    model: LyannaDraftModel, data_dir: str | Path, out: str | Path, cfg: TrainConfig, val_dir: str | Path | None = None
) -> dict[str, float]:
    """Train (resuming from `out` when it holds a checkpoint); returns the last validation metrics."""
    out = Path(out)
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    index = json.loads((Path(data_dir) / "index.json").read_text())
    per_epoch = min(index["num_examples"], cfg.max_examples or index["num_examples"])
    total = per_epoch * cfg.epochs
    step = done = 0
    if (out / "train_state.pt").exists():
        model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
        state = torch.load(out / "train_state.pt", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        step, done = state["step"], state["seen"]
        log.info("resumed at step %d (%d sequences consumed)", step, done)
    first = step  # the learning rate decays linearly from lr at step 0 to 0 at the last step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - (first + k) / max(1, total)))
    start = time.monotonic()
    seen = 0
    for epoch in range(cfg.epochs):
        for k, (h, t, m) in enumerate(iter_sequences(data_dir, cfg.max_seq, cfg.seed + epoch)):
            if k == per_epoch:
                break
            seen += 1
            if seen <= done:
                continue  # consumed before the resume
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.device.type == "cpu"):
                loss, stats = distill_loss(model, h.float(), t, m, cfg.steps, cfg.alpha, cfg.beta)
            if not loss.requires_grad:  # nothing to learn here (e.g. the answer lies past max_seq)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % cfg.log_every == 0:
                log.info(
                    "step %d/%d loss %.4f %s %.0fs",
                    step,
                    total,
                    loss.item(),
                    " ".join(f"{k} {v:.3f}" for k, v in stats.items()),
                    time.monotonic() - start,
                )
            if step % cfg.checkpoint_every == 0:
                save_checkpoint(model, opt, out, step, seen, cfg, {})
    metrics = evaluate(model, val_dir, cfg) if val_dir else {}
    save_checkpoint(
        model, opt, out, step, max(seen, done), cfg, {"val": metrics, "train_wall_s": time.monotonic() - start}
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Train a drafter for the embedded target (or --model) from prepared feature shards."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["lyanna", "eagle"], default="lyanna")
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-data", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="target checkpoint (default: embedded SmolLM2)")
    ap.add_argument("--rank", type=int, default=64, help="token-info rank")
    ap.add_argument("--no-fusion", action="store_true")
    ap.add_argument("--no-token-info", action="store_true")
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="restrict the LM head to the N most frequent assistant tokens of --data",
    )
    for name, default in asdict(TrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from engines.loader import load_model

    target = load_model(args.model, dtype="float32")
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    counts = hot_token_counts(args.data)
    save_hot_tokens(args.out, counts)
    hot = hot_tokens(counts, args.draft_vocab) if args.draft_vocab else None
    draft_cfg = LyannaConfig(
        target.config,
        token_info_rank=args.rank,
        use_fusion=not args.no_fusion,
        use_token_info=not args.no_token_info,
        draft_vocab=args.draft_vocab,
    )
    model = new_draft_model(args.kind, draft_cfg, target.model, hot)
    print(json.dumps(train(model, args.data, args.out, cfg, args.val_data)))


if __name__ == "__main__":
    main()
