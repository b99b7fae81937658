"""What every side of `engines.bench` reports for one wave, and the machine the run was on.

`WaveTiming` is one wave's outputs and clocks: the wall time of the whole wave (prefill included: end to
end), and the decode-only part, measured like llama-bench's `tg`: tokens generated after every sequence
of the wave has its first token, over the time after that moment. A side that serves its sequences one
at a time (llama.cpp) sums each sequence's tokens after its first over the time after its first.
`spread` summarises a metric over `--repeat` runs; `cpu_info` reads the CPU model and flags.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WaveTiming:
    """One wave on one side: new token ids per prompt, end-to-end wall time, and the decode-only part."""

    outputs: list[list[int]]
    wall_s: float  # from submitting the wave to its last token
    decode_tokens: int  # tokens generated after every sequence had its first token
    decode_s: float  # time after every sequence had its first token
    first_token_s: float = 0.0  # until every sequence had its first token (sum over sequences when sequential)
    extra: dict[str, float] = field(default_factory=dict)  # side-specific clocks, reported as they are


def spread(values: list[float]) -> dict[str, float | list[float]]:
    """Median, min and max of one metric over the repeats (and the runs themselves)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def cpu_info() -> dict[str, object]:
    """The CPU model, its flags (/proc/cpuinfo, first processor) and the cores this process may run on."""
    fields: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "flags": fields.get("flags", "").split(),
        "logical_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
