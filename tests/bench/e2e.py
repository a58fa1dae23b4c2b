"""End-to-end offline throughput of ``LLM.generate`` vs transformers, same run.

Run: ``python tests/bench/e2e.py [--quick] [--requests 64] [--skip-peers] [--num-workers 1]``.

Workload (seeded, identical for every system): ``--requests`` prompts (default 64) cut
from a fixed text corpus (the docstrings of some Python stdlib modules, tokenized) to
16-512 tokens, each with its own output length of 16-256 tokens; every request has
``ignore_eos`` semantics (EOS removed) so each system makes exactly the requested tokens.
Two workloads: "greedy" (all greedy) and "mix" (``--greedy-fraction`` greedy, the rest
sampled with temperature 0.8, top_p 0.95, top_k 50, a seed per request).

  ours      ``LLM(model=None, max_num_seqs=64, ...).generate(prompts, params)``: the whole
            workload in one call, all requests arriving at once.
  static    ``model.generate`` (SmolLM2 in the driver, float32, all CPU threads) on
            left-padded batches of 16 in arrival order; greedy and sampled requests go
            in separate batches (``generate`` cannot mix them per row); a batch runs to
            its longest ``max_tokens``, only the tokens each request asked for count.
  cb        transformers' continuous batching, the engine behind ``model.generate_batch``
            (``--cb-api``, see ``run_cb``), with the same rows / token budget as ours.

Figures: useful output tokens / wall seconds for each system and the ratios; for ours
TTFT (first token - arrival, everything arrives at t=0 so it includes queueing) and ITL
((last - first token) / (n - 1) per request) percentiles over requests; and the driver
overhead ``1 - StepStats.wait / wall``: the share of wall time the driver was not
blocked waiting on a worker step (scheduling, encoding, merging replies, building
outputs). It bounds from above the time the worker sits idle because of the driver.
Also the share of wall time outside the worker's forward + sample (everything else: the
driver, the Ray call, the worker's own bookkeeping; from ``StepStats``), and ours again
with two workers of one CPU each instead of one worker with both (``--no-two-workers``
skips it).
Targets (CPU): ours >= 1.5x static ``generate``, >= 1.2x ``generate_batch``; driver
overhead <= 10% and time outside forward + sample <= 5% at batch 64. One round per system: a full run takes about 30 minutes on a
2-core CPU (most of it in the peers); ``--quick`` a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from _results import Row, cpu_model, emit  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from cluster.engine import StepStats  # noqa: E402
from cluster.llm import LLM  # noqa: E402
from sampler.params import SamplingParams  # noqa: E402
from worker.runner.model_loader import default_model_path  # noqa: E402

STATIC_BATCH = 16
TEMPERATURE, TOP_P, TOP_K = 0.8, 0.95, 50
TARGET_STATIC, TARGET_CB, TARGET_OVERHEAD, TARGET_OUTSIDE = 1.5, 1.2, 0.10, 0.05
#: stdlib modules whose docstrings make the prompt corpus (fixed for a Python version)
CORPUS_MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "email", "functools", "http.client", "inspect", "itertools", "json",
    "logging", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest",
    "urllib.request", "zipfile",
]


# -- workload -------------------------------------------------------------------------


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    greedy: bool
    seed: int


def corpus_text() -> str:
    """The docstrings of ``CORPUS_MODULES`` and their members, one after another."""
    parts: list[str] = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def corpus_tokens(tok: Any) -> list[int]:
    """One long token stream: ``corpus_text`` tokenized."""
    return tok.encode(corpus_text(), add_special_tokens=False)


def build_workload(stream: list[int], n: int, prompt_len: tuple[int, int], out_len: tuple[int, int],
                   greedy_fraction: float, seed: int) -> tuple[list[Req], list[Req]]:
    """(greedy workload, mixed workload): the same prompts and lengths; in the mix a fixed
    ``greedy_fraction`` of the requests (seeded choice) stays greedy."""
    rng = random.Random(seed)
    base: list[tuple[list[int], int]] = []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(0, len(stream) - length)
        base.append((stream[start:start + length], rng.randint(*out_len)))
    greedy_rows = set(rng.sample(range(n), round(greedy_fraction * n)))
    greedy = [Req(p, o, True, seed + i) for i, (p, o) in enumerate(base)]
    mix = [Req(p, o, i in greedy_rows, seed + i) for i, (p, o) in enumerate(base)]
    return greedy, mix


# -- results --------------------------------------------------------------------------


@dataclass
class Result:
    wall: float = math.nan
    useful_tokens: int = 0
    computed_tokens: int = 0  # rows x steps actually generated (padding waste included)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    overhead: float | None = None  # ours: 1 - wait / wall
    driver_share: float | None = None  # ours: StepStats.driver / wall
    outside: float | None = None  # ours: 1 - (worker forward + sample) / wall
    error: str | None = None

    @property
    def tps(self) -> float:
        return self.useful_tokens / self.wall if self.wall > 0 else math.nan


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> list[float]:
    if not values:
        return [math.nan] * len(qs)
    if len(values) == 1:
        return values * len(qs)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return [cuts[q - 1] for q in qs]


def latencies(ttft: list[float], spans: list[tuple[float, float, int]]) -> tuple[list[float], list[float]]:
    """ITL per request from (first token time, last token time, n tokens)."""
    return ttft, [(last - first) / (n - 1) for first, last, n in spans if n > 1]


# -- ours -----------------------------------------------------------------------------


def sampling_params(r: Req) -> SamplingParams:
    if r.greedy:
        return SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
    return SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=r.seed,
                          max_tokens=r.max_tokens, ignore_eos=True)


def run_ours(llm: LLM, reqs: list[Req]) -> Result:
    llm.engine.stats = StepStats()
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], [sampling_params(r) for r in reqs], use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.engine.stats
    ttft, spans = [], []
    for r, out in zip(reqs, outs):
        n = len(out.outputs[0].token_ids)
        if n != r.max_tokens:
            raise RuntimeError(f"ours made {n} tokens for a request of max_tokens={r.max_tokens}")
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        spans.append((m.first_token_time, m.last_token_time, n))
    useful = sum(r.max_tokens for r in reqs)
    t, itl = latencies(ttft, spans)
    return Result(wall, useful, useful, t, itl, overhead=1 - stats.wait / wall, driver_share=stats.driver / wall,
                  outside=1 - (stats.forward + stats.sample) / wall)


# -- static model.generate ------------------------------------------------------------


def static_batches(reqs: list[Req]) -> list[list[Req]]:
    """Arrival order, batches of ``STATIC_BATCH``, greedy and sampled requests apart."""
    out = []
    for kind in (True, False):
        group = [r for r in reqs if r.greedy == kind]
        out += [group[i:i + STATIC_BATCH] for i in range(0, len(group), STATIC_BATCH)]
    return out


def generate_padded(model: Any, pad: int, batch: list[Req]) -> int:
    """Runs one left-padded batch to its longest max_tokens; returns that length."""
    width = max(len(r.prompt) for r in batch)
    new = max(r.max_tokens for r in batch)
    ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=model.device)
    kwargs: dict[str, Any] = {"do_sample": False}
    if not batch[0].greedy:
        torch.manual_seed(batch[0].seed)  # one stream per batch: no per-row seeds in generate
        kwargs = {"do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=pad, **kwargs)
    if out.shape[1] != width + new:
        raise RuntimeError(f"generate made {out.shape[1] - width} tokens, asked for {new}")
    return new


def run_static(model: Any, pad: int, reqs: list[Req]) -> Result:
    start = time.perf_counter()
    computed = sum(len(b) * generate_padded(model, pad, b) for b in static_batches(reqs))
    return Result(time.perf_counter() - start, sum(r.max_tokens for r in reqs), computed)


# -- transformers continuous batching -------------------------------------------------


def cb_config(reqs: list[Req], max_rows: int, max_batch_tokens: int) -> Any:
    """Sized like ours: ``max_rows`` requests and ``max_batch_tokens`` tokens per step, a
    KV cache that holds the whole workload (no eviction, as ours never preempts)."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        from transformers import ContinuousBatchingConfig

    page = 256  # the default page size
    blocks = sum(math.ceil((len(r.prompt) + r.max_tokens) / page) for r in reqs) + 4
    wanted = dict(page_size=page, block_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                  max_requests_per_batch=max_rows, per_request_processors=True, seed=reqs[0].seed)
    # The config's field names moved between transformers releases (page_size was
    # block_size): pass the ones this release takes.
    accepted = set(inspect.signature(ContinuousBatchingConfig).parameters)
    if page_size_missing := "page_size" not in accepted:
        wanted.pop("page_size")
    if not page_size_missing:
        wanted.pop("block_size")
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in accepted})


