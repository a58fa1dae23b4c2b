"""The worker package's layout rules, checked at run time (the import contracts of
``tests/test_import_contracts.py`` check the static import graph): the rooms it has,
importing it registers nothing with transformers (the runner registers its attention
when it loads a model), importing the Ray-free rooms loads no Ray (directly or through a
library), and no attention kernel lives in a module global (it travels in each step's
plan)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import worker

ROOT = Path(__file__).resolve().parents[1]
RAY_FREE_ROOMS = ("runner", "quant", "cpu", "gpu", "parallel")


def _modules(package: str) -> list[str]:
    path = ROOT / package.replace(".", "/")
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)]) if not m.ispkg]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_worker_has_its_rooms():
    rooms = sorted(p.name for p in (ROOT / "worker").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["cpu", "gpu", "parallel", "quant", "runner", "transport"]
    assert (ROOT / "worker" / "cpu" / "csrc" / "paged_attention.cpp").exists()
    assert not list((ROOT / "worker").glob("*.cpp")), "C++ sources live in worker/cpu/csrc"


@pytest.mark.slow  # a fresh interpreter importing every module
def test_importing_the_worker_registers_nothing_with_transformers():
    modules = [m for room in (*RAY_FREE_ROOMS, "transport") for m in _modules(f"worker.{room}")] + _modules("worker")
    code = "\n".join([f"import {m}" for m in modules] + [
        "from transformers import AttentionInterface",
        "from worker.runner.attention import ATTENTION_NAME",
        "assert ATTENTION_NAME not in AttentionInterface._global_mapping, 'registered at import'",
        "from worker.runner.attention import register_paged_attention",
        "register_paged_attention()",
        "assert ATTENTION_NAME in AttentionInterface._global_mapping",
        "print('ok')",
    ])
    assert _run(code).strip() == "ok"


@pytest.mark.slow  # a fresh interpreter importing every module
def test_the_ray_free_rooms_load_no_ray():
    """What the contracts cannot see: no library these rooms import pulls Ray in."""
    modules = [m for room in RAY_FREE_ROOMS for m in _modules(f"worker.{room}")]
    modules += ["worker", "worker.config", "worker.protocol", "worker.structured_output", "worker.build"]
    code = "\n".join([f"import {m}" for m in modules] + ["import sys", "print('ray' in sys.modules)"])
    assert _run(code).strip() == "False"


def test_no_attention_kernel_lives_in_a_module_global(tiny_model_path):
    """A loaded runner's kernel is its backend's and its plans'; no worker module holds one."""
    from worker.build import build_runner
    from worker.cpu.paged_attention import CpuPagedKernel
    from worker.gpu.flex_attention import FlexPagedAttention

    runner = build_runner(worker.WorkerConfig(model=tiny_model_path, max_num_seqs=2, max_model_len=64))
    assert isinstance(runner.backend.attention_kernel, CpuPagedKernel) or runner.backend.attention_kernel is None
    for name, module in list(sys.modules.items()):
        if name == "worker" or name.startswith("worker."):
            for attr, value in vars(module).items():
                assert not isinstance(value, (CpuPagedKernel, FlexPagedAttention)), f"{name}.{attr} holds a kernel"


def test_the_runner_alone_runs_the_reference_paths(tiny_model_path):
    """Without a chosen backend a runner runs transformers' forward and the torch
    attention: what every backend is tested against."""
    from worker.runner.model_runner import ModelRunner

    runner = ModelRunner(worker.WorkerConfig(model=tiny_model_path, max_num_seqs=2, max_model_len=64))
    assert runner.backend.attention_kernel is None and runner.backend.decoder is None and runner.graphs is None
