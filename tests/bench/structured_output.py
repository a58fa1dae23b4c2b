"""What structured outputs cost the worker's sampler step.

Run: ``python tests/bench/structured_output.py [--quick]``. SmolLM2's tokenizer (vocab
49152; the tiny test tokenizer with ``--quick``), a greedy batch of 64 rows, the
worker's processor set (built-ins) with and without the structured-output processor:

- idle: the processor is there but no row is constrained (target: no measurable cost);
- 8 and 64 rows under a JSON schema, each row somewhere in its document (the token
  bitmask from llguidance, then -inf on the banned tokens);
- the same 8 rows under speculative decoding (3 drafts per row: the bonus position in
  the sampler, then the draft positions in the rejection sampler: advance, mask, roll
  back);
- one-off costs: the llguidance tokenizer (once per process), a grammar compile (a
  cache miss) against a cached one (a copy of the compiled matcher).

Medians of interleaved rounds; every case gets a fresh copy of the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _results import Row, emit  # noqa: E402
from _timing import time_side_by_side  # noqa: E402

from sampler.config import SamplerConfig  # noqa: E402
from sampler.logits_processor import BatchUpdate  # noqa: E402
from sampler.logits_processor.loading import build_logitsprocs  # noqa: E402
from sampler.metadata import SamplingMetadata  # noqa: E402
from sampler.params import SamplingParams, StructuredOutputsParams  # noqa: E402
from sampler.rejection_sampler import RejectionSampler  # noqa: E402
from sampler.sampler import Sampler  # noqa: E402
from worker.structured_output import GrammarCompiler, StructuredOutputLogitsProcessor  # noqa: E402

BATCH = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "email"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@engine.com", "tags": ["admin", "user"],
            "address": {"city": "London", "zip": "W1"}}


def load_tokenizer(quick: bool):
    if quick:
        import tempfile

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from transformers import AutoTokenizer

        from tiny_model import build_tiny_model

        return AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp()))
    from worker.runner.model_loader import load_tokenizer as load

    return load(None)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny tokenizer, fewer rounds")
    args = parser.parse_args()
    tok = load_tokenizer(args.quick)
    vocab = len(tok)
    eos = [tok.eos_token_id]
    repeat = 7 if args.quick else 21

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab, eos)
    _ = compiler.ll_tokenizer  # built on first use: timed here
    t_tokenizer = time.perf_counter() - t0
    so = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    compiler.validate(so)
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        compiler.matcher(so)
    t_copy = (time.perf_counter() - t0) / 100

    doc = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    config = SamplerConfig(vocab_size=vocab, max_num_seqs=BATCH, num_spec_tokens=3)
    sampler = Sampler(config, in_place=True)
    rejection = RejectionSampler(config)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, vocab, generator=gen) * 2.0
    prompts = [[1, 2, 3]] * BATCH

    def batch(constrained: int, with_processor: bool = True):
        """Metadata of a greedy batch whose first ``constrained`` rows follow the schema,
        row i with i % len(doc) tokens of the document already out; and the drafts."""
        procs = build_logitsprocs(config)
        if with_processor:
            procs.non_argmax_invariant.append(StructuredOutputLogitsProcessor(config, "cpu", False, compiler=compiler))
        params, outputs, drafts = [], [], []
        for i in range(BATCH):
            k = (7 * i) % (len(doc) - 3)
            if i < constrained:
                params.append(SamplingParams(temperature=0.0, structured_outputs=so))
                outputs.append(doc[:k])
                drafts.append(doc[k:k + 3])
            else:
                params.append(SamplingParams(temperature=0.0))
                outputs.append([5] * k)
                drafts.append([6, 7, 8])
        procs.update_state(BatchUpdate(batch_size=BATCH, removed=[], added=[
            (i, p, prompts[i], outputs[i]) for i, p in enumerate(params)], moved=[]))
        md = SamplingMetadata.from_requests(params, prompts, outputs, vocab, logitsprocs=procs, config=config)
        spec_md = SamplingMetadata.from_requests(params, prompts, outputs, vocab, logitsprocs=procs,
                                                 spec_token_ids=drafts, config=config)
        return md, spec_md, drafts

    plain, plain_spec, drafts = batch(0, with_processor=False)
    idle, idle_spec, _ = batch(0)
    eight, eight_spec, drafts8 = batch(8)
    full, _, _ = batch(BATCH)
    target = torch.randn(BATCH * 3, vocab, generator=gen) * 2.0

    def spec_step(md, d):
        def run(x):
            bonus = sampler(x, md).sampled_token_ids
            rejection(d, None, target, bonus, md)
        return run

    step = lambda md: lambda x: sampler(x, md)  # noqa: E731
    alone = lambda md: lambda x: md.logitsprocs.non_argmax_invariant[-1].apply(x)  # noqa: E731
    times = time_side_by_side({
        "processor alone, 8 rows": (alone(eight), logits.clone),
        "processor alone, 64 rows": (alone(full), logits.clone),
        "no processor": (step(plain), logits.clone),
        "idle": (step(idle), logits.clone),
        "8 rows": (step(eight), logits.clone),
        "64 rows": (step(full), logits.clone),
        "spec, no processor": (spec_step(plain_spec, drafts), logits.clone),
        "spec, idle": (spec_step(idle_spec, drafts), logits.clone),
        "spec, 8 rows": (spec_step(eight_spec, drafts8), logits.clone),
    }, repeat=repeat)
    ms = {k: v * 1e3 for k, v in times.items()}
    base, spec_base = ms["no processor"], ms["spec, no processor"]
    print(f"vocab {vocab}, batch {BATCH} greedy; llguidance tokenizer {t_tokenizer * 1e3:.0f} ms once, "
          f"grammar compile {t_compile * 1e3:.2f} ms, cached copy {t_copy * 1e6:.1f} us")
    for name, value in ms.items():
        if name.startswith("processor"):
            print(f"  {name:26s} {value:8.3f} ms")
            continue
        ref = spec_base if name.startswith("spec") else base
        print(f"  {name:26s} {value:8.3f} ms   +{value - ref:7.3f} ms ({value / ref:.2f}x)")
    rows = [
        Row(f"sampler step ms, batch {BATCH} greedy, vocab {vocab}: structured-output processor idle vs absent",
            f"{ms['idle']:.2f}", f"{base:.2f}", f"{ms['idle'] / base:.2f}x", "<= 1.05x", ms["idle"] <= 1.05 * base),
        Row(f"sampler step ms, batch {BATCH} greedy, vocab {vocab}: 8 rows under a JSON schema vs none",
            f"{ms['8 rows']:.2f}", f"{base:.2f}", f"{ms['8 rows'] / base:.2f}x"),
        Row(f"sampler step ms, batch {BATCH} greedy, vocab {vocab}: 64 rows under a JSON schema vs none",
            f"{ms['64 rows']:.2f}", f"{base:.2f}", f"{ms['64 rows'] / base:.2f}x"),
        Row(f"structured-output processor alone ms per step, vocab {vocab}: 8 rows | 64 rows",
            f"{ms['processor alone, 8 rows']:.2f} | {ms['processor alone, 64 rows']:.2f}"),
        Row(f"sampler + rejection ms, 3 drafts/row, vocab {vocab}: 8 rows under a JSON schema vs none",
            f"{ms['spec, 8 rows']:.2f}", f"{spec_base:.2f}", f"{ms['spec, 8 rows'] / spec_base:.2f}x"),
        Row(f"grammar: compile ms (cache miss) vs cached copy ms, vocab {vocab}",
            f"{t_compile * 1e3:.2f}", f"{t_copy * 1e3:.3f}", f"{t_compile / t_copy:.0f}x"),
    ]
    emit("structured_output", rows, notes=[
        f"the llguidance tokenizer is built once per process on the first "
        f"constrained request ({t_tokenizer * 1e3:.0f} ms at vocab {vocab})."])


if __name__ == "__main__":
    main()
