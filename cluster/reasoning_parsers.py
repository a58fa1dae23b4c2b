"""Reasoning parsers: a model's reasoning apart from its answer, by the names of vLLM's
``--reasoning-parser`` (``REASONING_PARSERS``).

Each parser is a small grammar over the generated text: the markers that open and
close a reasoning section and what text before, between and after them is. A
``ReasoningSplit`` applies it to one sequence as its text arrives (``feed`` each
delta, ``finish`` at the end): text that might be the start of a marker is held back
until the next delta says, so a marker cut across two deltas is found, and the
deltas' pieces always add up to the whole text's split (``split``). That is where we
differ from vLLM, whose streaming parsers look for single marker tokens in each delta
and can disagree with their own whole-text split (a prompt that already opened the
reasoning, a text marker such as Granite's cut across deltas).

The parsers and their grammars (the markers are text: where they are special tokens the
text must keep them, ``ReasoningParserSpec.needs_special_tokens``):

- ``deepseek_r1``: the output starts in the reasoning (R1's template opens ``<think>``
  in the prompt; a ``<think>`` the model writes itself is dropped) up to ``</think>``;
  no ``</think>``: all of it is reasoning.
- ``qwen3``: as ``deepseek_r1``, and a ``<tool_call>`` also ends the reasoning (the
  call stays in the content for the tool parser); a stray ``</think>`` in the content
  is dropped. ``chat_template_kwargs: {"enable_thinking": false}``: all content.
- ``deepseek_v3``: ``deepseek_r1`` when the chat template was asked to think
  (``thinking`` or ``enable_thinking`` true), else all content.
- ``glm45``, ``glm47``: as ``qwen3``. ``step3``: reasoning up to ``</think>`` (a
  ``<think>`` stays text). ``seed_oss``: as ``deepseek_r1`` with ``<seed:think>``.
- ``mistral``: content until ``[THINK]``, reasoning until ``[/THINK]`` (Magistral).
- ``granite``: content until "Here's my thought process:" (or "Here is ..."),
  reasoning until "Here's my response:" (or "Here is ...").
- ``openai_gptoss``: the harmony format: the ``analysis`` channel's messages are the
  reasoning, ``final``'s (and ``commentary``'s) the content; text outside any message
  is content; a tool call (a message to a recipient) passes into the content as
  written, for the ``openai`` tool parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

#: harmony's control tokens (gpt-oss), as they appear in the text
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class MarkerGrammar:
    """Reasoning delimited by text markers. ``starts`` open it (inside it they are
    dropped), ``ends`` close it (dropped), ``kept_ends`` close it and stay in the
    content; ``stray_ends`` in the content are dropped. With ``starts_in_reasoning``
    the text begins inside the reasoning; otherwise a start marker opens it once."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    starts_in_reasoning: bool
    kept_ends: tuple[str, ...] = ()
    drop_stray_ends: bool = False


