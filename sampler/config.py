"""Per-worker sampler configuration."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)

#: vLLM's default cap on logprobs / prompt_logprobs per position.
DEFAULT_MAX_LOGPROBS = 20


class SamplerConfig(msgspec.Struct, kw_only=True):
    """What a logits processor and the sampler are built with.

    A processor is constructed as ``Cls(config, device, is_pin_memory)``; it reads
    at least ``max_num_seqs``, ``vocab_size`` and ``num_spec_tokens`` from here.
    """

    vocab_size: int
    max_num_seqs: int = 256
    num_spec_tokens: int = 0
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    logprobs_mode: LogprobsMode = "raw_logprobs"
    #: Custom processors as "module:Qualname" strings (server configuration only).
    logits_processors: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        check_logprobs_options(self.max_logprobs, self.logprobs_mode)


def check_logprobs_options(max_logprobs: int, logprobs_mode: str) -> None:
    """The rules on the server's logprobs settings (``ValueError`` naming the field)."""
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an integer >= -1, got {max_logprobs!r}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
