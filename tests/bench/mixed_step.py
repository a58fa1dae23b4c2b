"""A step that carries a prefill beside running decodes, ours against vLLM's, in process.

Run::

    make peers                                    # once: vLLM's CPU build in its own venv
    .venv/bin/python tests/bench/mixed_step.py    # three alternating rounds, about 15 minutes
    .venv/bin/python tests/bench/mixed_step.py --rounds 1 --cases 8:0,8:500

Issue 38 asks where a served first token's time goes. This bench asks whether the
engine's step is where it is lost. It takes the served path away: each engine runs in
one process, with nothing else on the machine.
- Ours: ``LLMEngine`` and its worker actor on a local Ray.
- vLLM: ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, with the env that
  ``vs_vllm.py`` gives it (its cores bound, Intel OpenMP preloaded, the same KV budget).
The served comparison is ``vs_vllm.py --only served``.

For each case ``D:P``, D greedy requests with fresh prompts of ~150-350 random tokens
start decoding (``ignore_eos``). After a few decode steps, one fresh prompt of P tokens
is added between two steps, and the step that gives its first token is timed: the
wall time of the engine's ``step()`` call that returned it. Ours keeps one step in
flight while it builds outputs, so that call is the second after the prompt was
added, and its first call is the decode step that was already running. ``D:0`` times
a decode step alone (the median of eight). Settings on both sides: float32
(``--dtype bfloat16`` for both), max_num_seqs 64, max_num_batched_tokens 512,
max_model_len 2048, prefix caching on (every prompt is new, so nothing is cached).

Each round runs the two engines one after the other, each in a fresh process, and the
rounds alternate which goes first. It prints each case's step in ms per round, and
the median ratio (vLLM's ms / ours: above 1, ours is faster).

The same file is the child process on either side (``--side ours|vllm``): standard
library only at the top, so the peer's Python runs it as is. It prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

MARKER = "@@MIXED_STEP@@ "
DEFAULT_CASES = "8:0,8:64,8:256,8:500,56:0,56:450"
SETTINGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "max_model_len": 2048,
            "enable_prefix_caching": True}


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        d, _, p = item.partition(":")
        cases.append((int(d), int(p or 0)))
    return cases


class Side:
    """One engine driven step by step: ``add(rid, ids, max_tokens)``, ``step`` (the
    ids and token counts of the outputs it returned), ``abort``, ``busy``."""

    def __init__(self, side: str, model: str, dtype: str) -> None:
        if side == "vllm":
            from vllm import LLM, SamplingParams

            llm = LLM(model=model, dtype=dtype, seed=0, **SETTINGS)
            self.engine = llm.llm_engine

            def add(rid: str, ids: list[int], n: int) -> None:
                params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
                self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
        else:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            sys.path.insert(0, root)
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            from cluster.config import EngineConfig
            from cluster.engine import LLMEngine
            from sampler.params import RequestOutputKind, SamplingParams

            self.engine = LLMEngine(EngineConfig(model=model, num_workers=1, dtype=dtype,
                                                 kv_cache_memory_bytes=4 << 30, kv_cache_prefault=True, **SETTINGS))

            def add(rid: str, ids: list[int], n: int) -> None:
                params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0,
                                        output_kind=RequestOutputKind.CUMULATIVE)
                self.engine.enqueue(self.engine.make_request(rid, {"prompt_token_ids": ids}, params))

        self.add = add

    def step(self) -> list[tuple[str, int]]:
        return [(o.request_id, len(o.outputs[0].token_ids)) for o in self.engine.step()]

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_request(rids)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def run_side(side: str, model: str, cases: list[tuple[int, int]], trials: int, seed: int,
             dtype: str = "float32") -> dict[str, Any]:
    """Each case ``trials`` times after one warm-up trial; ms per trial."""
    rng = random.Random(seed)
    eng = Side(side, model, dtype)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    out: dict[str, list[float]] = {}
    k = 0
    for trial in range(trials + 1):
        for d, p in cases:
            k += 1
            decodes = [f"d{k}-{i}" for i in range(d)]
            for rid in decodes:
                eng.add(rid, ids(rng.randint(150, 350)), 1500)
            started: set[str] = set()
            while len(started) < d:
                started.update(rid for rid, n in eng.step() if n)
            for _ in range(4):
                eng.step()
            if p == 0:
                walls = []
                for _ in range(8):
                    t = time.perf_counter()
                    eng.step()
                    walls.append(time.perf_counter() - t)
                ms = statistics.median(walls) * 1e3
            else:
                rid = f"x{k}"
                eng.add(rid, ids(p), 4)
                while True:
                    t = time.perf_counter()
                    got = any(r == rid and n for r, n in eng.step())
                    ms = (time.perf_counter() - t) * 1e3
                    if got:
                        break
                decodes.append(rid)
            eng.abort(decodes)
            while eng.busy():
                eng.step()
            if trial:  # the first trial warms up
                out.setdefault(f"{d}:{p}", []).append(ms)
    return {"side": side, "ms": out}


def child(args: argparse.Namespace) -> int:
    if args.side == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run_side(args.side, args.model, parse_cases(args.cases), args.trials, args.seed, args.dtype)
    print(MARKER + json.dumps(result), flush=True)
    os._exit(0)  # no engine teardown in the timing process's exit path


def run_child(side: str, py: str, env: dict[str, str], args: argparse.Namespace, seed: int) -> dict[str, list[float]]:
    cmd = [py, os.path.abspath(__file__), "--side", side, "--model", args.model, "--cases", args.cases,
           "--trials", str(args.trials), "--seed", str(seed), "--dtype", args.dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])["ms"]
    raise RuntimeError(f"{side} gave no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("ours", "vllm"), help="(internal) run one engine and print its result")
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2, converted)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"D:P decodes and prompt tokens (default {DEFAULT_CASES})")
    ap.add_argument("--trials", type=int, default=3, help="trials per case and process, after a warm-up one")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both engines' dtype (bfloat16 where the CPU has native bf16 matmuls)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a side's process may take")
    args = ap.parse_args()
    if args.side:
        return child(args)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_vllm  # noqa: E402 -- the peer's env and interpreter, as the served bench gives them

    if args.model is None:
        from worker.runner.model_loader import default_model_path

        args.model = str(default_model_path())
    peer = vs_vllm.find_peer()
    if peer is None:
        print("no vLLM peer: `make peers` first (or VLLM_PYTHON=...)", file=sys.stderr)
        return 2
    sides = {"ours": (sys.executable, {**os.environ, "PYTHONPATH": str(vs_vllm.ROOT)}),
             "vllm": (peer, vs_vllm.peer_env(peer))}
    cases = [f"{d}:{p}" for d, p in parse_cases(args.cases)]
    print(f"mixed step: {vs_vllm.cpu_model()}, {len(os.sched_getaffinity(0))} CPUs; model {args.model}; "
          f"{args.dtype}; cases {', '.join(cases)}; {args.trials} trials a case per process, {args.rounds} rounds", flush=True)
    per_round: list[dict[str, dict[str, list[float]]]] = []
    for r in range(args.rounds):
        order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
        got = {}
        for side in order:
            t0 = time.perf_counter()
            got[side] = run_child(side, *sides[side], args, args.seed + r)
            print(f"  round {r + 1}: {side} done in {time.perf_counter() - t0:.0f} s", flush=True)
        per_round.append(got)

    print(f"\n{'case (decodes:prompt)':<22} | {'ours ms (per round)':<28} | {'vLLM ms (per round)':<28} | vLLM/ours")
    for case in cases:
        ours = [statistics.median(g["ours"][case]) for g in per_round]
        theirs = [statistics.median(g["vllm"][case]) for g in per_round]
        ratios = sorted(t / o for o, t in zip(ours, theirs))
        print(f"{case:<22} | {' / '.join(f'{x:.1f}' for x in ours):<28} | {' / '.join(f'{x:.1f}' for x in theirs):<28} | "
              f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
    print("\nms: the step() call that returned the added prompt's first token (D:0: a decode step); "
          "each round's figure is the median of its trials")
    return 0


if __name__ == "__main__":
    sys.exit(main())
