"""Offline throughput of each model family against SmolLM2 on the Llama fast path.

Run: ``python tests/bench/model_families.py [--quick] [--rounds 3] [--families qwen3 gemma2 ...]``.

Every family gets a random model with SmolLM2-135M's shape (hidden 576, 30 layers, 9
query and 3 key/value heads of 64, MLP 1536, its 49,152-token vocabulary and tokenizer),
so per-token FLOPs are close; a mixture of experts gets 8 experts of 768 with 2 active
(the active parameters of SmolLM2's MLP). The baseline is SmolLM2 itself (float32, the
fused decoder). Both engines stay up side by side (one worker each, both cores); each
round runs the baseline and the family on a fresh seeded e2e workload (``e2e.py``'s
corpus, greedy, ``--requests`` requests at once), in alternating order. Per family:
output tokens per second of each, the ratio (median over rounds, with the spread) and
the family's path (fast or generic). Goals: every family >= 0.9x, a Qwen3-MoE >= 0.8x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import Row, emit, machine  # noqa: E402

#: SmolLM2-135M's shape
SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=768)
#: family -> its config's extras
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "phi3": {},
    "gemma2": {"query_pre_attn_scalar": 64, "sliding_window": 4096},
    "gemma3_text": {"query_pre_attn_scalar": 64, "sliding_window": 4096},
    "mistral": {"sliding_window": 4096},
    "qwen3_moe": {**MOE, "intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {**MOE, "intermediate_size": 768},
    "gpt_oss": {**MOE, "intermediate_size": 768, "sliding_window": 128},
    "deepseek_v3": {**MOE, "intermediate_size": 1536, "n_shared_experts": 0, "first_k_dense_replace": 0,
                    "n_group": 1, "topk_group": 1, "kv_lora_rank": 128, "q_lora_rank": None,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64, "head_dim": 32,
                    "num_key_value_heads": 9},
}


def build(folder: Path, family: str, tokenizer_dir: str) -> Path:
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = AutoConfig.for_model(family)
    kw = {k: v for k, v in {**SHAPE, **FAMILIES[family]}.items() if hasattr(base, k) or k in FAMILIES[family]}
    config = AutoConfig.for_model(family, **kw, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, short outputs, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/raydecode/bench-families"))
    ap.add_argument("--vllm", action="store_true",
                    help="then vLLM's CPU build ($VLLM_PYTHON or `make peers`) on the same models and workloads")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    n = args.requests or (8 if args.quick else 16)
    out_len = (16, 48) if args.quick else (32, 128)

    import ray
    from e2e import build_workload, corpus_tokens, run_ours

    from cluster import LLM
    from worker.runner.families import FAMILIES as REGISTRY
    from worker.runner.model_loader import default_model_path

    smol = str(default_model_path())
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    from transformers import AutoTokenizer

    stream = corpus_tokens(AutoTokenizer.from_pretrained(smol))
    # One worker each, both cores (the other engine idles meanwhile: its Ray CPU is nominal).
    engine = dict(max_num_seqs=64, max_model_len=1024, worker_num_cpus=1, worker_num_threads=os.cpu_count() or 2)
    base = LLM(smol, **engine)
    rows, notes = [], []
    workloads = 0  # every round its own prompts: the baseline engine keeps its prefix cache
    #: family -> (model folder, its rounds' workloads, our tok/s of SmolLM2 and of it per round)
    ran: dict[str, tuple[str, list, list[float], list[float]]] = {}
    print(f"{machine()}; {n} requests a round (prompts 16-256, outputs {out_len[0]}-{out_len[1]}), {rounds} rounds")
    print(f"{'family':14} {'path':8} {'SmolLM2 tok/s':>14} {'family tok/s':>13} {'ratio':>7}  spread")
    try:
        for family in args.families:
            path = build(Path(args.models) / family, family, smol)
            started = time.perf_counter()
            try:
                other = LLM(str(path), **engine)
            except Exception as exc:  # noqa: BLE001 - a family that cannot load is reported, not fatal
                print(f"{family:14} cannot load: {str(exc)[:120]}")
                notes.append(f"{family}: {exc}")
                continue
            ready = time.perf_counter() - started
            ours, theirs, ratios = [], [], []
            try:
                rounds_run = []
                for r in range(rounds):
                    workloads += 1
                    greedy, _ = build_workload(stream, n, (16, 256), out_len, 1.0, seed=7919 * workloads)
                    rounds_run.append(greedy)
                    order = [(base, ours), (other, theirs)] if r % 2 == 0 else [(other, theirs), (base, ours)]
                    for llm, into in order:
                        into.append(run_ours(llm, greedy).tps)
                    ratios.append(theirs[-1] / ours[-1])
            finally:
                other.shutdown()
            ran[family] = (str(path), rounds_run, ours, theirs)
            med = statistics.median(ratios)
            fam_path = REGISTRY.get(family).path if family in REGISTRY else "?"
            goal = 0.8 if "moe" in family or family in ("mixtral", "gpt_oss", "deepseek_v3") else 0.9
            print(f"{family:14} {fam_path:8} {statistics.median(ours):14.1f} {statistics.median(theirs):13.1f} "
                  f"{med:6.2f}x  {min(ratios):.2f}-{max(ratios):.2f}  (ready {ready:.0f} s)", flush=True)
            rows.append(Row(f"{family} ({fam_path}) vs SmolLM2, tok/s", f"{statistics.median(theirs):.1f}",
                            f"{statistics.median(ours):.1f}", f"{med:.2f}x", f">= {goal}x", med >= goal))
    finally:
        base.shutdown()
    if args.vllm and ran:
        ray.shutdown()  # vLLM runs alone on the cores
        rows += vllm_rows(smol, ran, notes)
    emit("model_families", rows, notes=notes)


def vllm_rows(smol: str, ran: dict[str, tuple[str, list, list[float], list[float]]], notes: list[str]) -> list:
    """vLLM's CPU build (float32, prefix caching, 64 rows, one process a model: SmolLM2
    over every round of every family, then each family over its rounds) on the same
    greedy workloads: its own family / SmolLM2 ratio round by round, and ours / vLLM on
    the family (medians)."""
    import tempfile

    from vs_vllm import find_peer, offline_peer, warm_requests

    py = find_peer()
    if py is None:
        notes.append("vLLM: no peer venv ($VLLM_PYTHON or `make peers`)")
        return []
    log_dir = Path(tempfile.mkdtemp(prefix="families-vllm-"))

    def tok_s(result: dict, name: str) -> float | None:
        r = result.get("results", {}).get(name) or {}
        return r["tokens"] / r["wall"] if r.get("wall") and not r.get("error") else None

    everything = {f"{family}-{i}": reqs for family, (_, runs, _, _) in ran.items() for i, reqs in enumerate(runs)}
    warm = warm_requests([t for reqs in everything.values() for r in reqs for t in r.prompt])
    base = offline_peer(py, smol, warm, everything, log_dir / "smollm2.log", timeout_s=3600)
    print(f"vLLM {base.get('vllm')}: {'family':14} {'SmolLM2 tok/s':>14} {'family tok/s':>13} {'ratio':>7}  "
          f"spread   ours/vLLM on the family")
    rows = []
    for family, (path, runs, _ours_smol, ours_family) in ran.items():
        result = offline_peer(py, path, warm, {f"{family}-{i}": reqs for i, reqs in enumerate(runs)},
                              log_dir / f"{family}.log", timeout_s=3600)
        pairs = [(tok_s(base, f"{family}-{i}"), tok_s(result, f"{family}-{i}")) for i in range(len(runs))]
        if result.get("error") or any(b is None or f is None for b, f in pairs):
            why = (result.get("error") or "no result").splitlines()[-1][:160]
            print(f"vLLM: {family:14} did not run: {why}", flush=True)
            notes.append(f"vLLM {family}: {why}")
            continue
        ratios = [f / b for b, f in pairs]
        theirs = statistics.median(f for _, f in pairs)
        vs = statistics.median(ours_family) / theirs
        print(f"vLLM: {family:14} {statistics.median(b for b, _ in pairs):14.1f} {theirs:13.1f} "
              f"{statistics.median(ratios):6.2f}x  {min(ratios):.2f}-{max(ratios):.2f}  {vs:.2f}x", flush=True)
        rows.append(Row(f"{family}: ours / vLLM tok/s", f"{statistics.median(ours_family):.1f}", f"{theirs:.1f}",
                        f"{vs:.2f}x", "", None))
    return rows


if __name__ == "__main__":
    main()
