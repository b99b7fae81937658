"""Rank 0 to the other CPU ranks of one node: commands through a shared-memory file.

A gloo broadcast costs ~1 ms here and wakes the receiving rank late (a blocked thread is woken
through a socket), which then starts its forward after rank 0 and holds rank 0 up at the first
all-reduce. Here rank 0 writes the pickled command into the shared buffer and publishes a sequence
number; the other ranks spin on it (yielding the CPU between checks) while commands come often, and
sleep between checks after `IDLE_AFTER_S` without one. Each rank acknowledges a command once it has
copied it out; rank 0 writes the next one only when every rank has. Commands larger than the buffer go
through the fallback channel (gloo broadcasts), announced in the buffer. Store ordering as in
engines/shm_all_reduce.py (x86-64).
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import torch

from engines.shm_all_reduce import alive, zero_file

COMMAND_BYTES = 4 * 2**20
IDLE_AFTER_S = 0.05  # without a command for this long, a rank sleeps between checks ...
IDLE_SLEEP_S = 0.001  # ... for this long
_WORDS = 3  # header: sequence, length (-1: sent through the fallback), rank 0's pid; then one ack per rank


def segment_bytes(world: int) -> int:
    """Size of the shared file for `world` ranks."""
    return 8 * (_WORDS + world) + COMMAND_BYTES


def create_segment(path: str, world: int) -> None:
    """Make the zero-filled shared file (rank 0, before the other ranks open it)."""
    zero_file(path, segment_bytes(world))


class SharedMemoryChannel:
    """Rank 0 sends (`send`), every other rank receives (`recv`), one command at a time, in order."""

    fallback: Any = None  # the gloo `Channel` (engines/tensor_parallel.py), set once its group exists

    def __init__(self, path: str, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        raw = torch.from_file(path, shared=True, size=segment_bytes(world), dtype=torch.uint8)
        words = raw[: 8 * (_WORDS + world)].view(torch.int64).numpy()
        self.header, self.acks = words[:_WORDS], words[_WORDS:]
        self.buffer = raw[8 * (_WORDS + world) :].numpy()
        if rank == 0:
            self.header[2] = os.getpid()
        self.seq = 0

    def send(self, command: Any) -> None:
        """(Rank 0) deliver `command` to every rank."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait(lambda: self.acks[1:].min() >= self.seq, "a rank to take the last command")
        self.seq += 1
        large = len(data) > COMMAND_BYTES
        if not large:
            self.buffer[: len(data)] = memoryview(data)
        self.header[1] = -1 if large else len(data)
        self.header[0] = self.seq  # after the payload and its length: x86 keeps the stores in order
        if large:
            assert self.fallback is not None, "no fallback channel"
            self.fallback.send(command)

    def recv(self) -> Any:
        """(Other ranks) the next command rank 0 sent."""
        self.seq += 1
        self._wait(lambda: self.header[0] >= self.seq, "rank 0's next command", idle=True)
        size = int(self.header[1])
        if size >= 0:
            data = self.buffer[:size].tobytes()
            self.acks[self.rank] = self.seq
            return pickle.loads(data)
        self.acks[self.rank] = self.seq
        assert self.fallback is not None, "no fallback channel"
        return self.fallback.recv()

    def _wait(self, ready: Any, what: str, idle: bool = False) -> None:
        """Spin (yielding) until `ready()`; sleep between checks once idle; raise if rank 0 died or,
        when not idle-waiting, after the timeout."""
        spins, start = 0, time.monotonic()
        while not ready():
            spins += 1
            if spins % 64:
                continue
            now = time.monotonic()
            if idle and now - start > IDLE_AFTER_S:
                time.sleep(IDLE_SLEEP_S)
                if spins % (64 * 256) == 0 and not alive(int(self.header[2])):
                    raise RuntimeError("tensor-parallel rank 0 died")
                continue
            time.sleep(0)
            if not idle and now - start > self.timeout_s:
                raise RuntimeError(f"waited {self.timeout_s:.0f} s for {what}")
