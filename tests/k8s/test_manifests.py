"""KubeRay manifests: valid against the RayService CRD, serveConfigV2 valid for Ray Serve and our app,
and the same applications block as serve_config.yaml up to the GPU overrides named here."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.app import SERVE_CLUSTER_ENV, AppArgs

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))

# What a GPU cluster changes in serve_config.yaml's applications (path -> value); nothing else may differ.
GPU_OVERRIDES = {
    ("args", "engine", "device"): "cuda",
    ("args", "engine", "num_kv_blocks"): 8192,
    ("deployments", "Ingress", "autoscaling_config", "max_replicas"): 4,
    ("deployments", "LLMReplica", "autoscaling_config", "max_replicas"): 8,
    ("deployments", "LLMReplica", "ray_actor_options", "num_gpus"): 1,
}


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def rayservices() -> list[tuple[Path, dict]]:
    out = [(p, doc) for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text()) if doc]
    return [(p, d) for p, d in out if d.get("kind") == "RayService"]


def test_there_is_a_rayservice():
    assert rayservices(), "k8s/ holds no RayService manifest"


@pytest.mark.parametrize(("path", "doc"), rayservices(), ids=lambda x: getattr(x, "name", ""))
def test_manifest_validates_against_the_crd(validator, path, doc):
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{path.name}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def test_the_validator_catches_broken_manifests(validator):
    (_, doc) = rayservices()[0]
    broken = copy.deepcopy(doc)
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    broken["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    messages = [e.message for e in validator.iter_errors(broken)]
    assert any("groupName" in m for m in messages) and any("boolean" in m for m in messages)


def _by_name(apps: list[dict]) -> dict:
    """Applications with their deployment lists keyed by name (so overrides can address them)."""
    out = {}
    for app in copy.deepcopy(apps):
        app["deployments"] = {d["name"]: d for d in app.get("deployments", [])}
        out[app["name"]] = app
    return out


@pytest.mark.parametrize(("path", "doc"), rayservices(), ids=lambda x: getattr(x, "name", ""))
def test_serve_config_v2_is_serve_config_yaml_with_gpu_overrides(path, doc):
    served = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(served)  # Ray Serve's own schema
    for app in served["applications"]:
        AppArgs.model_validate(app["args"])  # our application's arguments
    local = _by_name(yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"])
    for app in local.values():
        for keys, value in GPU_OVERRIDES.items():
            node = app
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
    assert _by_name(served["applications"]) == local


@pytest.mark.parametrize(("path", "doc"), rayservices(), ids=lambda x: getattr(x, "name", ""))
def test_cluster_shape(path, doc):
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {8000, 8080, 8265, 6379} <= head_ports
    served = yaml.safe_load(doc["spec"]["serveConfigV2"])
    llm = {d["name"]: d for d in served["applications"][0]["deployments"]}["LLMReplica"]
    (gpu,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu"]
    container = gpu["template"]["spec"]["containers"][0]
    engine = served["applications"][0]["args"]["engine"]
    # GPUs per replica = its tensor-parallel size: rank 0 takes one, its ranks one bundle each, all in one pod.
    assert llm["ray_actor_options"]["num_gpus"] == 1
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == engine["tensor_parallel_size"]
    assert gpu["maxReplicas"] >= llm["autoscaling_config"]["max_replicas"]
    assert container["readinessProbe"] and container["livenessProbe"]


def test_every_way_of_starting_the_server_gives_ray_the_cluster_environment():
    """`make run` and the image KubeRay starts set what serve_app.app.SERVE_CLUSTER_ENV names before Ray starts."""
    run = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    (command,) = [line.strip() for line in run.splitlines() if "serve run serve_config.yaml" in line]
    dockerfile = (ROOT / "k8s" / "Dockerfile").read_text().splitlines()
    for name, value in SERVE_CLUSTER_ENV.items():
        assert f"{name}={value}" in command.split(" serve run ")[0].split()
        assert f"ENV {name}={value}" in dockerfile
