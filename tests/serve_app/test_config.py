"""serve_config.yaml is a valid Ray Serve config and its args parse into the app's pydantic config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import AppArgs

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_serve_config_parses_with_ray_and_with_our_args():
    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "serve_app.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.engine.drafter == "lyanna" and args.engine.engine_config().spec.depth == 3
    deployments = {d.name: d for d in app.deployments}
    assert set(deployments) == {"Ingress", "LLMReplica"}
    for d in deployments.values():
        assert d.max_ongoing_requests and d.ray_actor_options is not None
        auto = d.autoscaling_config
        for key in ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            assert key in auto


def test_unknown_or_wrong_engine_args_fail_validation():
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"dtyp": "bfloat16"}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"max_num_seqs": "many"}})
