"""The GPU machine's wheel bundle: its static completeness check (tests/gpu/bundle_check.py)
on small synthetic wheels, the real .gpu-bundle/ when it is there, and tests/gpu_check.py in
its no-CUDA mode."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from bundle_check import MACHINE_PACKAGES, check_bundle, read_machine_packages, read_wheel  # noqa: E402

BUNDLE = REPO / ".gpu-bundle"

MACHINE = {"numpy": None, "packaging": None, "requests": None, "tokenizers": "0.23.2"}


def make_wheel(folder: Path, name: str, version: str, requires=(), extras=()) -> Path:
    """A minimal wheel: the METADATA that the check reads, and one module."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *[f"Provides-Extra: {e}" for e in extras],
        *[f"Requires-Dist: {r}" for r in requires],
    ]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        zf.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def machine():
    from packaging.version import Version

    return {k: Version(v) if v else None for k, v in MACHINE.items()}


def complete_set(folder: Path) -> None:
    make_wheel(folder, "app", "1.0", [
        "lib>=2",
        "numpy>=1.20",                                 # on the machine, version unknown
        "tokenizers<0.24,>=0.23",                      # on the machine, version known
        'pywin32>=300; sys_platform == "win32"',       # not on Linux
        'uvloop; platform_system == "Windows"',        # not on Linux either
        'tomli; python_version < "3.11"',              # not on 3.12
        'fancy>=1; extra == "fancy"',                  # an extra nobody asks for
    ], extras=["fancy"])
    make_wheel(folder, "lib", "2.1", ["Packaging>=20", "requests"])


def test_complete_set_passes(tmp_path):
    complete_set(tmp_path)
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.ok, report.format()
    assert set(report.wheels) == {"app", "lib"}
    left_out = "\n".join(report.not_needed)
    for name in ("pywin32", "uvloop", "tomli", "fancy"):
        assert name in left_out
    # numpy>=1.20 against a machine numpy of unknown version: met, said to be unverified
    assert any("numpy" in u for u in report.unverified)


def test_missing_requirement_is_reported(tmp_path):
    complete_set(tmp_path)
    make_wheel(tmp_path, "extra-thing", "0.1", ["not-anywhere>=1"])
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"missing"}
    (p,) = report.problems
    assert p.package == "extra-thing" and "not-anywhere" in p.requirement


def test_linux_only_marker_is_required(tmp_path):
    """The same requirement under a marker that holds on Linux is needed; one that
    excludes Linux is not."""
    make_wheel(tmp_path, "app", "1.0", ['linuxdep; sys_platform == "linux"',
                                        'windep; sys_platform != "linux"'])
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"missing"}
    assert [p.requirement for p in report.problems] == ['linuxdep; sys_platform == "linux"']
    assert any("windep" in n for n in report.not_needed)


def test_extra_counts_only_when_requested(tmp_path):
    make_wheel(tmp_path, "app", "1.0", ['fancy>=1; extra == "fancy"'], extras=["fancy"])
    assert check_bundle(tmp_path, machine(), extras={}).ok
    asked = check_bundle(tmp_path, machine(), extras={"app": ["fancy"]})
    assert asked.kinds() == {"missing"}
    assert "fancy" in asked.problems[0].requirement


def test_extra_requested_by_a_requirement(tmp_path):
    """``dep[speed]`` in one wheel asks dep's ``speed`` extra: its requirements count."""
    make_wheel(tmp_path, "app", "1.0", ["dep[speed]>=1"])
    make_wheel(tmp_path, "dep", "1.5", ['fastlib; extra == "speed"'], extras=["speed"])
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"missing"}
    assert report.problems[0].package == "dep"
    assert report.extras["dep"] == {"speed"}


def test_extras_from_the_manifest(tmp_path):
    make_wheel(tmp_path, "app", "1.0", ['fancy>=1; extra == "fancy"'], extras=["fancy"])
    (tmp_path / "manifest.json").write_text('{"extras": {"app": ["fancy"]}}')
    assert check_bundle(tmp_path, machine()).kinds() == {"missing"}


