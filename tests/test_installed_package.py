"""The project as a user gets it: built and installed non-editable (``pip install .``)
into a folder of its own and run from elsewhere, with no checkout beside it and no
``tests/``. The installed modules are the ones that run (not the venv's editable
install of this checkout), ``raydecode`` and each subcommand answer ``--help``,
``raydecode bench`` says where its scripts are instead of failing, and the package
carries every C++ source and header the CPU kernels' build reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
#: Not part of what ``pip install .`` reads from a fresh clone: version control, the
#: venv, build outputs and caches (a leftover build/lib would put deleted modules in
#: the wheel).
SKIP = {".git", ".venv", "build", "dist", ".pytest_cache", ".hypothesis", "bench-results", "__pycache__"}


def _ignore(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in SKIP or n.endswith((".egg-info", ".pyc", ".so"))
            or (Path(folder, n) / "pyvenv.cfg").exists()]


def _packages() -> list[str]:
    """The top-level packages pyproject.toml ships (``packages.find``'s include)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({p.split(".")[0].rstrip("*") for p in config["packages"]["find"]["include"]})


class Installed:
    def __init__(self, tmp: Path) -> None:
        self.src = tmp / "src"
        self.site = tmp / "site"
        self.cache = tmp / "cache"
        self.cwd = tmp / "elsewhere"
        self.cwd.mkdir()
        env = {**os.environ, "PYTHONPATH": str(self.site), "RAYDECODE_CACHE": str(self.cache)}
        for name in ("RAYDECODE_BENCH_SCRIPTS", "RAYDECODE_NO_CPU_KERNEL", "PYTHONHOME", "PYTHONSAFEPATH"):
            env.pop(name, None)
        self.env = env

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def raydecode(self, *argv: str) -> subprocess.CompletedProcess:
        """The console script pip wrote, run as a user types it (its shebang names
        this venv's python)."""
        return self.run(str(self.site / "bin" / "raydecode"), *argv)

    def python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-c", code, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """Copies the checkout as a fresh clone has it, builds it with this venv's
    setuptools (no build isolation, no index: nothing from the network) and installs it
    into ``site`` (not editable)."""
    inst = Installed(tmp_path_factory.mktemp("installed"))
    assert ROOT not in inst.cwd.parents
    shutil.copytree(ROOT, inst.src, ignore=_ignore)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-cache-dir", "--target", str(inst.site), str(inst.src)],
        cwd=inst.cwd, env={**os.environ, "PIP_NO_INPUT": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return inst


def _no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr + done.stdout, done.stderr


def test_the_installed_modules_are_the_ones_that_run(installed):
    """Every module and C++ source of the checkout's packages is installed, no tests
    folder is, and the imports resolve there, not to the editable install."""
    for package in _packages():
        for source in (installed.src / package).rglob("*"):
            if source.suffix in (".py", ".cpp", ".h") and "__pycache__" not in source.parts:
                relative = source.relative_to(installed.src)
                assert (installed.site / relative).is_file(), f"{relative} is not in the installed package"
    assert not (installed.site / "tests").exists()
    done = installed.python(
        "import json, cluster, deploy.cli, sampler, worker, worker.cpu.kernels as k; "
        "print(json.dumps({'modules': [m.__file__ for m in (cluster, deploy.cli, sampler, worker, k)], "
        "'sources': [str(p) for p in k.SOURCES + k.HEADERS]}))"
    )
    assert done.returncode == 0, done.stderr
    where = json.loads(done.stdout)
    for path in where["modules"] + where["sources"]:
        assert Path(path).is_relative_to(installed.site), f"{path} is not the installed copy"
        assert Path(path).is_file()


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["bench"]])
def test_the_command_and_each_subcommand_answer_help(installed, command):
    done = installed.raydecode(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: raydecode {command[0] if command else ''}".rstrip())
    _no_traceback(done)


def test_bench_without_a_checkout_says_where_its_scripts_are(installed):
    """The benchmark scripts live in a checkout's tests/bench: the installed command
    exits 2 saying so (and how to name them), before it writes anything; named, it
    finds them."""
    done = installed.raydecode("bench")
    assert done.returncode == 2
    assert "the benchmark scripts are not part of the installed package" in done.stderr
    assert "--scripts CHECKOUT/tests/bench" in done.stderr and "RAYDECODE_BENCH_SCRIPTS" in done.stderr
    _no_traceback(done)
    assert not any(installed.cwd.iterdir())  # no bench-results folder

    named = installed.raydecode("bench", "--scripts", str(ROOT / "tests" / "bench"), "no_such_bench")
    assert named.returncode == 2
    assert "unknown benchmark(s) ['no_such_bench']" in named.stderr and "'e2e'" in named.stderr
    _no_traceback(named)


def test_the_package_carries_every_kernel_source_the_build_reads(installed):
    """The installed ``worker.cpu.kernels`` builds from the package's own csrc/: every
    source and header it names is there, byte for byte the checkout's (the bytes
    ``make setup`` compiled), each quoted ``#include`` resolves inside that folder, and
    the build goes to the installed $RAYDECODE_CACHE. (Compiling them again from the
    installed folder took a minute and a half of the suite for the same bytes; a
    package without its sources would otherwise fall back to the torch paths
    silently.)"""
    done = installed.python(
        "import json; from worker.cpu import kernels; "
        "print(json.dumps({'csrc': str(kernels.CSRC), 'files': [str(p) for p in kernels.SOURCES + kernels.HEADERS], "
        "'build': str(kernels.build_dir())}))",
    )
    assert done.returncode == 0, done.stderr
    named = json.loads(done.stdout.strip().splitlines()[-1])
    csrc = Path(named["csrc"])
    assert csrc == installed.site / "worker" / "cpu" / "csrc"
    assert Path(named["build"]).is_relative_to(installed.cache / "kernels")
    ours = ROOT / "worker" / "cpu" / "csrc"
    shipped = {p.name: p.read_bytes() for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert shipped == {p.name: p.read_bytes() for p in ours.iterdir() if p.suffix in (".cpp", ".h")}
    assert {Path(f).name for f in named["files"]} == set(shipped), "kernels.SOURCES + HEADERS: every file, once"
    for name, text in shipped.items():
        for line in text.decode().splitlines():
            if line.startswith('#include "'):
                header = line.split('"')[1]
                assert header in shipped, f"{name} includes {header}, which the package does not carry"
