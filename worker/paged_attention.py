"""The CPU paged-attention kernel (``paged_attention.cpp``): building, loading, calling.

Short-query rows (decodes, speculative verification) attend through their block tables
in place, one task per (row, KV head) on torch's own thread pool, with an online
softmax; the torch path in ``worker/kv_cache.py`` (gather the blocks, then SDPA) is the
reference it is tested against and the fallback wherever the kernel does not apply
(other devices, other dtypes) or cannot be built (no C++ compiler). On this project's
2-core machine, one layer of a batch-64 decode 512 tokens deep takes 6.7 ms here against
52 ms gathering and 8.8 ms for SDPA over keys already contiguous per row (what the
pre-paged cache gave it); SmolLM2's whole decode step at batch 64, ~336 deep, went from
~500 ms with the dense cache to ~400 ms (``tests/bench/paged_attention.py``).

The same extension carries the fused layer ops (``layer_ops.cpp``: RMSNorm with the
residual add, rotary into the pool, SiLU-mul) that ``worker/fused_decoder.py`` runs, and
the float32 linear over column-panel weights (``panel_linear.cpp``) that
``worker/cpu_linear.py`` packs for.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` into
``$RAYDECODE_CACHE/kernels`` (``make setup`` does it ahead: ``python -m
worker.paged_attention``), for the instruction set of the CPU it runs on (AVX2 + FMA
where present), one build per level.
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

#: The extension's sources: the kernel (it defines the module) and the fused layer ops
#: of ``worker/fused_decoder.py``; HEADERS count for the build's identity too.
SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "layer_ops.cpp", "panel_linear.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_math.h", "work_split.h")]
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
    (SiLU-mul ran 3x slower than torch's); nothing here reads floating-point exception
    flags, and results are unchanged (no reassociation)."""
    return ["-O3", "-fopenmp", "-fno-trapping-math", *isa_flags()]


def build_dir() -> Path:
    """One build per source, torch installation and compiler flags (the instruction-set
    level among them: a home shared by different CPUs never loads a build the CPU
    cannot run). The installation's path counts because the build files name its
    headers: two virtual environments sharing one build would make each other rebuild."""
    from worker.model_loader import cache_dir

    flags = " ".join(compiler_flags())
    torch_home = os.path.dirname(torch.__file__)
    key = b"".join(source.read_bytes() for source in SOURCES + HEADERS) + torch.__version__.encode() + torch_home.encode() + flags.encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_dir() / "kernels" / f"paged_attention-{digest}"


def load() -> Any | None:
    """The compiled extension, building it on first use; None (and a warning) where
    it cannot be built. Thread-safe enough for one worker process; concurrent builds in
    several processes are serialized by torch's build lock."""
    if _loaded:
        return _loaded[0]
    module = None
    if os.environ.get("RAYDECODE_NO_CPU_KERNEL"):
        logger.warning("the CPU paged-attention kernel is off (RAYDECODE_NO_CPU_KERNEL): the torch path serves")
    else:
        try:
            from torch.utils.cpp_extension import load as load_extension

            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            module = load_extension(
                name="raydecode_paged_attention", sources=[str(source) for source in SOURCES], build_directory=str(folder),
                extra_cflags=compiler_flags(), extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path serves
            logger.warning("the CPU paged-attention kernel could not be built (%s); attention uses the torch path", exc)
            module = None
    _loaded.append(module)
    return module


class CpuPagedKernel:
    """What ``worker.kv_cache.paged_attention`` calls for short-query rows on CPU."""

    def __init__(self, module: Any) -> None:
        self.module = module

    @staticmethod
    def applies(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype == q.dtype

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
            kv_lens: torch.Tensor, query_lens: torch.Tensor, scale: float, softcap: float | None,
            window: int | None) -> torch.Tensor:
        """``q [B * Q, heads, D]`` (row b's queries are the last ``query_lens[b]`` of its
        ``kv_lens[b]`` positions) -> ``[B * Q, heads, D]`` (rows past a row's queries
        are zeros)."""
        out = torch.zeros(q.shape, dtype=torch.float32)
        self.module.paged_attention(
            out, q.contiguous(), k_pool, v_pool, block_table, kv_lens, query_lens,
            float(scale), float(softcap or 0.0), int(window or 0),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def run_packed(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                   kv_lens: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor, scale: float,
                   softcap: float | None, window: int | None) -> torch.Tensor:
        """``q [T, heads, D]``, the step's packed queries (a token's heads contiguous,
        tokens any stride apart: a column view of the merged q/k/v projection is read
        as it is); kernel row b's queries are tokens ``starts[b]`` on, the last
        ``query_lens[b]`` of its ``kv_lens[b]`` positions; every token must belong to
        one row. -> ``[T, heads, D]``."""
        if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=torch.float32)
        self.module.paged_attention_packed(
            out, q, k_pool, v_pool, block_table, kv_lens, query_lens, starts,
            float(scale), float(softcap or 0.0), int(window or 0),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def enable() -> bool:
    """Builds (or loads) the kernel and makes the attention function use it on CPU;
    returns whether it is on."""
    from worker import kv_cache

    module = load()
    kv_cache.cpu_kernel = CpuPagedKernel(module) if module is not None else None
    return module is not None


if __name__ == "__main__":  # `python -m worker.paged_attention`: build ahead of time
    logging.basicConfig(level=logging.INFO)
    ok = load() is not None
    print(f"CPU paged-attention kernel: {'built' if ok else 'not available'} in {build_dir()}")
    sys.exit(0 if ok else 1)
