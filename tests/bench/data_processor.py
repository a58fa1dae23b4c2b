"""Batch jobs on Ray Data (``deploy.data``) against ``LLM.generate`` with the same workers,
and the driver's memory as the dataset grows.

    .venv/bin/python tests/bench/data_processor.py                 # 2,000 chat prompts, 1 and 2 replicas, 3 pairs
    .venv/bin/python tests/bench/data_processor.py --rows 500 --pairs 1 --replicas 1
    .venv/bin/python tests/bench/data_processor.py --rss 2000,200000   # driver peak RSS (tiny model, 1 token)

Throughput: SmolLM2-135M-Instruct (the embedded default, float32 folder), ``--rows``
chat prompts (distinct: a number in each), ``--max-tokens`` greedy tokens each
(``ignore_eos``). For R replicas: the processor with ``concurrency=(R, R)``, each
replica one worker, against one ``LLM(num_workers=R)`` (R workers behind one driver),
``max_num_seqs`` 64 both, prefix caching off. Each run is a process of its own (a fresh
local Ray, its workers at niceness 0 as ``build_processor`` starts Ray: each model worker
raises itself to 15), the two alternated (processor, LLM, processor, ...).
``--no-stages``: the processor's rows carry ``tokenized_prompt`` (rendered and tokenized
in the driver first, as ``LLM.chat`` does) and its chat-template and tokenize stages are
off: what those stages' actors cost. Figures: output tokens over the engines'
busy span (the first row scheduled to the last finished, from the rows' own metrics:
start-up is not in it) and over the whole run (start-up in); the table gives medians and
the per-pair ratio processor/LLM (median, min-max).

RSS: the processor over ``ray.data.range(N)`` on a tiny random model (two layers, one
output token), rows consumed and dropped by the driver; the driver's peak RSS
(``ru_maxrss``) after N rows, for each N.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
MARKER = "@@DATA_BENCH@@ "


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write one sentence about the number {i} and a river."}]


def child_throughput(spec: dict) -> dict:
    import ray

    from sampler.params import SamplingParams
    from worker.runner.model_loader import default_model_path

    model, rows, replicas, max_tokens = str(default_model_path()), spec["rows"], spec["replicas"], spec["max_tokens"]
    engine = dict(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=512, enable_prefix_caching=False)
    started = time.monotonic()
    # Ray's workers at niceness 0, as build_processor and raydecode serve start Ray
    # (each model worker raises itself to 15): the same for both modes.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=replicas + 2)
    spans: list[tuple[float, float]] = []
    tokens = 0
    if spec["mode"] == "llm":
        from cluster import LLM

        llm = LLM(model, num_workers=replicas, **engine)
        outs = llm.chat([chat(i) for i in range(rows)],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        for o in outs:
            spans.append((o.metrics.first_scheduled_time, o.metrics.finished_time))
            tokens += len(o.outputs[0].token_ids)
        llm.shutdown()
    else:
        from deploy.data import build_processor, vLLMEngineProcessorConfig

        stages = {} if not spec.get("no_stages") else dict(chat_template_stage=False, tokenize_stage=False)
        config = vLLMEngineProcessorConfig(model_source=model, engine_kwargs=engine, concurrency=(replicas, replicas),
                                           batch_size=64, **stages)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        if spec.get("no_stages"):
            texts = {i: tok.apply_chat_template(chat(i), tokenize=False, add_generation_prompt=True) for i in range(rows)}
            pre = lambda row: dict(tokenized_prompt=tok.encode(texts[int(row["id"])], add_special_tokens=False),  # noqa: E731
                                   sampling_params=dict(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        else:
            pre = lambda row: dict(messages=chat(int(row["id"])),  # noqa: E731
                                   sampling_params=dict(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        processor = build_processor(config, preprocess=pre)
        for row in processor(ray.data.range(rows, override_num_blocks=max(4, rows // 256))).iter_rows():
            m = row["metrics"]
            spans.append((m["first_scheduled_time"], m["finished_time"]))
            tokens += row["num_generated_tokens"]
    total = time.monotonic() - started
    busy = max(e for _, e in spans) - min(s for s, _ in spans)
    ray.shutdown()
    return {"tokens": tokens, "rows": len(spans), "busy_s": busy, "total_s": total}


def child_rss(spec: dict) -> dict:
    import ray

    from deploy.data import build_processor, vLLMEngineProcessorConfig
    from tiny_model import build_tiny_model

    model = str(build_tiny_model(Path(tempfile.gettempdir()) / "raydecode-bench-tiny"))
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=4)
    config = vLLMEngineProcessorConfig(model_source=model, concurrency=(1, 1), batch_size=256,
                                       engine_kwargs=dict(max_num_seqs=256, max_model_len=128),
                                       chat_template_stage=False, tokenize_stage=False)
    processor = build_processor(config, preprocess=lambda row: dict(
        tokenized_prompt=[5 + int(row["id"]) % 300, 7, 9], sampling_params=dict(max_tokens=1, ignore_eos=True)),
        postprocess=lambda row: dict(id=row["id"], n=row["num_generated_tokens"]))
    seen = 0
    started = time.monotonic()
    for _ in processor(ray.data.range(spec["rows"])).iter_rows():
        seen += 1
    took = time.monotonic() - started
    ray.shutdown()
    return {"rows": seen, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "s": took}


def run_child(spec: dict, timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"child {spec} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--rss", default=None, help="row counts for the driver-RSS run (e.g. 2000,200000)")
    ap.add_argument("--no-stages", action="store_true", help="the processor without its chat-template and "
                    "tokenize stages (rows carry tokenized_prompt): what those stages' actors cost")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(sys.stdin.read())
        result = child_rss(spec) if spec["mode"] == "rss" else child_throughput(spec)
        print(MARKER + json.dumps(result), flush=True)
        return
    host = os.uname().nodename
    if args.rss:
        print(f"driver peak RSS ({host}): tiny model, 1 output token, rows consumed and dropped")
        for n in [int(x) for x in args.rss.split(",")]:
            r = run_child({"mode": "rss", "rows": n}, timeout_s=3600)
            print(f"  {n:>8} rows: {r['peak_rss_mib']:.0f} MiB peak ({r['rows']} rows in {r['s']:.0f} s, "
                  f"{r['rows'] / r['s']:.0f} rows/s)", flush=True)
        return
    print(f"processor vs LLM.generate ({host}): SmolLM2-135M float32, {args.rows} chat prompts, "
          f"{args.max_tokens} tokens each, {args.pairs} pairs")
    for replicas in [int(x) for x in args.replicas.split(",")]:
        busy_ratio, total_ratio, ours, theirs = [], [], [], []
        for _ in range(args.pairs):
            spec = {"rows": args.rows, "replicas": replicas, "max_tokens": args.max_tokens, "no_stages": args.no_stages}
            p = run_child({**spec, "mode": "processor"}, timeout_s=1800)
            q = run_child({**spec, "mode": "llm"}, timeout_s=1800)
            ours.append(p["tokens"] / p["busy_s"])
            theirs.append(q["tokens"] / q["busy_s"])
            busy_ratio.append(ours[-1] / theirs[-1])
            total_ratio.append((p["tokens"] / p["total_s"]) / (q["tokens"] / q["total_s"]))
            print(f"  {replicas} replica(s): processor {ours[-1]:.0f} tok/s busy ({p['total_s']:.0f} s in all), "
                  f"LLM.generate {theirs[-1]:.0f} tok/s busy ({q['total_s']:.0f} s in all)", flush=True)
        print(f"{replicas} replica(s): processor {statistics.median(ours):.0f} tok/s, LLM.generate "
              f"{statistics.median(theirs):.0f} tok/s; processor/LLM busy {spread(busy_ratio)}, "
              f"whole run {spread(total_ratio)}", flush=True)


if __name__ == "__main__":
    main()
