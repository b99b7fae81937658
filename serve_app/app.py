"""Application builder: `serve run serve_app.app:build_app` (or serve_config.yaml's import_path)."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.ingress import Ingress
from serve_app.replica import EngineSettings, LLMReplica


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ingress -> LLM replicas, with the engine settings given as application arguments."""
    args = dict(args or {})
    settings = EngineSettings.model_validate(args.get("engine", {}))
    replica = LLMReplica.bind(settings.model_dump())
    return Ingress.bind(replica, settings.served_model_name)
