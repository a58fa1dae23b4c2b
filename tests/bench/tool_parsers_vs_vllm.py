"""Our tool call parsers beside vLLM's own, on the same model texts, whole and streamed.

Run it with the vLLM peer's Python (``make peers`` installs it)::

    ~/.cache/raydecode/peers/vllm-venv/bin/python tests/bench/tool_parsers_vs_vllm.py [--write]

For every parser and case it prints vLLM's ``extract_tool_calls`` (content, and each
call's name and arguments parsed as JSON) and ours. Then the same text streamed token
by token (the same deltas to both): vLLM through its serving layer's ``Parser.parse_delta``
(``finished`` on the last token, so its end-of-stream completion of arguments runs
too), ours through ``feed``/``finish``; per call its name, how many deltas named it,
and its argument deltas joined, set beside that side's whole answer (``adds up``: the
same string, ``same JSON``, ``not JSON``). ``--write`` records vLLM's whole answers in
``tests/data/tool_parsers_vllm_cases.json``, which ``tests/test_tool_parsers.py`` holds
our parsers to (CI has no vLLM). The tokenizer is a byte-level BPE built here with the
formats' markers as special tokens, as the real models' tokenizers have them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (parser, model text): what the families write
CASES: list[tuple[str, str]] = [
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]'),
    ("pythonic", '[get_weather(city="Paris"), get_time(zone="CET", exact=True)]'),
    ("pythonic", '[search(query="a, b", filters={"year": 2024, "tags": ["x", "y"]}, limit=-3, ratio=0.5)]'),
    ("pythonic", '[f(x=null, y=true, z=false)]'),
    ("pythonic", "[f()]"),
    ("pythonic", "The weather is sunny."),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", ' [get_weather(city="Paris")]'),
    ("pythonic", '[get_weather(city="Paris")'),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Rome")]<|python_end|>'),
    ("llama4_pythonic", '[get_weather(city="Rome")]'),
    ("llama4_pythonic", "No tools needed."),
    # Mistral's tokenizers from v11 have [ARGS]: name[ARGS]{...} per [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'),
    ("mistral", "Just text."),
    # before v11 (no [ARGS] in the vocabulary): a JSON array after [TOOL_CALLS]
    ("mistral_v3", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("mistral_v3", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("mistral_v3", 'Sure.[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    ("mistral_v3", "Just text."),
    # Qwen3-Coder's XML calls; values take their parameter's type from the schema
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n"
                  "</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", '<tool_call>\n<function=search>\n<parameter=filters>\n{"year": 2024}\n</parameter>\n'
                  "<parameter=exact>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
                  "<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", "No call here."),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nnot a number\n</parameter>\n"
                    "</function>\n</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                    '```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek_v3", "No tools."),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("granite", "Plain answer."),
    ("internlm", 'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
                 "<|action_end|>"),
    ("internlm", '<|action_start|><|plugin|>{"name": "f", "arguments": {}}<|action_end|>'),
    ("internlm", "Plain answer."),
    # JSON calls between tags, or the whole output; compact JSON as a model may write it
    ("hermes", '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":3}}</tool_call>'),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": }}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               '{"city": "Paris"}<|call|>'),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4"),
]

#: the tools every case is parsed with (the XML format types its values by them)
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {"type": "object", "properties": {"filters": {"type": "object"}, "exact": {"type": "boolean"},
                                                "ratio": {"type": "number"}, "query": {"type": "string"}}},
    "get_time": {"type": "object"},
    "f": {"type": "object"},
}

#: case names that are our parser under another tokenizer
VARIANTS = {"mistral_v3": "mistral"}


def _ours():
    """Our parsers. ``cluster``'s ``__init__`` imports Ray, which vLLM's venv need not
    have: its package stands in empty (the reasoning parsers import nothing of it)."""
    import types

    sys.path.insert(0, str(ROOT))
    package = types.ModuleType("cluster")
    package.__path__ = [str(ROOT / "cluster")]
    sys.modules.setdefault("cluster", package)
    from deploy.openai.tool_parser_names import TOOL_PARSERS

    return TOOL_PARSERS


def _calls(pairs) -> list:
    return [[name, json.loads(arguments)] for name, arguments in pairs]


def tokenizer_dir(folder: Path, args_token: bool = True) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text for _, text in CASES] * 4, vocab_size=600, min_frequency=1, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    special = ["<|python_tag|>", "<|python_start|>", "<|python_end|>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>",
               "<|action_start|>", "<|action_end|>", "<|plugin|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
               "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<|start|>", "<|channel|>",
               "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
    tok.add_special_tokens({"additional_special_tokens": special + (["[ARGS]"] if args_token else [])})
    tok.save_pretrained(folder)
    return folder


def _request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], tools=tools, stream=True)


def token_pieces(name: str, text: str, tok) -> list[tuple[str, int]]:
    """The text as the model would stream it: (delta text, token id) per token."""
    if name == "openai":
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        ids = encoding.encode(text, allowed_special="all")
        return [(encoding.decode([i]), i) for i in ids]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces, sent = [], 0
    for i, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        end = max(end, sent)
        pieces.append((text[sent:end], i))
        sent = end
    if pieces and sent < len(text):
        pieces[-1] = (pieces[-1][0] + text[sent:], pieces[-1][1])
    return pieces


def vllm_stream(name: str, pieces: list[tuple[str, int]], tok) -> tuple[str | None, list]:
    """vLLM's serving layer on the stream: (content, [[name, times named, arguments joined]])."""
    from vllm.parser.parser_manager import ParserManager

    request = _request()
    if name == "openai":  # as vllm_harmony: its harmony parser, no reasoning parser
        from vllm.parser.harmony import HarmonyParser
        from vllm.tool_parsers.gptoss_tool_parser import GptOssToolParser

        HarmonyParser.reasoning_parser_cls, HarmonyParser.tool_parser_cls = None, GptOssToolParser
        parser_cls = HarmonyParser
    else:
        parser_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)
    parser = parser_cls(tok, request.tools)
    content, calls = "", {}
    for n, (delta, token) in enumerate(pieces):
        message = parser.parse_delta(delta, [token], request, [1], finished=n == len(pieces) - 1)
        if message is None:
            continue
        content += message.content or ""
        for call in message.tool_calls or []:
            entry = calls.setdefault(call.index, [None, 0, ""])
            function = call.function
            if function is not None and function.name:
                entry[0], entry[1] = entry[0] or function.name, entry[1] + 1
            entry[2] += (function.arguments or "") if function is not None else ""
    return content or None, [calls[i] for i in sorted(calls)]


