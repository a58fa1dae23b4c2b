"""The layering as contracts a tool checks over the import graph (import-linter, the
contracts in ``pyproject.toml``): ``deploy -> cluster -> worker -> sampler`` and never
back; only ``worker/transport`` imports Ray inside ``worker``; no HTTP below ``deploy``;
the driver uses the worker's public surface; the worker's rooms in their order; no
import cycle in any package. And the size rule: each module short enough to read in one
sitting."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sampler", "worker", "cluster", "deploy")
#: lines a module may have (docs/design.md: one idea each, read in one sitting)
MAX_MODULE_LINES = 600


def test_the_import_contracts_hold():
    # In a process of its own: import-linter's CLI configures logging with dictConfig,
    # which disables every logger that exists already (the suite's caplog tests after it
    # would then see nothing from "raydecode").
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_every_rule_is_a_contract():
    """The contracts stay configured: removing one to let an import through fails here."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert set(config["root_packages"]) == set(PACKAGES)
    ids = {c["id"] for c in config["contracts"]}
    assert ids == {"layers", "worker-rooms", "ray-only-in-transport", "no-http-below-deploy",
                   "driver-uses-worker-surface", "no-cycles"}


def test_no_module_is_over_the_size_rule():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert sizes and not {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}
