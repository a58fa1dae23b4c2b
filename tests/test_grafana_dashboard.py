"""``deploy/grafana/raydecode.json`` against what ``/metrics`` really exports: every
PromQL expression of the dashboard (panel targets and template variables) is parsed, and
each metric it names must be a sample name of a real scrape of the Serve app on the tiny
model (a counter's ``_total``, a histogram's ``_bucket`` / ``_sum`` / ``_count``), with
the labels its selector matches on; ``rate`` / ``increase`` only over counters and
histogram parts, ``histogram_quantile`` only over ``_bucket`` series, never a bare
counter. The JSON must be a dashboard Grafana imports: a Prometheus datasource variable
that every panel and target uses, panels with targets, a grid that fits."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import served

DASHBOARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "grafana",
                         "raydecode.json")

#: what the issue asks the dashboard to show, as the families it must query
REQUIRED = {
    "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "raydecode:replicas_live",
    "raydecode:workers_live", "raydecode:worker_failures", "raydecode:worker_restarts",
    "raydecode:requests_requeued", "raydecode:replica_scale_events",
}

# -- a small PromQL reader: which metrics an expression selects, under which functions ---

AGGREGATORS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group",
               "count_values"}
FUNCTIONS = AGGREGATORS | {
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "abs", "ceil", "floor", "round",
    "clamp", "clamp_min", "clamp_max", "absent", "vector", "scalar", "time", "label_replace", "label_join",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time", "last_over_time",
    "resets", "changes", "sort", "sort_desc",
}
MODIFIERS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"bool", "and", "or", "unless", "offset"}
RATES = {"rate", "irate", "increase"}
TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<dur>\d+(?:ms|[smhdwy])\b)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<var>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]])
""", re.X)


@dataclass(frozen=True)
class Selection:
    metric: str
    functions: tuple[str, ...]  # the calls around it, outermost first
    labels: tuple[str, ...]  # label names its matchers use


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        assert m is not None, f"cannot read {expr[pos:pos + 20]!r} in {expr!r}"
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _closing(toks: list[tuple[str, str]], i: int, open_: str, close: str) -> int:
    """The index of the token closing the ``open_`` at ``i``."""
    depth = 0
    for j in range(i, len(toks)):
        depth += {open_: 1, close: -1}.get(toks[j][1], 0) if toks[j][0] == "op" else 0
        if depth == 0:
            return j
    raise AssertionError(f"unbalanced {open_!r}")


def selections(expr: str) -> list[Selection]:
    """Every metric an expression selects, with the functions around it."""
    toks = tokens(expr)
    stack: list[str | None] = []  # per open parenthesis: its function (None: grouping)
    pending: str | None = None
    out = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "ident":
            if text in MODIFIERS:
                i = _closing(toks, i + 1, "(", ")") + 1 if nxt == "(" else i + 1
                continue
            if text in KEYWORDS:
                i += 1
                continue
            if nxt == "(" or (text in AGGREGATORS and nxt in ("by", "without")):
                assert text in FUNCTIONS, f"unknown PromQL function {text!r} in {expr!r}"
                pending = text
                i += 1
                continue
            labels: list[str] = []
            j = i + 1
            if nxt == "{":
                end = _closing(toks, i + 1, "{", "}")
                labels = [toks[k][1] for k in range(i + 2, end) if toks[k][0] == "ident"
                          and toks[k + 1][1] in ("=", "!=", "=~", "!~")]
                j = end + 1
            out.append(Selection(text, tuple(f for f in stack if f is not None), tuple(labels)))
            i = j
            continue
        if text == "(":
            stack.append(pending)
            pending = None
        elif text == ")":
            assert stack, f"unbalanced ')' in {expr!r}"
            stack.pop()
        elif text == "[":
            i = _closing(toks, i, "[", "]")
        elif text == "{":
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        i += 1
    assert not stack, f"unbalanced '(' in {expr!r}"
    return out


LABEL_VALUES = re.compile(r"^label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)$")


