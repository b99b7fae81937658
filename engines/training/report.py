"""What a drafter training run leaves beside its weights: the learning-curve plot and the model card."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def plot_curves(curves: dict[str, list[dict[str, float]]], path: str | Path, title: str = "") -> Path:
    """Validation acceptance and loss against training tokens, one line per run and step
    (`curves`: label -> curve points as `train` records them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, tok_ax, loss_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, curve in curves.items():
        xs = [p["tokens"] / 1e6 for p in curve]
        steps = sorted(int(k[4:]) for k in curve[-1] if k.startswith("cond"))
        for s in steps:
            acc_ax.plot(xs, [p.get(f"cond{s}", math.nan) for p in curve], marker=".", label=f"{label} step {s}")
        tok_ax.plot(xs, [p.get("chain_tokens", math.nan) for p in curve], marker=".", label=label)
        loss_ax.plot(xs, [p.get("val_loss", math.nan) for p in curve], marker=".", label=f"{label} val")
        loss_ax.plot(xs, [p.get("train_loss", math.nan) for p in curve], linestyle=":", label=f"{label} train")
    acc_ax.set(xlabel="training tokens (millions)", ylabel="conditional acceptance (greedy chain)", ylim=(0, 1))
    tok_ax.set(xlabel="training tokens (millions)", ylabel="tokens per target forward (chain)")
    loss_ax.set(xlabel="training tokens (millions)", ylabel="distillation loss", yscale="log")
    for ax in (acc_ax, tok_ax, loss_ax):
        ax.grid(alpha=0.3)
        entries = len(ax.get_legend_handles_labels()[1])
        ax.legend(fontsize=7 if entries <= 8 else 5, ncol=1 + entries // 13)  # many runs: columns
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curve_table(curve: list[dict[str, float]]) -> str:
    """The learning curve as a markdown table."""
    steps = sorted(int(k[4:]) for k in curve[-1] if k.startswith("cond")) if curve else []
    head = ["step", "tokens", "wall (min)", "train loss", "val loss", *[f"cond{s}" for s in steps], "chain tokens"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in curve:
        cells = [
            f"{int(p['step'])}",
            f"{int(p['tokens']):,}",
            f"{p['wall_s'] / 60:.1f}",
            f"{p['train_loss']:.3f}" if "train_loss" in p else "–",  # the untrained point has none
            f"{p.get('val_loss', math.nan):.3f}",
            *[f"{100 * p.get(f'cond{s}', math.nan):.1f}%" for s in steps],
            f"{p.get('chain_tokens', math.nan):.3f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def earlier_training(init: dict[str, Any] | None) -> list[str]:
    """Model-card lines for the drafters a fine-tuned one started from (`--init-from`), nearest first."""
    lines = []
    while init:
        data = init.get("data", {})
        lines.append(
            f"- started from `{init.get('checkpoint')}`: {init.get('tokens', 0):,} training tokens on "
            f"{data.get('train_examples', 0):,} {data.get('source', '')} conversations (`{init.get('command', '')}`)"
        )
        init = init.get("init_from")
    return lines


def write_model_card(folder: str | Path, card: dict[str, Any], progress) -> Path:
    """README.md of a drafter checkpoint: what it drafts for, what it was trained on, how, and how well
    (`progress`: the run's `train_drafter.Progress`)."""
    folder = Path(folder)
    curve = progress.curve
    last = curve[-1] if curve else {}
    steps = sorted(int(k[4:]) for k in last if k.startswith("cond"))
    data = card.get("data", {})
    lines = [
        f"# {card.get('kind', 'drafter').capitalize()} drafter for {card.get('target', 'the target')}",
        "",
        "Trained with `python -m engines.training`; load it with "
        f"`EngineConfig(drafter={card.get('kind', 'lyanna')!r}, draft_model=<this folder>)`.",
        "",
        "## Data",
        "",
        f"- source: {data.get('source')} ({data.get('train_examples', 0):,} training conversations, "
        f"{data.get('train_tokens', 0):,} tokens, {data.get('train_answer_tokens', 0):,} of them answer tokens; "
        f"{data.get('val_examples', 0):,} held-out conversations)",
        f"- target features: {card.get('features', {}).get('mode')} ({card.get('features', {}).get('reason')})",
        "",
        "## Training",
        "",
        f"- {progress.step:,} optimizer steps, {progress.tokens:,} tokens, "
        f"{progress.wall_s / 60:.1f} min wall on {card.get('workers', 1)} worker(s)",
        f"- settings: `{json.dumps(card.get('train', {}))}`",
        f"- command: `{card.get('command', '')}`",
        *earlier_training(card.get("init_from")),
        "",
        f"## Validation (held-out split, greedy chains, at step {int(last.get('step', 0)):,})",
        "",
        "Conditional acceptance at step s: the drafter's top-1 equals the target's given steps 1..s-1 did. "
        "Chain tokens: tokens per target forward of a width-1 chain (1 + expected accepted drafts).",
        "",
    ]
    if steps:
        lines += [
            " | ".join(f"step {s}: {100 * last[f'cond{s}']:.1f}%" for s in steps)
            + f" | chain tokens {last.get('chain_tokens', math.nan):.3f}",
            "",
        ]
    lines += ["## Learning curve", "", "![learning curves](curves.png)", "", curve_table(curve), ""]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path


def tokens_before(checkpoint: str | Path) -> int:
    """Training tokens of the drafters a checkpoint was fine-tuned from (`--init-from`), 0 for a fresh one."""
    path = Path(checkpoint) / "config.json"
    init = json.loads(path.read_text()).get("init_from") if path.exists() else None
    total = 0
    while init:
        total += int(init.get("tokens", 0))
        init = init.get("init_from")
    return total


def main(argv: list[str] | None = None) -> None:
    """Plot several runs' learning curves in one figure and print them as one markdown table each; a
    fine-tuned run's points sit at its training tokens plus those of the drafters it started from."""
    import argparse

    ap = argparse.ArgumentParser(description="python -m engines.training.report --run lyanna=runs/lyanna --run ...")
    ap.add_argument("--run", action="append", required=True, help="LABEL=RUN_FOLDER (its checkpoint/curve.jsonl)")
    ap.add_argument("--out", required=True, help="the figure (.png)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    curves = {}
    for spec in args.run:
        label, _, folder = spec.partition("=")
        lines = (Path(folder) / "checkpoint" / "curve.jsonl").read_text().splitlines()
        before = tokens_before(Path(folder) / "checkpoint")
        curves[label] = [p | {"tokens": p["tokens"] + before} for p in map(json.loads, lines)]
    plot_curves(curves, args.out, args.title)
    for label, curve in curves.items():
        print(f"\n{label}\n\n{curve_table(curve)}")


if __name__ == "__main__":
    main()
