"""Autoscaling policy for the LLM replicas, driven by SLO attainment and ongoing requests (Ray Serve's
custom autoscaling-policy hook: `autoscaling_config.policy` in serve_config.yaml).

Each replica reports, through `record_autoscaling_stats`, the share of its recent requests with
targets that met them (`slo_attainment`) and how many there were (`slo_requests`). Per control tick:

- scale up by one when attainment over enough requests falls below `min_attainment` while there is
  load (more replicas split the batch, so each request's steps get faster), or to the replica count
  the ongoing requests need at `target_ongoing_requests` each, whichever is larger;
- scale down by one when attainment is at least `scale_down_attainment` (or nothing had targets) and
  one replica fewer would still run under `scale_down_load` of its target;
- otherwise hold.

Ray Serve applies `upscale_delay_s` / `downscale_delay_s` (a wish must persist that long), the
min/max bounds and the scaling factors around this, so a brief burst or lull does not flap replicas.
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingContext


class SLOAutoscalingPolicy:
    """Replica count from SLO attainment and ongoing requests; state is kept per deployment."""

    def __init__(
        self,
        min_attainment: float = 0.9,
        scale_down_attainment: float = 0.98,
        scale_down_load: float = 0.5,
        min_requests: int = 4,
    ):
        if not 0 < min_attainment <= scale_down_attainment <= 1:
            raise ValueError("need 0 < min_attainment <= scale_down_attainment <= 1")
        self.min_attainment = min_attainment
        self.scale_down_attainment = scale_down_attainment
        self.scale_down_load = scale_down_load
        self.min_requests = min_requests

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """The desired replica count and the policy's state (what it saw, for debugging)."""
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        ongoing = float(ctx.total_num_requests)
        target = ctx.config.get_target_ongoing_requests()
        attainment, requests = slo_attainment(ctx.aggregated_metrics or {})
        state = {"slo_attainment": attainment, "slo_requests": requests, "ongoing": ongoing}
        needed = math.ceil(ongoing / target) if ongoing > 0 else 0
        missing = attainment is not None and requests >= self.min_requests and attainment < self.min_attainment
        if needed > n or (missing and ongoing > 0):
            return max(needed, n + 1), state
        healthy = attainment is None or requests < self.min_requests or attainment >= self.scale_down_attainment
        if n > 1 and healthy and ongoing <= (n - 1) * target * self.scale_down_load:
            return n - 1, state
        return n, state


def slo_attainment(metrics: dict[str, dict[Any, float]]) -> tuple[float | None, float]:
    """Attainment across replicas, weighted by their requests with targets; and that request count."""
    shares = metrics.get("slo_attainment", {})
    counts = metrics.get("slo_requests", {})
    total = sum(counts.get(r, 0.0) for r in shares)
    if total <= 0:
        return None, 0.0
    return sum(shares[r] * counts.get(r, 0.0) for r in shares) / total, total
