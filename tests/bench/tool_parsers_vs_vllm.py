"""Our tool call parsers beside vLLM's own, on the same model texts (whole answers).

Run it with the vLLM peer's Python (``make peers`` installs it)::

    ~/.cache/raydecode/peers/vllm-venv/bin/python tests/bench/tool_parsers_vs_vllm.py [--write]

For every parser and case it prints vLLM's ``extract_tool_calls`` (content, and each
call's name and arguments parsed as JSON) and ours. ``--write`` records vLLM's in
``tests/data/tool_parsers_vllm_cases.json``, which ``tests/test_tools.py`` holds our
parsers to (CI has no vLLM). The tokenizer is a byte-level BPE built here with the
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
    special = ["<|python_start|>", "<|python_end|>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>",
               "<|action_start|>", "<|action_end|>", "<|plugin|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
               "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<|start|>", "<|channel|>",
               "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
    tok.add_special_tokens({"additional_special_tokens": special + (["[ARGS]"] if args_token else [])})
    tok.save_pretrained(folder)
    return folder


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
    return content, [[c.name, json.loads(c.arguments)] for c in calls or []]


def vllm_parse(name: str, text: str, tok) -> tuple[str | None, list]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], tools=tools)
    if name == "openai":
        return vllm_harmony(text, tok, request)
    parser = ToolParserManager.get_tool_parser(name)(tok, request.tools)
    info = parser.extract_tool_calls(text, request)
    calls = [[c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls]
    return (info.content or None), calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="record vLLM's parses for the tests")
    args = ap.parse_args()
    import vllm
    from transformers import AutoTokenizer

    parsers = _ours()
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as e:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(Path(d)))
        old_tok = AutoTokenizer.from_pretrained(tokenizer_dir(Path(e), args_token=False))
    recorded, same = [], 0
    for case, text in CASES:
        name = VARIANTS.get(case, case)
        content, calls = vllm_parse(name, text, old_tok if case in VARIANTS else tok)
        our_content, our_calls = parsers[name](schemas=TOOLS).parse(text)
        ours = (our_content or None, _calls((c.name, c.arguments) for c in our_calls))
        same += ours == (content, calls)
        flag = "same" if ours == (content, calls) else "DIFFERENT"
        print(f"{case:16} {text[:50]!r}\n  vLLM {(content, calls)!r}\n  ours {ours!r}  [{flag}]")
        recorded.append({"parser": name, "text": text, "content": content, "calls": calls, "tools": TOOLS})
    print(f"\n{same}/{len(CASES)} parses the same as vLLM {vllm.__version__}")
    if args.write:
        out = ROOT / "tests" / "data" / "tool_parsers_vllm_cases.json"
        out.write_text(json.dumps({"vllm": vllm.__version__, "cases": recorded}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
