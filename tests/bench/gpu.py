"""GPU benchmark: the offline e2e workload on a random-weight ~1B Llama in bfloat16,
raydecode against transformers on the same GPU, in one run.

Run (on a CUDA machine): ``python tests/bench/gpu.py [--quick] [--requests N]``
(``tests/gpu_check.py`` runs it with ``--quick``).

Model: ``tests/tiny_model.py``'s ``LLAMA_1B`` (TinyLlama's shape, 20 layers, ~1.0B
parameters, 32 query / 4 KV heads, vocabulary 32,000), random weights, bfloat16.
Workload: ``tests/bench/e2e.py``'s (prompts cut from a fixed corpus, 16-512 tokens, each
with its own output length of 16-256 tokens, ``ignore_eos``), greedy and mixed.

  ours         ``LLM(num_workers=1, max_num_seqs=64, max_num_batched_tokens=2048)``, its worker actor on the GPU
               (FlexAttention over the paged pool), eager; and again with ``cuda_graphs``
  static       ``model.generate`` on left-padded batches of 16 (SDPA attention)
  cb           transformers' continuous batching (``continuous_batching_context_manager``,
               what ``generate_batch`` runs: per-request ``max_new_tokens``), the same rows
               and token budget as ours, its KV pages sized for the workload

Both KV caches are sized for the workload (ours ``kv_cache_tokens``, CB's ``num_blocks``),
so peak memory compares. Figures: output tokens/s, TTFT and ITL p50/p99 (ours and CB),
peak device memory in use during each run (``torch.cuda.mem_get_info`` sampled every
20 ms, every process on the GPU counted), and a decode step at batch 64 (contexts of 512
tokens) against its memory-bandwidth floor: (weight bytes + the KV bytes the step reads)
/ the device-to-device copy bandwidth measured here (bytes read + written), for the torch
attention path (gather + SDPA), FlexAttention, and FlexAttention with CUDA graphs.
Targets: ours >= 2x CB and >= 5x static; the decode step within 3x its floor.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the checkout

import e2e  # noqa: E402
import torch  # noqa: E402
from _results import Row, emit  # noqa: E402

TARGET_CB, TARGET_STATIC, TARGET_FLOOR = 2.0, 5.0, 3.0
#: tokens per step, ours and CB alike (a GPU takes larger steps than the CPU default)
STEP_TOKENS = 2048
MODEL_DIR = os.environ.get("RAYDECODE_GPU_MODEL_DIR", "/tmp/raydecode-llama-1b")


class PeakMemory:
    """The most device memory in use (all processes) while the block runs."""

    def __enter__(self) -> PeakMemory:
        self.peak = 0
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                free, total = torch.cuda.mem_get_info()
                self.peak = max(self.peak, total - free)
                self._stop.wait(0.02)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def gib(self) -> float:
        return self.peak / 2**30


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = 2**28  # 1 GiB of float32
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n * 4 / statistics.median(times[2:])


def ours(path: str, reqs_by_name: dict[str, list[e2e.Req]], kv_tokens: int, max_len: int,
         **config: Any) -> dict[str, tuple[e2e.Result, float]]:
    from cluster import LLM

    llm = LLM(path, num_workers=1, max_num_seqs=64, max_num_batched_tokens=STEP_TOKENS, max_model_len=max_len,
              dtype="bfloat16", kv_cache_tokens=kv_tokens, **config)
    try:
        warm = next(iter(reqs_by_name.values()))
        e2e.run_ours(llm, [e2e.Req(warm[0].prompt[:16], 4, True, 0), e2e.Req(warm[1].prompt[:300], 8, False, 1)])
        out = {}
        for name, reqs in reqs_by_name.items():
            with PeakMemory() as mem:
                result = e2e.run_ours(llm, reqs)
            out[name] = (result, mem.gib)
        return out
    finally:
        llm.shutdown()


def decode_step(path: str, rows: int, context: int, steps: int, device: str = "cuda", profile: bool = False,
                plan_on_host: bool = True, **config: Any) -> tuple[float, float]:
    """Median seconds of a decode step at ``rows`` rows ``context`` tokens deep (the
    in-process worker, its step as the engine sends it, the driver's side included),
    and of the worker's own part of it; ``profile``: the torch profiler over five more
    decode steps, its summary printed (``where_the_time_goes``); ``plan_on_host``: CUDA
    graphs' plans built on the host (False: on the GPU, as before 2026-11-28)."""
    from worker.gpu.cuda_graphs import DecodeGraphs

    DecodeGraphs.plan_on_host = plan_on_host
    try:
        return _decode_step(path, rows, context, steps, device, profile, **config)
    finally:
        DecodeGraphs.plan_on_host = True


def _decode_step(path: str, rows: int, context: int, steps: int, device: str, profile: bool,
                 **config: Any) -> tuple[float, float]:
    from helpers import make_worker
    from sampler.params import SamplingParams
    from worker_driver import MiniDriver

    w = make_worker(path, device=device, dtype="bfloat16", max_num_seqs=rows, max_model_len=context + steps + 8,
                    **config)
    worker_times: list[float] = []

    def timed_step(msg: bytes) -> bytes:
        t = time.perf_counter()
        reply = w.step(msg)
        worker_times.append(time.perf_counter() - t)
        return reply

    d = MiniDriver(timed_step, max_rows=rows, token_budget=8192, chunk=context, num_blocks=w._runner.kv.num_blocks)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(rows):
        d.submit(f"r{i}", torch.randint(1, min(30000, w._runner.loaded.vocab_size), (context,), generator=g).tolist(), params)
    times, own = [], []
    while d.waiting or d.rows:
        decoding = bool(d.rows) and not d.waiting and all(r.computed >= len(r.prompt) for r in d.rows)
        t0 = time.perf_counter()
        d.step()
        if decoding:
            times.append(time.perf_counter() - t0)
            own.append(worker_times[-1])
        if d.rows and all(r.done() for r in d.rows) and not d.waiting:
            break
        if profile and len(times) == max(steps - 16, 1):
            d.step_fn = w._step  # the worker's step on this thread, where the profilers look
            where_the_time_goes(d.step, 5)
            d.step_fn = timed_step
    w = None  # frees the worker (timed_step keeps this cell)
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[3:]), statistics.median(own[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 requests, the greedy workload only")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="skip ours with cuda_graphs")
    ap.add_argument("--profile", action="store_true", help="the torch profiler over each decode-step variant")
    ap.add_argument("--decode-only", action="store_true",
                    help="the decode step alone: CUDA graphs with and without this change's parts, and eager")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA here: this benchmark needs a GPU")
        return
    import ray
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_model import LLAMA_1B, build_random_llama

    t_start = time.perf_counter()
    n = args.requests or (32 if args.quick else 64)
    prompt_len, out_len = (16, 512), (16, 256)
    path = str(build_random_llama(MODEL_DIR))
    tok = AutoTokenizer.from_pretrained(path)
    greedy, mix = e2e.build_workload(e2e.corpus_tokens(tok), n, prompt_len, out_len, 0.25, 0)
    workloads = {"greedy": greedy} if args.quick else {"greedy": greedy, "mix": mix}
    max_len = prompt_len[1] + out_len[1]
    kv_tokens = sum(len(r.prompt) + r.max_tokens for r in greedy) + 64 * 16
    bandwidth = copy_bandwidth()
    name = torch.cuda.get_device_name(0)
    print(f"GPU: {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); torch {torch.__version__}, "
          f"transformers {transformers.__version__}, ray {ray.__version__}")
    print(f"model: random Llama {LLAMA_1B}, bfloat16; {n} requests, prompts {prompt_len[0]}-{prompt_len[1]}, "
          f"outputs {out_len[0]}-{out_len[1]}, ignore_eos")

    if args.decode_only:
        print_steps(*decode_steps(path, bandwidth, DECODE_VARIANTS, args.profile))
        print(f"bench wall {time.perf_counter() - t_start:.0f} s")
        return
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[str, tuple[e2e.Result, float]]] = {}
    print("running ours (eager) ...", flush=True)
    try:
        results["ours"] = ours(path, workloads, kv_tokens, max_len, cuda_graphs=False)
    except Exception as exc:  # noqa: BLE001  (FlexAttention failed here: the torch path is still ours)
        print(f"ours with FlexAttention failed: {type(exc).__name__}: {exc}; the gather + SDPA path instead")
        results["ours"] = ours(path, workloads, kv_tokens, max_len, flex_attention=False, cuda_graphs=False)
    if not args.no_graphs:
        print("running ours (cuda_graphs) ...", flush=True)
        try:
            results["ours + graphs"] = ours(path, workloads, kv_tokens, max_len, cuda_graphs=True)
        except Exception as exc:  # noqa: BLE001  (report, go on)
            print(f"ours with cuda_graphs failed: {type(exc).__name__}: {exc}")
    ray.shutdown()

    if not args.skip_peers:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        model.generation_config = copy.deepcopy(model.generation_config)
        model.generation_config.eos_token_id = None
        pad = tok.pad_token_id or 0
        e2e.generate_padded(model, pad, [e2e.Req(greedy[0].prompt[:16], 4, True, 0)])
        for label, run in (("static", lambda reqs: e2e.run_static(model, pad, reqs)),
                           ("cb", lambda reqs: e2e.run_cb(model, reqs, "manager", 64, STEP_TOKENS))):
            print(f"running {label} ...", flush=True)
            results[label] = {}
            for wname, reqs in workloads.items():
                with PeakMemory() as mem:
                    res = e2e.guarded(lambda: run(reqs))  # noqa: B023 (called here)
                results[label][wname] = (res, mem.gib)
                if res.error:
                    print(f"  {label} {wname}: could not run: {res.error}")
        del model
        torch.cuda.empty_cache()

    floor, steps = decode_steps(path, bandwidth, STANDING_VARIANTS, args.profile)

    rows: list[Row] = []
    table: list[tuple[str, ...]] = []
    for wname in workloads:
        base = results["ours"][wname][0]
        for system in results:
            res, mem = results[system][wname]
            if res.error:
                table.append((wname, system, "failed", "-", "-", "-", "-", f"{mem:.1f}"))
                continue
            t50, _, t99 = e2e.percentiles(res.ttft) if res.ttft else ("-",) * 3
            i50, _, i99 = e2e.percentiles(res.itl) if res.itl else ("-",) * 3
            fmt = lambda v, k=1.0, d=2: f"{v * k:.{d}f}" if isinstance(v, float) else v  # noqa: E731
            table.append((wname, system, f"{res.tps:.0f}", fmt(t50), fmt(t99), fmt(i50, 1e3, 1), fmt(i99, 1e3, 1),
                          f"{mem:.1f}"))
        for peer, target in (("cb", TARGET_CB), ("static", TARGET_STATIC)):
            if peer in results and not results[peer][wname][0].error:
                best = max((results[s][wname][0].tps for s in results if s.startswith("ours")
                            and not results[s][wname][0].error), default=base.tps)
                ratio = best / results[peer][wname][0].tps
                rows.append(Row(f"{wname}: output tok/s vs {peer}", f"{best:.0f}",
                                f"{results[peer][wname][0].tps:.0f}", f"{ratio:.2f}x", f">= {target}x", ratio >= target))
    print()
    head = ("workload", "system", "tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "peak GiB")
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print()
    print_steps(floor, steps)
    for label, (secs, _) in steps.items():
        rows.append(Row(f"decode step b64x512, {label}", f"{secs * 1e3:.2f} ms", f"{floor * 1e3:.2f} ms floor",
                        f"{secs / floor:.1f}x floor", f"<= {TARGET_FLOOR}x", secs / floor <= TARGET_FLOOR))
    for row in rows:
        print(f"  {row.figure}: {row.ours} vs {row.peer} ({row.ratio}; target {row.target}: "
              f"{'met' if row.met else 'NOT met'})")
    print(f"bench wall {time.perf_counter() - t_start:.0f} s")
    emit("gpu", rows, notes=[f"{name}; random Llama ~1B bf16; {n} requests", "cb: transformers' continuous "
                             f"batching manager, per-request max_new_tokens, 64 rows, {STEP_TOKENS}-token budget, KV for the "
                             "workload; static: generate, left-padded batches of 16"])


#: the decode-step variants of the standing table: (label, worker settings)
STANDING_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gather + SDPA", {"flex_attention": False}),
    ("FlexAttention", {"cuda_graphs": False}),
    ("FlexAttention + CUDA graphs", {"cuda_graphs": True}),
)
#: ``--decode-only``: the graphed step with and without its parts (norms compiled, the
#: plan built on the host), then eager
DECODE_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("graphs, plan on the host, norms compiled", {"cuda_graphs": True}),
    ("graphs, plan on the GPU, norms not compiled", {"cuda_graphs": True, "compiled_norms": False,
                                                     "plan_on_host": False}),
    ("graphs, plan on the host, norms not compiled", {"cuda_graphs": True, "compiled_norms": False}),
    ("FlexAttention eager", {"cuda_graphs": False}),
)


