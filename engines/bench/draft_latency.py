"""Draft-step latency breakdown: Lyanna's one-pass LM head vs a per-step head, Lyanna vs EAGLE.

    python -m engines.bench.draft_latency --prompts FILE.jsonl --num-prompts 4 --depth 3 --width 4 --budget 16

For each prompt, both drafters see the same prefilled context; then, in interleaved rounds, the
pieces of one draft step are timed (median milliseconds over rounds and prompts):

- lyanna.layer: the decoder-layer steps h_1..h_N (context already cached)
- lyanna.head_one_pass: one LM-head GEMM over [h_1..h_N]
- lyanna.head_per_step: N LM-head GEMMs of one row each (what a per-step head would cost)
- lyanna.tree: Algorithm 1 (token info, top-k, pruning) on the logits, as `propose` runs it (batched form)
- lyanna.draft: the whole proposal; eagle.draft: EAGLE-2's whole proposal (one layer forward and one
  LM head per depth over the frontier); eagle.head: its LM-head calls alone (same shapes)
- lyanna.catch_up_batched / lyanna.catch_up_one_by_one: all prompts' requests at once, each with
  `UNREAD` tokens the drafter has not read (as after that many steps without a draft), read in
  one pass vs one request at a time, from the same context each round

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engines.datasets import read_prompt_file
from engines.drafters.token_info import TokenInfoTable
from engines.drafters.token_info_sampling import build_subtrees
from engines.engine import EngineConfig, LLMEngine
from engines.engine_config import add_engine_args
from engines.request import Request
from engines.sampling import SamplingParams
from engines.spec_params import SpecParams


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def draft_pieces(lyanna, eagle, lreq: Request, ereq: Request, spec: SpecParams) -> dict[str, Callable[[], object]]:
    """The timed pieces of one draft step for a request whose context both drafters have cached."""
    m = lyanna.model
    traj = lyanna.trajectory(lreq, spec.depth)
    logits = m.logits(traj)
    root = lreq.token_ids(lreq.num_tokens - 1, lreq.num_tokens)[0]
    frontier_h = traj[:1].expand(spec.width, -1).contiguous()
    info, widths, budget = lyanna.token_info, [spec.width], spec.budget + 1  # budget: nodes kept, root included
    return {
        "lyanna.layer": lambda: lyanna.trajectory(lreq, spec.depth),
        "lyanna.head_one_pass": lambda: m.logits(traj),
        "lyanna.head_per_step": lambda: [m.logits(traj[i : i + 1]) for i in range(spec.depth)],
        "lyanna.tree": lambda: build_subtrees([logits], [root], info, widths, m.d2t)[0].prune(budget),
        "lyanna.draft": lambda: lyanna.propose([lreq], [spec]),
        "eagle.draft": lambda: eagle.propose([ereq], [spec]),
        "eagle.head": lambda: [eagle._top_children(frontier_h, spec.width) for _ in range(spec.depth)],
    }


UNREAD = 3  # tokens per request the catch-up timing leaves unread: a typical decode step's worth


def catch_up_pieces(engine: LLMEngine, requests: list[Request]) -> dict[str, Callable[[], object]]:
    """Reading the unread context of `requests` (prefilled) in one pass vs one by one; each call first
    forgets the K/V of the last `UNREAD` positions (a view, no copy), so it has them to read again."""
    drafter = engine.executor.drafter
    drafter.catch_up(requests)
    states = [drafter.states[req.request_id] for req in requests]
    kept = [st.processed - UNREAD for st in states]

    def forget() -> None:
        for st, n in zip(states, kept, strict=True):
            st.processed = n
            if st.keys is not None:  # the eager layer's cache (the fused layer's is overwritten in place)
                st.keys, st.values = st.keys[:n], st.values[:n]

    def batched() -> None:
        forget()
        drafter.catch_up(requests)

    def one_by_one() -> None:
        forget()
        for req in requests:
            drafter.catch_up([req])

    return {"lyanna.catch_up_batched": batched, "lyanna.catch_up_one_by_one": one_by_one}


def main(argv: list[str] | None = None) -> dict:
    """Time the draft-step pieces and print the medians as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=4)
    add_engine_args(ap, ["spec_depth", "spec_width", "spec_budget", "dtype", "lyanna_token_info_rows"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--lyanna", default=None, help="Lyanna checkpoint (default: the shipped one)")
    ap.add_argument("--eagle", default=None, help="EAGLE checkpoint (default: the shipped one)")
    args = ap.parse_args(argv)
    spec = SpecParams(depth=args.spec_depth, width=args.spec_width, budget=args.spec_budget)

    def engine(drafter: str, checkpoint: str | None) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                dtype=args.dtype,
                drafter=drafter,
                draft_model=checkpoint,
                spec_depth=spec.depth,
                spec_width=spec.width,
                spec_budget=spec.budget,
                lyanna_token_info_rows=args.lyanna_token_info_rows,
            )
        )

    lyanna_engine, eagle_engine = engine("lyanna", args.lyanna), engine("eagle", args.eagle)
    lyanna, eagle = lyanna_engine.executor.drafter, eagle_engine.executor.drafter
    times: dict[str, list[float]] = {}
    records = read_prompt_file(args.prompts)[: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with torch.inference_mode():
        for rec in records:
            lreq = lyanna_engine.add_request(rec["messages"], params, spec=spec)
            ereq = eagle_engine.add_request(rec["messages"], params, spec=spec)
            lyanna_engine.step()  # prefill: both drafters now hold the context's hidden states
            eagle_engine.step()
            lyanna.propose([lreq], [spec])
            eagle.propose([ereq], [spec])  # context K/V cached; what follows is one draft step
            pieces = draft_pieces(lyanna, eagle, lreq, ereq, spec)
            for _ in range(args.rounds):
                for name, fn in pieces.items():
                    times.setdefault(name, []).append(_ms(fn))
            for eng in (lyanna_engine, eagle_engine):
                while eng.has_unfinished():
                    eng.step()
        reqs = [lyanna_engine.add_request(rec["messages"], params, spec=spec) for rec in records]
        lyanna_engine.step()  # one prefill step for all of them (the default token budget holds them)
        pieces = catch_up_pieces(lyanna_engine, [r for r in reqs if r.num_computed_tokens == r.num_tokens - 1])
        for _ in range(args.rounds):
            for name, fn in pieces.items():
                times.setdefault(name, []).append(_ms(fn))
        while lyanna_engine.has_unfinished():
            lyanna_engine.step()
    result = {name: statistics.median(v) for name, v in times.items()}
    result["catch_up_batched_vs_one_by_one"] = result["lyanna.catch_up_batched"] / result["lyanna.catch_up_one_by_one"]
    result["lyanna_vs_eagle_draft"] = result["lyanna.draft"] / result["eagle.draft"]
    result["head_one_pass_vs_per_step"] = result["lyanna.head_one_pass"] / result["lyanna.head_per_step"]
    info = lyanna.token_info
    result["token_info"] = "table" if isinstance(info, TokenInfoTable) else "dense" if info is not None else "none"
    result["token_info_bytes"] = getattr(info, "nbytes", 0)
    result["token_info_table_rows"] = getattr(info, "num_hot", 0)
    result |= {"depth": args.spec_depth, "width": args.spec_width, "budget": args.spec_budget, "dtype": args.dtype}
    for name, v in result.items():
        print(f"{name:28s} {v:.3f}" if isinstance(v, float) else f"{name:28s} {v}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
