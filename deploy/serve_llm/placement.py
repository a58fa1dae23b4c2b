"""Where an ``LLMConfig``'s workers run: its ``accelerator_type``, ``accelerator_config``
and ``placement_group_config`` become the engine's worker resources (every worker
requires Ray's ``accelerator_type:<T>`` resource), and the check, at build time, that
the running Ray cluster has a node with that accelerator or an autoscaler that could
add one (skipped where no Ray is initialised).
"""

from __future__ import annotations

import json
from typing import Any

import ray


def accelerator_types() -> list[str]:
    """The accelerator names Ray knows (``ray.util.accelerators``), as Ray Serve LLM
    accepts them."""
    import ray.util.accelerators.accelerators as known

    return [v for k, v in vars(known).items() if not k.startswith("_") and isinstance(v, str)]


def accelerator_resource(accelerator_type: str) -> str:
    """Ray's resource that nodes with ``accelerator_type`` offer."""
    return f"accelerator_type:{accelerator_type}"


def checked_accelerator_type(value: str) -> str:
    """``LLMConfig.accelerator_type`` as Ray Serve LLM takes it (``A10`` is ``A10G``):
    one of Ray's accelerator types, and no TPU (``ValueError`` otherwise)."""
    value = "A10G" if value == "A10" else value  # as Ray Serve LLM
    known = accelerator_types()
    if value not in known:
        raise ValueError(f"Unsupported accelerator type: {value} (Ray's accelerator types: {', '.join(known)})")
    if value.startswith("TPU-"):
        raise ValueError(f"accelerator_type {value}: TPUs are not supported by raydecode (CUDA GPUs or CPUs)")
    return value


def place_workers(engine: dict[str, Any], placement_group_config: dict[str, Any] | None,
                  accelerator_kind: str | None, accelerator_type: str | None) -> None:
    """``accelerator_type``, ``accelerator_config``'s kind and ``placement_group_config``
    onto the engine's worker resources (``engine``: ``EngineConfig`` fields, in place)."""
    def put(name: str, value: Any, given_as: str) -> None:
        if name in engine and engine[name] != value:
            raise ValueError(f"{given_as}: sets {name}, which engine_kwargs sets to {engine[name]!r}")
        engine[name] = value

    resources = dict(engine.get("worker_resources") or {})
    pg = placement_group_config
    if pg is not None:
        unknown = sorted(set(pg) - {"bundle_per_worker", "bundles", "strategy"})
        if unknown:
            raise ValueError(f"placement_group_config.{unknown[0]}: not a placement_group_config key "
                             "(bundle_per_worker, strategy)")
        if pg.get("bundles") is not None:
            raise ValueError("placement_group_config.bundles: not supported: raydecode places one bundle per "
                             "worker rank itself; give bundle_per_worker (and strategy)")
        if pg.get("strategy") is not None:
            put("placement_group_strategy", pg["strategy"], "placement_group_config.strategy")
        bundle = pg.get("bundle_per_worker") or {}
        if not isinstance(bundle, dict):
            raise ValueError("placement_group_config.bundle_per_worker: expected a dict of resources")
        for key, amount in bundle.items():
            where = f"placement_group_config.bundle_per_worker.{key}"
            if key == "CPU":
                put("worker_num_cpus", amount, where)
            elif key == "GPU":
                put("worker_num_gpus", amount, where)
            elif key == "TPU":
                raise ValueError(f"{where}: TPUs are not supported by raydecode")
            elif key == "memory":
                raise ValueError(f"{where}: not supported (worker memory is not reserved through Ray)")
            else:
                resources[key] = amount
    if accelerator_kind == "tpu":
        raise ValueError("accelerator_config: TPUs are not supported by raydecode")
    if accelerator_kind == "cpu":
        if accelerator_type is not None:
            raise ValueError(f"accelerator_type={accelerator_type!r} cannot be used with CPU-only "
                             "configurations (accelerator_config kind cpu)")
        put("device", "cpu", "accelerator_config.kind")
        engine.setdefault("worker_num_gpus", 0)
    if accelerator_type is not None:
        resources[accelerator_resource(accelerator_type)] = 0.001  # Ray Serve LLM's amount
    if resources:
        engine["worker_resources"] = resources


def missing_accelerator(accelerator_type: str, cluster: dict[str, float],
                        could_add: dict[str, float] | None) -> str | None:
    """Why no node could offer ``accelerator_type``, or None when one can: ``cluster``
    is the running cluster's resources, ``could_add`` what its autoscaler can add ({}:
    no autoscaler; None: one runs but does not say, so any type could come)."""
    resource = accelerator_resource(accelerator_type)
    if cluster.get(resource, 0) > 0 or could_add is None or could_add.get(resource, 0) > 0:
        return None
    present = sorted(k.split(":", 1)[1] for k in {**cluster, **could_add} if k.startswith("accelerator_type:"))
    return (f"accelerator_type {accelerator_type!r}: no node of this Ray cluster has it (resource "
            f"{resource!r}) and no autoscaler could add one; the cluster's accelerator types: "
            f"{', '.join(present) or 'none'}")


def _autoscaler_resources() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler could bring: what it
    publishes (autoscaler v2, KubeRay), {} where the head runs Ray's read-only monitor
    (a cluster without an autoscaling config: its nodes are all there is), None where
    that cannot be told (an autoscaler v1 with node types of its own, or no report yet)."""
    try:
        from ray._private import state
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.autoscaler._private.util import format_readonly_node_type
        from ray.experimental.internal_kv import _internal_kv_get

        most = state.state.get_max_resources_from_cluster_config()
        if most:
            return dict(most)
        status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        if not status:
            return None
        mapping = (json.loads(status).get("autoscaler_report") or {}).get("node_type_mapping") or {}
        if mapping and all(kind == format_readonly_node_type(node) for node, kind in mapping.items()):
            return {}
        return None
    except Exception:  # Ray's private API moved: assume an autoscaler could add it
        return None


def check_accelerator(accelerator_type: str) -> None:
    """Fails when the running Ray cluster cannot have a node with ``accelerator_type``
    (no-op where Ray is not initialised: the deployment would wait for such a node)."""
    if not ray.is_initialized():
        return
    why = missing_accelerator(accelerator_type, ray.cluster_resources(), _autoscaler_resources())
    if why is not None:
        raise ValueError(why)

