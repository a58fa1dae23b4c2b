"""Shared fixtures (the tiny random model, the suite's local Ray, a Ray of a test's own)
and the two tiers.

The suite marks its own slow tier (``slow``): a test is slow when it requests a fixture
that starts a Ray cluster or a server, loads SmolLM2's weights, builds the kernels or
runs ``pip install`` (``SLOW_FIXTURES``, through any fixture it depends on), carries a
marker of such a test (``SLOW_MARKERS``), or sits in a module whose tests start one in
their bodies (``SLOW_MODULES``). ``--tier fast`` runs the rest (``make test-fast``, over
both cores with pytest-xdist) with property tests drawing fewer examples, and fails any
test of it that takes longer than ``--fast-limit`` seconds (5), naming it: a test that
builds an ``LLM`` in its body cannot hide in the fast tier. ``--tier slow`` runs the
slow tier alone; no ``--tier`` (``make test``, what CI runs) runs everything at full
strength.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

# Ray 2.60 turns on token auth for a new local cluster; tests say what they want.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

#: fixtures that make a test slow: a Ray cluster or a server, SmolLM2's weights, a
#: kernel build, ``pip install``, a GPU-sized model
SLOW_FIXTURES = frozenset({
    "ray_local", "ray_of_its_own",
    "smollm2_path", "smol_tok",
    "installed",
    "llama_1b",
})
#: markers that put a test in the slow tier
SLOW_MARKERS = frozenset({"smollm2", "multinode", "statistical", "cuda", "slow"})
#: modules whose tests start Ray, a server, a subprocess or a kernel build in their
#: bodies, or compile, where no fixture says so
SLOW_MODULES = frozenset({
    "test_cli", "test_colocated", "test_fake_cluster", "test_kernel_build_dir", "test_multinode",
    "test_serve_scaling", "test_served_chaos", "test_installed_package", "test_worker_niceness",
    "test_step_channel", "test_shm_allreduce", "test_smollm2_llm", "test_smollm2_worker",
    "test_long_prefix_cache", "test_cuda", "test_structured_output_llm", "test_bench_report",
    "test_flex_attention",  # FlexAttention compiled on the CPU, a shape at a time
    "test_tool_templates",  # pip download of llama.cpp's source package (its chat templates), once
})
FAST_LIMIT_S = 5.0
#: the fast tier's property tests draw this share of their CI examples (at least 10)
FAST_EXAMPLES_SHARE = 0.1


def _serve_as_shipped() -> None:
    """Serve's replicas talk as `raydecode serve` and the cluster files make them
    (gRPC between replicas): set before Ray starts or Serve is imported, so the Ray
    every test starts, and each Serve app on it, runs that way. Direct ingress stays
    off here: in-process apps are reached through Serve's proxy."""
    from deploy.serve_env import throughput_serve_env

    for key, value in throughput_serve_env(direct_ingress=False).items():
        os.environ.setdefault(key, value)


_serve_as_shipped()


# -- the tiers ------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("raydecode tiers")
    group.addoption("--tier", choices=("all", "fast", "slow"), default="all",
                    help="fast: the tests not marked slow, each within --fast-limit seconds, property tests "
                         "drawing fewer examples; slow: the slow tier alone; all (default): everything")
    group.addoption("--fast-limit", type=float, default=FAST_LIMIT_S,
                    help="seconds a fast-tier test may take (its setup and its call each; shared session "
                         "fixtures excluded)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("tier") == "fast":
        # Read by tests/hypothesis_budget.py as test modules import it (xdist's workers
        # configure themselves with the same options).
        os.environ["RAYDECODE_TEST_TIER"] = "fast"
        os.environ["RAYDECODE_FAST_EXAMPLES_SHARE"] = str(FAST_EXAMPLES_SHARE)
    from hypothesis import settings

    settings.register_profile("fast", max_examples=20, deadline=None)
    if os.environ.get("RAYDECODE_TEST_TIER") == "fast":
        settings.load_profile("fast")
        if hasattr(config, "workerinput"):
            # One of xdist's workers, one per core: two OpenMP teams spinning on two
            # cores would slow every kernel call several times over.
            import torch

            torch.set_num_threads(1)
        if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):  # not xdist's controller
            _warm_up()


def _warm_up() -> None:
    """The fast tier's guard times each test's own work: a process's one-time costs (the
    model classes' imports, the built CPU kernels' load) are paid here, before the first
    test, not by whichever test happens to come first."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (their lazy modules)

    from worker.cpu import kernels

    kernels.load()  # None where they cannot build: the tests take the torch paths


def is_slow(item: pytest.Item) -> str | None:
    """Why ``item`` belongs in the slow tier, or None."""
    fixtures = SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if fixtures:
        return f"requests {sorted(fixtures)}"
    markers = SLOW_MARKERS.intersection(m.name for m in item.iter_markers())
    if markers:
        return f"marked {sorted(markers)}"
    module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
    if module in SLOW_MODULES:
        return f"in {module}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_cuda_without_a_gpu(items)
    for item in items:
        if is_slow(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    tier = config.getoption("tier")
    if tier == "all":
        return
    keep = [item for item in items if (item.get_closest_marker("slow") is not None) == (tier == "slow")]
    deselected = [item for item in items if item not in set(keep)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = keep


def _skip_cuda_without_a_gpu(items: list[pytest.Item]) -> None:
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


#: seconds spent setting up session-scoped fixtures so far (shared by every test after:
#: not counted against the test whose setup happened to create them)
_shared_setup_s = 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    global _shared_setup_s
    started = time.perf_counter()
    yield
    if fixturedef.scope == "session":
        _shared_setup_s += time.perf_counter() - started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    before = _shared_setup_s
    yield
    item.stash[_SHARED_KEY] = _shared_setup_s - before


_SHARED_KEY = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """The fast tier's guard: a passing test whose setup or call took longer than the
    limit fails, naming itself and how to move it."""
    outcome = yield
    report = outcome.get_result()
    if item.config.getoption("tier") != "fast" or report.when not in ("setup", "call") or not report.passed:
        return
    took = report.duration - (item.stash.get(_SHARED_KEY, 0.0) if report.when == "setup" else 0.0)
    limit = item.config.getoption("fast_limit")
    if took > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: its {report.when} took {took:.1f} s, over the fast tier's {limit:.0f} s. It belongs "
            "in the slow tier: request the fixture that makes it slow (tests/conftest.py SLOW_FIXTURES), "
            "mark it slow, or make it faster.")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def start_local_ray():
    """The local Ray the suite shares (4 logical CPUs), started if it is not running."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.fixture(scope="session")
def _stop_ray_at_the_end():
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_stop_ray_at_the_end):
    """The suite's shared local Ray, running for this module's tests whatever ran
    before (a test with a Ray of its own may have stopped it)."""
    return start_local_ray()


@contextlib.contextmanager
def own_ray() -> Iterator[None]:
    """A Ray cluster of the caller's own (``ray.cluster_utils.Cluster``, a fake multinode
    cluster) is about to be built: the suite's local Ray is stopped first; afterwards
    this process is disconnected, and the local Ray comes back if it was running."""
    import ray

    had_local = ray.is_initialized()
    ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
        if had_local:
            start_local_ray()


@pytest.fixture
def ray_of_its_own() -> Iterator[None]:
    """``own_ray`` around one test."""
    with own_ray():
        yield
