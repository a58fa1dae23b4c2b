"""Shared fixtures: the tiny random model (built once per session) and a local Ray."""

from __future__ import annotations

import os

import pytest

# Ray 2.60 turns on token auth for a new local cluster; tests say what they want.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _serve_as_shipped() -> None:
    """Serve's replicas talk as `raydecode serve` and the cluster files make them
    (gRPC between replicas): set before Ray starts or Serve is imported, so the Ray
    every test starts, and each Serve app on it, runs that way. Direct ingress stays
    off here: in-process apps are reached through Serve's proxy."""
    from deploy.cli import throughput_serve_env

    for key, value in throughput_serve_env(direct_ingress=False).items():
        os.environ.setdefault(key, value)


_serve_as_shipped()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def start_local_ray():
    """The local Ray every test shares (4 logical CPUs); multi-node tests shut it down,
    use their own cluster, then call this again."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture(scope="session")
def ray_local():
    yield start_local_ray()
    import ray

    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA GPU: skipped, with the reason, where
    torch.cuda.is_available() is false (tests/gpu_check.py runs them on the GPU machine)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    try:
        import torch

        available, why = torch.cuda.is_available(), f"torch {torch.__version__}"
    except Exception as exc:  # noqa: BLE001  (torch missing or broken: no CUDA either way)
        available, why = False, f"torch does not import: {exc}"
    if available:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch.cuda.is_available() is false ({why})")
    for item in cuda_items:
        item.add_marker(skip)
