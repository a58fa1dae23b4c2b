"""Where a served first token's time goes (issue 38), from two sources, and the steps
that carried it:

* ours: the client's records (``_load_generator``: ``X-Request-Id``, send and first
  token wall times) joined with ``raydecode serve --request-timeline``'s lines
  (``deploy/timeline.py``), one segment per stage of the path;
* either server: the difference of its ``/metrics`` histograms before and after a
  load level (vLLM's names, which ours exports too): queue time, prefill time
  (first scheduled to first token) and TTFT as the engine sees them. Percentiles from
  histogram buckets are interpolated within the bucket (Prometheus'
  ``histogram_quantile``), so they are as coarse as the buckets.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import httpx
from _load_generator import RequestRecord, percentile
from prometheus_client.parser import text_string_to_metric_families

#: (name, from, to): a segment of the first token's path, between two stamps
SEGMENTS = (
    ("client -> ingress handler", "sent", "ingress.in"),
    ("ingress -> engine replica", "ingress.in", "engine.in"),
    ("tokenize, into the engine", "engine.in", "engine.queued"),
    ("waiting queue", "engine.queued", "engine.scheduled"),
    ("first scheduled -> first token", "engine.scheduled", "engine.first_token"),
    ("first token -> event out", "engine.first_token", "engine.first_event"),
    ("event -> client", "engine.first_event", "first"),
    ("TTFT (client)", "sent", "first"),
)

#: vLLM's histograms of a request's engine-side first-token path
ENGINE_HISTOGRAMS = (
    ("queue (engine)", "vllm:request_queue_time_seconds"),
    ("prefill (engine)", "vllm:request_prefill_time_seconds"),
    ("TTFT (engine)", "vllm:time_to_first_token_seconds"),
)


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a stopped server
    return out


def segments(records: list[RequestRecord], lines: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Seconds per segment (``SEGMENTS``) over the requests found in both sources."""
    stages: dict[str, dict[str, float]] = {}
    for line in lines:
        if line.get("stage") == "step":
            continue
        stamps = stages.setdefault(line.get("id", ""), {})
        for k, v in line.items():
            if isinstance(v, (int, float)) and k not in ("prompt_tokens", "cached_tokens"):
                stamps[f"{line.get('stage')}.{k}"] = float(v)
    out: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    for rec in records:
        if rec.error is not None or math.isnan(rec.first_at):
            continue
        stamps = {"sent": rec.sent_at, "first": rec.first_at, **stages.get(rec.request_id, {})}
        for name, a, b in SEGMENTS:
            if a in stamps and b in stamps:
                out[name].append(stamps[b] - stamps[a])
    return out


