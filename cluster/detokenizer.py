"""Incremental detokenization and stop strings for one sequence.

Text grows one token at a time without re-decoding the whole output: the detokenizer
decodes a small window (from ``prefix_offset``) and emits what the newest tokens add,
holding back text while the window ends in an incomplete UTF-8 character (a multi-byte
character split across tokens decodes to U+FFFD until its last byte arrives). A few
prompt tokens seed the window, so the first output token gets the leading space a
whole-text decode would give it.

Stop strings are searched only in the new text plus ``len(stop) - 1`` characters of
look-back; unless ``include_stop_str_in_output``, the text is cut before the stop string
and streamed text holds back the last ``max(len(stop)) - 1`` characters (they may turn
out to start a stop string).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

#: Each token's own text, per tokenizer (at most one entry per vocabulary id).
_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()

#: Prompt tokens that seed the decoding window.
PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.output_text = ""
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = (
            max((len(s) for s in self.stop), default=1) - 1
            if self.stop and not include_stop_str_in_output else 0
        )
        self._streamed = 0  # characters of output_text already handed out as deltas

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Adds one token; returns the stop string it completed (the text is then cut
        per ``include_stop_str_in_output``), else None. ``check_stop=False`` before
        ``min_tokens`` is reached."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return None  # nothing printable yet (a partial character, or a skipped token)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        before = len(self.output_text)
        self.output_text += delta
        return self._check_stop(before) if check_stop else None

    def _check_stop(self, new_from: int) -> str | None:
        for s in self.stop:
            start = max(0, new_from - len(s) + 1)
            at = self.output_text.find(s, start)
            if at != -1:
                end = at + len(s) if self.include_stop_str_in_output else at
                self.output_text = self.output_text[:end]
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not handed out before; while running, the hold-back stays behind."""
        end = len(self.output_text) if finished else max(self._streamed, len(self.output_text) - self.holdback)
        delta = self.output_text[self._streamed : end]
        self._streamed = end
        return delta

    def visible_text(self, finished: bool) -> str:
        """The whole text so far, less the hold-back while running (cumulative outputs)."""
        if finished or not self.holdback:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.holdback)]

    def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs), from a cache shared by every sequence of
        the tokenizer; the ids not seen before are decoded in one call."""
        texts = _TOKEN_TEXTS.get(self.tokenizer)
        if texts is None:
            texts = _TOKEN_TEXTS[self.tokenizer] = {}
        missing = [t for t in dict.fromkeys(token_ids) if t not in texts]
        if missing:
            decoded = self.tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=False)
            texts.update(zip(missing, decoded))
        return [texts[t] for t in token_ids]