class ReasoningSplit(Protocol):
    """One sequence's split, fed its text delta by delta."""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) the text so far adds, up to what might begin a marker."""
        ...

    def finish(self) -> tuple[str, str]:
        """What was held back, now that no more text comes."""
        ...

    @property
    def reasoned(self) -> bool:
        """Whether the text had a reasoning section (so far)."""
        ...


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` might begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of ``markers`` in ``text`` (the longest where two start together)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


class MarkerSplit:
    """``MarkerGrammar`` applied to one sequence."""

    def __init__(self, grammar: MarkerGrammar) -> None:
        self.grammar = grammar
        self.in_reasoning = grammar.starts_in_reasoning
        self.opened = grammar.starts_in_reasoning  # a start marker no longer opens anything
        self._pending = ""

    @property
    def reasoned(self) -> bool:
        return self.opened

    def _markers(self) -> tuple[str, ...]:
        g = self.grammar
        if self.in_reasoning:
            return g.starts + g.ends + g.kept_ends
        return (() if self.opened else g.starts) + (g.ends if g.drop_stray_ends and self.opened else ())

    def feed(self, text: str) -> tuple[str, str]:
        g = self.grammar
        reasoning: list[str] = []
        content: list[str] = []
        pending = self._pending + text
        while True:
            markers = self._markers()
            found = _first(pending, markers) if markers else None
            if found is None:
                keep = _held_back(pending, markers)
                out, self._pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
                (reasoning if self.in_reasoning else content).append(out)
                break
            at, marker = found
            (reasoning if self.in_reasoning else content).append(pending[:at])
            pending = pending[at + len(marker):]
            if self.in_reasoning and marker in g.ends:
                self.in_reasoning = False
            elif self.in_reasoning and marker in g.kept_ends:
                self.in_reasoning = False
                content.append(marker)
            elif not self.in_reasoning and marker in g.starts and not self.opened:
                self.in_reasoning = self.opened = True
            # else: a start inside the reasoning, a stray end in the content: dropped
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)


class HarmonySplit:
    """gpt-oss's harmony messages: ``<|channel|>NAME ...<|message|>TEXT<|end|>``
    (or ``<|return|>`` / ``<|call|>``), each after ``<|start|>ROLE`` but the first (the
    prompt ends with ``<|start|>assistant``; the first header may go on from it with a
    recipient, `` to=functions.f<|channel|>commentary json``, as gpt-oss's template
    writes calls). ``analysis`` is reasoning, ``final`` and
    ``commentary`` addressed to no one are content, other channels neither; separate
    messages of one kind are joined by a newline (as vLLM's harmony parser). A message
    to a recipient (a tool call) is recorded in ``calls`` (recipient, content type,
    text) and, with ``raw_calls``, passed into the content as it was written, for the
    ``openai`` tool parser after this split. Text outside any message (a model not
    writing harmony) is content."""

    def __init__(self, raw_calls: bool = True) -> None:
        self.raw_calls = raw_calls
        self.calls: list[tuple[str, str, str]] = []
        self._call: list[str] | None = None  # the recipient message being read
        self._pending = ""
        self._where = "outside"  # "outside", "header", "body"
        self._header = ""
        self._kind = ""  # the body's: "reasoning", "content" or "" (neither)
        self._started: dict[str, bool] = {"reasoning": False, "content": False}
        self._body_begun = False
        self._seen_analysis = False
        self._at_start = True  # the prompt's "<|start|>assistant" may go on with " to=RECIPIENT"

    @property
    def reasoned(self) -> bool:
        return self._seen_analysis

    def feed(self, text: str) -> tuple[str, str]:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        pending = self._pending + text
        if self._at_start:
            head = pending.lstrip()
            if len(head) < 3 and "to=".startswith(head):
                self._pending = pending  # too short to tell
                return "", ""
            self._at_start = False
            if head.startswith("to="):  # the recipient in the role header the prompt began
                self._where, self._header = "header", ""
        while True:
            found = _first(pending, HARMONY_TOKENS)
            if found is None:
                keep = _held_back(pending, HARMONY_TOKENS)
                self._take(pending[:len(pending) - keep], out)
                self._pending = pending[len(pending) - keep:]
                break
            at, token = found
            self._take(pending[:at], out)
            pending = pending[at + len(token):]
            if token in ("<|start|>", "<|channel|>", "<|constrain|>"):
                if self._where != "header":
                    self._where, self._header = "header", ""
                self._header += token
            elif token == "<|message|>":
                self._where, self._body_begun = "body", False
                self._kind = self._kind_of(self._header)
                self._seen_analysis |= self._kind == "reasoning"
                if self._kind == "call":
                    self._call = []
                    if self.raw_calls:
                        out["content"].append(self._header + token)
            else:  # <|end|>, <|return|>, <|call|>
                self._end_call(out, token)
                self._where = "outside"
        return "".join(out["reasoning"]), "".join(out["content"])

    def _end_call(self, out: dict[str, list[str]], token: str = "") -> None:
        if self._where != "body" or self._kind != "call" or self._call is None:
            return
        recipient = re.search(r"to=([^\s<]+)", self._header)
        constrain = self._header.partition("<|constrain|>")[2].strip()
        self.calls.append((recipient.group(1) if recipient else "", constrain, "".join(self._call)))
        self._call = None
        if self.raw_calls and token:
            out["content"].append(token)

    @staticmethod
    def _kind_of(header: str) -> str:
        channel = ""
        if "<|channel|>" in header:
            channel = header.rpartition("<|channel|>")[2].split("<|constrain|>")[0].strip().split(" ")[0]
        if re.search(r"(^|\s)to=", header.replace("<|", " <|")):
            return "call"  # a message to a recipient: a tool call
        return {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(channel, "")

    def _take(self, text: str, out: dict[str, list[str]]) -> None:
        if not text:
            return
        if self._where == "header":
            self._header += text
            return
        kind = self._kind if self._where == "body" else "content"
        if kind == "call":
            if self._call is not None:
                self._call.append(text)
            if self.raw_calls:
                out["content"].append(text)
            return
        if not kind:
            return
        if self._where == "body" and not self._body_begun:
            self._body_begun = True
            if self._started[kind]:
                out[kind].append("\n")
        self._started[kind] = True
        out[kind].append(text)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._take(rest, out)
        self._end_call(out)
        return "".join(out["reasoning"]), "".join(out["content"])


@dataclass(frozen=True)
class ReasoningParserSpec:
    """One ``--reasoning-parser``: its grammar (None: harmony's) and the markers a
    thinking budget counts between and forces (``budget_start`` / ``budget_end``)."""

    name: str
    budget_start: str
    budget_end: str
    grammar: MarkerGrammar | None = None
    #: chat template keywords that turn thinking on (deepseek_v3) or off (qwen3);
    #: (keys, default): thinking when any key is true, ``default`` when none is given
    thinking_switch: tuple[tuple[str, ...], bool] | None = None

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request rendered with these template keywords reasons."""
        if self.thinking_switch is None:
            return True
        keys, default = self.thinking_switch
        given = [bool(chat_template_kwargs[k]) for k in keys if chat_template_kwargs and k in chat_template_kwargs]
        return any(given) if given else default

    def markers(self) -> tuple[str, ...]:
        """Every marker text its grammar looks for."""
        if self.grammar is None:
            return HARMONY_TOKENS
        return self.grammar.starts + self.grammar.ends + self.grammar.kept_ends

    def needs_special_tokens(self, tokenizer: Any) -> bool:
        """Whether some of its markers are special tokens of ``tokenizer``, which the
        text shows only with ``skip_special_tokens`` off (gpt-oss's harmony tokens,
        Magistral's ``[THINK]``, a tokenizer that made ``</think>`` special)."""
        special = set(getattr(tokenizer, "all_special_tokens", ()))
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special.update(token.content for token in added.values() if getattr(token, "special", False))
        return any(marker in special for marker in self.markers())

    def new_split(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningSplit:
        """A split for one sequence of a request rendered with these keywords."""
        if not self.thinks(chat_template_kwargs):
            return MarkerSplit(_ALL_CONTENT)
        if self.grammar is None:
            return HarmonySplit()
        return MarkerSplit(self.grammar)

    def split(self, text: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str | None, str | None]:
        """A whole text's (reasoning, content): None where there is none (reasoning:
        the text had no reasoning section; content: empty), as vLLM's parsers."""
        s = self.new_split(chat_template_kwargs)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        content = c1 + c2
        return (r1 + r2 if s.reasoned else None), (content or None)


_ALL_CONTENT = MarkerGrammar(starts=(), ends=(), starts_in_reasoning=False)
_THINK = MarkerGrammar(starts=("<think>",), ends=("</think>",), starts_in_reasoning=True)

REASONING_PARSERS: dict[str, ReasoningParserSpec] = {
    spec.name: spec for spec in (
        ReasoningParserSpec("deepseek_r1", "<think>", "</think>", _THINK),
        ReasoningParserSpec(
            "qwen3", "<think>", "</think>",
            MarkerGrammar(starts=("<think>",), ends=("</think>",), starts_in_reasoning=True,
                          kept_ends=("<tool_call>",), drop_stray_ends=True),
            thinking_switch=(("enable_thinking",), True)),
        ReasoningParserSpec("deepseek_v3", "<think>", "</think>", _THINK,
                            thinking_switch=(("thinking", "enable_thinking"), False)),
        ReasoningParserSpec("mistral", "[THINK]", "[/THINK]",
                            MarkerGrammar(starts=("[THINK]",), ends=("[/THINK]",), starts_in_reasoning=False,
                                          drop_stray_ends=True)),
        ReasoningParserSpec(
            "granite", "Here's my thought process:", "Here's my response:",
            MarkerGrammar(starts=("Here's my thought process:", "Here is my thought process:"),
                          ends=("Here's my response:", "Here is my response:"), starts_in_reasoning=False)),
        ReasoningParserSpec(
            "glm45", "<think>", "</think>",
            MarkerGrammar(starts=("<think>",), ends=("</think>",), starts_in_reasoning=True,
                          kept_ends=("<tool_call>",), drop_stray_ends=True),
            thinking_switch=(("enable_thinking",), True)),
        ReasoningParserSpec(
            "glm47", "<think>", "</think>",
            MarkerGrammar(starts=("<think>",), ends=("</think>",), starts_in_reasoning=True,
                          kept_ends=("<tool_call>",), drop_stray_ends=True),
            thinking_switch=(("enable_thinking",), True)),
        ReasoningParserSpec("step3", "<think>", "</think>",  # its template never writes <think>: kept as text
                            MarkerGrammar(starts=(), ends=("</think>",), starts_in_reasoning=True)),
        ReasoningParserSpec("seed_oss", "<seed:think>", "</seed:think>",
                            MarkerGrammar(starts=("<seed:think>",), ends=("</seed:think>",), starts_in_reasoning=True)),
        ReasoningParserSpec("openai_gptoss", "<|channel|>analysis<|message|>",
                            "<|end|><|start|>assistant<|channel|>final<|message|>", None),
    )
}


def reasoning_parser(name: str) -> ReasoningParserSpec:
    """The parser named ``name``; a ``ValueError`` naming the known ones otherwise."""
    spec = REASONING_PARSERS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return spec
