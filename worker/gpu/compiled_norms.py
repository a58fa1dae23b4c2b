"""A model's RMSNorms compiled into one kernel each, for the decode steps CUDA graphs replay.

transformers' RMSNorm runs as half a dozen kernels on a GPU: the cast to float32, the
square, the mean, the reciprocal square root, two multiplies and the cast back. A graphed
decode step of a small model is made largely of such elementwise glue, and compiling the
norms shortens it (measured: docs/performance.md, "The numbers behind the code's
choices"). Each norm module's own ``forward`` is compiled
(``torch.compile``, dynamic shapes: one compile serves every batch size and every norm
of the same class), so its arithmetic is unchanged; only intermediate roundings go
(inductor keeps float32 in registers until the final cast: in bfloat16 an output may
differ from transformers' by one unit in the last place).

The compiled norms run only where ``CompiledNorms.wrap`` switches them on: the forwards
a CUDA graph records (its warm-up, where they compile, and its capture). Steps launched
from Python keep transformers' norms: there a compiled function's call costs more host
time than the kernels it saves (the eager decode step ran slower with them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class CompiledNorms:
    """Every RMSNorm of ``model`` (a module whose class name ends in ``RMSNorm``) given a
    compiled twin of its ``forward``, used while ``on``."""

    def __init__(self, model: nn.Module) -> None:
        self.on = False
        #: each norm class's forward, compiled
        self.compiled: dict[type, Callable[..., Any]] = {}
        self.count = 0
        for module in model.modules():
            cls = type(module)
            if not cls.__name__.endswith("RMSNorm") or "forward" in module.__dict__:
                continue
            if cls not in self.compiled:
                self.compiled[cls] = torch.compile(cls.forward, dynamic=True)
            module.forward = self._either(module, cls)
            self.count += 1

    def _either(self, module: nn.Module, cls: type) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return (self.compiled[cls] if self.on else cls.forward)(module, *args, **kwargs)

        return forward

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run with the compiled norms."""

        @functools.wraps(fn)
        def with_compiled_norms(*args: Any, **kwargs: Any) -> Any:
            self.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.on = False

        with_compiled_norms.compiled_norms = self  # type: ignore[attr-defined]
        return with_compiled_norms
