"""Embeddings per second, side by side: raydecode's ``LLM.embed``, sentence-transformers'
own ``encode`` and vLLM's CPU build (``LLM.embed``), on the same folders and texts.

Run::

    make peers                                    # once: vLLM's CPU build in its own venv
    .venv/bin/python tests/bench/embeddings.py                 # both models, 3 rounds
    .venv/bin/python tests/bench/embeddings.py --quick         # 1 round, 64 texts
    ... --models bert-base --texts 512 --rounds 5 --skip-peer --skip-st

Models (built once into ``$RAYDECODE_CACHE/bench-embeddings/``, each a
sentence-transformers folder, so all three systems read the same pooling config):

  bert-base   a random encoder of BERT-base's shape (768 wide, 12 layers, 12 heads,
              110M parameters), a WordPiece tokenizer of 30,522 tokens trained on the
              stdlib-docstring corpus; mean pooling, normalised
  smollm2     SmolLM2-135M-Instruct in float32 (the embedded default's dequantized copy)
              as a last-token embedder, normalised (vLLM and raydecode with runner
              "pooling", as Qwen3-Embedding is served)

Texts: ``--texts`` passages of 16-128 words cut from the stdlib-docstring corpus
(seeded), the same for every system; one untimed warm-up call of 16 other passages,
then one timed call over all of them. Figure: texts / that call's wall time.

Each system runs in a process of its own, one after the other (ours, ST, vLLM, ours,
...), ``--rounds`` times; the table gives each one's median, and ours over each peer as
the median of the per-round ratios (min-max). Settings: float32 everywhere, every core
to the one process; ours one worker (``max_num_batched_tokens`` ``--budget``);
sentence-transformers ``batch_size`` 32 (its default; it sorts texts by length);
vLLM ``runner="pooling"``, ``max_num_batched_tokens`` the same budget, its documented
CPU environment (``vs_vllm.peer_env``: ``VLLM_CPU_KVCACHE_SPACE``, thread binding,
its preloads), eager (``enforce_eager``: its compile is not in the figure either way).
The first vectors of each system are compared (cosine), so a figure never stands for
a different computation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

from e2e import corpus_text  # noqa: E402
from vs_vllm import find_peer, peer_env, run_json_child  # noqa: E402

MARKER = "@@EMBED@@ "
WORDS_RANGE = (16, 128)


def passages(n: int, seed: int, tokenizer: Any = None, max_tokens: int = 510) -> list[str]:
    """``n`` passages of the corpus (seeded); with a ``tokenizer``, only ones of at most
    ``max_tokens`` tokens (every system embeds them whole: none truncates)."""
    words = corpus_text().split()
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*WORDS_RANGE)
        start = rng.randrange(0, len(words) - k)
        text = " ".join(words[start : start + k])
        if tokenizer is None or len(tokenizer(text)["input_ids"]) <= max_tokens:
            out.append(text)
    return out


def bench_dir() -> Path:
    from worker.cache import cache_dir

    path = cache_dir() / "bench-embeddings"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_bert_base(folder: Path) -> Path:
    if (folder / "modules.json").exists():
        return folder
    import torch
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from tiny_encoder import build_sentence_transformer

    raw = folder.parent / "bert-base-raw"
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(corpus_text().split("\n\n"), vocab_size=30522, min_frequency=1, show_progress=False,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok = BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                            cls_token="[CLS]", mask_token="[MASK]")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, max_position_embeddings=512), add_pooling_layer=False)
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    return build_sentence_transformer(folder, raw, pooling="mean", max_seq_length=512)


def build_smollm2(folder: Path) -> Path:
    if (folder / "modules.json").exists():
        return folder
    from tiny_encoder import build_sentence_transformer
    from worker.runner.model_loader import default_model_path

    build_sentence_transformer(folder, default_model_path(), pooling="lasttoken")
    # sentence-transformers 6 puts a text through the chat template of a model that has
    # one (its "message" modality); the other two embed the text as it is: so does it here
    config_path = folder / "sentence_bert_config.json"
    config = json.loads(config_path.read_text())
    config.get("modality_config", {}).pop("message", None)
    config_path.write_text(json.dumps(config, indent=2))
    return folder


MODELS = {"bert-base": (build_bert_base, False), "smollm2": (build_smollm2, True)}


# -- the children ----------------------------------------------------------------------


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from cluster import LLM

    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine"])
    start = time.perf_counter() - t0
    try:
        llm.embed(spec["warmup"], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed(spec["texts"], use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return {"start_s": start, "wall": wall, "count": len(outs), "tokens": sum(len(o.prompt_token_ids) for o in outs),
            "probe": [o.outputs.embedding for o in outs[: spec["probe"]]], "error": None}


def child_st(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = SentenceTransformer(spec["model"], device="cpu")
    if model.tokenizer.pad_token is None:  # a decoder's tokenizer (SmolLM2 has one)
        model.tokenizer.pad_token = model.tokenizer.eos_token
    start = time.perf_counter() - t0
    model.encode(spec["warmup"], batch_size=32)
    t0 = time.perf_counter()
    vectors = model.encode(spec["texts"], batch_size=32)
    wall = time.perf_counter() - t0
    return {"start_s": start, "wall": wall, "count": len(vectors), "tokens": None,
            "probe": vectors[: spec["probe"]].tolist(), "error": None}


def child_main(kind: str) -> None:
    spec = json.load(sys.stdin)
    try:
        out = child_ours(spec) if kind == "ours" else child_st(spec)
    except Exception as exc:
        import traceback

        out = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    print(MARKER + json.dumps(out), flush=True)


# -- the parent ------------------------------------------------------------------------


def run_system(system: str, folder: Path, decoder: bool, texts: list[str], warmup: list[str], args: argparse.Namespace,
               logs: Path, round_: int) -> dict[str, Any] | None:
    spec: dict[str, Any] = {"model": str(folder), "texts": texts, "warmup": warmup, "probe": 2}
    log = logs / f"{folder.name}-{system}-{round_}.log"
    if system == "vllm":
        py = find_peer()
        spec["engine"] = {"runner": "pooling", "dtype": "float32", "max_num_batched_tokens": args.budget,
                          "enforce_eager": True, "max_model_len": 512}
        env = {**peer_env(py), "VLLM_CPU_KVCACHE_SPACE": "2"}
        cmd = [py, str(HERE / "_vllm_embed_peer.py")]
    else:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        spec["engine"] = {"max_num_batched_tokens": args.budget, "max_num_seqs": args.rows, "max_model_len": 512,
                          **({"runner": "pooling"} if decoder else {})}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system]
    result, code = run_json_child(cmd, spec, log, env, timeout_s=args.timeout, marker=MARKER)
    if result is None or result.get("error"):
        print(f"  {system}: failed (exit {code}): {(result or {}).get('error') or 'no result'}; log {log}", flush=True)
        return None
    rate = result["count"] / result["wall"]
    print(f"  {folder.name:9s} {system:5s} round {round_}: {rate:8.1f} texts/s ({result['wall']:.1f} s; start "
          f"{result['start_s']:.1f} s)", flush=True)
    return {**result, "rate": rate}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def cosine(a: list[float], b: list[float]) -> float:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=("ours", "st"))
    parser.add_argument("--models", default="bert-base,smollm2")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens of ours and vLLM")
    parser.add_argument("--rows", type=int, default=64, help="our max_num_seqs")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-st", action="store_true", help="leave sentence-transformers out")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    if args.quick:
        args.texts, args.rounds = 64, 1
    systems = ["ours"] + ([] if args.skip_st else ["st"]) + ([] if args.skip_peer or find_peer() is None else ["vllm"])
    logs = Path(tempfile.mkdtemp(prefix="raydecode-embed-bench-"))
    import platform

    print(f"host: {platform.processor() or platform.machine()} {_cpu_model()}, {os.cpu_count()} cores; "
          f"{args.texts} texts of {WORDS_RANGE[0]}-"
          f"{WORDS_RANGE[1]} words; systems {systems}; logs {logs}", flush=True)
    table = []
    for name in args.models.split(","):
        build, decoder = MODELS[name]
        folder = build(bench_dir() / name)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        texts, warmup = passages(args.texts, 1, tok), passages(16, 2, tok)
        print(f"{name}: {sum(len(tok(t)['input_ids']) for t in texts)} tokens in {len(texts)} texts", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems:
                res = run_system(system, folder, decoder, texts, warmup, args, logs, r)
                if res is not None:
                    runs[system].append(res)
        ours = runs["ours"]
        for peer in systems[1:]:
            pairs = [(a["rate"], b["rate"]) for a, b in zip(ours, runs[peer])]
            if not pairs:
                continue
            ratios = [a / b for a, b in pairs]
            agree = min(cosine(x, y) for x, y in zip(ours[0]["probe"], runs[peer][0]["probe"]))
            table.append((name, peer, statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
                          statistics.median(ratios), min(ratios), max(ratios), agree))
    print("\n| model | peer | ours texts/s | peer texts/s | ours/peer (min-max) | vectors agree (min cosine) |")
    print("|---|---|---|---|---|---|")
    for name, peer, a, b, med, lo, hi, agree in table:
        print(f"| {name} | {peer} | {a:.1f} | {b:.1f} | {med:.2f}x ({lo:.2f}-{hi:.2f}) | {agree:.6f} |")


if __name__ == "__main__":
    main()
