"""What several test files share, so that no test file imports another.

- The in-process worker on a model and its references: ``make_worker``, ``prompts``,
  transformers' greedy ``generate``, ``assert_greedy_equal`` (equal up to a near-tie),
  ``run_alone_and_mixed`` and the ``SEEDED`` sampling params it is used with.
- The SmolLM2 chat ``QUESTIONS``.
- Scheduler fakes: a one-letter-per-token ``TOKENIZER`` and the ``ShadowWorker`` that
  applies each StepRequest by the protocol's rules.
- Paged attention: ``random_paged_case`` (a random pool, rows and block tables).
- Serving: ``free_port``, ``served`` (an app under Serve on it), ``post_json`` and the
  plain chat ``TEMPLATE``.

Imports that take seconds (the worker, Ray Serve, the app) happen in the functions that
need them, so a benchmark script can take ``free_port`` cheaply.
"""

from __future__ import annotations

import copy
import json
import random
import socket
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import torch

from sampler.params import SamplingParams
from worker_driver import MiniDriver, greedy_divergence

if TYPE_CHECKING:
    from worker.protocol import StepRequest
    from worker.transport.actor import Worker

# -- the worker and its references ------------------------------------------------------

NEAR_TIE = 1e-4  # a top-2 logit gap below this may flip greedy between two correct kernels


def make_worker(path: str, **config) -> Worker:
    """A loaded in-process worker (no Ray): 4 rows, 256 tokens unless ``config`` says."""
    from worker.config import WorkerConfig
    from worker.transport.actor import Worker

    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_model_len", 256)
    w = Worker()
    w.load(WorkerConfig(model=path, **config))
    return w


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    """Random token prompts of the given lengths (ids 1 .. vocab - 1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def generate(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens; like ignore_eos, EOS neither stops nor is suppressed (so not
    ``min_new_tokens``, which bans EOS)."""
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
            )
    finally:
        model.generation_config = saved
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(model, prompt, ours, ref) -> None:
    """``ours`` equals ``ref`` up to the first position where the reference model's top
    two logits are a near-tie (after which either continuation is right)."""
    div = greedy_divergence(model, prompt, ours, ref)
    if div is not None:
        pos, gap = div
        assert gap < NEAR_TIE, f"diverged at token {pos} where the top-2 gap is {gap:.3g} (not a near-tie)"


def run_alone_and_mixed(new_step_fn: Callable, target: SamplingParams, prompt):
    """The target request alone, then joining a busy batch (other rows, another row
    index, a later step, smaller prefill chunks, swaps). ``new_step_fn()`` gives the
    step function of a fresh worker."""
    d = MiniDriver(new_step_fn(), max_rows=4)
    d.submit("t", prompt, target)
    alone = d.run()["t"].output
    d = MiniDriver(new_step_fn(), max_rows=4, chunk=7, swap_seed=1)
    noise = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    for i, p in enumerate(prompts(400, [11, 30, 5, 22, 8], seed=9)):
        d.submit(f"n{i}", p, noise, arrival_step=i)
    d.submit("t", prompt, target, arrival_step=2)
    mixed = d.run()["t"].output
    return alone, mixed


SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)

# -- SmolLM2 ----------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five year old in two sentences.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' into Spanish and German, and say which language has more speakers.",
    "What does a Ray actor do? Answer briefly, like a teacher speaking to a new student on their first day.",
    "2+2=",
]

# -- scheduler fakes --------------------------------------------------------------------


