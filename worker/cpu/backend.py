"""The CPU backend: the compiled kernels of ``csrc/`` put to work on a loaded model.

In order: the fused decoder (``fused_decoder.FAMILIES``: each layer's q/k/v and
gate/up projections merged first), the packed linears (column panels, a library GEMM's copy
for large calls, oneDNN's packing elsewhere; a mixture of experts' packed experts in
one call: ``moe_experts.py``), the quantized linears on their kernel
(``quant_linear.py``), the paged-attention kernel. Each has an
``EngineConfig`` switch (``cpu_fused_decoder``, ``cpu_packed_linear``,
``cpu_panel_linear``, ``cpu_gemm_from_rows``, ``cpu_attention_kernel``); each falls
back to the torch path where the kernels cannot be built or do not apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from worker.cpu.fused_decoder import FusedDecoder, fused_decoder_applies, merge_projections
from worker.cpu.kernels import load as load_kernels
from worker.cpu.moe_experts import install_native_experts
from worker.cpu.packed_linear import pack_linear_layers
from worker.cpu.paged_attention import CpuPagedKernel
from worker.cpu.quant_linear import quantize_linear_layers
from worker.quant.linear import QuantizedLinear
from worker.runner.backend import Backend
from worker.runner.experts import unstack_experts

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.parallel.group import ParallelGroup


def prepare_cpu_backend(model: nn.Module, config: WorkerConfig, group: ParallelGroup | None = None) -> Backend:
    wants_kernels = config.cpu_fused_decoder or config.cpu_attention_kernel or (
        config.cpu_packed_linear and config.cpu_panel_linear)
    ops = load_kernels() if wants_kernels else None
    if config.cpu_packed_linear:
        unstack_experts(model)  # each expert's projections as linears, packed below
    fused = config.cpu_fused_decoder and fused_decoder_applies(model, ops)
    if fused:
        merge_projections(model)  # before packing: the merged linears are packed
    packed = 0
    if config.cpu_packed_linear:
        panel_ops = ops if config.cpu_panel_linear else None
        packed = pack_linear_layers(model, panel_ops, config.cpu_gemm_from_rows, config.cpu_gemm_library)
        install_native_experts(model, panel_ops)  # a layer's packed experts in one call
    if ops is None and any(isinstance(m, QuantizedLinear) for m in model.modules()):
        ops = load_kernels()  # quantized layers run on the kernel whatever the float switches say
    packed += quantize_linear_layers(model, ops, config.cpu_gemm_from_rows)
    kernel = CpuPagedKernel(ops) if ops is not None and config.cpu_attention_kernel else None
    return Backend(
        attention_kernel=kernel,
        decoder=FusedDecoder(model, ops, group) if fused else None,
        num_packed_linear=packed,
    )
