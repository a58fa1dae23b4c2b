"""Logprobs at the driver: GC-tracked objects and time to merge 1000 positions x top-5
into ``FlatLogprobs`` (what the driver does: the reply's logprob arrays become lists in
one call per step, then one ``append_position`` per sampled token) against vLLM's
classic ``list[dict[int, Logprob]]`` built from the same lists.

Run: ``python tests/bench/logprobs_merge.py [--quick]``. Target (issue 6): the flat
container's tracked objects <= 1% of the list-of-dicts'.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _results import Row, emit  # noqa: E402
from _timing import time_side_by_side  # noqa: E402

from sampler.logprobs import FlatLogprobs, Logprob  # noqa: E402

TOP = 5


def make_reply(positions: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[str]]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 49152, size=(positions, TOP + 1), dtype=np.int32)
    vals = -np.sort(rng.exponential(size=(positions, TOP + 1)).astype(np.float32), axis=1)
    ranks = rng.integers(1, 100, size=positions, dtype=np.int32)
    texts = [[f"tok{t}" for t in row] for row in ids.tolist()]
    return ids, vals, ranks, texts


def merge_flat(reply) -> FlatLogprobs:
    ids, vals, ranks, texts = reply
    out = FlatLogprobs()
    for p in range(len(ids)):  # one step's reply at a time, as the driver merges
        row_ids, row_vals, row_ranks = ids[p : p + 1].tolist(), vals[p : p + 1].tolist(), ranks[p : p + 1].tolist()
        out.append_position(row_ids[0], row_vals[0], row_ranks[0], texts[p])
    return out


def merge_dicts(reply) -> list[dict[int, Logprob]]:
    ids, vals, ranks, texts = reply
    out: list[dict[int, Logprob]] = []
    for p in range(len(ids)):
        row_ids, row_vals, row_ranks = ids[p : p + 1].tolist(), vals[p : p + 1].tolist(), ranks[p : p + 1].tolist()
        row_ids, row_vals = row_ids[0], row_vals[0]
        entry = {row_ids[0]: Logprob(row_vals[0], row_ranks[0], texts[p][0])}
        for r in range(1, TOP + 1):
            entry[row_ids[r]] = Logprob(row_vals[r], r, texts[p][r])
        out.append(entry)
    return out


def tracked_objects(build, reply) -> int:
    """GC-tracked objects that ``build`` leaves alive (its result included)."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        result = build(reply)
        after = len(gc.get_objects())
    finally:
        gc.enable()
    del result
    return after - before - 1  # the list gc.get_objects() itself returned is not ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds")
    args = ap.parse_args()
    reply = make_reply(args.positions)
    flat_objs, dict_objs = tracked_objects(merge_flat, reply), tracked_objects(merge_dicts, reply)
    times = time_side_by_side(
        {"flat": (lambda: merge_flat(reply), None), "dicts": (lambda: merge_dicts(reply), None)},
        repeat=5 if args.quick else 21,
    )
    share = flat_objs / dict_objs
    print(f"{args.positions} positions x top-{TOP} (+ the sampled token)")
    print(f"{'figure':<28} | {'FlatLogprobs':>12} | {'list[dict]':>10} | {'ratio':>7} | target")
    print(f"{'GC-tracked objects':<28} | {flat_objs:>12} | {dict_objs:>10} | {share:7.2%} | <= 1%: {'met' if share <= 0.01 else 'NOT met'}")
    print(f"{'merge time (ms)':<28} | {times['flat'] * 1e3:12.2f} | {times['dicts'] * 1e3:10.2f} | "
          f"{times['dicts'] / times['flat']:6.2f}x |")
    what = f"{args.positions} positions x top-{TOP}, FlatLogprobs vs list[dict]"
    emit("logprobs_merge", [
        Row(f"GC-tracked objects kept, {what}", str(flat_objs), str(dict_objs), f"{share:.2%}",
            "<= 1%", share <= 0.01),
        Row(f"merge time ms, {what}", f"{times['flat'] * 1e3:.2f}", f"{times['dicts'] * 1e3:.2f}",
            f"{times['dicts'] / times['flat']:.2f}x"),
    ])


if __name__ == "__main__":
    main()
