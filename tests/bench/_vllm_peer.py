"""The vLLM side of ``vs_vllm.py``'s offline workloads, run by the PEER's python.

vLLM cannot be imported into raydecode's venv (it pins its own torch and
transformers), so ``vs_vllm.py`` runs this file with ``$VLLM_PYTHON`` (the peer venv's
interpreter, ``make peers``) in a subprocess. Standard library and vLLM only: nothing
from this repository is importable there.

Input: one JSON object on stdin::

    {"model": "/path/to/hf-folder",
     "engine": {"dtype": "float32", "max_num_seqs": 64, ...},   # vllm.LLM keyword arguments
     "warmup": [REQ, ...],                                       # run once, untimed
     "workloads": {"greedy": [REQ, ...], "mix": [REQ, ...]}}     # each timed, in this order

with REQ = ``{"prompt_token_ids": [...], "max_tokens": N, "temperature": T, "top_p": P,
"top_k": K, "seed": S or null}``; every request runs with ``ignore_eos=True``.

Output: one line on stdout, ``@@VS_VLLM@@ `` followed by a JSON object::

    {"vllm": version, "torch": version, "import_s": s, "start_s": s,
     "results": {name: {"wall": s, "tokens": n, "ttft": [s, ...], "itl": [s, ...],
                        "metrics": bool, "error": str | null}},
     "error": str | null}

``start_s`` is the ``vllm.LLM(...)`` constructor's wall time (engine-core process,
weights, KV cache, compilation); ``import_s`` the ``import vllm`` before it. TTFT per
request is vLLM's own ``RequestOutput.metrics.first_token_latency`` (first token minus
arrival; needs ``disable_log_stats=False``, which this script sets), ITL
``(last_token_ts - first_token_ts) / (n - 1)``; ``metrics`` is false (and the lists
empty) when vLLM gave no per-request metrics.

Run by hand: ``echo '{"model": ..., ...}' | $VLLM_PYTHON tests/bench/_vllm_peer.py``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

MARKER = "@@VS_VLLM@@ "


def _params(SamplingParams: Any, req: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {"max_tokens": req["max_tokens"], "ignore_eos": True,
                              "temperature": req.get("temperature", 0.0)}
    if kwargs["temperature"] > 0:
        kwargs.update(top_p=req.get("top_p", 1.0), top_k=req.get("top_k") or 0)
        if req.get("seed") is not None:
            kwargs["seed"] = req["seed"]
    return SamplingParams(**kwargs)


def _run(llm: Any, SamplingParams: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [_params(SamplingParams, r) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft: list[float] = []
    itl: list[float] = []
    have_metrics = True
    for r, out in zip(reqs, outs):
        n = len(out.outputs[0].token_ids)
        if n != r["max_tokens"]:
            raise RuntimeError(f"vLLM made {n} tokens for a request of max_tokens={r['max_tokens']}")
        m = getattr(out, "metrics", None)
        if m is None or not getattr(m, "first_token_ts", 0):
            have_metrics = False
            continue
        ttft.append(float(m.first_token_latency))
        if n > 1:
            itl.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    if not have_metrics:
        ttft, itl = [], []
    return {"wall": wall, "tokens": sum(r["max_tokens"] for r in reqs), "ttft": ttft, "itl": itl,
            "metrics": have_metrics, "error": None}


def main() -> int:
    spec = json.load(sys.stdin)
    result: dict[str, Any] = {"results": {}, "error": None}
    try:
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        result.update(vllm=vllm.__version__, torch=torch.__version__, import_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], tokenizer=spec["model"], disable_log_stats=False, **spec.get("engine", {}))
        result["start_s"] = time.perf_counter() - t0
        if spec.get("warmup"):
            _run(llm, SamplingParams, spec["warmup"])
        for name, reqs in spec.get("workloads", {}).items():
            print(f"vllm peer: running {name} ({len(reqs)} requests) ...", file=sys.stderr, flush=True)
            try:
                result["results"][name] = _run(llm, SamplingParams, reqs)
            except Exception as exc:  # noqa: BLE001 -- one failed workload is a row, not a crash
                traceback.print_exc()
                result["results"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    print(MARKER + json.dumps(result), flush=True)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
