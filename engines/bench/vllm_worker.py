"""vLLM (CPU build) serving `engines.bench` waves over JSON lines; runs in vLLM's own virtual environment.

    VENV/bin/python -P engines/bench/vllm_worker.py     (started by engines/bench/vllm_peer.py)

It imports only the standard library and vLLM (the project's packages are not installed there). The
first stdin line is the set-up (`model`, `dtype`, `max_num_seqs`, `max_model_len`, `seed`,
`enable_prefix_caching`, `llm_kwargs`); it answers `{"ready": ...}` with vLLM's version and settings.
Then each line is a wave (`prompts` as token ids, `max_new_tokens`, `temperature`, `seed`), answered
with the new token ids and the clocks, measured here as our engine measures its own: the wall time from
adding the requests to the last token, and the decode-only part after the step at which every request
has its first token (the tokens emitted after it over the time after it). Requests are added to
`LLM.llm_engine` and stepped here, the loop `LLM.generate` runs, with delta outputs so each step's
tokens are counted. vLLM logs to stdout: the protocol keeps a private copy of stdout, and fd 1 goes to
stderr before vLLM is imported.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback
from typing import Any


def _serve(proto: Any) -> None:
    setup = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(
        model=setup["model"],
        dtype=setup.get("dtype", "bfloat16"),
        seed=setup.get("seed", 0),
        max_num_seqs=setup["max_num_seqs"],
        max_model_len=setup["max_model_len"],
        enable_prefix_caching=setup.get("enable_prefix_caching", False),
        **setup.get("llm_kwargs", {}),
    )
    engine = llm.llm_engine
    config = engine.vllm_config
    settings = {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_model_len": config.model_config.max_model_len,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "distributed_executor_backend": str(config.parallel_config.distributed_executor_backend),
        "llm_kwargs": setup.get("llm_kwargs", {}),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k in ("LD_PRELOAD", "OMP_NUM_THREADS")},
    }
    _send(proto, {"ready": True, "vllm_version": vllm.__version__, "settings": settings})
    ids = itertools.count()
    for line in sys.stdin:
        wave = json.loads(line)
        if wave.get("op") == "exit":
            break
        n = wave["max_new_tokens"]
        temperature = wave.get("temperature", 0.0)
        params = SamplingParams(
            temperature=temperature,
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            seed=wave.get("seed") if temperature > 0 else None,
            output_kind=RequestOutputKind.DELTA,
        )
        t0 = time.perf_counter()
        names = [f"r{next(ids)}" for _ in wave["prompts"]]
        for name, prompt in zip(names, wave["prompts"], strict=True):
            engine.add_request(name, {"prompt_token_ids": prompt}, params)
        outputs: dict[str, list[int]] = {name: [] for name in names}
        waiting_first = set(names)
        total = at_first = 0
        t_first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].token_ids
                outputs[out.request_id].extend(new)
                total += len(new)
                if new:
                    waiting_first.discard(out.request_id)
            if t_first is None and not waiting_first:
                t_first, at_first = time.perf_counter(), total
        t_end = time.perf_counter()
        t_first = t_end if t_first is None else t_first
        _send(
            proto,
            {
                "outputs": [outputs[name] for name in names],
                "wall_s": t_end - t0,
                "first_token_s": t_first - t0,
                "decode_tokens": total - at_first,
                "decode_s": t_end - t_first,
            },
        )


def _send(proto: Any, message: dict[str, Any]) -> None:
    proto.write(json.dumps(message) + "\n")
    proto.flush()


def main() -> None:
    """Serve waves until stdin closes or says exit; a failure is reported as `{"error": ...}`."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        _serve(proto)
    except Exception as e:
        _send(proto, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise


if __name__ == "__main__":
    main()
