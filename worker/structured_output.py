"""Structured outputs: JSON schema, regex, choice and grammar constraints, enforced in
the worker as a logits processor built on llguidance.

- ``GrammarCompiler`` turns a request's ``StructuredOutputsParams`` into an llguidance
  grammar and compiles it against the model's tokenizer, keeping the compiled
  matchers in an LRU keyed by (kind, spec, options). The driver uses one to validate a
  constraint when the request enters (``validate``: a ``ValueError`` naming the field);
  each worker uses one to start a row's matcher (``matcher``: a copy of the compiled
  one, far cheaper than a compile).
- ``StructuredOutputLogitsProcessor`` keeps one matcher per constrained row, following
  the ``BatchUpdate`` (a re-added request, preempted or moved off a dead worker, gets a
  fresh matcher that consumes its output so far), advances it with each token the row
  really emitted (its live output list), and masks every token the grammar does not
  allow next (only EOS once the grammar is complete). Under speculative decoding it
  masks each draft position after the drafts before it (advance, mask, roll back), so
  rejected drafts never touch the real state.

A row whose matcher breaks (a token forced past the mask, a grammar that hits one of
llguidance's resource limits) has every token banned: the sampler reports it as
unsatisfiable and the worker fails that request alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from sampler.logits_processor.builtin import process_dict_updates
from sampler.logits_processor.interface import BatchUpdate, LogitsProcessor
from sampler.params import StructuredOutputsParams

if TYPE_CHECKING:
    from sampler.config import SamplerConfig
    from sampler.params import SamplingParams

logger = logging.getLogger(__name__)

#: Compiled grammars kept per process (driver and each worker).
GRAMMAR_CACHE_SIZE = 256
_LITTLE_ENDIAN = sys.byteorder == "little"  # llguidance writes native-endian u32 words
#: byte value -> what to add to its eight tokens' logits (bit i set: token i allowed).
_BYTE_TO_ADD = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(0.0), np.float32(-np.inf),
).astype(np.float32)
#: Longest llguidance message quoted in a ValueError (its messages can embed the grammar).
_MAX_MESSAGE = 600


# -- from params to an llguidance grammar ------------------------------------------------


def constraint_spec(so: StructuredOutputsParams) -> tuple[str, str, tuple]:
    """(kind, spec text, options): what the grammar is compiled from."""
    kind = so.kind
    if kind == "json":
        text = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif kind == "json_object":
        text = '{"type": "object"}'
    elif kind == "choice":
        text = json.dumps(so.choice)
    else:
        text = getattr(so, kind)
    options: tuple = ()
    if kind in ("json", "json_object"):
        options = (so.disable_any_whitespace, so.disable_additional_properties, so.whitespace_pattern)
    return kind, text, options


def serialize_grammar(kind: str, text: str, options: tuple) -> str:
    """The llguidance grammar (a JSON string) of one constraint; ``ValueError`` when
    the spec cannot even be translated (validity is checked when it compiles)."""
    if kind in ("json", "json_object"):
        no_whitespace, closed_objects, whitespace_pattern = options
        if closed_objects:
            text = json.dumps(_close_objects(json.loads(text)))
        defaults: dict[str, Any] = {"whitespace_flexible": not no_whitespace}
        if whitespace_pattern is not None:
            defaults["whitespace_pattern"] = whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    # Lark; a GBNF grammar is converted to Lark first.
    return llguidance.grammar_from("grammar", text)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
    "allOf", "anyOf", "oneOf",
)


def _close_objects(schema: Any) -> Any:
    """``disable_additional_properties``: every object schema that lists ``properties``
    and says nothing about ``additionalProperties`` gets ``false`` (in place)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), (dict, list)):
                stack.append(node[key])
    return schema


def _is_panic(exc: BaseException) -> bool:
    """pyo3 reports a Rust panic as ``PanicException``, a ``BaseException``."""
    return type(exc).__name__ == "PanicException"


