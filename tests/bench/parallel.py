"""Tensor and pipeline parallelism on one CPU host, same total threads: one worker with
all the threads vs a TP=2 group and a PP=2 group with one thread per rank.

Run: ``python tests/bench/parallel.py [--quick] [--requests 64] [--rounds 3] [--single-thread-ref]``.

Configurations (each a fresh ``LLM``, so each its own engine and prefix cache; shut down
before the next starts):
  A  ``LLM(model, worker_num_threads=2)``: one worker, 2 threads
  B  ``LLM(model, tensor_parallel_size=2, worker_num_threads=1)``: 2 ranks x 1 thread
  C  ``LLM(model, pipeline_parallel_size=2, worker_num_threads=1)``: 2 stages x 1 thread
run A B C A B C ... for ``--rounds`` rounds.

Model: a random-weight Llama of SmolLM2-135M's size but with heads that divide by 2
(hidden 576, 8 heads x 72, 2 KV heads, MLP 1536, 30 layers, vocabulary 49152, tied
embeddings, float32), built once into ``--model-dir`` with the embedded default model's
tokenizer (same vocabulary).
Workload: ``tests/bench/e2e.py``'s greedy offline workload (its corpus, prompt and
output lengths, TTFT / ITL), all requests at once.

Figures per configuration, median and min-max over rounds: output tokens/s, TTFT p50,
ITL p50, and the leader's collective share ``StepStats.collective / (forward + sample)``;
per round the ratios B/A and C/A of tokens/s (median, min-max).
Targets: B/A >= 0.85x, C/A >= 0.85x. ``--single-thread-ref`` adds D, one worker with 1
thread, to every round (a reference: C's stages run one after the other, so C cannot
beat D by more than noise).
Each run also reports how many cores other processes kept busy meanwhile (the host's
busy time less this script's and its Ray's): Ray's workers run at nice 15, and a
2-thread worker loses several-fold when one of its threads is preempted, so a run shared
with other work measures the host, not the code.
Also a capacity figure (arithmetic only): for SmolLM2's real shape (9 heads, 3 KV heads,
30 layers, head_dim 64) the KV tokens a TP=3 group holds vs one worker, each rank
with the same KV memory as the one worker.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
sys.path.insert(0, HERE)  # tests/bench: e2e's workload

import ray  # noqa: E402
import torch  # noqa: E402
from _results import cpu_model  # noqa: E402
from e2e import Req, build_workload, corpus_tokens, percentiles, run_ours  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from cluster.llm import LLM  # noqa: E402
from worker.runner.kv_pool import PagedKVCache  # noqa: E402
from worker.runner.model_loader import default_model_path  # noqa: E402

TARGET_TP, TARGET_PP = 0.85, 0.85
DEFAULT_DIR = "/tmp/raydecode-bench-smollm-tp2"
#: SmolLM2-135M's size with 8 heads x 72 (divisible by 2) instead of 9 x 64
SHAPE = dict(hidden_size=576, num_attention_heads=8, head_dim=72, num_key_value_heads=2, intermediate_size=1536,
             num_hidden_layers=30, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
CONFIGS: dict[str, dict[str, Any]] = {
    "A": dict(worker_num_threads=2),
    "B": dict(tensor_parallel_size=2, worker_num_threads=1),
    "C": dict(pipeline_parallel_size=2, worker_num_threads=1),
}
LABELS = {"A": "A 1 worker x 2 threads", "B": "B TP=2 x 1 thread", "C": "C PP=2 x 1 thread",
          "D": "D 1 worker x 1 thread"}
#: ``--single-thread-ref``: what one rank's thread does alone (PP=2 cannot beat it: its
#: stages run one after the other), to tell the cost of splitting from the second thread's gain
REFERENCE = {"D": dict(worker_num_threads=1)}


# -- the model ------------------------------------------------------------------------


def build_model(folder: Path, seed: int = 0) -> Path:
    """The random Llama of ``SHAPE`` with the default model's tokenizer, written once."""
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    src = default_model_path()
    ref = AutoConfig.from_pretrained(src)
    rope_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta") or getattr(ref, "rope_theta", 1e4)
    config = AutoConfig.for_model(
        "llama", **SHAPE, rms_norm_eps=ref.rms_norm_eps, rope_theta=rope_theta, bos_token_id=ref.bos_token_id,
        eos_token_id=ref.eos_token_id, pad_token_id=ref.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.03, generator=g)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    del model
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # whole or absent: a killed build leaves no half folder
    return folder


