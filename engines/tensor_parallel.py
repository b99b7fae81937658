"""Tensor-parallel replicas: the engine's process is rank 0; ranks 1..N-1 are Ray actors it starts.

Rank 0 keeps everything that decides (scheduler, drafter, sampler, verification) and its shard of the
target. The other ranks hold only their shard and their KV cache (their share of the KV heads, the
same blocks), and have no allocator: every step rank 0 broadcasts the `StepPlan` (block tables
included) with the KV slot moves of the last verification, and every rank runs the same forward with
its two all-reduces per layer. The embedding and LM head are replicated, so rank 0 ends the forward
with full logits and last-layer hidden states, which is what verification and the drafters need.

Each replica has its own process groups, made from a TCP store rank 0 hosts (not the process-wide
default group). CPU ranks (one node) pass commands and sum partial results through shared memory
(engines/shm_channel.py, engines/shm_all_reduce.py), with a gloo group for what does not fit; CUDA
ranks use a gloo group for commands and an NCCL group for the sums.
"""

from __future__ import annotations

import datetime
import glob
import logging
import os
import pickle
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engines import shm_all_reduce, shm_channel
from engines.kv_cache import PagedKVCache
from engines.loader import load_model, parse_kv_cache_dtype
from engines.model_runner import ModelRunner, StepResult
from engines.parallel import TensorParallel
from engines.shm_all_reduce import SharedMemoryAllReduce
from engines.shm_channel import SharedMemoryChannel
from engines.step_plan import StepPlan
from lyanna_kernels.dispatch import set_deterministic, set_kernel_mode

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0  # a collective that waits longer than this on a silent rank fails


@dataclass
class CacheSpec:
    """What every rank's KV cache and model compute look like (decided by rank 0)."""

    num_blocks: int
    block_size: int
    dtype: str
    compute_fp32: bool  # the residual stream and norms in fp32 (CPUs without bf16 arithmetic)
    drop_layer_copies: bool = False  # the fused decoder takes every step: release the layers' fp32 weight copies
    deterministic: bool = False  # batch-invariant Triton kernels (EngineConfig.deterministic)


def connect(
    rank: int,
    world: int,
    host: str,
    port: int,
    device: torch.device,
    shm_prefix: str | None,
    store: dist.Store | None = None,
) -> tuple[TensorParallel, Channel | SharedMemoryChannel]:
    """Join a replica's process groups: (this rank's `TensorParallel` for the forward, the command
    channel). Blocks until every rank has joined. CPU ranks given `shm_prefix` sum and talk through
    the shared files made by `create_shared_files` (engines/shm_all_reduce.py, engines/shm_channel.py);
    otherwise commands go through gloo and sums through gloo (CPU) or NCCL (CUDA)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    shared = device.type == "cpu" and shm_prefix is not None
    if shared:  # mapped before joining: rank 0 removes the files once everyone has joined
        reducer = SharedMemoryAllReduce(shm_prefix + "-sum", rank, world, TIMEOUT_S)
        channel = SharedMemoryChannel(shm_prefix + "-cmd", rank, world, TIMEOUT_S)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, timeout)
    if shared:
        reducer.fallback, channel.fallback = control, Channel(control)
        return TensorParallel(world_size=world, rank=rank, group=control, reducer=reducer), channel
    compute = control
    if device.type == "cuda":
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world)
    return TensorParallel(world_size=world, rank=rank, group=compute), Channel(control)


def create_shared_files(prefix: str, world: int) -> list[str]:
    """The files `connect` maps for CPU ranks on one node; returns their paths. Files of replicas that
    died before every rank had joined (rank 0 removes them once all have) are swept on the way."""
    folder, name = os.path.split(prefix)
    for old in glob.glob(os.path.join(folder, name.rsplit("-", 1)[0] + "-*")):
        try:
            if time.time() - os.path.getmtime(old) > 2 * TIMEOUT_S:  # past any rank's joining deadline
                os.unlink(old)
        except OSError:
            pass  # another replica swept it first
    shm_all_reduce.create_segment(prefix + "-sum", world)
    shm_channel.create_segment(prefix + "-cmd", world)
    return [prefix + "-sum", prefix + "-cmd"]


class Channel:
    """Rank 0 to every other rank: one pickled command per call, over the control group's broadcasts."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def send(self, command: Any) -> None:
        """(Rank 0) deliver `command` to every rank."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv(self) -> Any:
        """(Other ranks) the next command rank 0 sent."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        self._broadcast(buf)
        return pickle.loads(buf.numpy().tobytes())


