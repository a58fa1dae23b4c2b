"""The accuracy of the quantized path: perplexity of the embedded SmolLM2 on English prose,
served from its Q4_1 GGUF file kept quantized, against the same file dequantized (the
float path), and llama.cpp's own ``llama-perplexity`` on the same file.

Run: ``python tests/bench/quantized_accuracy.py [--llama-cpp BUILD_DIR] [--chunks 8]``.

The text: the ``assignment``, ``compound``, ``function`` and ``class`` topics of Python's
own documentation (the ``pydoc_data.topics`` module of the standard library), a few
thousand tokens of English technical prose every Python carries. The chunking is
llama-perplexity's: the text's tokens cut into chunks of ``--ctx`` (512) tokens, a chunk's
first token replaced by BOS where the vocabulary adds one, and each chunk scored on its
second half (the log-likelihood of tokens ``ctx / 2 + 1`` to ``ctx - 1``, each given the
tokens before it in its chunk).

Ours (``LLM.generate`` with ``prompt_logprobs=0``, one token out): perplexity quantized
and float, and the mean |difference| of the chosen tokens' log-probabilities between
the two (what the quantized arithmetic changes). llama.cpp, where ``--llama-cpp`` names
a build with ``llama-perplexity`` (or ``LLAMA_PERPLEXITY`` names the binary): its
perplexity on the same Q4_1 file and on an F32 copy of the dequantized model (converted
with llama.cpp's own ``convert_hf_to_gguf.py``, ``--llama-cpp-src``), with the same text
and context, and its ``--kl-divergence`` statistics of Q4_1 against that F32 base.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from _results import Row, emit, machine  # noqa: E402

TOPICS = ("assignment", "compound", "function", "class")


def prose() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[name] for name in TOPICS)


def chunks(tokens: list[int], ctx: int, bos: int | None, limit: int | None) -> list[list[int]]:
    """llama-perplexity's chunks of ``tokens``."""
    n = len(tokens) // ctx
    if limit:
        n = min(n, limit)
    out = []
    for c in range(n):
        chunk = tokens[c * ctx : (c + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def scored_logprobs(quantization: str | None, prompts: list[list[int]], ctx: int) -> list[float]:
    """Each chunk's second-half log-probabilities (tokens ctx/2 + 1 .. ctx - 1), served by
    the engine."""
    from cluster import LLM
    from sampler.params import SamplingParams

    llm = LLM(quantization=quantization, max_model_len=ctx + 8, max_num_seqs=4, max_num_batched_tokens=ctx)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    first = ctx // 2
    values = []
    for prompt, out in zip(prompts, outs):
        for j in range(first + 1, ctx):
            entry = out.prompt_logprobs[j]
            values.append(entry[prompt[j]].logprob)
    return values


def llama_perplexity(binary: str, model: str, text_file: str, ctx: int, chunks_: int | None,
                     extra: list[str] = ()) -> tuple[float | None, str]:
    cmd = [binary, "-m", model, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "-t", str(os.cpu_count()),
           *(["--chunks", str(chunks_)] if chunks_ else []), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log = done.stdout + done.stderr
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    return (float(match.group(1)) if match else None), log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: the whole text)")
    ap.add_argument("--llama-cpp", help="a llama.cpp build folder (its bin/llama-perplexity)")
    ap.add_argument("--llama-cpp-src", help="llama.cpp's sources (convert_hf_to_gguf.py, gguf-py) for the F32 copy")
    ap.add_argument("--f32-gguf", help="the F32 copy, already converted (the converter wants sentencepiece, which "
                                       "this project does not install: convert in a venv of its own)")
    ap.add_argument("--python", default=sys.executable, help="the python that runs convert_hf_to_gguf.py")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from worker.runner.model_loader import default_model_file, default_model_path, load_tokenizer

    tokenizer, _ = load_tokenizer(None)
    text = prose()
    tokens = tokenizer(text, add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id if tokenizer("a", add_special_tokens=True)["input_ids"][0] == tokenizer.bos_token_id \
        else None
    prompts = chunks(tokens, args.ctx, bos, args.chunks)
    print(f"machine: {machine()}; text: pydoc_data.topics {list(TOPICS)}, {len(tokens)} tokens, {len(prompts)} "
          f"chunks of {args.ctx}", flush=True)
    quantized = scored_logprobs(None, prompts, args.ctx)
    dense = scored_logprobs("none", prompts, args.ctx)
    ppl_q = math.exp(-sum(quantized) / len(quantized))
    ppl_f = math.exp(-sum(dense) / len(dense))
    delta = sum(abs(a - b) for a, b in zip(quantized, dense)) / len(dense)
    print(f"ours: PPL quantized (Q4_1 kept) {ppl_q:.4f}, float (dequantized) {ppl_f:.4f}; mean |delta logprob| "
          f"{delta:.2e} over {len(dense)} tokens", flush=True)
    rows = [Row("SmolLM2 Q4_1 perplexity, ours quantized / float path", f"{ppl_q:.4f}", f"{ppl_f:.4f} (float)"),
            Row("mean |delta logprob| of the chosen token, quantized vs float path (ours)", f"{delta:.2e}")]
    binary = os.environ.get("LLAMA_PERPLEXITY") or (
        os.path.join(args.llama_cpp, "bin", "llama-perplexity") if args.llama_cpp else None)
    if binary and os.path.exists(binary):
        with tempfile.TemporaryDirectory() as tmp:
            text_file = os.path.join(tmp, "prose.txt")
            with open(text_file, "w") as f:
                f.write(text)
            ppl_l, log = llama_perplexity(binary, str(default_model_file()), text_file, args.ctx, args.chunks)
            counted = re.search(r"tokenizing the input.*?(\d+) chunks", log, re.S)
            print(f"llama.cpp: PPL Q4_1 {ppl_l} ({counted.group(1) if counted else '?'} chunks)", flush=True)
            rows.append(Row("SmolLM2 Q4_1 perplexity, llama-perplexity", f"{ppl_l}"))
            f32 = args.f32_gguf
            if f32 is None and args.llama_cpp_src:
                f32 = os.path.join(tmp, "smollm2-f32.gguf")
                env = {**os.environ, "PYTHONPATH": os.path.join(args.llama_cpp_src, "gguf-py")}
                subprocess.run([args.python, os.path.join(args.llama_cpp_src, "convert_hf_to_gguf.py"),
                                str(default_model_path()), "--outtype", "f32", "--outfile", f32], check=True, env=env,
                               capture_output=True)
            if f32:
                base = os.path.join(tmp, "base.kld")
                ppl_f32, _ = llama_perplexity(binary, f32, text_file, args.ctx, args.chunks,
                                              ["--kl-divergence-base", base])
                _, kld_log = llama_perplexity(binary, str(default_model_file()), text_file, args.ctx, args.chunks,
                                              ["--kl-divergence-base", base, "--kl-divergence"])
                stats = "\n".join(line for line in kld_log.splitlines()
                                  if re.match(r"\s*(Mean|Median|Same top|KLD|RMS|Δp|ln)", line))
                print(f"llama.cpp: PPL F32 {ppl_f32}\n{stats}", flush=True)
                rows.append(Row("SmolLM2 F32 (dequantized) perplexity, llama-perplexity", f"{ppl_f32}"))
    emit("quantized_accuracy", rows)


if __name__ == "__main__":
    main()