def scrape(base_url: str) -> str:
    try:
        return httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def _buckets(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(le, cumulative count) summed over label sets, the sum and the count."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
    return sorted(buckets.items()), total, count


def histogram_delta(before: str, after: str, name: str) -> dict[str, float]:
    """``name``'s observations between two scrapes: count, mean, p50, p99 (s)."""
    b0, s0, c0 = _buckets(before, name)
    b1, s1, c1 = _buckets(after, name)
    prev = dict(b0)
    cum = [(le, c - prev.get(le, 0.0)) for le, c in b1]
    n = c1 - c0
    out = {"count": n, "mean": (s1 - s0) / n if n > 0 else math.nan}
    for q in (50, 99):
        out[f"p{q}"] = _quantile(cum, q / 100) if n > 0 else math.nan
    return out


def _quantile(cum: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q."""
    if not cum:
        return math.nan
    total = cum[-1][1]
    rank = q * total
    lo_le, lo_c = 0.0, 0.0
    for le, c in cum:
        if c >= rank:
            if math.isinf(le):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1.0)
        lo_le, lo_c = le, c
    return lo_le


def engine_view(before: str, after: str) -> dict[str, dict[str, float]]:
    return {label: histogram_delta(before, after, name) for label, name in ENGINE_HISTOGRAMS}


def print_breakdown(label: str, level: int, segs: dict[str, list[float]] | None,
                    engine: dict[str, dict[str, float]] | None) -> None:
    print(f"    {label} at {level} streams: where the first token's time goes (s)")
    if segs:
        for name, values in segs.items():
            if values:
                print(f"      {name:34s} p50 {percentile(values, 50):7.3f}  p99 {percentile(values, 99):7.3f}  "
                      f"mean {sum(values) / len(values):7.3f}  (n={len(values)})")
    if engine:
        for name, h in engine.items():
            if h["count"] > 0:
                print(f"      {name + ', /metrics':34s} p50 {h['p50']:7.3f}  p99 {h['p99']:7.3f}  "
                      f"mean {h['mean']:7.3f}  (n={h['count']:.0f}, bucket-interpolated)")


# -- the steps ------------------------------------------------------------------------

#: prompt tokens a step carried: (label, low, high) with low <= tokens < high
STEP_BINS = (("decode only", 0, 1), ("1-127 prompt tokens", 1, 128), ("128-255", 128, 256), ("256-383", 256, 384),
             ("384-511", 384, 512), ("512 (the budget)", 512, 1 << 30))
_ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
                        r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")


def ours_steps(lines: list[dict[str, Any]], since: float, until: float) -> list[dict[str, float]]:
    """Our steps whose replies came in between ``since`` and ``until`` (``time.time()``):
    prompt tokens, decode rows, the worker's time (s) and the round trip (s)."""
    return [{"prefill_tokens": ln["prefill_tokens"], "decode_rows": ln["decode_rows"], "time_s": ln["worker_time"],
             "round_trip_s": ln["round_trip"]}
            for ln in lines if ln.get("stage") == "step" and since <= ln.get("at", 0.0) <= until
            and ln.get("worker_time") is not None]


def vllm_steps(log: Path, offset: int) -> list[dict[str, float]]:
    """vLLM's iterations logged from byte ``offset`` of its server log on."""
    if not log.exists():
        return []
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [{"prefill_tokens": int(m[2]), "decode_rows": int(m[3]), "time_s": float(m[5]) / 1e3}
            for m in _ITERATION.finditer(text)]


def step_bins(steps: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per bin of ``STEP_BINS``: steps, mean prompt tokens and decode rows, the median
    time (ms) and, for ours, the median round trip (ms)."""
    out = {}
    for label, lo, hi in STEP_BINS:
        got = [s for s in steps if lo <= s["prefill_tokens"] < hi]
        if not got:
            continue
        row = {"n": len(got), "prefill_tokens": statistics.fmean(s["prefill_tokens"] for s in got),
               "decode_rows": statistics.fmean(s["decode_rows"] for s in got),
               "ms": statistics.median(s["time_s"] for s in got) * 1e3}
        if all("round_trip_s" in s for s in got):
            row["round_trip_ms"] = statistics.median(s["round_trip_s"] for s in got) * 1e3
        out[label] = row
    return out


def print_steps(label: str, level: int, bins: dict[str, dict[str, float]]) -> None:
    if not bins:
        return
    print(f"    {label} at {level} streams: its steps by the prompt tokens they carried (median ms)")
    for name, b in bins.items():
        trip = f", round trip {b['round_trip_ms']:.1f}" if "round_trip_ms" in b else ""
        print(f"      {name:22s} n={b['n']:<5d} {b['ms']:7.1f} ms{trip}  (prompt tokens {b['prefill_tokens']:.0f}, "
              f"decode rows {b['decode_rows']:.1f})")


def print_steps_side_by_side(level: int, ours: list[dict[str, dict[str, float]]],
                             peer: list[dict[str, dict[str, float]]]) -> None:
    """The steps of every run at ``level``: each bin's median over the runs, ours (the
    worker's time) against vLLM's (its iteration time), and vLLM / ours (> 1: ours
    shorter)."""
    if not ours or not peer:
        return
    print(f"served c={level}: the steps, ours (the worker's time) against vLLM's (iteration elapsed time), "
          "median ms over the runs' medians")
    for name, _, _ in STEP_BINS:
        o = [b[name] for b in ours if name in b]
        p = [b[name] for b in peer if name in b]
        if not o or not p:
            continue
        om, pm = statistics.median(b["ms"] for b in o), statistics.median(b["ms"] for b in p)
        print(f"  {name:22s} ours {om:7.1f} (n={sum(b['n'] for b in o)})  vLLM {pm:7.1f} (n={sum(b['n'] for b in p)})  "
              f"{pm / om:.2f}x")
