"""Driver <-> worker wire format: msgspec (worker.protocol.Codec) against pickle.

Run: ``python tests/bench/wire.py [--quick]``. Prints, for (a) a realistic step message
and (b) a realistic step reply, the median time of encode+decode (and of each half)
with the msgspec Codec and with pickle (protocol 5, ``pickle.dumps`` / ``pickle.loads``)
of equivalent plain Python dataclasses that hold the same data the way a naive
implementation would: token ids, logprobs and ranks as lists of Python ints / floats,
the sampling parameters as a plain dataclass with SamplingParams' fields. Also the size
of each encoding. Target: pickle / msgspec >= 5x on encode+decode.

(a) step: batch of 64 rows; 4 rows removed, 8 requests added (each a 512-token prompt
    with realistic sampling parameters: stop strings, seeds, some logprobs, a logit
    bias on one), 2 moves, num_scheduled_tokens for the 64 rows (8 prefills of 512,
    56 decodes of 1).
(b) reply: 64 rows that sampled one token each with logprobs=5, so width 6: token ids
    (int32), logprobs (float32) and the sampled tokens' ranks (int32).

msgspec's decode includes what a received step must pay anyway: validation of every
field (SamplingParams' own checks included); the pickle side validates nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _results import Row, emit  # noqa: E402
from _timing import time_side_by_side  # noqa: E402

from sampler.params import SamplingParams  # noqa: E402
from worker.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    Float32Array,
    Int32Array,
    MovedRows,
    StepReply,
    StepRequest,
    StepTimings,
)

BATCH = 64
PROMPT_LEN = 512
NUM_ADDED = 8
LOGPROBS = 5
VOCAB = 151936
PICKLE_PROTOCOL = 5


# -- the naive equivalents (plain dataclasses, lists of Python numbers) ------------------

#: SamplingParams' fields and defaults as a plain dataclass (no validation), derived
#: from the Struct so the two never drift apart.
NaiveSamplingParams = dataclasses.make_dataclass(
    "NaiveSamplingParams",
    [(f.name, Any, dataclasses.field(default=f.default) if f.default is not msgspec.NODEFAULT
      else dataclasses.field(default_factory=f.default_factory))
     for f in msgspec.structs.fields(SamplingParams)],
)
NaiveSamplingParams.__module__ = __name__  # so that pickle finds it


@dataclasses.dataclass
class NaiveAddedRequest:
    row: int
    request_id: str
    params: NaiveSamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclasses.dataclass
class NaiveMovedRows:
    a: int
    b: int
    swap: bool = False


@dataclasses.dataclass
class NaiveStepRequest:
    version: int
    step_id: int
    batch_size: int
    removed: list[int]
    added: list[NaiveAddedRequest]
    moved: list[NaiveMovedRows]
    num_scheduled_tokens: list[int]


@dataclasses.dataclass
class NaiveRowError:
    row: int
    request_id: str
    message: str


@dataclasses.dataclass
class NaiveStepReply:
    version: int
    step_id: int
    num_sampled: list[int]
    sampled_token_ids: list[int]
    logprobs_width: int
    logprob_token_ids: list[int]
    logprobs: list[float]
    logprob_ranks: list[int]
    prompt_logprob_rows: list[int]
    prompt_logprob_counts: list[int]
    prompt_logprobs_width: int
    prompt_logprob_token_ids: list[int]
    prompt_logprobs: list[float]
    prompt_logprob_ranks: list[int]
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]
    failed: list[NaiveRowError]
    error: str | None
    timings: list[float] | None


def _plain(value: Any) -> Any:
    """A message field the naive way: arrays as lists of Python numbers."""
    if isinstance(value, (Int32Array, Float32Array)):
        return value.numpy().tolist()
    return value


def naive_params(params: SamplingParams) -> NaiveSamplingParams:
    fields = {name: getattr(params, name) for name in SamplingParams.__struct_fields__}
    fields["output_kind"] = int(fields["output_kind"])
    return NaiveSamplingParams(**fields)


def naive_step(step: StepRequest) -> NaiveStepRequest:
    return NaiveStepRequest(
        version=step.version,
        step_id=step.step_id,
        batch_size=step.batch_size,
        removed=list(step.removed),
        added=[
            NaiveAddedRequest(a.row, a.request_id, naive_params(a.params),
                              _plain(a.prompt_token_ids), _plain(a.output_token_ids))
            for a in step.added
        ],
        moved=[NaiveMovedRows(m.a, m.b, m.swap) for m in step.moved],
        num_scheduled_tokens=_plain(step.num_scheduled_tokens),
    )


def naive_reply(reply: StepReply) -> NaiveStepReply:
    fields = {name: _plain(getattr(reply, name)) for name in StepReply.__struct_fields__}
    fields["failed"] = [NaiveRowError(e.row, e.request_id, e.message) for e in reply.failed]
    fields["timings"] = None if reply.timings is None else list(msgspec.structs.astuple(reply.timings))
    return NaiveStepReply(**fields)


# -- the messages -----------------------------------------------------------------------


def realistic_params(i: int, rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=0.7 if i % 2 else 1.0,
        top_p=0.9 if i % 4 != 3 else 1.0,
        top_k=50 if i % 2 == 0 else 0,
        min_p=0.05 if i % 4 == 1 else 0.0,
        repetition_penalty=1.1 if i % 3 == 0 else 1.0,
        presence_penalty=0.2 if i % 3 == 1 else 0.0,
        frequency_penalty=0.2 if i % 3 == 1 else 0.0,
        seed=1000 + i if i % 2 else None,
        stop=["</s>", "\n\nUser:"] if i % 2 else None,
        max_tokens=1024,
        logprobs=LOGPROBS if i % 4 == 0 else None,
        logit_bias={int(t): -100.0 for t in rng.integers(0, VOCAB, 10)} if i == 0 else None,
        eos_token_ids=[151643, 151645],
    )


def make_step(rng: np.random.Generator) -> StepRequest:
    removed = [3, 17, 30, 45]
    # The 4 freed rows and 4 new rows at the end of the (grown) batch get the new requests.
    add_rows = removed + [60, 61, 62, 63]
    added = [
        AddedRequest(
            row=row,
            request_id=f"cmpl-{rng.integers(0, 2**63):016x}-{i}",
            params=realistic_params(i, rng),
            prompt_token_ids=Int32Array.of(rng.integers(0, VOCAB, PROMPT_LEN)),
        )
        for i, row in enumerate(add_rows)
    ]
    scheduled = np.ones(BATCH, dtype=np.int32)
    scheduled[add_rows] = PROMPT_LEN
    return StepRequest(
        version=PROTOCOL_VERSION,
        step_id=123_456,
        batch_size=BATCH,
        removed=removed,
        added=added,
        moved=[MovedRows(59, 50), MovedRows(12, 13, swap=True)],
        num_scheduled_tokens=Int32Array.of(scheduled),
    )


def make_reply(rng: np.random.Generator) -> StepReply:
    width = LOGPROBS + 1
    sampled = rng.integers(0, VOCAB, BATCH)
    top = rng.integers(0, VOCAB, (BATCH, width))
    top[:, 0] = sampled  # the sampled token first, then the top-k
    logprobs = np.sort(-rng.exponential(2.0, (BATCH, width)), axis=1)[:, ::-1].astype(np.float32)
    return StepReply(
        version=PROTOCOL_VERSION,
        step_id=123_456,
        num_sampled=Int32Array.of(np.ones(BATCH, dtype=np.int32)),
        sampled_token_ids=Int32Array.of(sampled),
        logprobs_width=width,
        logprob_token_ids=Int32Array.of(top.ravel()),
        logprobs=Float32Array.of(logprobs.ravel()),
        logprob_ranks=Int32Array.of(rng.integers(1, 4, BATCH)),
        timings=StepTimings(prepare=0.0011, forward=0.1702, sample=0.0019, bookkeeping=0.0002),
    )


# -- timing -----------------------------------------------------------------------------


def _looped(fn, inner: int):
    def run() -> None:
        for _ in range(inner):
            fn()
    return run


def bench(name: str, message, naive, decode, inner: int, repeat: int) -> list[tuple]:
    codec = Codec()
    data = codec.encode(message)
    pickled = pickle.dumps(naive, protocol=PICKLE_PROTOCOL)
    assert decode(codec, data) == message
    assert pickle.loads(pickled) == naive
    cases = {
        "msgspec enc+dec": lambda: decode(codec, codec.encode(message)),
        "pickle enc+dec": lambda: pickle.loads(pickle.dumps(naive, protocol=PICKLE_PROTOCOL)),
        "msgspec enc": lambda: codec.encode(message),
        "pickle enc": lambda: pickle.dumps(naive, protocol=PICKLE_PROTOCOL),
        "msgspec dec": lambda: decode(codec, data),
        "pickle dec": lambda: pickle.loads(pickled),
    }
    times = time_side_by_side(
        {k: (_looped(fn, inner), None) for k, fn in cases.items()},
        warmup=max(1, repeat // 7), repeat=repeat,
    )
    rows = []
    for part, target in (("enc+dec", ">= 5x"), ("enc", ""), ("dec", "")):
        ours = times[f"msgspec {part}"] / inner
        theirs = times[f"pickle {part}"] / inner
        rows.append((f"{name} {part}", ours, theirs, theirs / ours, target,
                     len(data), len(pickled)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    inner, repeat = (20, 7) if args.quick else (200, 21)

    rng = np.random.default_rng(0)
    step, reply = make_step(rng), make_reply(rng)
    rows = bench("step", step, naive_step(step), lambda c, d: c.decode_step(d), inner, repeat)
    rows += bench("reply", reply, naive_reply(reply), lambda c, d: c.decode_reply(d),
                  inner, repeat)

    print(f"wire format, batch {BATCH}: step = {len(step.removed)} removes, "
          f"{len(step.added)} adds x {PROMPT_LEN}-token prompt, {len(step.moved)} moves; "
          f"reply = 1 token/row, logprobs={LOGPROBS}")
    print(f"pickle protocol {PICKLE_PROTOCOL} of plain dataclasses + lists; median of "
          f"{repeat} interleaved rounds x {inner} calls{' (--quick)' if args.quick else ''}")
    print(f"{'case':<15} | {'msgspec µs':>10} | {'pickle µs':>9} | {'ratio':>6} | "
          f"{'target':<6} | {'msgspec B':>9} | {'pickle B':>8}")
    for case, ours, theirs, ratio, target, size_ours, size_theirs in rows:
        print(f"{case:<15} | {ours * 1e6:10.1f} | {theirs * 1e6:9.1f} | {ratio:5.2f}x | "
              f"{target:<6} | {size_ours:9d} | {size_theirs:8d}")
    emit("wire", [
        Row(f"{case} µs, msgspec vs pickle ({size_ours} / {size_theirs} B)", f"{ours * 1e6:.1f}",
            f"{theirs * 1e6:.1f}", f"{ratio:.2f}x", target, ratio >= 5 if target else None)
        for case, ours, theirs, ratio, target, size_ours, size_theirs in rows if case.endswith("enc+dec")
    ])


if __name__ == "__main__":
    main()
