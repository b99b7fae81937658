"""All-reduce across the CPU ranks of one node through a shared-memory file, for small tensors.

A gloo all-reduce of one decode row costs ~1.5 ms on loopback here (each call waits on socket and
thread wake-ups), and a tensor-parallel forward makes two per layer. Ranks on one node can instead
write their partial sums into their slot of a shared segment, publish a sequence number, spin until
every rank has published, and add the slots up in rank order (so every rank gets bit-identical sums).
Two sets of slots alternate between calls, so a rank can write the next call's slot while a slower
rank still reads the previous call's. Tensors larger than a slot go through the fallback group.

Publishing relies on the CPU keeping stores in program order (x86-64's TSO): the data copy is visible
before the sequence number. Other CPUs use the fallback group for every call (`supported()`).

The fused CPU decoder (lyanna_kernels/csrc/decoder.c) sums through the same segment from C, inside its forward:
`SharedSegment` gives it the addresses, and this rank's call counter and wait time live in memory both
sides update, so calls from Python and from C interleave in one sequence.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import numpy
import torch
import torch.distributed as dist

SLOT_BYTES = 4 * 2**20  # per rank and set: 1,820 fp32 rows of a 576-wide model
_HEADER_WORDS = 2  # per rank: sequence number, pid


def supported() -> bool:
    """Whether this CPU orders stores as the protocol needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes(world: int) -> int:
    """Size of the shared file for `world` ranks."""
    return 8 * _HEADER_WORDS * world + 2 * world * SLOT_BYTES


def zero_file(path: str, nbytes: int) -> None:
    """Make a zero-filled file of `nbytes` (a shared segment, before any rank maps it)."""
    with open(path, "wb") as f:
        f.truncate(nbytes)


def create_segment(path: str, world: int) -> None:
    """Make the zero-filled shared file (rank 0, before the other ranks open it)."""
    zero_file(path, segment_bytes(world))


@dataclass(frozen=True)
class SharedSegment:
    """Where one rank's all-reduce lives, for a C implementation of the same protocol: addresses of the
    sequence numbers and pids ([world] int64 each), the slots ([2 * world][slot_bytes]), this rank's call
    counter (int64) and wait time (float64, seconds)."""

    seqs: int
    pids: int
    data: int
    seq: int
    wait_seconds: int
    rank: int
    world: int
    slot_bytes: int
    timeout_s: float


class SharedMemoryAllReduce:
    """Sums CPU tensors across the ranks of one node; `fallback` takes what does not fit a slot."""

    fallback: dist.ProcessGroup | None = None  # set once the process group exists

    def __init__(self, path: str, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._raw = raw = torch.from_file(path, shared=True, size=segment_bytes(world), dtype=torch.uint8)
        header = 8 * _HEADER_WORDS * world
        words = raw[:header].view(torch.int64).numpy()  # numpy reads memory on every access: spin on it
        self.seqs, self.pids = words[:world], words[world:]
        self.data = raw[header:].view(2 * world, SLOT_BYTES)
        self.pids[rank] = os.getpid()
        # this rank's call counter and wait time, in memory the fused decoder's C all-reduce updates too
        self._seq = numpy.zeros(1, dtype=numpy.int64)
        self._waited = numpy.zeros(1, dtype=numpy.float64)
        self._views: dict[tuple[int, torch.dtype, torch.Size], list[torch.Tensor]] = {}

    @property
    def seq(self) -> int:
        """Calls made so far (from Python or C)."""
        return int(self._seq[0])

    @property
    def wait_seconds(self) -> float:
        """Time spent waiting for other ranks (load imbalance and their lateness)."""
        return float(self._waited[0])

    def segment(self) -> SharedSegment:
        """The addresses a C implementation of this all-reduce works on (valid while this object lives)."""
        base = self._raw.data_ptr()
        return SharedSegment(
            seqs=base,
            pids=base + 8 * self.world,
            data=self.data.data_ptr(),
            seq=self._seq.ctypes.data,
            wait_seconds=self._waited.ctypes.data,
            rank=self.rank,
            world=self.world,
            slot_bytes=SLOT_BYTES,
            timeout_s=self.timeout_s,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks in place."""
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or x.device.type != "cpu" or not x.is_contiguous():
            assert self.fallback is not None, "no fallback group"
            self.fallback.allreduce([x]).wait()
            return x
        self._seq[0] += 1
        seq = self.seq
        slots = self._slots(seq % 2, x.dtype, x.shape, nbytes)
        slots[self.rank].copy_(x)
        self.seqs[self.rank] = seq  # after the copy: x86 keeps the two stores in this order
        self._wait(seq)
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x.add_(s)
        return x

    def _slots(self, half: int, dtype: torch.dtype, shape: torch.Size, nbytes: int) -> list[torch.Tensor]:
        """Every rank's slot in set `half`, viewed as `shape` (views are kept: a step repeats few shapes)."""
        key = (half, dtype, shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            first = half * self.world
            views = [self.data[first + r, :nbytes].view(dtype).view(shape) for r in range(self.world)]
            self._views[key] = views
        return views

    def _wait(self, seq: int) -> None:
        """Spin until every rank has published `seq`; raise if a rank's process is gone or time runs out."""
        if self.seqs.min() >= seq:
            return
        began = time.perf_counter()
        try:
            self._spin(seq)
        finally:
            self._waited[0] += time.perf_counter() - began

    def _spin(self, seq: int) -> None:
        spins, start = 0, None
        while self.seqs.min() < seq:
            spins += 1
            if spins % 64:
                continue
            time.sleep(0)  # let this process's other threads (the server's event loop) run
            if spins % 8192:
                continue
            now = time.monotonic()
            start = start or now
            for r, pid in enumerate(self.pids):
                if self.seqs[r] < seq and not alive(int(pid)):
                    raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) died")
            if now - start > self.timeout_s:
                raise RuntimeError(f"tensor-parallel all-reduce waited {self.timeout_s:.0f} s for a rank")


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this node)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