def make_cache(model_layers: int, kv_heads: int, head_dim: int, spec: CacheSpec, device: torch.device) -> PagedKVCache:
    """A rank's KV cache: the same blocks as every rank's, its own KV heads."""
    return PagedKVCache(
        model_layers, kv_heads, head_dim, spec.num_blocks, spec.block_size, parse_kv_cache_dtype(spec.dtype), device
    )


class TensorParallelWorker:
    """Rank r >= 1 of a replica (a Ray actor): loads its shard, then runs the commands rank 0 sends."""

    def __init__(
        self,
        model: str | None,
        dtype: str,
        device: str,
        rank: int,
        world: int,
        host: str,
        port: int,
        shm_prefix: str | None,
        threads: int,
        quantization: str = "none",
    ):
        torch.set_num_threads(threads)
        self.rank = rank
        self.device = torch.device("cuda", 0) if device.startswith("cuda") else torch.device(device)
        self.tp, self.channel = connect(rank, world, host, port, self.device, shm_prefix)
        self.model = load_model(model, dtype, self.device, tp=self.tp, quantization=quantization).model
        self.runner: ModelRunner | None = None
        self.running = False
        self.steps = 0
        self.fused_decoder = False  # whether decode steps run the fused CPU decoder (known after setup)

    def run(self) -> int:
        """Serve rank 0's commands until it says stop; returns the number of steps run."""
        self.running = True
        try:
            while True:
                command = self.channel.recv()
                kind = command[0]
                if kind == "stop":
                    return self.steps
                if kind == "setup":
                    self._setup(*command[1:])
                elif kind == "step":
                    _, moves, plan = command
                    assert self.runner is not None, "step before setup"
                    self.runner.move_kv(*moves)
                    self.runner.execute(plan, logits=False)  # rank 0 alone reads logits
                    self.steps += 1
                else:
                    raise ValueError(f"unknown command {kind!r}")
        finally:
            self.running = False

    def _setup(self, spec: CacheSpec, max_num_seqs: int, kernels: str = "auto") -> None:
        set_kernel_mode(kernels)
        set_deterministic(spec.deterministic)
        if spec.compute_fp32:
            self.model.compute_in(torch.float32)
        if spec.drop_layer_copies:
            self.model.drop_layer_copies()
        cfg = self.model.cfg
        kv = make_cache(cfg.num_layers, self.model.attn_kv_heads, cfg.head_dim, spec, self.device)
        self.runner = ModelRunner(self.model, kv, self.device, max_num_seqs)
        self.fused_decoder = self.model.fused_decoder(kv, 1) is not None

    def ping(self) -> dict[str, Any]:
        """Liveness for the replica's health check: rank, whether the command loop runs, steps run, time
        waited in all-reduces, and whether decode steps run the fused CPU decoder (lyanna_kernels/fused_decoder.py)."""
        reducer = self.tp.reducer
        wait = getattr(reducer, "wait_seconds", None)
        return {
            "rank": self.rank,
            "running": self.running,
            "steps": self.steps,
            "all_reduce_wait_s": wait,
            "fused_decoder": self.fused_decoder,
        }


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: starts them (in the caller's placement group when it has one),
    sends them commands, checks and stops them."""

    def __init__(self, model: str | None, dtype: str, device: str, world: int, quantization: str = "none"):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self.world = world
        self.group_id = uuid.uuid4().hex[:12]
        host = ray.util.get_node_ip_address()
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        shm_prefix, files = None, []  # CPU ranks on one node (placement STRICT_PACK) share memory
        if not device.startswith("cuda") and shm_all_reduce.supported():
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            shm_prefix = os.path.join(folder, f"lyanna-tp-{self.group_id}")
            files = create_shared_files(shm_prefix, world)
        pg = ray.util.get_current_placement_group()
        actor = ray.remote(TensorParallelWorker)
        self.workers = []
        for rank in range(1, world):
            resources: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1 if device.startswith("cuda") else 0}
            options: dict[str, Any] = {"max_concurrency": 2}  # `ping` answers while `run` loops
            if pg is not None and rank < len(pg.bundle_specs):
                bundle = pg.bundle_specs[rank]
                resources = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            threads = max(1, int(resources["num_cpus"]))
            # Named (lyanna-tp::<group>::rank<r>) so operators can find a replica's ranks in `ray list actors`.
            options["name"], options["namespace"] = f"lyanna-tp::{self.group_id}::rank{rank}", "lyanna"
            args = (model, dtype, device, rank, world, host, store.port, shm_prefix, threads, quantization)
            self.workers.append(actor.options(**resources, **options).remote(*args))
        try:
            self.tp, self.channel = connect(0, world, host, store.port, torch.device(device), shm_prefix, store)
        finally:
            for f in files:
                os.unlink(f)  # every rank has mapped them by now (they map them before joining)
        self.store = store  # the store must outlive the groups
        self.loops: list[Any] = []

    def start(self, spec: CacheSpec, max_num_seqs: int, kernels: str = "auto") -> None:
        """Give every rank its cache and kernel mode (`lyanna_kernels.dispatch`) and start its command loop."""
        self.loops = [w.run.remote() for w in self.workers]
        self.channel.send(("setup", spec, max_num_seqs, kernels))

    def states(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Every other rank's `ping`."""
        import ray

        return ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    def check(self, timeout_s: float = 10.0) -> None:
        """Raise if a rank has died or its command loop has stopped (the replica's health check)."""
        import ray

        done, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        if done:
            try:
                ray.get(done)
                raise RuntimeError("a tensor-parallel rank stopped its command loop")
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"a tensor-parallel rank died: {e}") from e
        states = self.states(timeout_s)
        stopped = [s["rank"] for s in states if not s["running"]]
        if stopped:
            raise RuntimeError(f"tensor-parallel ranks {stopped} are not running")

    def shutdown(self) -> None:
        """Stop every rank's loop and its actor (no stray processes)."""
        import ray

        try:
            self.channel.send(("stop",))
            ray.get(self.loops, timeout=10)
        except Exception as e:  # a dead rank: the kill below is all that is left to do
            log.warning("tensor-parallel ranks did not stop cleanly: %r", e)
        for w in self.workers:
            ray.kill(w)
        self.workers, self.loops = [], []