def capacity_figure(block_size: int = 16, dtype: torch.dtype = torch.float32) -> tuple[str, float]:
    """KV tokens of a TP=3 group vs one worker for SmolLM2-135M's real shape, every rank
    (and the one worker) with the same KV bytes: each TP=3 rank holds 1 of the 3 KV heads."""
    layers, kv_heads, head_dim = 30, 3, 64
    budget = 1 << 30  # per rank; the ratio does not depend on it
    one = PagedKVCache.bytes_per_block(layers, kv_heads, head_dim, block_size, dtype)
    rank = PagedKVCache.bytes_per_block(layers, kv_heads // 3, head_dim, block_size, dtype)
    tokens_one = budget // one * block_size
    tokens_tp3 = budget // rank * block_size  # every rank holds all tokens' KV for its head
    text = (f"SmolLM2-135M (30 layers, 9 heads, 3 KV heads x 64, {str(dtype).split('.')[-1]}, "
            f"{block_size}-token blocks), 1 GiB of KV per rank: one worker {one} B/block -> {tokens_one} tokens; "
            f"TP=3 each rank {rank} B/block -> {tokens_tp3} tokens")
    return text, tokens_tp3 / tokens_one


# -- other processes' CPU use ------------------------------------------------------


def cpu_reading() -> tuple[float, float]:
    """(CPU seconds the whole host has been busy, CPU seconds this script and its
    descendants have used: its Ray, GCS, raylet, the workers), now."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / tick  # all but idle and iowait
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    me = os.getpid()

    def ours(pid: int) -> bool:
        for _ in range(64):
            if pid == me:
                return True
            if pid <= 1:
                return False
            pid = parent.get(pid, 0)
        return False

    return busy, sum(t for pid, t in cpu.items() if ours(pid))


def foreign_cores(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """Cores kept busy by other processes between two ``cpu_reading``s: the host's busy
    time less this script's (its processes live through the timed run, so none of
    theirs is missed)."""
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


# -- runs -----------------------------------------------------------------------------


def run_config(model: str, extra: dict[str, Any], reqs: list[Req], warm: list[Req],
               engine_kwargs: dict[str, Any]) -> dict[str, float]:
    llm = LLM(model, **extra, **engine_kwargs)
    try:
        run_ours(llm, warm)
        before = cpu_reading()
        res = run_ours(llm, reqs)
        foreign = foreign_cores(before, cpu_reading(), res.wall)
        stats = llm.engine.stats
        compute = stats.forward + stats.sample
        return {
            "tps": res.tps, "wall": res.wall, "ttft": percentiles(res.ttft, (50,))[0],
            "itl": percentiles(res.itl, (50,))[0],
            "coll": stats.collective / compute if compute > 0 else math.nan,
            "steps": stats.worker_steps, "fwd_share": compute / res.wall, "foreign": foreign,
        }
    finally:
        llm.shutdown()


def code_version() -> str:
    """Where the engine's code was imported from, and its git commit when it is a checkout."""
    import subprocess

    import cluster

    root = os.path.dirname(os.path.dirname(os.path.abspath(cluster.__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    if not commit:
        return f"{root} (not a git checkout)"
    return f"{root} at {commit}" + (" with uncommitted changes" if dirty else "")


def med_span(values: list[float], fmt: str) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return format(vals[0], fmt)
    return f"{format(statistics.median(vals), fmt)} ({format(min(vals), fmt)}-{format(max(vals), fmt)})"


def print_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, short prompts and outputs (smoke run)")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 64, 16 with --quick)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of A B C")
    ap.add_argument("--single-thread-ref", action="store_true",
                    help="also run D: one worker with 1 thread (after C in every round)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--pp-partition", default=None,
                    help="also run C2: PP=2 with this pipeline_layer_partition (e.g. 19,11: the last stage also "
                         "runs the LM head, which costs about 8 of this model's layers)")
    ap.add_argument("--model-dir", default=DEFAULT_DIR)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]
    n = args.requests or (16 if args.quick else 64)
    prompt_len, out_len = ((16, 128), (16, 64)) if args.quick else ((16, 512), (16, 256))

    model = str(build_model(Path(args.model_dir), args.seed))
    tok = AutoTokenizer.from_pretrained(model)
    reqs, _ = build_workload(corpus_tokens(tok), n, prompt_len, out_len, 1.0, args.seed)
    warm = [Req(reqs[0].prompt[:16], 4, True, 0), Req(reqs[1].prompt[:16], 4, True, 1)]
    engine_kwargs = dict(max_model_len=prompt_len[1] + out_len[1], max_num_seqs=args.max_num_seqs, dtype="float32")

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cap_text, cap_ratio = capacity_figure()
    command = "python tests/bench/parallel.py " + " ".join(sys.argv[1:])
    print(f"parallel: {n} requests (greedy, ignore_eos), prompts {prompt_len[0]}-{prompt_len[1]} tokens, "
          f"outputs {out_len[0]}-{out_len[1]}, all at once; {args.rounds} rounds of A B C; model {model}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}, ray {ray.__version__}")
    print(f"code: {code_version()}")

    configs = {**CONFIGS, **(REFERENCE if args.single_thread_ref else {})}
    if args.pp_partition:
        configs["C2"] = dict(pipeline_parallel_size=2, worker_num_threads=1, pipeline_layer_partition=args.pp_partition)
        LABELS["C2"] = f"C2 PP=2 x 1 thread, layers {args.pp_partition}"
    results: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for rnd in range(args.rounds):
        for key, extra in configs.items():
            t0 = time.perf_counter()
            r = run_config(model, extra, reqs, warm, engine_kwargs)
            results[key].append(r)
            print(f"round {rnd + 1} {LABELS[key]}: {r['tps']:.1f} tok/s, wall {r['wall']:.1f} s, TTFT p50 "
                  f"{r['ttft']:.2f} s, ITL p50 {r['itl'] * 1e3:.1f} ms, collectives {r['coll']:.1%} of "
                  f"forward+sample, forward+sample {r['fwd_share']:.1%} of wall, {r['steps']} worker steps "
                  f"({time.perf_counter() - t0:.0f} s with start and shutdown); other processes used "
                  f"{r['foreign']:.2f} cores meanwhile", flush=True)
    ray.shutdown()

    rows: list[tuple[str, ...]] = []
    for key in configs:
        rs = results[key]
        rows.append((LABELS[key], "output tok/s", med_span([r["tps"] for r in rs], ".1f"), "-", "-"))
        rows.append((LABELS[key], "TTFT p50 s", med_span([r["ttft"] for r in rs], ".2f"), "-", "-"))
        rows.append((LABELS[key], "ITL p50 ms", med_span([r["itl"] * 1e3 for r in rs], ".1f"), "-", "-"))
        if key in ("B", "C", "C2"):
            rows.append((LABELS[key], "leader collectives / (forward+sample)",
                         med_span([r["coll"] * 100 for r in rs], ".1f") + " %", "-", "-"))
        rows.append((LABELS[key], "other processes' CPU during the run, cores",
                     med_span([r["foreign"] for r in rs], ".2f"), "-", "-"))
    for key, target in (("B", TARGET_TP), ("C", TARGET_PP), ("C2", TARGET_PP)):
        if key not in results:
            continue
        ratios = [b["tps"] / a["tps"] for a, b in zip(results["A"], results[key])]
        met = "yes" if statistics.median(ratios) >= target else "NO"
        rows.append((f"{key}/A", "output tok/s ratio per round", med_span(ratios, ".2f") + "x", f">= {target}x", met))
    if "D" in results:
        ratios = [d["tps"] / a["tps"] for a, d in zip(results["A"], results["D"])]
        rows.append(("D/A", "output tok/s ratio per round (the second thread's gain, inverted)",
                     med_span(ratios, ".2f") + "x", "-", "-"))
    rows.append(("capacity", "KV tokens, TP=3 group / one worker (SmolLM2 shape, equal KV bytes per rank)",
                 f"{cap_ratio:.1f}x", "-", "-"))

    print()
    print(f"host: {cpu_model()} ({socket.gethostname()}), {os.cpu_count()} CPUs")
    print(f"command: `{command}`")
    print()
    print_table(("configuration", "figure", "median (min-max)", "target", "met?"), rows)
    print()
    print("notes:")
    print(f"  {cap_text}")
    print("  TTFT = first token - arrival (everything arrives at t=0: queueing included); "
          "ITL = (last - first token) / (n - 1) per request, p50 over requests; median (min-max) over rounds.")
    print("  collectives: the group leader's seconds in all-reduces, logits gather, stage hand-off, token "
          "broadcast (StepStats.collective), over its forward + sample.")
    busy = load_at_start > 0.5 * (os.cpu_count() or 1)
    print(f"  1-minute load average when the script started: {load_at_start:.1f} on {os.cpu_count()} CPUs"
          + (" -- other work was running" if busy else ""))
    foreign = [r["foreign"] for rs in results.values() for r in rs]
    disturbed = [f"round {i + 1} {key} ({r['foreign']:.2f})" for key, rs in results.items() for i, r in enumerate(rs)
                 if r["foreign"] > 0.1]
    print(f"  CPU used by other processes during the timed runs (host busy time less this script's): median "
          f"{statistics.median(foreign):.2f} cores, max {max(foreign):.2f}"
          + (f"; runs shared with other work (> 0.1 cores), their timings unreliable: {', '.join(disturbed)}"
             if disturbed else ""))


if __name__ == "__main__":
    main()