def build_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's (fast) tokenizer, covering every logits column."""
    try:
        n_vocab = max(int(vocab_size), len(tokenizer))
        return llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None
        )
    except Exception as exc:
        raise ValueError(
            "structured_outputs needs a fast (tokenizers-backed) tokenizer; this model's "
            f"cannot be used: {exc}"
        ) from None


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class GrammarCompiler:
    """Compiles constraints against one tokenizer, with an LRU of compiled matchers
    (invalid specs are cached too, with their error). The llguidance tokenizer is built
    on first use (not cheap for a large vocabulary), so a process that never sees a
    constraint never pays for it. Safe to share between threads."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = int(vocab_size)
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._lock = threading.Lock()
        self.cache = _LRU(cache_size)
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer_error is not None:
                    raise ValueError(self._tokenizer_error)
                try:
                    self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self._vocab_size, self._eos)
                except ValueError as exc:
                    self._tokenizer_error = str(exc)
                    raise
            return self._ll_tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.ll_tokenizer.eos_tokens)

    @property
    def mask_words(self) -> int:
        """int32 words of one token bitmask."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def _compiled(self, so: StructuredOutputsParams) -> tuple[llguidance.LLMatcher | None, str | None]:
        kind, text, options = constraint_spec(so)
        key = (kind, hashlib.blake2b(text.encode("utf-8"), digest_size=20).digest(), options)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        tokenizer = self.ll_tokenizer  # a ValueError here is about the model, not cached
        self.compiles += 1
        matcher, error = None, None
        try:
            grammar = serialize_grammar(kind, text, options)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                error, matcher = matcher.get_error(), None
        except BaseException as exc:  # noqa: BLE001 - hostile input: every failure is a 400
            if not isinstance(exc, Exception) and not _is_panic(exc):
                raise
            error, matcher = f"{exc}", None
        if error is not None:
            if len(error) > _MAX_MESSAGE:
                error = error[:_MAX_MESSAGE] + "..."
            error = f"structured_outputs.{kind} is invalid: {error}"
        self.cache.put(key, (matcher, error))
        return matcher, error

    def validate(self, so: StructuredOutputsParams) -> None:
        """``ValueError`` naming ``structured_outputs.<field>`` when the constraint does
        not compile (the driver calls this where the request enters)."""
        _, error = self._compiled(so)
        if error is not None:
            raise ValueError(error)

    def matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one row (a copy of the cached compiled one); raises
        ``ValueError`` when the constraint does not compile."""
        matcher, error = self._compiled(so)
        if error is not None:
            raise ValueError(error)
        return matcher.deep_copy()


# -- the processor -----------------------------------------------------------------------


def _gate_end(tokens: Sequence[int], start: int, gate: Sequence[int]) -> int | None:
    """The index just past the first ``gate`` sequence in ``tokens`` that ends at or
    after ``start`` (None: none ends there)."""
    n = len(gate)
    for i in range(max(start, n - 1), len(tokens)):
        if tokens[i] == gate[-1] and list(tokens[i - n + 1:i + 1]) == list(gate):
            return i + 1
    return None


class _RowGrammar:
    """One row's matcher, in step with the row's live output list. With a ``gate``
    (the reasoning end marker's token ids: ``after_reasoning``) the grammar sees only
    the tokens after the first time the output completes it; until then the row is not
    constrained."""

    __slots__ = ("matcher", "output", "consumed", "error", "eos", "gate")

    def __init__(self, matcher: llguidance.LLMatcher | None, output: list[int],
                 eos: frozenset[int], error: str | None = None, gate: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.output = output
        self.consumed = 0
        self.error = error
        self.eos = eos
        self.gate = gate  # () once open (or never gated)
        self.sync()

    @property
    def gated(self) -> bool:
        """Whether the grammar does not apply yet (the reasoning has not ended)."""
        return bool(self.gate) and self.error is None

    def _open_gate(self) -> None:
        if not self.gate:
            return
        end = _gate_end(self.output, self.consumed, self.gate)
        if end is None:
            self.consumed = len(self.output)
        else:
            self.consumed, self.gate = end, ()

    def _fail(self, error: str) -> None:
        self.error = error
        logger.warning("structured output: %s; the request's row bans every token and fails", error)

    def sync(self) -> None:
        """Consume the tokens the row emitted since the last call."""
        if self.error is not None:
            self.consumed = len(self.output)
            return
        self._open_gate()
        m = self.matcher
        while not self.gate and self.consumed < len(self.output):
            token = self.output[self.consumed]
            self.consumed += 1
            if m.is_stopped():  # the grammar is complete: only EOS follows (ignore_eos repeats it)
                continue
            if not m.consume_token(token):
                self._fail(f"token {token} does not follow the grammar: {m.get_error()[:_MAX_MESSAGE]}")
                return

    def fill_after_prefixes(self, bitmask: np.ndarray, items: list[tuple[int, Sequence[int]]]) -> None:
        """Mask ``bitmask[k]`` for the state after this row's output plus ``prefix``,
        for each ``(k, prefix)``; the real state is left as it was (rolled back). A
        position behind a draft the grammar does not allow is never reached (that draft
        is rejected), so it stays unmasked (all ones)."""
        if self.gated:  # the grammar starts after the gate, if a draft completes it
            tail = list(self.output[max(0, len(self.output) - len(self.gate) + 1):])
            opened = []
            for k, prefix in items:
                end = _gate_end(tail + list(prefix), len(tail), self.gate)
                if end is not None:
                    opened.append((k, list(prefix)[end - len(tail):]))
            gate, self.gate = self.gate, ()
            try:
                self.fill_after_prefixes(bitmask, opened)  # the others stay unmasked
            finally:
                self.gate = gate
            return
        if self.error is None:
            m = self.matcher
            current: list[int] = []
            recorded = 0  # tokens the matcher consumed (what a rollback undoes)
            dead = False
            for k, prefix in sorted(items, key=lambda item: len(item[1])):
                prefix = list(prefix)
                if prefix[: len(current)] != current:  # not an extension: start over
                    if not self._rollback(recorded):
                        break
                    current, recorded, dead = [], 0, False
                for token in prefix[len(current):]:
                    current.append(token)
                    if dead:
                        continue
                    if m.is_stopped():  # only EOS may follow the complete grammar
                        dead = token not in self.eos
                    elif m.try_consume_tokens([token]) == 1:
                        recorded += 1
                    else:
                        dead = True
                if not dead:
                    llg_numpy.fill_next_token_bitmask(m, bitmask, k)
            else:
                self._rollback(recorded)
        if self.error is not None:  # broken (now or before): the row fails
            for k, _ in items:
                bitmask[k] = 0

    def _rollback(self, n: int) -> bool:
        if n and not self.matcher.rollback(n):
            self._fail(f"rollback of {n} draft tokens failed: {self.matcher.get_error()[:_MAX_MESSAGE]}")
            return False
        return True


class StructuredOutputLogitsProcessor(LogitsProcessor):
    """Masks each constrained row to the tokens its grammar allows next.

    Built by the worker as ``Cls(config, device, is_pin_memory, compiler=...)`` with the
    worker's ``GrammarCompiler``. Not argmax-invariant, so it runs with the other
    constraints, before penalties and the greedy argmax. With no constrained row in the
    batch every method returns at once.
    """

    reads_output_token_ids = True
    reads_draft_tokens = True

    def __init__(
        self, config: SamplerConfig, device: torch.device, is_pin_memory: bool,
        compiler: GrammarCompiler | None = None, reasoning_end: Sequence[int] = (),
    ) -> None:
        self.device = torch.device(device)
        self.compiler = compiler
        #: the worker's reasoning end marker: ``after_reasoning`` rows wait for it
        self.reasoning_end = tuple(reasoning_end)
        self.rows: dict[int, _RowGrammar] = {}
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._row_add: np.ndarray | None = None
        self._executor: llguidance.LLExecutor | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    # -- state ------------------------------------------------------------------------

    def _new_row(self, params: SamplingParams, _prompt: Any, output: list[int]) -> _RowGrammar | None:
        so = params.structured_outputs
        if so is None:
            return None
        try:
            if self.compiler is None:
                raise ValueError("this worker has no grammar compiler (no tokenizer)")
            matcher = self.compiler.matcher(so)
            eos = frozenset(self.compiler.eos_token_ids)
        except ValueError as exc:  # the driver validates first; this is a worker-side guard
            logger.warning("structured output: %s; the request's row bans every token and fails", exc)
            return _RowGrammar(None, output, frozenset(), error=str(exc))
        return _RowGrammar(matcher, output, eos, gate=self.reasoning_end if so.after_reasoning else ())

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)
        for row in self.rows.values():
            row.sync()  # advance with the tokens accepted last step

    # -- masking ------------------------------------------------------------------------

    def _words(self) -> int:
        if self.compiler is not None:
            try:
                return self.compiler.mask_words
            except ValueError:
                pass
        return 1  # every row has failed: its mask is all zeros, any width bans all

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(r for r in self.rows if r < logits.shape[0])
        if not rows:
            return logits
        bitmask = np.empty((len(rows), self._words()), dtype=np.int32)
        live = []
        for k, r in enumerate(rows):
            state = self.rows[r]
            state.sync()
            if state.gated:
                bitmask[k] = -1  # still reasoning: every token allowed
            elif state.error is None:
                live.append((state.matcher, k))
            else:
                bitmask[k] = 0
        if live:  # all masks in one call (no per-row Python; threads on larger hosts)
            llg_numpy.fill_next_token_bitmask_par(self._mask_executor(), live, bitmask)
        return self._apply_bitmask(logits, rows, bitmask)

    def _mask_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            # A mask is quick to compute: on a small host a second thread only competes
            # with torch's; on a larger one, up to 8 compute masks side by side.
            threads = max(1, min(8, torch.get_num_threads() // 2))
            self._executor = llguidance.LLExecutor(num_threads=threads)
        return self._executor

    def apply_at_positions(
        self,
        logits: torch.Tensor,
        row_index: Sequence[int],
        num_prior: Sequence[int],
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Logits row i follows batch row ``row_index[i]``'s output plus the drafts
        ``prefixes[i]`` (``num_prior[i]`` of them): it gets the mask of that state."""
        if not self.rows:
            return logits
        by_row: dict[int, list[tuple[int, int]]] = {}
        for i, r in enumerate(np.asarray(row_index).tolist()):
            if r in self.rows:
                by_row.setdefault(r, []).append(i)
        if not by_row:
            return logits
        if prefixes is None:
            if any(int(num_prior[i]) for items in by_row.values() for i in items):
                raise ValueError("StructuredOutputLogitsProcessor needs the draft tokens (prefixes)")
            prefixes = [()] * len(row_index)
        positions = sorted(i for items in by_row.values() for i in items)
        slot = {i: k for k, i in enumerate(positions)}
        bitmask = np.full((len(positions), self._words()), -1, dtype=np.int32)
        for r, items in by_row.items():
            state = self.rows[r]
            state.sync()
            state.fill_after_prefixes(bitmask, [(slot[i], prefixes[i]) for i in items])
        return self._apply_bitmask(logits, positions, bitmask)

    def _apply_bitmask(self, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
        """-inf where ``bitmask`` (one bit per token, llguidance's layout) is 0; tokens
        past the bitmask are banned. On CPU with numpy (a byte lookup, then one add per
        row: much faster than a torch ``masked_fill``, whose intra-op threads stall when
        the cores are busy); elsewhere the bits are unpacked on the device."""
        vocab = logits.shape[1]
        if (logits.device.type == "cpu" and _LITTLE_ENDIAN and logits.dtype == torch.float32
                and logits.is_contiguous() and not logits.requires_grad):
            # 0 / -inf per token, eight tokens per bitmask byte, added to each row (one
            # row's worth of scratch, kept: no fresh rows x vocab array per step).
            data = bitmask.view(np.uint8)
            if self._row_add is None or self._row_add.shape[0] != data.shape[1]:
                self._row_add = np.empty((data.shape[1], 8), dtype=np.float32)
            add = self._row_add.reshape(-1)
            values = logits.numpy()
            width = min(add.shape[0], vocab)
            for k, r in enumerate(rows):
                np.take(_BYTE_TO_ADD, data[k], axis=0, out=self._row_add, mode="clip")  # unbuffered
                np.add(values[r, :width], add[:width], out=values[r, :width])
                values[r, width:] = -np.inf
            return logits
        device = logits.device
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = torch.from_numpy(bitmask).to(device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
        if allowed.shape[1] >= vocab:
            banned = ~allowed[:, :vocab]
        else:
            banned = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
            banned[:, : allowed.shape[1]] = ~allowed
        if len(rows) == logits.shape[0]:  # rows are sorted and distinct: every row, in order
            return logits.masked_fill_(banned, float("-inf"))
        index = torch.tensor(rows, dtype=torch.long, device=device)
        logits[index] = logits[index].masked_fill_(banned, float("-inf"))
        return logits