class FakeTokenizer:
    """Enough of a tokenizer for the detokenizer: one letter per token."""

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(t) % 26) for t in ids)

    def batch_decode(self, batch: Seq[Seq[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in batch]


TOKENIZER = FakeTokenizer()


@dataclass
class ShadowRow:
    seq_id: str
    tokens: list[int]
    computed: int = 0


class ShadowWorker:
    """The worker's persistent batch: applies a StepRequest as the worker does (removes,
    adds, moves in order), checking that each change makes sense, then runs the step."""

    def __init__(self) -> None:
        self.rows: list[ShadowRow | None] = []

    def apply(self, msg: StepRequest, replaceable: set[str]) -> None:
        """``replaceable``: the sequences that left since the last step (a refilled
        freed row is not listed in ``removed``, so an add may overwrite only those)."""
        rows = self.rows
        assert len(set(msg.removed)) == len(msg.removed), f"duplicate removes {msg.removed}"
        for r in msg.removed:
            assert r < len(rows) and rows[r] is not None, f"removed row {r} holds nothing"
            assert rows[r].seq_id in replaceable, f"removed row {r} holds running {rows[r].seq_id}"
            rows[r] = None
        for add in msg.added:
            assert add.row <= len(rows), f"add into row {add.row} leaves a gap ({len(rows)} rows)"
            if add.row == len(rows):
                rows.append(None)
            old = rows[add.row]
            assert old is None or old.seq_id in replaceable, f"add overwrites running {old.seq_id}"
            tokens = add.prompt_token_ids.numpy().tolist() + add.output_token_ids.numpy().tolist()
            rows[add.row] = ShadowRow(add.request_id, tokens)
        for mv in msg.moved:
            assert not mv.swap, f"{mv}: only unidirectional moves"
            assert mv.a > mv.b, f"{mv}: moves go from a higher row to a lower one"
            assert mv.a < len(rows) and rows[mv.a] is not None, f"{mv}: source row is empty"
            assert rows[mv.b] is None, f"{mv}: target row holds {rows[mv.b].seq_id}"
            rows[mv.b], rows[mv.a] = rows[mv.a], None
        n = msg.batch_size
        assert len(rows) >= n and all(r is not None for r in rows[:n]), f"holes below batch_size {n}: {rows}"
        assert all(r is None for r in rows[n:]), f"requests left above batch_size {n}"
        del rows[n:]
        assert len({r.seq_id for r in rows}) == n, "a request holds two rows"
        assert len(msg.num_scheduled_tokens) == n

    def run(self, msg: StepRequest, rng: random.Random, num_spec_tokens: int) -> dict[str, list[int]]:
        """Runs the scheduled tokens; a row that reaches its last known token samples one
        token plus up to ``num_spec_tokens`` accepted drafts. Returns what each sampled."""
        sampled: dict[str, list[int]] = {}
        for row, n in zip(self.rows, msg.num_scheduled_tokens.numpy().tolist()):
            assert 0 <= n <= len(row.tokens) - row.computed, f"{row.seq_id}: {n} tokens scheduled"
            row.computed += n
            if n and row.computed == len(row.tokens):
                new = [rng.randrange(1, 1000) for _ in range(1 + rng.randint(0, num_spec_tokens))]
                row.tokens += new
                row.computed = len(row.tokens) - 1
                sampled[row.seq_id] = new
        return sampled


# -- paged attention --------------------------------------------------------------------


def random_paged_case(seed: int, q_lens: list[int], depth: int, kv_heads: int, group: int, dim: int, block: int,
                      dtype: torch.dtype, shared: int):
    """A pool with random keys and values, rows with ``q_lens`` queries after up to
    ``depth`` cached tokens each (the first ``shared`` blocks shared by every row, at the
    same positions, as the prefix cache shares them), block tables in random order."""
    from worker.runner.kv_pool import PagedKVCache

    rng = np.random.default_rng(seed)
    rows = len(q_lens)
    q_lens = np.array(q_lens, dtype=np.int64)
    cached = shared * block + rng.integers(0, depth + 1, rows)
    kv_lens = cached + q_lens
    need = -(-kv_lens // block)
    num_blocks = int(need.sum()) + 4
    order = rng.permutation(num_blocks)
    table = np.zeros((rows, int(need.max()) + 2), dtype=np.int32)
    at = shared
    for r, n in enumerate(need):
        table[r, :shared] = order[:shared]
        table[r, shared:n] = order[at : at + n - shared]
        at += n - shared
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, block, kv_heads, dim, dtype, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    q = torch.randn(int(q_lens.sum()), kv_heads * group, dim, generator=g).to(dtype)
    return cache, np.arange(rows), cached, q_lens, table, q


# -- serving ----------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(args: dict[str, Any], name: str) -> Iterator[str]:
    """``build_app(args)`` under Serve on a free port; yields its base URL."""
    from ray import serve

    from deploy.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def post_json(server: str, body: dict, path: str = "/v1/chat/completions", model: str = "tiny") -> httpx.Response:
    return httpx.post(f"{server}{path}", json={"model": model, **body}, timeout=120)


def stream_completion_text(url: str, body: dict, began: Any = None) -> tuple[str, str | None]:
    """POSTs a streaming ``/v1/completions`` ``body`` to ``url``: (its text, None) when
    it ended with ``[DONE]``, else (the text so far, how it ended: a status, an error
    event, a cut connection). ``began`` (a ``threading.Event``) is set at its first text."""
    parts: list[str] = []
    done = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=180) as r:
            if r.status_code != 200:
                return "", f"HTTP {r.status_code}: {r.read()[:300]!r}"
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        return "".join(parts), f"error event: {chunk['error']}"
                    parts.append(chunk["choices"][0]["text"])
                    if began is not None:
                        began.set()
    except httpx.HTTPError as exc:
        return "".join(parts), f"{type(exc).__name__}: {exc}"
    return "".join(parts), None if done else f"no [DONE] after {len(parts)} chunks"


def add_call_deltas(calls: dict[int, list[str]], deltas: Any) -> None:
    """A tool parser's call deltas into ``calls`` (index -> [name, arguments]), as a
    client reassembles them, checking the stream's shape: a call's first delta names it
    (and only it does), with no arguments yet; later ones add arguments."""
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.name and d.arguments == ""
            calls[d.index] = [d.name, ""]
        else:
            assert d.name is None and d.index in calls and d.arguments
            calls[d.index][1] += d.arguments
