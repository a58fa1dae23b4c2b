"""``speculative_config``: vLLM's description of speculative decoding, checked.

Two methods run here:

- ``ngram``: prompt lookup (``prompt_lookup_min`` / ``prompt_lookup_max``), the same
  drafts as the ``num_spec_tokens`` shorthand.
- ``draft_model``: a second model in the target's worker proposes
  ``num_speculative_tokens`` tokens per decoding row (its argmax for greedy rows, a draw
  from its distribution for sampling ones); the target verifies them with the rejection
  sampler, so outputs keep the target's distribution. ``model``
  names the draft (a path, a hub id, a ``.gguf`` file) or ``"self"``: the target's own
  weights, quantized at load by ``quantization`` (raydecode's meaning of the field:
  vLLM's names a draft checkpoint's format). ``disable_by_batch_size``: no drafting in a
  step whose batch has at least this many rows.

Anything else vLLM's ``SpeculativeConfig`` takes is refused by name: a setting this
engine would silently ignore is worse than an error.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

#: the most draft tokens a step may verify per row: past this the verification is a
#: prefill, never hidden in the memory-bound decode step
MAX_SPECULATIVE_TOKENS = 16

#: ``model`` value for the target's own weights as the draft
SELF_DRAFT = "self"

#: ``disable_by_batch_size`` for draft models when the config does not say: the
#: crossover measured on CPU (docs/performance.md, "Draft-model speculative decoding")
DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE = 5


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    #: draft_model: the draft (path, hub id, .gguf, or "self")
    model: str | None = None
    #: draft_model: "int4" / "int8" quantize the draft's weights at load (a "self" draft
    #: needs one); None: the draft checkpoint as it is
    quantization: str | None = None
    #: options of the on-the-fly scheme (int4's group_size and symmetric)
    quantization_config: dict[str, Any] | None = None
    #: no drafting in a step of at least this many rows; None: draft models stop at
    #: ``DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE``, n-gram drafts never
    disable_by_batch_size: int | None = None
    #: ngram: shortest and longest n-gram matched
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @property
    def is_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def self_draft(self) -> bool:
        return self.model == SELF_DRAFT

    @property
    def batch_size_limit(self) -> int | None:
        """Steps of this many rows or more run without drafts (None: none do)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE if self.is_draft_model else None


def _bad(field: str, why: str) -> ValueError:
    return ValueError(f"speculative_config.{field}: {why}")


def parse_speculative_config(raw: Any) -> SpeculativeConfig:
    """``raw`` (a mapping, as ``LLM(speculative_config=...)``, the CLI's JSON or the YAML
    give it) checked into a ``SpeculativeConfig``; ``ValueError`` naming the field."""
    if isinstance(raw, SpeculativeConfig):
        raw = msgspec.to_builtins(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    method = raw.get("method")
    if method == "[ngram]":  # vLLM's spelling from its old CLI
        raw["method"] = method = "ngram"
    if method not in ("ngram", "draft_model"):
        raise _bad("method", f"{method!r} is not run by raydecode (it runs 'ngram' and 'draft_model'; "
                   "EAGLE, MTP and Medusa heads are vLLM-only)")
    if "num_speculative_tokens" not in raw:
        raise _bad("num_speculative_tokens", "required")
    try:
        spec = msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "unknown field" in text:
            raise ValueError(f"speculative_config: {text} (raydecode takes {sorted(SpeculativeConfig.__struct_fields__)})") from None
        raise ValueError(f"speculative_config: {text}") from None
    k = spec.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise _bad("num_speculative_tokens", f"must be from 1 to {MAX_SPECULATIVE_TOKENS}, got {k}")
    limit = spec.disable_by_batch_size
    if limit is not None and limit < 1:
        raise _bad("disable_by_batch_size", f"must be >= 1 (or None), got {limit}")
    if spec.is_draft_model:
        _check_draft(spec)
    else:
        for name in ("model", "quantization", "quantization_config"):
            if getattr(spec, name) is not None:
                raise _bad(name, "only for method draft_model (n-gram drafts have no model)")
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise _bad("prompt_lookup_min", f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                       f"{spec.prompt_lookup_min}, {spec.prompt_lookup_max}")
    return spec


def _check_draft(spec: SpeculativeConfig) -> None:
    """(``quantization_config``'s options are checked with the target's, in ``WorkerConfig``.)"""
    if not spec.model or not isinstance(spec.model, str):
        raise _bad("model", "method draft_model needs the draft model (a path, hub id, .gguf file, or 'self')")
    if spec.quantization is not None and spec.quantization not in ("int4", "int8"):
        raise _bad("quantization", f"'int4' or 'int8' (the draft's weights quantized at load), or None; got "
                   f"{spec.quantization!r} (a quantized draft checkpoint loads in its own format without it)")
    if spec.self_draft and spec.quantization is None:
        raise _bad("quantization", "a 'self' draft is the target's weights quantized: say int4 or int8 "
                   "(unquantized, it is the target again and saves nothing)")
    if spec.quantization_config is not None and spec.quantization is None:
        raise _bad("quantization_config", "only with quantization int4 or int8")
    if spec.prompt_lookup_min != 1 or spec.prompt_lookup_max != 4:
        raise _bad("prompt_lookup_min", "only for method ngram")