def ours_stream(parsers, name: str, pieces: list[tuple[str, int]]) -> tuple[str | None, list]:
    parser = parsers[name](schemas=TOOLS)
    content, calls = "", {}
    for delta in [*(d for d, _ in pieces), None]:
        more, deltas = parser.feed(delta) if delta is not None else parser.finish()
        content += more
        for d in deltas:
            entry = calls.setdefault(d.index, [None, 0, ""])
            if d.name:
                entry[0], entry[1] = entry[0] or d.name, entry[1] + 1
            entry[2] += d.arguments
    return content or None, [calls[i] for i in sorted(calls)]


def adds_up(streamed: tuple[str | None, list], whole: tuple[str | None, list]) -> str:
    """How a stream stands to the whole answer: its calls' names (each named once) and
    argument strings, and its content."""
    (content, calls), (whole_content, whole_calls) = streamed, whole
    if [[n, a] for n, _, a in calls] == [list(c) for c in whole_calls] and all(k == 1 for _, k, _ in calls):
        say = "adds up"
    else:
        try:
            same = [(n, k, json.loads(a)) for n, k, a in calls] == [(n, 1, json.loads(a)) for n, a in whole_calls]
            say = "same JSON" if same else "DIFFERENT CALLS"
        except ValueError:
            say = "NOT JSON"
    return say if (content or None) == (whole_content or None) else f"{say}, DIFFERENT CONTENT"


