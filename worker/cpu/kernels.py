"""Builds and loads the CPU backend's C++ extension (``csrc/``): one module with

- the paged-attention kernel (``paged_attention.cpp``), called through
  ``worker/cpu/paged_attention.py``;
- the fused layer ops (``layer_ops.cpp``: RMSNorm with the residual add, rotary into
  the pool, SiLU-mul) that ``worker/cpu/fused_decoder.py`` runs;
- the float32 linear over column-panel weights (``panel_linear.cpp``) that
  ``worker/cpu/packed_linear.py`` packs for, and a mixture-of-experts layer's experts
  over such weights in one call (``moe_experts.cpp``, behind
  ``worker/runner/experts.py``);
- the linear over quantized panel weights, dequantized in registers
  (``quant_linear.cpp``), behind ``worker/cpu/quant_linear.py``;
- the shared-memory all-reduce between tensor-parallel ranks on one node
  (``shm_allreduce.cpp``), behind ``worker/cpu/shm_allreduce.py``.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` into
``$RAYDECODE_CACHE/kernels`` (``make setup`` does it ahead: ``python -m
worker.cpu.kernels``), for the instruction set of the CPU it runs on (AVX2 + FMA
where present), one build per level. Where it cannot be built (no C++ compiler) the
runner uses the torch paths and says so in a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("raydecode")

#: The C++ sources (shipped as package data).
CSRC = Path(__file__).with_name("csrc")
#: The extension's sources: the attention kernel (it defines the module), the fused
#: layer ops, the float and quantized panel linears and the shm all-reduce; HEADERS
#: count for the build's identity too.
SOURCES = [CSRC / name for name in (
    "paged_attention.cpp", "layer_ops.cpp", "panel_linear.cpp", "moe_experts.cpp", "quant_linear.cpp",
    "shm_allreduce.cpp")]
HEADERS = [CSRC / name for name in ("cpu_math.h", "panel_blocks.h", "panel_run.h", "work_split.h")]
_loaded: list[Any] = []  # the built module, once (empty: not tried; [None]: unavailable)


def isa_flags() -> list[str]:
    """Compiler flags for the best instruction set this CPU has that the kernel uses
    (x86-64-v3: AVX2 and FMA); none elsewhere (the compiler's baseline)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return ["-march=x86-64-v3"] if {"avx2", "fma", "bmi2", "movbe"} <= set(flags) else []


def compiler_flags() -> list[str]:
    """-fopenmp: ``at::parallel_for`` in the kernel is an inline template whose OpenMP
    pragma only runs its tasks in parallel when the extension itself is built with it
    (without it every row runs on one thread). -fno-trapping-math: without it GCC keeps
    a float clamp (``fast_exp``'s) as a branch and leaves the loop around it scalar
    (SiLU-mul ran slower than torch's); nothing here reads floating-point exception
    flags, and results are unchanged (no reassociation)."""
    return ["-O3", "-fopenmp", "-fno-trapping-math", *isa_flags()]


def build_dir() -> Path:
    """One build per source, torch installation and compiler flags (the instruction-set
    level among them: a home shared by different CPUs never loads a build the CPU
    cannot run). The installation's path counts because the build files name its
    headers, and the sources' folder because they name the sources: two virtual
    environments, or two checkouts (git worktrees) of the same sources, sharing one
    build would make each other rebuild, every time the other one had loaded it (ninja
    sees another command), and a worker waits for that build (minutes on a busy host)."""
    from worker.cache import cache_dir

    flags = " ".join(compiler_flags())
    torch_home = os.path.dirname(torch.__file__)
    where = "\0".join(str(path.resolve()) for path in SOURCES + HEADERS)
    key = (b"".join(source.read_bytes() for source in SOURCES + HEADERS) + torch.__version__.encode()
           + torch_home.encode() + flags.encode() + where.encode())
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_dir() / "kernels" / f"cpu_kernels-{digest}"


def load() -> Any | None:
    """The compiled extension, building it on first use; None (and a warning) where
    it cannot be built. Thread-safe enough for one worker process; concurrent builds in
    several processes are serialized by torch's build lock."""
    if _loaded:
        return _loaded[0]
    module = None
    if os.environ.get("RAYDECODE_NO_CPU_KERNEL"):
        logger.warning("the CPU kernels are off (RAYDECODE_NO_CPU_KERNEL): the torch paths serve")
    else:
        try:
            from torch.utils.cpp_extension import load as load_extension

            _put_ninja_on_path()
            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            module = load_extension(
                name="raydecode_cpu_kernels", sources=[str(source) for source in SOURCES], build_directory=str(folder),
                extra_cflags=compiler_flags(), extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path serves
            logger.warning("the CPU kernels could not be built (%s): attention, linears and the decoder use the torch paths", exc)
            module = None
    _loaded.append(module)
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs the first ``ninja`` on PATH: make that the ``ninja`` wheel's
    (a dependency; it installs beside the interpreter, on PATH only in an activated
    venv), whatever else is there. From 1.13 ninja hashes a build's commands
    differently, so a system ninja (1.11) and the wheel's (1.13) took turns rebuilding
    all four kernels, each seeing the other's commands as changed: a full build at a
    worker's start whenever a process started without the venv on PATH loaded
    them after one started with it, or the other way round."""
    try:
        import ninja
    except ImportError:  # the system's ninja, if any; the build says when there is none
        return
    if not os.path.isfile(os.path.join(ninja.BIN_DIR, "ninja")):  # a layout without its launcher
        return
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p != ninja.BIN_DIR]
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *rest])


if __name__ == "__main__":  # `python -m worker.cpu.kernels`: build ahead of time
    logging.basicConfig(level=logging.INFO)
    ok = load() is not None
    print(f"CPU kernels: {'built' if ok else 'not available'} in {build_dir()}")
    sys.exit(0 if ok else 1)
