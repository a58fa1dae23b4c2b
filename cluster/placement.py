"""Placement: what a worker's ranks ask Ray for, and where they go.

One rank asks for a GPU when the cluster has GPUs, else for a token CPU reservation
(``rank_resources``); as a placement-group bundle that is ``resources_bundle``. A
model-parallel worker's ranks are gang-scheduled in one placement group: the Serve
replica's own, when it was deployed with ``serve_bundles`` and so reserved every rank's
bundle after its own, else one made for the worker (``rank_placement``). A worker that
cannot be placed is reported with what it asked for and what the cluster has
(``placement_message``). The arithmetic is here; ``WorkerPool`` starts the actors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

import ray

from cluster.config import EngineConfig

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


class RankResources(TypedDict):
    """What one rank asks Ray for (the actor's ``num_gpus``, ``num_cpus`` and custom
    ``resources`` options)."""

    num_gpus: float
    num_cpus: float
    resources: dict[str, float]


def rank_resources(config: EngineConfig, cluster_gpus: float) -> RankResources:
    """What one rank asks Ray for: a GPU each when the cluster has GPUs
    (``worker_num_gpus`` overrides); CPUs ``worker_num_cpus``, else one CPU per worker
    shared among its ranks (a scheduling token, not a thread cap: a group of three fits
    a two-core machine; threads are the node's cores split among the ranks on it)."""
    gpus = config.worker_num_gpus
    if gpus is None:
        gpus = 1 if cluster_gpus >= 1 else 0
    cpus = config.worker_num_cpus if config.worker_num_cpus is not None else round(1.0 / config.group_size, 4)
    return {"num_gpus": gpus, "num_cpus": cpus, "resources": dict(config.worker_resources)}


def resources_bundle(resources: RankResources) -> dict[str, float]:
    """``rank_resources`` as a placement-group bundle."""
    merged = {"CPU": resources["num_cpus"], "GPU": resources["num_gpus"], **resources["resources"]}
    return {k: v for k, v in merged.items() if v}


def serve_bundles(config: EngineConfig, cluster_gpus: float, replica_cpus: float = 0.001) -> list[dict[str, float]]:
    """A Serve replica's ``placement_group_bundles`` for an engine of model-parallel
    workers (Ray Serve LLM's shape): the replica's own bundle, then every rank's, so a
    replica starts only once all its ranks can (the pool finds them there)."""
    rank = resources_bundle(rank_resources(config, cluster_gpus))
    return [{"CPU": replica_cpus}] + [dict(rank) for _ in range(config.num_workers * config.group_size)]


def reserved_placement_group(bundle: dict[str, float], num_workers: int, group_size: int) -> PlacementGroup | None:
    """The placement group this engine runs in when it holds the group's bundles
    after its own first one (a Serve replica deployed with ``serve_bundles``), else
    None: the pool then makes a placement group per worker."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is None or group_size == 1:
        return None
    specs = pg.bundle_specs
    need = 1 + num_workers * group_size
    if len(specs) >= need and all(specs[i] == bundle for i in range(1, need)):
        return pg
    return None


def rank_placement(config: EngineConfig, bundle: dict[str, float], lane: int,
                   group_size: int) -> tuple[list[dict[str, Any]], PlacementGroup | None]:
    """Each rank's actor options for a worker filling ``lane`` (which of the engine's
    ``num_workers`` places it takes), and the placement group made for it (None when
    none was: a single rank, or a group in the Serve replica's reserved bundles, this
    lane's run of them)."""
    n = group_size
    options: list[dict[str, Any]] = [{} for _ in range(n)]
    pg = None
    if n > 1:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        reserved = reserved_placement_group(bundle, config.num_workers, n)
        if reserved is not None:  # the Serve replica's own bundles, this lane's run of them
            target, first = reserved, 1 + lane * n
        else:
            pg = target = placement_group([dict(bundle) for _ in range(n)], strategy=config.placement_group_strategy)
            first = 0
        options = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
            target, placement_group_bundle_index=first + i, placement_group_capture_child_tasks=False)}
            for i in range(n)]
    return options, pg


def placement_message(index: int, num_ranks: int, waited_s: float, asked: dict[str, float], strategy: str) -> str:
    """Why worker ``index`` (of ``num_ranks`` ranks, each asking for the bundle
    ``asked``) has not been placed after ``waited_s`` seconds: what it asks for and
    what the cluster has."""
    try:
        available, total = ray.available_resources(), ray.cluster_resources()
    except Exception:  # the cluster itself is gone
        available, total = {}, {}
    keys = sorted(set(asked) | {"CPU", "GPU"})
    n = num_ranks
    what = f"it asks for {asked}" if n == 1 else (
        f"its {n} ranks ask for {asked} each ({strategy} placement group)")
    return (
        f"worker {index} has not been placed for {waited_s:.0f} s: {what}; "
        f"the cluster has {_pick(available, keys)} available of {_pick(total, keys)} "
        "(free some, or lower worker_num_cpus / worker_num_gpus / worker_resources)"
    )


def _pick(resources: dict[str, float], keys: list[str]) -> dict[str, float]:
    return {k: resources.get(k, 0) for k in keys}
