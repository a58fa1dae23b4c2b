"""In-place SUM all-reduce between 2 CPU ranks on this machine: gloo (loopback TCP)
against the shared-memory all-reduce (``worker/cpu/shm_allreduce.py``).

Run: ``python tests/bench/allreduce.py [--rows 1 8 64 512] [--hidden 576] [--rounds 30]``.

Two spawned processes, one torch thread each, one gloo process group and one shm
segment. For each [rows, hidden] float32 tensor (a tensor-parallel layer's output:
decode steps have a few rows, prefill chunks hundreds), rounds of ``--calls`` calls of
each, gloo and shm alternating which goes first; every call is timed alone on rank 0
(the tensor refilled untimed before it) and the table shows the median microseconds
per call and gloo / shm. Both give the same sum, bit for bit, which is checked first.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _results import Row, emit  # noqa: E402

from worker.cpu.shm_allreduce import ShmAllReduce  # noqa: E402

WORLD = 2


def timed_calls(fn, t: torch.Tensor, src: torch.Tensor, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t.copy_(src)
        start = time.perf_counter_ns()
        fn(t)
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def rank_main(rank: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    shm = ShmAllReduce.for_group()
    kinds = {"gloo": lambda t: dist.all_reduce(t), "shm": shm.all_reduce}
    table = {}
    for rows in args.rows:
        src = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rank))
        a, b = src.clone(), src.clone()
        dist.all_reduce(a)
        shm.all_reduce(b)
        assert torch.equal(a, b), "gloo and shm sums differ"
        t = src.clone()
        for fn in kinds.values():  # warm-up
            timed_calls(fn, t, src, args.calls)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for r in range(args.rounds):
            for name in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                times[name] += timed_calls(kinds[name], t, src, args.calls)
        table[rows] = {name: statistics.median(v) for name, v in times.items()}
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20, help="calls of one kind in a row")
    args = ap.parse_args()
    if not ShmAllReduce.available():
        print("the CPU kernels could not be built here: nothing to compare")
        emit("allreduce", [], notes=["the CPU kernels could not be built"])
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    table = results.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{WORLD} ranks x 1 thread, float32 [rows, {args.hidden}], in place; median us per call "
          f"over {args.rounds} x {args.calls} calls each")
    print(f"{'rows':>5} {'KB':>7} {'gloo':>9} {'shm':>9} {'gloo/shm':>9}")
    rows: list[Row] = []
    for m, us in table.items():
        kb = m * args.hidden * 4 / 1024
        ratio = us["gloo"] / us["shm"]
        print(f"{m:>5} {kb:>7.1f} {us['gloo']:>9.1f} {us['shm']:>9.1f} {ratio:>8.1f}x")
        rows.append(Row(f"all-reduce of [{m}, {args.hidden}] float32, 2 ranks: us per call, shm vs gloo",
                        f"{us['shm']:.1f}", f"{us['gloo']:.1f}", f"{ratio:.1f}x",
                        ">= 2x" if m <= 64 else "", ratio >= 2 if m <= 64 else None))
    emit("allreduce", rows)


if __name__ == "__main__":
    main()
