"""Float32 linears on CPU: our column-panel kernel and MKL's packed sgemm against
oneDNN's packed linear.

Run: ``python tests/bench/panel_linear.py [--quick] [--rows 1 8 64 512]``.

SmolLM2-135M's linear layers, as the fused decoder runs them: 30 layers of the merged
q/k/v (960 x 576), the output projection (576 x 576), the merged gate/up (3072 x 576)
and the down projection (576 x 1536), then the LM head (49152 x 576). Every layer has
its own random weights, so nothing stays in cache from one call to the next, as in a
real step. For each row count M: one pass of x [M, in] through every layer with the
weights as ``PanelLinear`` (``worker/cpu/csrc/panel_linear.cpp``), as
``MklPackedWeight`` (MKL's packed sgemm, what a panel linear hands calls of
``cpu_gemm_from_rows`` rows or more, where torch has MKL) and as ``PackedLinear``
(oneDNN's blocked layout, what ``cpu_panel_linear=False`` runs, and the large calls'
copy without MKL), interleaved round by round, median ms per pass. The LM head runs on 1 row per 8 at prefill sizes
(M >= 256: only the rows that are sampled reach it, as in the engine).

At decode sizes the pass reads ~540 MB of weights and is bound by memory; at prefill
sizes it is bound by the FMA units.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from _results import Row, emit  # noqa: E402
from torch import nn  # noqa: E402

from worker.cpu import kernels  # noqa: E402
from worker.cpu.packed_linear import MklPackedWeight, PackedLinear, PanelLinear, mkl_packed_linear_available  # noqa: E402

LAYERS = 30
HIDDEN = 576
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
VOCAB = 49152


def build(ops, layers: int) -> dict[str, tuple[list, object]]:
    """Each kind's layer stack and LM head, over the same random weights."""
    torch.manual_seed(0)
    kinds = {"panels": lambda lin: PanelLinear(lin, ops), "oneDNN": PackedLinear}
    if mkl_packed_linear_available():
        kinds["MKL"] = MklPackedWeight
    stacks: dict[str, list] = {name: [] for name in kinds}
    for _ in range(layers):
        for out_f, in_f in SHAPES:
            linear = nn.Linear(in_f, out_f, bias=False)
            for name, make in kinds.items():
                stacks[name].append(make(linear))
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    return {name: (stacks[name], make(head)) for name, make in kinds.items()}


def one_pass(stack, head, inputs: dict[int, torch.Tensor], head_rows: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for linear in stack:
        linear(inputs[linear.in_features])
    head(head_rows)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer layers and rounds")
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    ops = kernels.load()
    if ops is None or not hasattr(ops, "panel_linear"):
        print("the CPU kernels could not be built here: nothing to compare")
        emit("panel_linear", [], notes=["the CPU kernels could not be built"])
        return
    torch.set_num_threads(os.cpu_count() or 1)
    layers = 4 if args.quick else LAYERS
    rows_list = args.rows or ([1, 64] if args.quick else [1, 8, 64, 128, 256, 512])
    rounds = args.rounds or (3 if args.quick else 9)
    kinds = build(ops, layers)
    names = list(kinds)  # panels, oneDNN[, MKL]
    print(f"{layers} layers + LM head, float32, {torch.get_num_threads()} threads, "
          f"ISAs {ops.panel_isas()}; median ms per pass over {rounds} rounds")
    print(f"{'rows':>5} " + " ".join(f"{n:>9}" for n in names) + "   oneDNN/panels" + ("   oneDNN/MKL" if "MKL" in kinds else ""))
    rows: list[Row] = []
    with torch.inference_mode():
        for m in rows_list:
            inputs = {k: torch.randn(m, k) for k in {shape[1] for shape in SHAPES}}
            head_rows = inputs[HIDDEN][:: 8 if m >= 256 else 1].contiguous()
            for stack, head in kinds.values():  # warm-up: page every copy in
                one_pass(stack, head, inputs, head_rows)
            times: dict[str, list[float]] = {n: [] for n in names}
            for r in range(rounds):
                for n in (names if r % 2 == 0 else names[::-1]):
                    times[n].append(one_pass(*kinds[n], inputs, head_rows))
            ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            line = f"{m:>5} " + " ".join(f"{ms[n]:>9.1f}" for n in names) + f"   {ms['oneDNN'] / ms['panels']:>12.2f}x"
            rows.append(Row(f"{layers} layers + LM head, {m} rows: ms per pass, panels vs oneDNN packed",
                            f"{ms['panels']:.1f}", f"{ms['oneDNN']:.1f}", f"{ms['oneDNN'] / ms['panels']:.2f}x"))
            if "MKL" in ms:
                line += f"   {ms['oneDNN'] / ms['MKL']:>9.2f}x"
                rows.append(Row(f"{layers} layers + LM head, {m} rows: ms per pass, MKL packed vs oneDNN packed",
                                f"{ms['MKL']:.1f}", f"{ms['oneDNN']:.1f}", f"{ms['oneDNN'] / ms['MKL']:.2f}x"))
            print(line)
    emit("panel_linear", rows)


if __name__ == "__main__":
    main()