class ParallelModelRunner(ModelRunner):
    """Rank 0's model runner: sends each step (and the KV moves before it) to the other ranks, then runs
    its own shard of the same forward."""

    def __init__(
        self, model: Any, kv_cache: PagedKVCache, device: torch.device, max_num_seqs: int, workers: WorkerGroup
    ):
        super().__init__(model, kv_cache, device, max_num_seqs)
        self.workers = workers
        self.pending_moves: tuple[list[int], list[int]] = ([], [])
        self.send_seconds = 0.0  # time spent broadcasting commands (per-step communication, for benchmarks)
        self.step_started: float | None = None  # while a step runs (a hung rank keeps it set)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Move here now; the other ranks move before their next forward (nothing writes in between)."""
        super().move_kv(src, dst)
        self.pending_moves[0].extend(src)
        self.pending_moves[1].extend(dst)

    def execute(self, plan: StepPlan, logits: bool = True) -> StepResult:
        """Broadcast the step, then run rank 0's part of it."""
        self.step_started = start = time.monotonic()
        try:
            self.workers.channel.send(("step", self.pending_moves, plan))
            self.send_seconds += time.monotonic() - start
            self.pending_moves = ([], [])
            return super().execute(plan, logits)
        finally:
            self.step_started = None

    def check(self) -> None:
        """Raise if a rank died or stopped, or a step has waited on the ranks for half the collective
        timeout (a hung rank; the collective itself fails at the timeout)."""
        started = self.step_started
        if started is not None and time.monotonic() - started > TIMEOUT_S / 2:
            raise RuntimeError(f"a tensor-parallel step has been running for {time.monotonic() - started:.0f} s")
        self.workers.check()