def test_version_clash_in_the_bundle(tmp_path):
    complete_set(tmp_path)
    make_wheel(tmp_path, "other", "1.0", ["lib<2"])
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"version"}
    assert "lib 2.1" in report.problems[0].detail


def test_version_clash_with_the_machine(tmp_path):
    make_wheel(tmp_path, "app", "1.0", ["tokenizers>=0.24"])
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"version"}
    assert "machine has tokenizers 0.23.2" in report.problems[0].detail


def test_our_own_requirements(tmp_path):
    """pyproject's dependencies (the manifest's project_requires) are checked too."""
    complete_set(tmp_path)
    assert check_bundle(tmp_path, machine(), extras={}, project=["lib>=2", "tokenizers>=0.20"]).ok
    report = check_bundle(tmp_path, machine(), extras={}, project=["tokenizers>=0.30", "absent"])
    assert sorted((p.kind, p.package) for p in report.problems) == [
        ("missing", "raydecode"), ("version", "raydecode")]
    (tmp_path / "manifest.json").write_text('{"project_requires": ["lib>=3"]}')
    assert check_bundle(tmp_path, machine(), extras={}).kinds() == {"version"}


def test_duplicate_and_forbidden_wheels(tmp_path):
    make_wheel(tmp_path, "lib", "2.1")
    make_wheel(tmp_path, "lib", "2.2")
    make_wheel(tmp_path, "torch", "2.11.0")
    report = check_bundle(tmp_path, machine(), extras={})
    assert report.kinds() == {"duplicate", "forbidden"}


def test_machine_packages_file_parses():
    pkgs = read_machine_packages(MACHINE_PACKAGES)
    assert str(pkgs["transformers"]) == "5.17.0" and str(pkgs["torch"]) == "2.11.0"
    assert str(pkgs["packaging"]) == "26.3" and "pytest-timeout" in pkgs
    for absent in ("ray", "msgspec", "llguidance", "jsonschema", "gguf", "pydantic", "fastapi"):
        assert absent not in pkgs


@pytest.mark.skipif(not BUNDLE.is_dir(), reason="no .gpu-bundle/: make gpu-bundle builds it")
def test_real_bundle_is_complete():
    report = check_bundle(BUNDLE)
    assert report.ok, report.format()
    for name in ("ray", "msgspec", "llguidance", "jsonschema", "gguf"):
        assert name in report.wheels, f"{name} is not in .gpu-bundle/"
    ray = read_wheel(report.wheels["ray"].path)
    from importlib.metadata import version

    assert str(ray.version) == version("ray"), "the bundle's Ray is not the .venv's"
    with zipfile.ZipFile(ray.path) as zf:
        names = zf.namelist()
    assert not any(n.startswith("ray/jars/") for n in names), "Ray's jar was not stripped"
    total = sum(w.path.stat().st_size for w in report.wheels.values())
    assert total < 58 * 2**20


def test_gpu_check_without_cuda(tmp_path):
    """No CUDA (hidden from torch): the static check, a 'no CUDA' line, exit 0."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RAYDECODE_GPU_RESULTS": str(tmp_path)}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_check.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "no CUDA" in out
    if not BUNDLE.is_dir():
        assert "no bundle: make gpu-bundle builds it" in out
    assert (tmp_path / "summary.json").exists() and (tmp_path / "summary.md").exists()
    tail = proc.stdout.strip().splitlines()[-6:]  # the table comes last
    assert any(line.split()[:3] == ["stage", "status", "seconds"] for line in tail), out


@pytest.mark.cuda
def test_cuda_seen_by_torch_and_a_ray_worker(ray_local):
    """On the GPU machine: torch sees the GPU, Ray counts it and a task given it sees it."""
    import torch

    assert torch.cuda.is_available()
    assert ray_local.cluster_resources().get("GPU", 0) >= 1

    @ray_local.remote(num_gpus=1)
    def device_name() -> str:
        import torch

        return torch.cuda.get_device_name(0)

    assert ray_local.get(device_name.remote(), timeout=60) == torch.cuda.get_device_name(0)
