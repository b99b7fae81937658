"""Per-request speculation settings: tree depth, width and verification budget."""

from __future__ import annotations

from dataclasses import dataclass

from engines.errors import InvalidRequestError


@dataclass
class SpecParams:
    """How much to speculate for one request: a tree `depth` deep, `width` children per node at most,
    and at most `budget` draft tokens verified per step (the root is not counted)."""

    # The tree that served the shipped Lyanna drafter best at batch 1 on CPU (README, "Shipped drafters").
    depth: int = 3
    width: int = 2
    budget: int = 6
    enabled: bool = True
    fixed: bool = False  # exactly this tree every step; the adaptive policy treats the fields as caps otherwise

    def validate(self) -> SpecParams:
        """Raise InvalidRequestError for impossible settings."""
        for name in ("depth", "width", "budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
                raise InvalidRequestError(
                    f"speculation {name} must be an integer in [1, 64], got {v!r}", param=f"speculation.{name}"
                )
        return self
