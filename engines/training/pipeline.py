"""One command from a target checkpoint and a data source to a trained drafter with its model card.

    python -m engines.training --kind lyanna --source sharegpt --num 2000 --out runs/lyanna
    python -m engines.training --model path/to/llama --source chats.jsonl --workers 4 --out runs/mine

    python -m engines.training --kind lyanna --num 17671 --skip 8000 --init-from runs/lyanna/checkpoint \
        --out runs/lyanna-more    # go on training a drafter on conversations it has not seen

Stages, each resumable from what `--out` already holds (run the same command again to continue):
1. data: conversations of the train and validation splits rendered with the target's chat template
   (`sharegpt` as shipped, `self` = the target's own answers, or a JSONL file of chats), kept in
   `data/{train,val}.jsonl`;
2. features: the target's hidden states stored in shards (`features/`) or computed on the fly during
   training (`--features auto` decides from free disk and measured speeds);
3. training: in this process (`--workers 0`) or data-parallel on Ray Train workers (`--workers N`),
   with a progress bar, validation every `--eval-every` steps and checkpoints;
4. the drafter folder `checkpoint/`: weights, config, hot tokens, learning curve (`curve.jsonl`,
   `curves.png`) and model card (`README.md`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shlex
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engines.drafters.checkpoint import new_draft_model, read_config, save_hot_tokens
from engines.drafters.lyanna_model import LyannaConfig
from engines.drafters.token_info import tokens_by_frequency
from engines.engine_config import add_engine_args
from engines.training.data import (
    Example,
    ExampleFile,
    chat_file_examples,
    self_distilled_examples,
    sharegpt_examples,
    target_hidden_states,
)
from engines.training.features import (
    OnTheFlyFeatures,
    StoredFeatures,
    choose_features,
    feature_tokens_per_second,
    stored_features,
)
from engines.training.report import plot_curves, write_model_card
from engines.training.train_drafter import Progress, Run, TrainConfig, tokens_per_second, train, training_weights

log = logging.getLogger(__name__)


# ---- data ---------------------------------------------------------------------------------------
def prepare_examples(args: argparse.Namespace, split: str, num: int, out: Path) -> list[Example]:
    """The split's rendered conversations (extended to `num` after an interruption), keeping only
    those with an answer token inside the training window."""
    file = ExampleFile(out / "data" / f"{split}.jsonl")
    have = file.read()
    skip = args.skip if split == "train" else 0
    num = max(0, num - skip)
    if len(have) < num:
        from engines.engine import EngineConfig, LLMEngine

        if args.source == "self":
            engine = LLMEngine(
                EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.gen_batch, drafter="none")
            )
            log.info("self-distilling %d %s answers", num - len(have), split)
            source = self_distilled_examples(
                engine,
                split,
                num - len(have),
                args.max_new_tokens,
                args.gen_batch,
                skip={e.id for e in have},
                skip_first=skip,
            )
            skip = 0  # the prompts were skipped before generating
        else:
            from engines.loader import resolve_checkpoint
            from engines.tokenizer import Tokenizer

            tokenizer = Tokenizer(resolve_checkpoint(args.model))
            if args.source in ("sharegpt", "sharegpt-parts"):
                source = sharegpt_examples(tokenizer, split, args.max_seq, parts=args.source == "sharegpt-parts")
            else:
                source = chat_file_examples(tokenizer, args.source, split, args.max_seq)
        done = {e.id for e in have}
        source = itertools.islice(source, skip, None)  # the source's order is fixed: skip the first ones
        fresh = (e for e in source if e.id not in done)  # the bar counts only what is added
        have = file.extend(_progress(fresh, num, len(have), f"{split} data"), num)
    cut = [Example(e.id, e.token_ids[: args.max_seq], e.loss_mask[: args.max_seq]) for e in have[:num]]
    return [e for e in cut if any(e.loss_mask[2:])]  # an answer token the drafter can learn to predict


def _progress(items, total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(items, total=total, initial=initial, desc=desc, unit="conv", dynamic_ncols=True)


def data_summary(source: str, train: list[Example], val: list[Example], max_seq: int) -> dict[str, Any]:
    """Counts for the model card."""
    return {
        "source": source,
        "train_examples": len(train),
        "train_tokens": sum(min(len(e.token_ids), max_seq) for e in train),
        "train_answer_tokens": sum(sum(e.loss_mask[:max_seq]) for e in train),
        "val_examples": len(val),
    }


def answer_token_counts(examples: list[Example]) -> Counter:
    """How often each token appears in the answers (what the hot vocabulary is chosen from)."""
    counts: Counter = Counter()
    for e in examples:
        counts.update(t for t, m in zip(e.token_ids, e.loss_mask, strict=True) if m)
    return counts


# ---- the recipe every worker builds from -----------------------------------------------------------
def build(recipe: dict[str, Any]):
    """(drafter, train data, val data, TrainConfig, card) from a recipe (run on each worker)."""
    from engines.loader import load_model

    device = recipe["device"]
    if device == "cuda" and recipe["workers"]:  # a Ray Train GPU worker's own device
        import ray.train.torch

        device = str(ray.train.torch.get_device())
    frozen = load_model(recipe["model"], "float32", device, quantization="none").model  # embedding, head, norm
    torch.manual_seed(recipe["train"]["seed"])  # the same initial drafter on every worker and every run
    model = new_drafter(recipe, frozen).to(device)
    if recipe["init_from"]:  # fine-tuning: an earlier drafter's weights (a run checkpoint, if any, wins later)
        weights = grown_token_info(training_weights(recipe["init_from"]), model)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - {"chain_embed"}:  # a chain embedding is new when --chain-fusion adds it
            raise RuntimeError(f"--init-from weights do not fit: missing {missing}, unexpected {unexpected}")
    out = Path(recipe["out"])
    target = None
    if recipe["features"] != "store":
        target = load_model(recipe["model"], recipe["dtype"], device, quantization=recipe["quantization"]).model

    def source(split: str):
        if target is None:
            return StoredFeatures(out / "features" / split)
        keep = set(recipe[f"{split}_ids"])
        examples = [e for e in ExampleFile(out / "data" / f"{split}.jsonl").read() if e.id in keep]
        return OnTheFlyFeatures(target, examples)

    return model, source("train"), source("val"), TrainConfig(**recipe["train"]), recipe["card"]


def grown_token_info(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`weights` with a lower token-info rank than `model`'s padded up to it: W1's new columns as freshly
    initialised, W2's new rows zero, so the offsets start equal to the earlier drafter's."""
    info = getattr(model, "token_info", None)
    w1, w2 = weights.get("token_info.w1"), weights.get("token_info.w2")
    if info is None or w1 is None or w2 is None or w1.shape[1] >= info.w1.shape[1]:
        return weights
    extra = info.w1.shape[1] - w1.shape[1]
    fresh = info.w1.detach()[:, w1.shape[1] :].to(w1.dtype)
    return weights | {
        "token_info.w1": torch.cat([w1, fresh], dim=1),
        "token_info.w2": torch.cat([w2, w2.new_zeros(extra, w2.shape[1])]),
    }


