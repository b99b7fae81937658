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
    config = args.engine.engine_config()
    assert args.engine.drafter == "lyanna" and config.spec_policy == "adaptive" and config.spec.depth == 4
    deployments = {d.name: d for d in app.deployments}
    llm = deployments["LLMReplica"]
    assert llm.request_router_config["request_router_class"] == "policies.routing:LoadAwareRouter"
    assert llm.autoscaling_config["policy"]["policy_function"] == "policies.autoscaling:SLOAutoscalingPolicy"
    # the router's tight classes are the app's (both read a request's `slo.class`)
    assert llm.request_router_config["request_router_kwargs"]["tight_classes"] == args.slo.tight_classes
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