def vllm_harmony(text: str, tok, request) -> tuple[str | None, list]:
    """gpt-oss: vLLM's ``HarmonyParser`` with its tool parser on the real harmony token
    ids (no reasoning parser: the analysis is dropped, as ours drops it)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from vllm.parser.harmony import HarmonyParser
    from vllm.tool_parsers.gptoss_tool_parser import GptOssToolParser

    ids = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).encode(text, allowed_special="all")
    HarmonyParser.reasoning_parser_cls = None
    HarmonyParser.tool_parser_cls = GptOssToolParser
    _, content, calls = HarmonyParser(tok, request.tools).parse(text, request, enable_auto_tools=True,
                                                               model_output_token_ids=ids)
    return content, [[c.name, c.arguments] for c in calls or []]


def vllm_parse(name: str, text: str, tok) -> tuple[str | None, list]:
    """vLLM's whole answer: (content, [[name, arguments string]])."""
    from vllm.tool_parsers import ToolParserManager

    request = _request()
    request.stream = False
    if name == "openai":
        return vllm_harmony(text, tok, request)
    parser = ToolParserManager.get_tool_parser(name)(tok, request.tools)
    info = parser.extract_tool_calls(text, request)
    return (info.content or None), [[c.function.name, c.function.arguments] for c in info.tool_calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="record vLLM's parses for the tests")
    args = ap.parse_args()
    import logging

    import vllm

    logging.getLogger("vllm").setLevel(logging.CRITICAL)  # its parsers log what they fail to stream
    from transformers import AutoTokenizer

    parsers = _ours()
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as e:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(Path(d)))
        old_tok = AutoTokenizer.from_pretrained(tokenizer_dir(Path(e), args_token=False))
    recorded, same, stream_same, tally = [], 0, 0, {"vLLM": {}, "ours": {}}
    for case, text in CASES:
        name = VARIANTS.get(case, case)
        case_tok = old_tok if case in VARIANTS else tok
        content, raw_calls = vllm_parse(name, text, case_tok)
        calls = _calls(raw_calls)
        our_content, our_calls = parsers[name](schemas=TOOLS).parse(text)
        ours = (our_content or None, _calls((c.name, c.arguments) for c in our_calls))
        same += ours == (content, calls)
        flag = "same" if ours == (content, calls) else "DIFFERENT"
        print(f"{case:16} {text[:50]!r}\n  vLLM {(content, calls)!r}\n  ours {ours!r}  [{flag}]")
        recorded.append({"parser": name, "text": text, "content": content, "calls": calls, "tools": TOOLS})
        pieces = token_pieces(name, text, case_tok)
        try:
            theirs_streamed = vllm_stream(name, pieces, case_tok)
        except Exception as e:  # noqa: BLE001 - a failing stream is a result here
            theirs_streamed = (f"<vLLM's stream failed: {type(e).__name__}: {e}>", [])
        ours_streamed = ours_stream(parsers, name, pieces)
        theirs_say = adds_up(theirs_streamed, (content, raw_calls))
        ours_say = adds_up(ours_streamed, (our_content, [[c.name, c.arguments] for c in our_calls]))
        tally["vLLM"][theirs_say] = tally["vLLM"].get(theirs_say, 0) + 1
        tally["ours"][ours_say] = tally["ours"].get(ours_say, 0) + 1
        try:
            alike = [(n, json.loads(a)) for n, _, a in theirs_streamed[1]] == [
                (n, json.loads(a)) for n, _, a in ours_streamed[1]]
        except ValueError:
            alike = False
        stream_same += alike
        print(f"  streamed in {len(pieces)} tokens\n    vLLM {theirs_streamed!r}  [{theirs_say}]\n"
              f"    ours {ours_streamed!r}  [{ours_say}]  [{'same calls' if alike else 'DIFFERENT calls'}]")
    print(f"\n{same}/{len(CASES)} parses the same as vLLM {vllm.__version__}")
    print(f"streamed calls the same as vLLM's streamed calls: {stream_same}/{len(CASES)}")
    for side, counts in tally.items():
        print(f"{side}: streamed calls against its own whole answers: {counts}")
    if args.write:
        out = ROOT / "tests" / "data" / "tool_parsers_vllm_cases.json"
        out.write_text(json.dumps({"vllm": vllm.__version__, "cases": recorded}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