def cb_generation_config(sampled: bool, max_new_tokens: int) -> GenerationConfig:
    kwargs: dict[str, Any] = {"do_sample": False}
    if sampled:
        kwargs = {"do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K}
    # eos -1: no EOS stop (CB's own spelling of "disabled")
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0, **kwargs)


def run_cb(model: Any, reqs: list[Req], api: str, max_rows: int, max_batch_tokens: int) -> Result:
    """``api="manager"``: ``model.continuous_batching_context_manager`` (what
    ``generate_batch`` runs inside) with ``add_request(ids, max_new_tokens=per request,
    top_k=1 for greedy rows)``: per-request lengths, greedy and sampled rows in one batch;
    the manager is built and warmed up before the clock starts.
    ``api="generate_batch"``: ``model.generate_batch(inputs, generation_config)`` as is:
    one ``max_new_tokens`` for all (the workload's longest; only requested tokens count),
    one call per sampling kind, manager setup inside the timing."""
    if api == "generate_batch":
        start = time.perf_counter()
        computed = 0
        for kind in (True, False):
            group = [r for r in reqs if r.greedy == kind]
            if not group:
                continue
            new = max(r.max_tokens for r in group)
            res = model.generate_batch(
                inputs=[r.prompt for r in group], generation_config=cb_generation_config(not kind, new),
                continuous_batching_config=cb_config(group, max_rows, max_batch_tokens), progress_bar=False,
            )
            if len(res) != len(group) or any(o.error or len(o.generated_tokens) != new for o in res.values()):
                raise RuntimeError("generate_batch lost requests or made the wrong number of tokens")
            computed += new * len(group)
        return Result(time.perf_counter() - start, sum(r.max_tokens for r in reqs), computed)

    sampled = any(not r.greedy for r in reqs)
    gen_cfg = cb_generation_config(sampled, max(r.max_tokens for r in reqs))
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_config(reqs, max_rows, max_batch_tokens),
        block=True, timeout=5,
    ) as manager:
        start = time.perf_counter()
        ids = {}
        for i, r in enumerate(reqs):
            extra = {"top_k": 1} if sampled and r.greedy else {}  # top-k 1 = argmax
            rid = manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                      record_timestamps=True, **extra)
            ids[rid] = r
        results: dict[str, Any] = {}
        while len(results) < len(reqs):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped early")
        wall = time.perf_counter() - start
    ttft, spans = [], []
    for rid, r in ids.items():
        out = results[rid]
        n = len(out.generated_tokens)
        if out.error or n != r.max_tokens:
            raise RuntimeError(f"cb request {rid}: {out.error or f'{n} tokens for {r.max_tokens}'}")
        ts = out.timestamps
        ttft.append(ts[0] - start)
        spans.append((ts[0], ts[-1], n))
    useful = sum(r.max_tokens for r in reqs)
    t, itl = latencies(ttft, spans)
    return Result(wall, useful, useful, t, itl)


