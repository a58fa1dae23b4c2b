"""The vLLM side of ``embeddings.py``, run by the PEER's python (vLLM's venv: standard
library and vLLM only, nothing of this repository).

Input, one JSON object on stdin: ``{"model": folder, "engine": {vllm.LLM kwargs},
"texts": [...], "warmup": [...], "probe": n}``. Output, one line: ``@@EMBED@@ `` and
``{"vllm": version, "start_s": s, "wall": s, "count": n, "tokens": n, "probe": [[...]],
"error": str | null}``: ``wall`` is ``LLM.embed(texts)``'s alone (after an untimed
``embed(warmup)``), ``probe`` the first ``probe`` vectors (the bench checks the three
systems embed alike).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

MARKER = "@@EMBED@@ "


def main() -> None:
    spec = json.load(sys.stdin)
    out = {"error": None}
    try:
        import vllm

        out["vllm"] = vllm.__version__
        t0 = time.perf_counter()
        llm = vllm.LLM(spec["model"], **spec["engine"])
        out["start_s"] = time.perf_counter() - t0
        llm.embed(spec["warmup"], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed(spec["texts"], use_tqdm=False)
        out["wall"] = time.perf_counter() - t0
        out["count"] = len(outs)
        out["tokens"] = sum(len(o.prompt_token_ids) for o in outs)
        out["probe"] = [o.outputs.embedding for o in outs[: spec.get("probe", 2)]]
    except Exception as exc:  # reported, not raised: the bench prints what failed
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM's engine core starts with spawn: the guard is needed
    main()
