"""Where a served first token's time goes (issue 38), from two sources:

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
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _load_generator import RequestRecord, percentile

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