def new_drafter(recipe: dict[str, Any], target) -> torch.nn.Module:
    """An untrained drafter of the recipe's kind and settings over a target model."""
    hot = torch.tensor(sorted(recipe["hot_tokens"])) if recipe["hot_tokens"] else None
    return new_draft_model(recipe["kind"], LyannaConfig(target.cfg, **recipe["draft"]), target, hot)


def hot_vocabulary(counts: Counter, size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent answer tokens, padded with the lowest other ids on a small data set."""
    hot = tokens_by_frequency(counts, size)
    taken = set(hot)
    return hot + [t for t in range(vocab_size) if t not in taken][: size - len(hot)]


def finish(checkpoint: Path, progress: Progress, card: dict[str, Any], counts: Counter) -> None:
    """Complete the drafter folder: hot tokens, learning-curve plot and model card."""
    save_hot_tokens(checkpoint, counts)
    plot_curves({card["kind"]: progress.curve}, checkpoint / "curves.png", f"{card['kind']} drafter, {card['target']}")
    write_model_card(checkpoint, card, progress)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (every TrainConfig field is an option)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["lyanna", "eagle"], default="lyanna")
    add_engine_args(ap, ["model", "dtype", "quantization"])
    ap.add_argument(
        "--source",
        default="sharegpt",
        help="'sharegpt', 'sharegpt-parts' (its records that continue a conversation), 'self' (the target's "
        "answers) or a chats .jsonl",
    )
    ap.add_argument("--num", type=int, default=2000, help="training conversations")
    ap.add_argument("--val-num", type=int, default=64, help="held-out conversations")
    ap.add_argument(
        "--skip", type=int, default=0, help="leave out the source's first N training conversations (of --num)"
    )
    ap.add_argument(
        "--init-from", default=None, help="a drafter checkpoint of --kind to start from (fine-tuning), else random"
    )
    ap.add_argument("--out", required=True, help="run folder (rerun the command to resume)")
    ap.add_argument("--features", choices=["auto", "store", "on-the-fly"], default="auto")
    ap.add_argument("--workers", type=int, default=0, help="Ray Train workers (0: train in this process)")
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="train on GPUs (one per Ray Train worker)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length (--source self)")
    ap.add_argument("--gen-batch", type=int, default=16, help="generation batch (--source self)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="hot-vocabulary LM head (0: full vocabulary)")
    ap.add_argument("--rank", type=int, default=64, help="token-info rank")
    ap.add_argument("--no-fusion", action="store_true")
    ap.add_argument("--no-token-info", action="store_true")
    ap.add_argument(
        "--chain-fusion",
        action="store_true",
        help="Lyanna: steps >= 2 read fuse(h, a learned token-free embedding) (added when fine-tuning one without)",
    )
    for name, default in asdict(TrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return ap.parse_args(argv)


def init_drafter_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The `--init-from` drafter's hot vocabulary and training record, with its architecture switches
    copied onto `args` (a fine-tuned drafter keeps its shape); None without `--init-from`."""
    if not args.init_from:
        return None
    init = Path(args.init_from).resolve()
    if init.is_relative_to(Path(args.out).resolve()):
        raise SystemExit(f"--init-from {init} lies inside --out {args.out}: start from another run's drafter")
    meta = read_config(init)
    if meta.get("kind", "lyanna") != args.kind:
        raise SystemExit(f"--init-from {init} holds a {meta.get('kind')!r} drafter, not {args.kind!r}")
    draft = meta.get("draft", {})
    shape = {  # a larger --rank grows the token info (grown_token_info); the rest is the drafter's
        "rank": max(draft.get("token_info_rank", args.rank), args.rank),
        "no_fusion": not draft.get("use_fusion", True),
        "no_token_info": not draft.get("use_token_info", True),
        "draft_vocab": draft.get("draft_vocab") or 0,
    }
    defaults = parse_args(["--out", args.out])
    for name, value in shape.items():
        if getattr(args, name) not in (value, getattr(defaults, name)):
            flag = "--" + name.replace("_", "-")
            log.warning("%s %s ignored: the --init-from drafter has %s", flag, getattr(args, name), value)
        setattr(args, name, value)
    args.chain_fusion = args.chain_fusion or draft.get("chain_fusion", False)  # kept, or added now
    d2t = load_file(str(init / "model.safetensors")).get("d2t")
    record = {k: meta[k] for k in ("data", "command", "init_from") if k in meta}
    curve = init / "curve.jsonl"
    if curve.exists() and curve.read_text().strip():  # how far it had trained
        record["tokens"] = json.loads(curve.read_text().strip().splitlines()[-1])["tokens"]
    return {"hot_tokens": None if d2t is None else d2t.tolist(), "card": {"checkpoint": str(init)} | record}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every stage; print and return the final validation point."""
    args = parse_args(argv)
    if args.chain_fusion and (args.kind != "lyanna" or args.no_fusion):
        raise SystemExit("--chain-fusion is Lyanna's and reads the fuse projection: not with --kind eagle, --no-fusion")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    init = init_drafter_settings(args)  # before the data: a wrong --init-from fails at once
    train_ex = prepare_examples(args, "train", args.num, out)
    val_ex = prepare_examples(args, "val", args.val_num, out)
    if not train_ex or not val_ex:
        raise SystemExit(f"no usable conversations from {args.source!r} (train {len(train_ex)}, val {len(val_ex)})")
    checkpoint = out / "checkpoint"
    if (checkpoint / "config.json").exists():
        before = json.loads((checkpoint / "config.json").read_text()).get("workers", 1)
        if before != (args.workers or 1):
            raise SystemExit(f"{out} was trained with {before} worker(s): resume it with --workers {before}")
    counts = answer_token_counts(train_ex)
    vocab = args.draft_vocab or None
    from engines.loader import load_model

    device = "cuda" if args.gpu else "cpu"
    target = load_model(args.model, args.dtype, device, quantization=args.quantization)
    hot = hot_vocabulary(counts, vocab, target.config.vocab_size) if vocab else None
    if init is not None:  # the earlier drafter's head rows, so its weights keep their meaning
        hot = init["hot_tokens"]
    workers = max(1, args.workers)
    rates: dict[str, float] = {}
    recipe = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": device,
        "workers": args.workers,
        "kind": args.kind,
        "draft": {
            "token_info_rank": args.rank,
            "use_fusion": not args.no_fusion,
            "use_token_info": not args.no_token_info,
            "draft_vocab": vocab,
            "chain_fusion": args.chain_fusion,
        },
        "hot_tokens": hot,
        "init_from": str(Path(args.init_from).resolve()) if args.init_from else None,
        "out": str(out.resolve()),
        "train_ids": [e.id for e in train_ex],
        "val_ids": [e.id for e in val_ex],
        "train": asdict(cfg),
    }
    if args.features == "auto":  # measure both sides of the choice on this machine
        probe = new_drafter(recipe, target.model).to(device)
        rates["features"] = feature_tokens_per_second(target.model, train_ex)
        ex = train_ex[0]
        hidden = target_hidden_states(target.model, ex.token_ids).float()
        rates["train"] = tokens_per_second(
            probe.float(), (hidden, torch.tensor(ex.token_ids), torch.tensor(ex.loss_mask)), cfg
        )
        del probe
    summary = data_summary(args.source, train_ex, val_ex, args.max_seq)
    stored = out / "features" / "train" / "index.json"
    if args.features == "auto" and stored.exists() and len(StoredFeatures(stored.parent)) == len(train_ex):
        args.features = "store"  # a finished earlier run's shards: reuse them
    plan = choose_features(
        args.features,
        summary["train_tokens"],
        target.config.hidden_size,
        args.epochs,
        workers,
        out,
        rates.get("features"),
        rates.get("train"),
    )
    log.info("features: %s (%s); measured rates %s", plan.mode, plan.reason, rates)
    if plan.mode == "store":
        stored_features(
            target.model, _progress(train_ex, len(train_ex), 0, "train features"), out / "features" / "train"
        )
        stored_features(target.model, val_ex, out / "features" / "val")
    del target
    recipe["features"] = plan.mode
    recipe["card"] = {
        "kind": args.kind,
        "target": args.model or "SmolLM2-135M-Instruct (embedded)",
        "data": summary,
        "features": {"mode": plan.mode, "reason": plan.reason, "rates_tokens_per_s": rates},
        "workers": args.workers or 1,
        "init_from": init and init["card"],
        "command": "python -m engines.training " + shlex.join(sys.argv[1:] if argv is None else argv),
    }
    if args.workers:
        from engines.training.ray_train import fit_on_ray

        progress = fit_on_ray(
            build, recipe, args.workers, out / "ray", "drafter", checkpoint, args.gpu, args.threads_per_worker
        )
    else:
        model, data, val, cfg, card = build(recipe)
        progress = train(model, data, cfg, val, Run(checkpoint), card, progress_bar=True)
    finish(checkpoint, progress, recipe["card"] | {"train": recipe["train"]}, counts)
    final = progress.curve[-1] if progress.curve else {}
    print(json.dumps({"checkpoint": str(checkpoint), "step": progress.step} | final))
    return final
