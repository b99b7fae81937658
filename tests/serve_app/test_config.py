"""serve_config.yaml is a valid Ray Serve config and its args parse into the app's pydantic config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray._common.utils import import_attr
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from serve_app.app import SERVE_RUNTIME_ENV, AppArgs

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_serve_config_parses_with_ray_and_with_our_args():
    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app = schema.applications[0]
    assert app.import_path == "serve_app.app:build_app"
    assert app.runtime_env == SERVE_RUNTIME_ENV  # what the test servers run with
    # what `serve run` / `serve deploy` do with it: import the builder, call it with the args block
    builder = import_attr(app.import_path)
    assert isinstance(call_user_app_builder_with_args_if_necessary(builder, app.args), Application)
    args = AppArgs.model_validate(app.args)
    config = args.engine.engine_config()
    assert args.engine.drafter == "lyanna+suffix" and config.spec_policy == "adaptive" and config.spec.depth == 4
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


def test_the_tensor_parallel_example_is_serve_config_with_two_ranks_per_replica():
    base = yaml.safe_load(CONFIG.read_text())
    tp2 = yaml.safe_load((CONFIG.parent / "serve_config.tp2.yaml").read_text())
    ServeDeploySchema.model_validate(tp2)
    engine = AppArgs.model_validate(tp2["applications"][0]["args"]).engine
    assert engine.tensor_parallel_size == 2 and engine.engine_config().tensor_parallel_size == 2
    assert engine.placement_bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]
    llm = {d["name"]: d for d in tp2["applications"][0]["deployments"]}["LLMReplica"]
    assert llm["ray_actor_options"]["num_cpus"] == engine.cpus_per_rank  # rank 0 runs in the first bundle
    base_app = base["applications"][0]
    base_app["args"]["engine"]["tensor_parallel_size"] = 2
    llm_autoscaling = {d["name"]: d for d in base_app["deployments"]}["LLMReplica"]["autoscaling_config"]
    llm_autoscaling["max_replicas"] = 1
    del llm_autoscaling["initial_replicas"]  # one replica of two ranks fills the node
    assert tp2 == base


def test_gpu_ranks_reserve_a_gpu_each():
    from serve_app.replica import EngineSettings

    settings = EngineSettings(device="cuda", tensor_parallel_size=4, cpus_per_rank=2)
    assert settings.placement_bundles() == [{"CPU": 2, "GPU": 1.0}] * 4
