"""A soak under faults: the Serve app at moderate load for a long while, with a worker
SIGKILL or a worker node's removal every few minutes (issue 39).

Run: ``python tests/bench/soak.py [--minutes 30] [--fault-every 180] [--quick]``.

A ``ray.cluster_utils.Cluster`` on this machine (a head with no CPUs that runs Serve and
the app's replica, two worker nodes of one CPU, one worker each: ``tests/chaos.py``),
``build_app`` on the tiny random model (``--model`` for another), ``--concurrency``
closed-loop HTTP clients (completions and chat, streaming and not, greedy and seeded
temperature 0.8) cycling over a pool of requests whose undisturbed answers are taken
first. After ``--warmup`` seconds the first sample; then a fault every ``--fault-every``
seconds, SIGKILL of a worker's process and removal of a worker's node (a fresh node is
added, as an autoscaler would) in turn, each followed by ``/health`` going green again;
the last sample at the end. Samples are taken with new requests held back until nothing
is in flight: RSS, threads and open files of the replica (the driver: engine, scheduler,
HTTP) and of each worker (psutil on their PIDs).

Printed: requests sent, answered whole, lost, duplicated (client side: an answer for
another id, two finishes or ``[DONE]``s, one response id twice; engine side:
``vllm:request_success_total`` against requests sent), with another text; each fault and
how long until ``/health`` was green; the figures after warm-up and at the end and
whether each stayed within ``--tolerance`` (10%). Exit status 1 when anything was lost,
duplicated or different, or a figure grew beyond the tolerance. ``--quick`` (what
``raydecode bench --quick`` passes): 3 minutes, a fault every 40 s, 30 s warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import Row, emit  # noqa: E402

from chaos import (  # noqa: E402
    INJECT,
    ChaosCluster,
    SoakReport,
    SoakSettings,
    app_args,
    make_specs,
    run_load,
    soak,
    tally,
    texts,
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the soak (default 30)")
    ap.add_argument("--fault-every", type=float, default=180.0, help="seconds between faults (default 180)")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the first sample (default 60)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    ap.add_argument("--faults", default="worker SIGKILL,node removal",
                    help=f"comma-separated, injected in turn: {', '.join(INJECT)} (default: both)")
    ap.add_argument("--pool", type=int, default=96, help="distinct requests the clients cycle over (default 96)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed growth of each figure (default 0.10)")
    ap.add_argument("--model", default=None, help="model folder (default: the tests' tiny random Llama)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 minutes, a fault every 40 s, 30 s warm-up")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.fault_every, args.warmup = 3.0, 40.0, 30.0
    args.faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    unknown = [f for f in args.faults if f not in INJECT]
    if unknown or not args.faults:
        ap.error(f"--faults: unknown {unknown}; choose from {list(INJECT)}")
    if args.warmup >= args.minutes * 60:
        ap.error("--warmup must be shorter than the soak")
    return args


def rows_of(report: SoakReport, tolerance: float) -> list[Row]:
    t = report.tally
    clean = not (t.lost or t.duplicated or t.wrong) and report.engine_finished == t.sent
    rows = [
        Row("soak: requests lost / duplicated / other text", f"{len(t.lost)} / {len(t.duplicated)} / {len(t.wrong)} "
            f"of {t.sent} (engine finished {report.engine_finished})", target="0 / 0 / 0", met=clean),
        Row("soak: faults injected", ", ".join(f"{f.kind} (green in {f.green_after_s:.0f} s)" for f in report.faults)
            or "none"),
    ]
    flat = report.flat(tolerance)
    for name, (a, b, rel) in report.growth().items():
        show = (lambda v: f"{v / 2**20:.0f} MiB") if name.endswith("rss") else (lambda v: f"{v:.1f}")
        rows.append(Row(f"soak: {name}, after warm-up -> end", f"{show(a)} -> {show(b)} ({rel:+.1%})",
                        target=f"within {tolerance:.0%}", met=flat[name]))
    return rows


def main() -> int:
    args = parse_args()
    settings = SoakSettings(duration_s=args.minutes * 60, warmup_s=args.warmup, fault_every_s=args.fault_every,
                            concurrency=args.concurrency, faults=args.faults, seed=args.seed)
    model = args.model
    if model is None:
        from tiny_model import build_tiny_model

        model = str(build_tiny_model(os.path.join(tempfile.gettempdir(), "raydecode-soak-tiny-llama")))
    started = time.monotonic()
    cl = ChaosCluster()
    try:
        url = cl.deploy(app_args(model), "soak", worker_nodes=2)
        print(f"the app is up after {time.monotonic() - started:.0f} s: {url}", flush=True)
        pool = make_specs(args.pool, seed=args.seed)
        outcomes = asyncio.run(run_load(url, [(f"ref-{s.key}", s) for s in pool], args.concurrency, settings.timeout_s))
        undisturbed = tally(outcomes, {})
        if undisturbed.ok != len(pool):
            print(f"the undisturbed pass failed: {undisturbed.summary()}", flush=True)
            return 1
        expected = texts(outcomes)
        print(f"undisturbed answers of {len(pool)} requests taken; soaking for {args.minutes:g} min", flush=True)
        report = soak(cl, url, pool, expected, settings, log=lambda line: print(line, flush=True))
    finally:
        cl.close()
    lines = report.lines(args.tolerance)
    print("\n".join(lines), flush=True)
    emit("soak", rows_of(report, args.tolerance), notes=lines)
    t = report.tally
    ok = (not (t.lost or t.duplicated or t.wrong) and report.engine_finished == t.sent
          and all(report.flat(args.tolerance).values()))
    print("soak: " + ("PASS" if ok else "FAIL"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
