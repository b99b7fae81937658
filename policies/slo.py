"""Service-level objectives: named latency classes, a request's targets, and attainment over time.

A request names a class (`"slo": {"class": "interactive"}`) or gives its own TTFT/TPOT targets; the
class sets the targets a request does not give. The targets steer the speculation policy (TPOT),
the request router (tight classes go to the least-loaded replica) and the autoscaler (the share of
recent requests that met their targets).

Whether a request met its targets is decided in one place, `SLOTarget.attained`, from the engine's
timestamps (one monotonic clock): the replica's tracker (autoscaling) and the ingress's metrics both
call it on the same finished stream item.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SLOClass(BaseModel):
    """Latency targets of one class."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)


def _default_classes() -> dict[str, SLOClass]:
    # Sized for the embedded model on a CPU replica; set your own for a GPU deployment.
    return {
        "interactive": SLOClass(ttft_ms=2000, tpot_ms=100),
        "batch": SLOClass(ttft_ms=20000, tpot_ms=400),
    }


class SLOSettings(BaseModel):
    """The classes requests may name (serve_config.yaml `args.slo`), and the class of those naming none."""

    model_config = ConfigDict(extra="forbid")

    classes: dict[str, SLOClass] = Field(default_factory=_default_classes)
    default_class: str | None = None  # None: a request without `slo` has no targets
    tight_classes: list[str] = Field(default_factory=lambda: ["interactive"])  # routed to the least-loaded replica

    @model_validator(mode="after")
    def _known_classes(self) -> SLOSettings:
        for name in [self.default_class, *self.tight_classes]:
            if name is not None and name not in self.classes:
                raise ValueError(f"SLO class {name!r} is not among the classes {sorted(self.classes)}")
        return self

    def target(self, slo_class: str | None, ttft_ms: float | None, tpot_ms: float | None) -> SLOTarget:
        """A request's targets: its explicit ones, else its class's (ValueError for an unknown class)."""
        name = slo_class if slo_class is not None else self.default_class
        cls = None
        if name is not None:
            cls = self.classes.get(name)
            if cls is None:
                raise ValueError(f"unknown SLO class {name!r}; this server has {sorted(self.classes)}")
        ttft = ttft_ms if ttft_ms is not None else cls.ttft_ms if cls else None
        tpot = tpot_ms if tpot_ms is not None else cls.tpot_ms if cls else None
        return SLOTarget(name, None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3)


@dataclass(frozen=True)
class SLOTarget:
    """One request's class and targets in seconds (None: no target)."""

    slo_class: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def has_target(self) -> bool:
        """Whether there is anything to meet."""
        return self.ttft_s is not None or self.tpot_s is not None

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a finished request's latencies met the targets (a missing latency meets its target)."""
        ok_ttft = self.ttft_s is None or ttft_s is None or ttft_s <= self.ttft_s
        ok_tpot = self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s
        return ok_ttft and ok_tpot

    def attained(
        self, arrival_s: float, first_token_s: float | None, finish_s: float, num_output_tokens: int
    ) -> bool | None:
        """Whether a finished request met the targets, from one clock's timestamps (the engine's);
        None when there is no target."""
        if not self.has_target:
            return None
        return self.met(*latencies(arrival_s, first_token_s, finish_s, num_output_tokens))


def latencies(
    arrival_s: float, first_token_s: float | None, finish_s: float | None, num_output_tokens: int
) -> tuple[float | None, float | None]:
    """A request's (TTFT, TPOT) from one clock's timestamps. TPOT spans the tokens after the first;
    None where a latency does not exist (no token yet, not finished, fewer than two tokens)."""
    if first_token_s is None:
        return None, None
    ttft = first_token_s - arrival_s
    if finish_s is None or num_output_tokens < 2:
        return ttft, None
    return ttft, (finish_s - first_token_s) / (num_output_tokens - 1)


@dataclass
class SLOTracker:
    """The share of requests with targets that met them, over a sliding window of finish times."""

    window_s: float = 30.0

    def __post_init__(self) -> None:
        self._events: collections.deque[tuple[float, bool]] = collections.deque()

    def record(self, now: float, met: bool) -> None:
        """One finished request with targets."""
        self._events.append((now, met))
        self._trim(now)

    def attainment(self, now: float) -> float | None:
        """Fraction met in the window; None when no request with targets finished in it."""
        self._trim(now)
        if not self._events:
            return None
        return sum(met for _, met in self._events) / len(self._events)

    def count(self, now: float) -> int:
        """Requests with targets that finished in the window."""
        self._trim(now)
        return len(self._events)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
