"""Quantized weights on this CPU: the embedded SmolLM2-135M served from its Q4_1 GGUF file
kept quantized, against the same model dequantized to float32.

Run: ``python tests/bench/quantized.py [--quick] [--rows 1 4 8 16] [--rounds 3]``.

Three parts, each printing side by side:

1. **The linears alone** (``--linears``): SmolLM2's linears as the fused decoder calls
   them (30 layers of merged q/k/v, o, merged gate/up and down, then the LM head), each
   layer's weights its own, through the quantized kernel (``QuantPanelLinear`` on the
   file's Q4_1 layers and Q8_0 embedding) and the float panel kernel (``PanelLinear``),
   rounds alternating; ms per pass at each row count, beside the pass's bandwidth floor
   (the bytes it reads over this machine's copy bandwidth, measured here with a large
   ``torch`` copy).
2. **A decode step in process**: the in-process worker (no Ray, no HTTP) on the default
   model, quantized (``quantization=None``) and float (``"none"``), ``rows`` sequences
   decoding together, median ms per decode step, rounds alternating.
3. **Startup and memory**: time to a loaded worker and its process RSS, each in a fresh
   process, quantized and float, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
from _results import Row, emit, machine  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB float32 copy on this process's threads (the best of
    five): the memory floor the passes are measured against."""
    src = torch.empty(64 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best  # read and write


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def linears(rows: list[int], rounds: int) -> list[Row]:
    from worker.cpu import kernels
    from worker.cpu.packed_linear import PanelLinear
    from worker.cpu.quant_linear import QuantPanelLinear
    from worker.quant.gguf_model import load_gguf_model
    from worker.quant.linear import QuantizedLinear
    from worker.quant.weight import stack_outputs
    from worker.runner.model_loader import default_model_file

    ops = kernels.load()
    model = load_gguf_model(str(default_model_file())).model
    quant, floats = [], []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for parts in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
            w = stack_outputs([p.quantized for p in parts])
            quant.append(QuantPanelLinear(w, None, ops))
            dense = torch.nn.Linear(w.in_features, w.out_features, bias=False)
            dense.weight.data = w.dequantize()
            floats.append(PanelLinear(dense, ops))
    head = model.lm_head
    assert isinstance(head, QuantizedLinear)
    quant.append(QuantPanelLinear(head.quantized, None, ops))
    dense = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    dense.weight.data = head.quantized.dequantize()
    floats.append(PanelLinear(dense, ops))
    qbytes = sum(q.codes.numel() + q.groups.numel() * q.groups.element_size() for q in quant)
    fbytes = sum(f.panels.numel() * 4 for f in floats)
    bandwidth = copy_bandwidth()
    out = [Row("copy bandwidth (256 MiB float32 copy)", f"{bandwidth / 1e9:.1f} GB/s")]
    print(f"weights read per pass: quantized {qbytes / 2**20:.0f} MiB, float32 {fbytes / 2**20:.0f} MiB; copy "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for m in rows:
        xs = [torch.randn(m, lin.in_features) for lin in quant]
        times: dict[str, list[float]] = {"quantized": [], "float": []}
        for _ in range(rounds + 1):
            for name, mods in (("quantized", quant), ("float", floats)):
                t = _timed(lambda mods=mods, xs=xs: [mod.matmul(x) for mod, x in zip(mods, xs)])
                times[name].append(t)
        q = statistics.median(times["quantized"][1:]) * 1e3
        f = statistics.median(times["float"][1:]) * 1e3
        floor = qbytes / bandwidth * 1e3
        print(f"linears, {m} rows: quantized {q:.2f} ms (floor {floor:.2f}: {q / floor:.1f}x), float32 {f:.2f} ms "
              f"-> {f / q:.2f}x", flush=True)
        out.append(Row(f"SmolLM2 linears, one pass at {m} rows (ms)", f"{q:.2f}", f"{f:.2f} (float32 panels)",
                       f"{f / q:.2f}x", ""))
    return out


def decode_step(rows: list[int], rounds: int, steps: int) -> list[Row]:
    from helpers import make_worker
    from sampler.params import SamplingParams
    from worker_driver import MiniDriver

    workers = {q: make_worker(None, quantization=q, max_num_seqs=max(rows), max_model_len=512)
               for q in (None, "none")}
    prompt = [1, 9690, 198, 504, 3575, 282, 4649, 314, 2593, 30, 2]
    out = []
    for m in rows:
        times: dict[object, list[float]] = {None: [], "none": []}
        for r in range(rounds + 1):
            for q, w in workers.items():
                d = MiniDriver(w.step, max_rows=m, token_budget=512, chunk=512, num_blocks=w._runner.kv.num_blocks)
                params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
                for i in range(m):
                    d.submit(f"{r}-{i}", prompt + [10 + i], params)
                d.step()  # the prefill
                step_times = []
                while d.waiting or d.rows:  # decode steps, until every row is done and removed
                    step_times.append(_timed(d.step))
                if r:
                    times[q].append(statistics.median(step_times))
        qt, ft = statistics.median(times[None]) * 1e3, statistics.median(times["none"]) * 1e3
        print(f"decode step, {m} rows: quantized {qt:.2f} ms, float32 {ft:.2f} ms -> {ft / qt:.2f}x", flush=True)
        out.append(Row(f"SmolLM2 decode step in process, {m} rows (ms)", f"{qt:.2f}", f"{ft:.2f} (float32)",
                       f"{ft / qt:.2f}x"))
    return out


STARTUP = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
t0 = time.perf_counter()
from helpers import make_worker
w = make_worker(None, quantization={q!r}, max_num_seqs=8, max_model_len=512, kv_cache_tokens=4096)
import psutil
print(json.dumps({{"seconds": time.perf_counter() - t0, "rss": psutil.Process().memory_info().rss}}))
"""


def startup(rounds: int) -> list[Row]:
    runs: dict[object, list[dict]] = {None: [], "none": []}
    for _ in range(rounds):
        for q in runs:
            code = STARTUP.format(tests=os.path.join(ROOT, "tests"), q=q)
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
            runs[q].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = []
    for key, label, scale, unit in (("seconds", "time to a loaded worker", 1, "s"), ("rss", "worker RSS", 2**-20, "MiB")):
        q = statistics.median(r[key] for r in runs[None]) * scale
        f = statistics.median(r[key] for r in runs["none"]) * scale
        print(f"{label}: quantized {q:.1f} {unit}, float32 {f:.1f} {unit}", flush=True)
        out.append(Row(f"{label} ({unit})", f"{q:.1f}", f"{f:.1f} (float32)", f"{f / q:.2f}x"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, rows 1 and 8")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--only", choices=["linears", "decode", "startup"], nargs="+")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.rows = 1, [1, 8]
    parts = args.only or ["linears", "decode", "startup"]
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}", flush=True)
    rows: list[Row] = []
    if "linears" in parts:
        rows += linears(args.rows, args.rounds)
    if "decode" in parts:
        rows += decode_step(args.rows, args.rounds, args.steps)
    if "startup" in parts:
        rows += startup(args.rounds)
    emit("quantized", rows)


if __name__ == "__main__":
    main()