def guarded(fn: Callable[[], Result]) -> Result:
    """A peer that cannot run here becomes a row that says so, not a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return Result(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:120])


# -- report ---------------------------------------------------------------------------


def print_table(rows: list[tuple[str, ...]]) -> None:
    head = ("workload", "figure", "ours", "peer", "ratio", "target", "met?")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: " | ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def rows_for(name: str, ours: Result, static: Result | None, cb: Result | None, cb_label: str,
             batch: int) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []

    def vs(label: str, peer: Result | None, target: float) -> None:
        if peer is None:
            return
        if peer.error:
            rows.append((name, f"output tok/s vs {label}", f"{ours.tps:.1f}", "could not run", "-",
                         f">= {target}x", "n/a"))
            return
        ratio = ours.tps / peer.tps
        rows.append((name, f"output tok/s vs {label}", f"{ours.tps:.1f}", f"{peer.tps:.1f}",
                     f"{ratio:.2f}x", f">= {target}x", "yes" if ratio >= target else "NO"))

    def lat(label: str, ours_v: list[float], peer_v: list[float] | None, scale: float, unit: str) -> None:
        fmt = lambda v: "/".join(f"{x * scale:.0f}" if scale > 1 else f"{x * scale:.2f}" for x in percentiles(v))  # noqa: E731
        peer_txt = fmt(peer_v) if peer_v else "-"
        rows.append((name, f"{label} p50/p90/p99 {unit}", fmt(ours_v), peer_txt, "-", "-", "-"))

    vs(f"static generate (bs {STATIC_BATCH})", static, TARGET_STATIC)
    vs(cb_label, cb, TARGET_CB)
    cb_lat = cb is not None and not cb.error and bool(cb.ttft)
    lat("TTFT", ours.ttft, cb.ttft if cb_lat else None, 1.0, "s")
    lat("ITL", ours.itl, cb.itl if cb_lat else None, 1000.0, "ms")
    met = "yes" if ours.overhead <= TARGET_OVERHEAD else "NO"
    rows.append((name, f"driver overhead 1-wait/wall (batch {batch})", f"{ours.overhead:.1%}", "-", "-",
                 f"<= {TARGET_OVERHEAD:.0%}", met))
    met = "yes" if ours.outside <= TARGET_OUTSIDE else "NO"
    rows.append((name, f"share of wall outside worker forward+sample (batch {batch})", f"{ours.outside:.1%}",
                 "-", "-", f"<= {TARGET_OUTSIDE:.0%}", met))
    rows.append((name, "wall s", f"{ours.wall:.1f}",
                 " / ".join(f"{p.wall:.1f}" if not p.error else "-" for p in (static, cb) if p is not None) or "-",
                 "-", "-", "-"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, short prompts and outputs (smoke run)")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (default 64, 16 with --quick)")
    ap.add_argument("--skip-peers", action="store_true", help="ours only (no transformers runs)")
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="ours' step token budget, also CB's max_batch_tokens (default: EngineConfig's)")
    ap.add_argument("--greedy-fraction", type=float, default=0.25, help="greedy share of the mix workload")
    ap.add_argument("--cb-api", choices=["manager", "generate_batch"], default="manager",
                    help="how to drive transformers' continuous batching (see run_cb)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="none",
                    help="ours' weights: none (default: float32, what transformers runs), or None for the embedded "
                         "Q4_1 file kept quantized")
    ap.add_argument("--no-two-workers", action="store_true",
                    help="skip the second run of ours with two workers of one CPU each")
    args = ap.parse_args()
    args.quantization = None if args.quantization == "None" else args.quantization
    load_at_start = os.getloadavg()[0]  # before this script's own work adds to it
    n = args.requests or (16 if args.quick else 64)
    prompt_len, out_len = ((16, 128), (16, 64)) if args.quick else ((16, 512), (16, 256))

    torch.set_num_threads(os.cpu_count() or 1)
    path = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    greedy, mix = build_workload(corpus_tokens(tok), n, prompt_len, out_len, args.greedy_fraction, args.seed)

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    engine_kwargs: dict[str, Any] = {"max_model_len": prompt_len[1] + out_len[1]}
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=None, quantization=args.quantization, num_workers=args.num_workers, max_num_seqs=args.max_num_seqs,
              **engine_kwargs)
    budget = llm.engine.config.max_num_batched_tokens
    warm = [Req(greedy[0].prompt[:16], 4, True, 0), Req(greedy[1].prompt[:16], 4, False, 1)]
    run_ours(llm, warm)

    model = None
    pad = 0
    if not args.skip_peers:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config = copy.deepcopy(model.generation_config)
        model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to its length
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        generate_padded(model, pad, warm[:1])

    cb_label = "generate_batch (CB)" if args.cb_api == "generate_batch" else "generate_batch CB manager"
    print(f"end-to-end offline throughput, {n} requests, prompts {prompt_len[0]}-{prompt_len[1]} tokens, "
          f"outputs {out_len[0]}-{out_len[1]} tokens, ignore_eos; mix = {args.greedy_fraction:.0%} greedy + "
          f"sampled (T={TEMPERATURE}, top_p={TOP_P}, top_k={TOP_K})")
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, ray {ray.__version__}; SmolLM2-135M-Instruct float32")
    print(f"ours: LLM(num_workers={args.num_workers}, max_num_seqs={args.max_num_seqs}, "
          f"max_num_batched_tokens={budget}, max_model_len={engine_kwargs['max_model_len']})")

    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    ours_by_name: dict[str, Result] = {}
    for name, reqs in (("greedy", greedy), ("mix", mix)):
        print(f"running {name}: ours ...", flush=True)
        ours = ours_by_name[name] = run_ours(llm, reqs)
        static = cb = None
        if model is not None:
            print(f"running {name}: static generate ...", flush=True)
            static = guarded(lambda: run_static(model, pad, reqs))  # noqa: B023 (called here)
            print(f"running {name}: {cb_label} ...", flush=True)
            cb = guarded(lambda: run_cb(model, reqs, args.cb_api, args.max_num_seqs, budget))  # noqa: B023
            for label, p in (("static generate", static), (cb_label, cb)):
                if p.error:
                    notes.append(f"{name}: {label} could not run: {p.error}")
            if not static.error:
                notes.append(f"{name}: static generate computed {static.computed_tokens} row-tokens for "
                             f"{static.useful_tokens} useful ({static.computed_tokens / static.useful_tokens:.2f}x, "
                             "padding to each batch's longest output)")
            if not cb.error and cb.computed_tokens != cb.useful_tokens:
                notes.append(f"{name}: generate_batch computed {cb.computed_tokens} row-tokens for "
                             f"{cb.useful_tokens} useful (one max_new_tokens per call)")
        notes.append(f"{name}: ours driver time (schedule+encode+decode+merge+outputs) = "
                     f"{ours.driver_share:.1%} of wall")
        rows += rows_for(name, ours, static, cb, cb_label, min(n, args.max_num_seqs))

    if not args.no_two_workers and args.num_workers == 1 and (os.cpu_count() or 1) >= 2:
        llm.shutdown()
        llm = LLM(model=None, quantization=args.quantization, num_workers=2, worker_num_cpus=(os.cpu_count() or 2) // 2,
                  max_num_seqs=args.max_num_seqs, **engine_kwargs)
        run_ours(llm, warm)
        for name, reqs in (("greedy", greedy), ("mix", mix)):
            print(f"running {name}: ours with two workers ...", flush=True)
            two, one = run_ours(llm, reqs), ours_by_name[name]
            ratio = two.tps / one.tps
            rows.append((name, "output tok/s, 2 workers x half the CPUs vs 1 worker x all", f"{two.tps:.1f}",
                         f"{one.tps:.1f}", f"{ratio:.2f}x", "-", "-"))

    print()
    print_table(rows)
    print()
    print("notes:")
    print("  TTFT = first token - arrival (all requests arrive at once: queueing included); "
          "ITL = (last - first token) / (n - 1) per request; peer latencies are the CB run's.")
    print("  driver overhead = 1 - (time blocked in ray.wait on worker steps) / wall: the share of wall time "
          "the driver spent on its own work; an upper bound on worker idle time caused by the driver.")
    if args.cb_api == "manager":
        print("  CB manager: model.continuous_batching_context_manager + add_request(max_new_tokens=per request); "
              "greedy rows in the mix use per-request top_k=1; one global seed (no per-request seeds); "
              "manager setup and warm-up outside the timing. generate_batch itself takes one max_new_tokens "
              "for all requests (--cb-api generate_batch runs it as is).")
    else:
        print("  generate_batch: one max_new_tokens (the longest) per call, one call per sampling kind; "
              "only requested tokens count; manager setup inside the timing.")
    for note in notes:
        print(f"  {note}")
    busy = load_at_start > 0.5 * (os.cpu_count() or 1)
    print(f"  1-minute load average when the script started: {load_at_start:.1f} on {os.cpu_count()} CPUs"
          + (" -- other work was running: timings are unreliable" if busy else ""))
    met = {"yes": True, "NO": False}
    emit("e2e", [
        Row(f"{workload}: {figure}", ours, peer, ratio, target if target != "-" else "", met.get(ok))
        for workload, figure, ours, peer, ratio, target, ok in rows if not figure.startswith("wall")
    ], notes=[f"{n} requests, prompts {prompt_len[0]}-{prompt_len[1]} tokens, outputs {out_len[0]}-{out_len[1]}, "
              f"ignore_eos, all arriving at once; one worker with all CPUs, max_num_seqs {args.max_num_seqs}, "
              f"{budget}-token steps"] + notes)
    llm.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