def dashboard_queries(dash: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """The panels' PromQL expressions, and the template variables' (metric, label)."""
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    variables = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = LABEL_VALUES.match(query.strip())
        assert m is not None, f"variable {var['name']}: only label_values(metric, label) is read here: {query!r}"
        variables.append((m.group(1), m.group(2)))
    return exprs, variables


def test_the_promql_reader_finds_metrics_and_their_functions():
    got = selections('histogram_quantile(0.9, sum by (le) (rate(vllm:x_seconds_bucket{model_name=~"$m"}'
                     '[$__rate_interval]))) / sum without (engine) (vllm:y{a="1", b!~"x"}) > bool 2')
    assert got == [Selection("vllm:x_seconds_bucket", ("histogram_quantile", "sum", "rate"), ("model_name",)),
                   Selection("vllm:y", ("sum",), ("a", "b"))]
    assert selections("sum(rate(a_total[5m])) by (le) + max(b) offset 5m") == [
        Selection("a_total", ("sum", "rate"), ()), Selection("b", ("max",), ())]
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        selections("summ(rate(a_total[5m]))")
    with pytest.raises(AssertionError, match="unbalanced"):
        selections("sum(rate(a_total[5m])")


# -- the dashboard's shape ---------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def test_the_dashboard_is_a_grafana_dashboard_over_a_prometheus_variable(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    (ds,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    source = {"type": "prometheus", "uid": f"${{{ds['name']}}}"}
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in panels:
        pos = p["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("h", "w", "x", "y")) and pos["x"] + pos["w"] <= 24, p["title"]
    for p in graphs:
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge", "table"), p["title"]
        assert p["datasource"] == source, p["title"]
        targets = p["targets"]
        assert targets, f"panel {p['title']!r} has no targets"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["datasource"] == source and t["expr"].strip(), p["title"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == source
    exprs, variables = dashboard_queries(dashboard)
    queried = {s.metric for e in exprs for s in selections(e)} | {m for m, _ in variables}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in queried}
    assert REQUIRED <= families, f"the dashboard does not show {sorted(REQUIRED - families)}"


# -- against a real scrape ------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(ray_local, tiny_model_path) -> dict[str, tuple[str, set[str]]]:
    """{sample name: (its family's type, its label names)} of a real ``/metrics`` scrape
    of the Serve app on the tiny model, after one request."""
    args = {"model": tiny_model_path, "served_model_name": "tiny",
            "engine": {"max_num_seqs": 4, "max_model_len": 128, "worker_num_cpus": 1}}
    with served(args, "grafana") as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics", timeout=60).text
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            _, labels = out.setdefault(s.name, (family.type, set()))
            labels.update(s.labels)
    return out


def test_every_metric_the_dashboard_queries_is_exported(dashboard, exported):
    exprs, variables = dashboard_queries(dashboard)
    problems = []
    for metric, label in variables:
        if metric not in exported:
            problems.append(f"variable: {metric} is not exported")
        elif label not in exported[metric][1]:
            problems.append(f"variable: {metric} has no label {label}")
    for expr in exprs:
        found = selections(expr)
        if not found:
            problems.append(f"{expr}: selects no metric")
        for s in found:
            if s.metric not in exported:
                problems.append(f"{expr}: {s.metric} is not exported (names: {sorted(exported)[:3]}...)")
                continue
            kind, labels = exported[s.metric]
            inner = s.functions[-1] if s.functions else None
            missing = set(s.labels) - labels
            if missing:
                problems.append(f"{expr}: {s.metric} has no label {sorted(missing)}")
            if "histogram_quantile" in s.functions and not (kind == "histogram" and s.metric.endswith("_bucket")):
                problems.append(f"{expr}: histogram_quantile over {s.metric}, not a histogram's _bucket")
            if inner in RATES and kind not in ("counter", "histogram"):
                problems.append(f"{expr}: {inner} over the {kind} {s.metric}")
            if kind in ("counter", "histogram") and not set(s.functions) & RATES:
                problems.append(f"{expr}: the {kind} {s.metric} is read without rate/increase")
    assert not problems, "\n".join(problems)
