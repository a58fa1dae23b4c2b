"""Where the CPU kernels are built (``worker.cpu.kernels.build_dir``): one build per
sources' content and place. Two checkouts of the same sources (git worktrees sharing a
venv and ``$RAYDECODE_CACHE``) once shared a build folder; the build files name the
sources' paths, so each checkout's first load in a process made ninja rebuild what the
other had built (2 minutes on the busy 2-core host, while every worker of that checkout
waited on torch's build lock: a Serve app took 90-115 s to start instead of ~15 s)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from worker.cpu import kernels


def _checkout(root: Path) -> tuple[list[Path], list[Path]]:
    """A copy of the kernels' sources under ``root``: (sources, headers)."""
    csrc = root / "worker" / "cpu" / "csrc"
    shutil.copytree(kernels.CSRC, csrc)
    return [csrc / p.name for p in kernels.SOURCES], [csrc / p.name for p in kernels.HEADERS]


def _build_dir(monkeypatch: pytest.MonkeyPatch, sources: list[Path], headers: list[Path]) -> Path:
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "SOURCES", sources)
        mp.setattr(kernels, "HEADERS", headers)
        return kernels.build_dir()


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    main = _checkout(tmp_path / "main")
    worktree = _checkout(tmp_path / "ingress")
    assert [p.read_bytes() for p in main[0]] == [p.read_bytes() for p in worktree[0]]
    here = _build_dir(monkeypatch, *main)
    assert _build_dir(monkeypatch, *main) == here  # stable for one checkout
    assert _build_dir(monkeypatch, *worktree) != here
    assert here.parent == kernels.build_dir().parent  # under $RAYDECODE_CACHE/kernels, as before


def test_changed_sources_build_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources, headers = _checkout(tmp_path / "main")
    before = _build_dir(monkeypatch, sources, headers)
    headers[0].write_text(headers[0].read_text() + "\n// changed\n")
    assert _build_dir(monkeypatch, sources, headers) != before


def test_the_build_runs_the_wheels_ninja_whatever_else_is_on_path(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's builder runs the first ``ninja`` on PATH. A process started by
    ``.venv/bin/python`` without the venv activated (``vs_vllm.py``'s server, a service)
    found the system's ninja (1.11 on the dev host), an activated one the ``ninja``
    wheel's (1.13). From 1.13 ninja hashes a build's commands differently, so each saw
    the other's commands as changed and rebuilt all four kernels: ~50 s of both cores at
    a worker's start, every time the other kind had built last."""
    import os
    import stat

    ninja = pytest.importorskip("ninja")
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), os.environ.get("PATH", "")]))
    kernels._put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    kernels._put_ninja_on_path()  # again: PATH does not grow
    assert os.environ["PATH"].split(os.pathsep).count(ninja.BIN_DIR) == 1
