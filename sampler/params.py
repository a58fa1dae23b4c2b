"""SamplingParams: the per-request sampling knobs, with vLLM's field names and rules."""

from __future__ import annotations

import copy
import enum
import json as _json
import math
from typing import Any

import msgspec

from sampler.config import DEFAULT_MAX_LOGPROBS

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output once the request finished


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The largest float32: a parameter beyond it becomes inf on the device (and inf
#: arithmetic gives NaN), so every float parameter must stay within it.
_FLOAT32_MAX = 3.4028234663852886e38
#: OpenAI's and vLLM's range for a logit bias; larger values are clamped to it.
LOGIT_BIAS_LIMIT = 100.0


def _is_float32(value: Any) -> bool:
    """A number that is finite as a float32 (the device's dtype for every parameter)."""
    return _is_number(value) and math.isfinite(value) and abs(value) <= _FLOAT32_MAX


def text_problem(value: Any) -> str | None:
    """Why ``value`` (a string, or lists/dicts holding strings) cannot be sent as text,
    or None. Lone UTF-16 surrogates (``"\\ud800"``, which JSON can carry) are not
    Unicode text: nothing can encode them, so they are refused where they enter."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return f"holds a lone surrogate {item[exc.start]!r} at character {exc.start}, which is not valid Unicode text"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def check_text(field: str, value: Any) -> None:
    """``ValueError`` naming ``field`` when ``value`` holds something that is not text."""
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"{field} {problem}")


#: Deepest nesting a JSON schema may have (a deeper one is refused before anything
#: recursive, copying or serializing, touches it).
MAX_SCHEMA_DEPTH = 64
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of dicts/lists in ``value``, counted iteratively up to ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams`` fields):
    exactly one of ``json`` (a JSON schema: a dict, or a string holding one),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark, or
    GBNF) and ``json_object`` (any JSON object). The JSON options: ``disable_any_whitespace``
    (no whitespace between tokens), ``disable_additional_properties`` (objects with
    ``properties`` get ``additionalProperties: false`` unless they say otherwise),
    ``whitespace_pattern`` (a regex for the whitespace allowed between tokens).

    The worker enforces it (``worker/structured_output.py``, llguidance); here
    the shape is checked, and ``LLMEngine.make_request`` compiles it before it is queued.
    Invalid values raise ``ValueError`` naming ``structured_outputs.<field>``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    #: the constraint applies once the model's reasoning has ended (the worker's
    #: reasoning end marker, set by a reasoning parser) and not to the reasoning before
    #: it, as vLLM constrains reasoning models; a text that never ends its reasoning is
    #: not constrained. The chat endpoint and ``LLM.chat`` set it when the server has a
    #: reasoning parser
    after_reasoning: bool = False

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, rule: str, value: Any) -> ValueError:
            shown = repr(value)
            shown = shown if len(shown) <= 200 else f"{shown[:200]}..."
            return ValueError(f"structured_outputs.{field} must be {rule}, got {shown}")

        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}; got {what}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                check_text("structured_outputs.json", schema)
                try:
                    schema = _json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise bad("json", "a JSON schema object (a dict, or a string holding one)", self.json)
            if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
            check_text("structured_outputs.json", schema)  # also what JSON escapes decode to
            if schema is self.json:
                try:  # it compiles from JSON and crosses the wire to the workers as msgpack
                    _json.dumps(schema, allow_nan=False)
                    msgspec.msgpack.encode(schema)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise ValueError(f"structured_outputs.json must hold only JSON values: {exc}") from None
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or (name == "grammar" and not value.strip()):
                    raise bad(name, "a non-empty string" if name == "grammar" else "a string", value)
                check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(
                isinstance(c, str) for c in self.choice
            ):
                raise bad("choice", "a non-empty list of strings", self.choice)
            check_text("structured_outputs.choice", self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise bad("json_object", "true (or left out)", self.json_object)
        for name in ("disable_any_whitespace", "disable_additional_properties", "after_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool", getattr(self, name))
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise ValueError("structured_outputs.whitespace_pattern applies to json and json_object only")

    @property
    def kind(self) -> str:
        """The constraint's field name: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters of one request (vLLM field names and validation).

    Invalid values raise ``ValueError`` naming the field and its allowed range, both
    when built in Python and when decoded from the wire.
    ``top_k`` of 0 or -1 disables top-k; ``temperature`` 0 means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    #: A JSON schema / regex / choice / grammar the output must follow (a dict is
    #: turned into ``StructuredOutputsParams``); enforced by the worker.
    structured_outputs: StructuredOutputsParams | None = None
    #: Token ids of ``bad_words``; filled by :meth:`tokenize_bad_words` (engine side).
    bad_words_token_ids: list[list[int]] | None = None
    #: The model's EOS token ids; set by the engine from the tokenizer/generation config.
    eos_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        self._validate()

    # -- validation -----------------------------------------------------------------

    def _validate(self) -> None:
        def bad(field: str, rule: str, value: Any) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1", self.n)
        if not _is_float32(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise bad("top_k", "-1 or 0 (disabled) or an int >= 1", self.top_k)
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise bad(name, "in [-2, 2]", value)
        if not _is_float32(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        if self.seed is not None and (
            not _is_int(self.seed) or not (-(2**63) <= self.seed < 2**64)
        ):
            raise bad("seed", "an int in [-2**63, 2**64) or None", self.seed)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an int >= 1 or None", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            # The cap is the server's max_logprobs, checked by ``verify``.
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise bad(name, "an int >= -1 (-1: the whole vocabulary) or None", value)
        if self.thinking_token_budget is not None and (
            not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0
        ):
            raise bad("thinking_token_budget", "an int >= 0 or None", self.thinking_token_budget)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "a dict of token id -> bias", self.logit_bias)
            for key, value in self.logit_bias.items():
                if not _is_int(key) or key < 0:
                    raise bad("logit_bias", "keyed by int token ids >= 0", key)
                if not _is_number(value) or not math.isfinite(value):
                    raise bad("logit_bias", "finite bias values", value)
            # OpenAI and vLLM clamp biases to [-100, 100]: a float32 logit plus a larger
            # one can overflow to inf, and inf logits sample NaN.
            if any(abs(v) > LOGIT_BIAS_LIMIT for v in self.logit_bias.values()):
                self.logit_bias = {
                    k: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, v)) for k, v in self.logit_bias.items()
                }
        self._validate_token_list("stop_token_ids", self.stop_token_ids)
        self._validate_token_list("allowed_token_ids", self.allowed_token_ids)
        self._validate_token_list("eos_token_ids", self.eos_token_ids)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "a non-empty list or None", self.allowed_token_ids)
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(
                isinstance(s, str) and s for s in self.stop
            ):
                raise bad("stop", "a non-empty string or a list of non-empty strings", self.stop)
            check_text("stop", self.stop)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            ):
                raise bad("bad_words", "a list of non-blank strings", self.bad_words)
            check_text("bad_words", self.bad_words)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise bad("extra_args", "a dict or None", self.extra_args)
            check_text("extra_args", self.extra_args)
            try:  # it crosses the wire to the workers as msgpack
                msgspec.msgpack.encode(self.extra_args)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"extra_args must hold only JSON-like values: {exc}") from None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams (or a dict of its fields) or None",
                          self.structured_outputs)
            self.structured_outputs._validate()
        if self.bad_words_token_ids is not None:
            for seq in self.bad_words_token_ids:
                self._validate_token_list("bad_words_token_ids", seq)
                if not seq:
                    raise bad("bad_words_token_ids", "non-empty token sequences", seq)

    @staticmethod
    def _validate_token_list(field: str, ids: Any) -> None:
        if ids is None:
            return
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"{field} must be a list of int token ids >= 0, got {ids!r}")

    def verify(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """Checks that need the model: token ids inside the vocabulary, logprob caps.

        Raises ``ValueError`` naming the field.
        """
        def check_ids(field: str, ids: Any) -> None:
            for tok in ids or ():
                if tok >= vocab_size:
                    raise ValueError(
                        f"{field} must hold token ids in [0, {vocab_size}), got {tok}"
                    )

        check_ids("logit_bias", self.logit_bias)
        check_ids("allowed_token_ids", self.allowed_token_ids)
        check_ids("stop_token_ids", self.stop_token_ids)
        for seq in self.bad_words_token_ids or ():
            check_ids("bad_words", seq)
        if self.min_tokens and self.allowed_token_ids and set(self.allowed_token_ids) <= (
            self.all_stop_token_ids
        ):
            raise ValueError(
                "allowed_token_ids must hold a token that is not a stop token when "
                f"min_tokens > 0 (min_tokens={self.min_tokens} bans every allowed token)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if value > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, got {value}")
            wanted = vocab_size if value == -1 else value
            if max_logprobs != -1 and wanted > max_logprobs:
                raise ValueError(
                    f"{name} must be in [-1, {max_logprobs}] (the server's max_logprobs), "
                    f"got {value}"
                )

    # -- derived views --------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request: stop_token_ids plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(self.eos_token_ids or ())
        return ids

    def tokenize_bad_words(self, tokenizer: Any) -> None:
        """Fill ``bad_words_token_ids`` the way vLLM does: each word with and without a
        leading space (when that changes the tokens)."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for variant in (word.strip(), " " + word.strip()):
                ids = list(tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated deep copy (no list or dict shared) with some fields changed."""
        out = msgspec.structs.replace(copy.deepcopy(self), **changes)
        out._validate()
        return out
