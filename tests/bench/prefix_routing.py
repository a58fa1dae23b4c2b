"""Prefix-cache hit rate across engine replicas: prefix-aware routing, Serve's power of
two choices, and one replica alone.

Run: ``python tests/bench/prefix_routing.py [--quick] [--runs N] [--model PATH]``.

One Serve app, one ingress, three engine deployments of the same model (the tiny random
model unless ``--model``): ``prefix`` (2 replicas, the prefix-aware router),
``pow2`` (2 replicas, power of two choices) and ``single`` (1 replica). Each run draws 4
fresh long system prompts and sends the same 4 x ``--per-prompt`` chat requests (the
system prompt, a distinct short user turn; interleaved 0 1 2 3 0 ...; ``--concurrency``
clients) to each deployment in turn, with fresh prompts per deployment too, so no
measurement finds another's prefixes cached. Printed per setup: the prefix-cache hit
rate (tokens hit / tokens looked up, from ``/metrics``, all replicas of the deployment
together), the requests per second, and the spread over the runs (median, min, max);
then the ratio of each 2-replica setup's hit rate to one replica's (the issue's target:
prefix-aware >= 90% of one replica alone).

``--kv-cache-tokens N`` sizes the KV pool of each 2-replica setup's replicas, and gives
the single replica 2N, the same KV memory in all: with N = 1024 (the tiny model's
prompts are about 360 tokens) a replica holds about 2 of the 4 system prompts, so routing
decides whether they stay cached. By default every pool holds all 4 (8 x 512 tokens).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from _results import Row, emit  # noqa: E402
from ray import serve  # noqa: E402

from helpers import free_port  # noqa: E402
from prefix_workload import Run, chat_requests, engine_args, measure, multi_engine_app, send_all, system_prompts  # noqa: E402

SETUPS = {"prefix": (2, "prefix_aware"), "pow2": (2, "power_of_two"), "single": (1, "prefix_aware")}
TARGET = 0.9


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the tiny random model, built here)")
    ap.add_argument("--quick", action="store_true", help="2 runs of 32 requests")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--per-prompt", type=int, default=None, help="requests per system prompt (default 16)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-chars", type=int, default=900, help="characters of each system prompt")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV pool of each replica of the 2-replica setups; the single replica gets twice as much "
                         "(default: 8 x 512 each)")
    args = ap.parse_args()
    runs = args.runs or (2 if args.quick else 5)
    per_prompt = args.per_prompt or (8 if args.quick else 16)
    model = args.model
    if model is None:
        import tempfile

        from tiny_model import build_tiny_model

        model = str(build_tiny_model(os.path.join(tempfile.gettempdir(), "raydecode-bench-tiny")))
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    def engine(replicas: int) -> dict[str, int]:  # the same KV memory per setup
        return {"kv_cache_tokens": args.kv_cache_tokens * 2 // replicas} if args.kv_cache_tokens else {}

    serve.run(multi_engine_app({name: engine_args(model, name, replicas, router, **engine(replicas))
                                for name, (replicas, router) in SETUPS.items()}), name="prefix-bench", route_prefix="/")
    results: dict[str, list[Run]] = {name: [] for name in SETUPS}
    sent = dict.fromkeys(SETUPS, 0)
    names = list(SETUPS)
    try:
        for i, name in enumerate(names):  # warm-up (first calls, first steps): not measured
            sent[name] += len(warm := chat_requests(-1 - i, system_prompts(-1 - i, 2, 200), 2))
            send_all(url, name, warm, args.concurrency)
        for run in range(runs):
            for name in names[run % 3:] + names[:run % 3]:  # each goes first in turn
                seed = 1000 * run + names.index(name)  # fresh prompts for every setup of every run
                bodies = chat_requests(seed, system_prompts(seed, 4, args.system_chars), per_prompt)
                r = measure(url, name, bodies, args.concurrency, sent[name])
                sent[name] += len(bodies)
                results[name].append(r)
                per_replica = " / ".join(f"{q:.0f}" for q in sorted(r.per_replica_queries.values()))
                print(f"run {run} {name:7s} hit rate {r.hit_rate:.3f}  {r.requests_per_s:5.1f} req/s  "
                      f"tokens looked up per replica {per_replica}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    single = [r.hit_rate for r in results["single"]]
    pools = (f"KV pool {args.kv_cache_tokens} tokens per replica ({2 * args.kv_cache_tokens} for the single one)"
             if args.kv_cache_tokens else "KV pools holding every prefix")
    print(f"\n{runs} runs x {4 * per_prompt} chat requests (4 system prompts of {args.system_chars} chars, "
          f"concurrency {args.concurrency}, {pools}); median (min-max)")
    print(f"{'setup':8s} {'hit rate':>22s} {'req/s':>20s} {'hit rate / single':>24s}")
    rows = []
    for name, (replicas, router) in SETUPS.items():
        rates = [r.hit_rate for r in results[name]]
        ratios = [h / s if s else 0.0 for h, s in zip(rates, single)]
        rps = [r.requests_per_s for r in results[name]]
        print(f"{name:8s} {spread(rates):>22s} {spread(rps, '{:.1f}'):>20s} {spread(ratios):>24s}")
        label = f"{replicas} replica{'s' if replicas > 1 else ''}, {router}"
        met = min(ratios) >= TARGET if name == "prefix" else None
        rows.append(Row(f"prefix hit rate, {label} (x one replica's)", f"{spread(rates)} ({spread(ratios)}x)",
                        target=">= 0.9x one replica" if name == "prefix" else "", met=met))
        rows.append(Row(f"chat requests/s, {label}", spread(rps, "{:.1f}")))
    emit("prefix_routing", rows, notes=[
        f"prefix_routing: {runs} runs x {4 * per_prompt} chats on 4 fresh system prompts each, {pools}; hit rate "
        "from /metrics (tokens hit / looked up); median (min-max)"])


if __name__ == "__main__":
    main()