def decode_steps(path: str, bandwidth: float, variants: tuple[tuple[str, dict[str, Any]], ...],
                 profile: bool) -> tuple[float, dict[str, tuple[float, float]]]:
    """The floor of a decode step at batch 64, 512 deep, and each variant's step (the
    whole, the worker's own), printed."""
    from tiny_model import LLAMA_1B

    print("decode step at batch 64, 512 deep ...", flush=True)
    weights = _weight_bytes(path)
    kv_bytes = 64 * (512 + 16) * 2 * LLAMA_1B["num_hidden_layers"] * LLAMA_1B["num_key_value_heads"] * (
        LLAMA_1B["hidden_size"] // LLAMA_1B["num_attention_heads"]) * 2
    floor = (weights + kv_bytes) / bandwidth
    print(f"floor {floor * 1e3:.2f} ms (weights {weights / 2**30:.2f} GiB + KV {kv_bytes / 2**30:.2f} GiB at "
          f"{bandwidth / 1e12:.2f} TB/s)", flush=True)
    steps: dict[str, tuple[float, float]] = {}
    for label, config in variants:
        try:
            steps[label] = decode_step(path, 64, 512, 40, profile=profile and (not steps or len(variants) == 3),
                                       **config)
            print(f"  {label}: {steps[label][0] * 1e3:.2f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"  decode step with {label} failed: {type(exc).__name__}: {exc}", flush=True)
    return floor, steps


def print_steps(floor: float, steps: dict[str, tuple[float, float]]) -> None:
    print(f"decode step, batch 64, 512 deep: floor {floor * 1e3:.2f} ms")
    for label, (secs, own) in steps.items():
        print(f"  {label}: {secs * 1e3:.2f} ms ({secs / floor:.1f}x the floor); the worker's own "
              f"{own * 1e3:.2f} ms ({own / floor:.1f}x)")


def where_the_time_goes(step: Any, n: int) -> None:
    """The torch profiler over ``n`` calls of ``step``: per step, the wall time, the GPU's
    busy time (kernels and copies), the biggest kernels and the host's biggest ops."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = (time.perf_counter() - t0) / n
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in on_gpu) / n
    print(f"  profile of {n} steps: wall {wall * 1e3:.2f} ms per step, GPU busy {gpu_us / 1e3:.2f} ms "
          f"({gpu_us / 1e3 / (wall * 1e3):.0%}); {sum(e.count for e in on_gpu) / n:.0f} kernels and copies per step")
    print("  biggest on the GPU (ms per step, share of its busy time, calls per step):")
    for e in sorted(on_gpu, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"    {e.self_device_time_total / n / 1e3:7.3f}  {e.self_device_time_total / n / max(gpu_us, 1e-9):5.1%}"
              f"  {e.count / n:5.0f}  {e.key[:110]}")
    on_host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print("  biggest torch ops on the host (self ms per step, calls per step):")
    for e in sorted(on_host, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"    {e.self_cpu_time_total / n / 1e3:7.3f}  {e.count / n:5.0f}  {e.key[:110]}")
    # The host's Python (the plan in numpy, the sampler, the reply) over n more steps.
    import cProfile
    import pstats

    py = cProfile.Profile()
    py.runcall(lambda: [step() for _ in range(n)])
    stats = pstats.Stats(py)
    print(f"  the host's Python, {n} more steps, {stats.total_tt / n * 1e3:.2f} ms per step under cProfile; "
          "biggest by own time (ms per step, calls per step):")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]
    for (file, line, func), (_, calls, own, _, _) in rows:
        print(f"    {own / n * 1e3:7.3f}  {calls / n:6.0f}  {func} ({os.path.basename(file)}:{line})")


def _weight_bytes(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                for key in st.keys():
                    t = st.get_slice(key)
                    shape = t.get_shape()
                    total += 2 * int(torch.tensor(shape).prod().item())
    return total


if __name__ == "__main__":
    main()
