"""Our reasoning parsers beside vLLM's own, on the same model texts.

Run it with the vLLM peer's Python (``make peers`` installs it)::

    ~/.cache/raydecode/peers/vllm-venv/bin/python tests/bench/reasoning_vs_vllm.py [--write]

For every parser and case it prints vLLM's whole-text split, vLLM's streamed split (one
token a delta, joined), and ours (whole, and fed character by character). ``--write``
records vLLM's whole-text splits in ``tests/data/reasoning_vllm_cases.json``, which
``tests/test_reasoning_parsers.py`` holds our parsers to (CI has no vLLM). The
tokenizer is a byte-level BPE built here with each parser's markers added as special
tokens, as the real models' tokenizers have them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))



def _our_parsers():
    """``cluster/reasoning_parsers.py`` alone (the package's ``__init__`` needs Ray,
    which vLLM's venv need not have)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reasoning_parsers", ROOT / "cluster" / "reasoning_parsers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reasoning_parsers"] = module
    spec.loader.exec_module(module)
    return module.REASONING_PARSERS


REASONING_PARSERS = _our_parsers()

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "[THINK]", "[/THINK]", "[TOOL_CALLS]",
           "<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>", "<|observation|>", "<|user|>"]

#: (parser, chat_template_kwargs, model text): what the families write
CASES: list[tuple[str, dict | None, str]] = [
    ("deepseek_r1", None, "<think>Let me add 2 and 2.</think>The answer is 4."),
    ("deepseek_r1", None, "Okay, the user wants a haiku.\n</think>\n\nLeaves fall, quiet pond."),
    ("deepseek_r1", None, "Still thinking when the tokens ran out"),
    ("deepseek_r1", None, "<think></think>Straight to it."),
    ("deepseek_r1", None, "reasoning</think>"),
    ("deepseek_r1", None, "a</think>b</think>c"),
    ("qwen3", None, "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"),
    ("qwen3", None, "<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3", {"enable_thinking": False}, "Hello there."),
    ("qwen3", {"enable_thinking": False}, "<think>\n\n</think>\n\nHello there."),
    ("qwen3", None, "<think>unfinished thought"),
    ("deepseek_v3", None, "Plain answer, no thinking."),
    ("deepseek_v3", {"thinking": True}, "Think first.</think>Then answer."),
    ("mistral", None, "[THINK]Compute 3*3.[/THINK]It is 9."),
    ("mistral", None, "No reasoning at all."),
    ("mistral", None, "[THINK]never closed"),
    ("granite", None, "Here's my thought process:\nCheck facts.\nHere's my response:\nParis."),
    ("granite", None, "Here is my thought process: a. Here is my response: b."),
    ("granite", None, "Just an answer."),
    *[(name, kwargs, text) for name in ("glm45", "glm47", "step3") for kwargs, text in [
        (None, "<think>Weigh it.</think>Answer."),
        (None, "Weigh it.</think>Answer."),
        (None, "Only thinking"),
        (None, "<think>Need a tool.</think><tool_call>get_weather</tool_call>"),
        (None, "<think>Call now<tool_call>get_weather</tool_call>"),
        ({"enable_thinking": False}, "Direct answer."),
        (None, "a</think>b</think>c"),
    ]],
    ("seed_oss", None, "<seed:think>Budget check.</seed:think>Done."),
    ("seed_oss", None, "Budget check.</seed:think>Done."),
    ("seed_oss", None, "Still going"),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>User asks 2+2.<|end|>"
                            "<|start|>assistant<|channel|>final<|message|>4"),
    ("openai_gptoss", None, "<|channel|>final<|message|>Only the answer"),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis"
                            "<|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>Done."),
    ("openai_gptoss", None, "<|channel|>analysis<|message|>Cut off mid-thought"),
    ("openai_gptoss", None, "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>Checked."),
]


def tokenizer_dir(folder: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [text for _, _, text in CASES] * 4
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, min_frequency=1, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    harmony = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
    tok.add_special_tokens({"additional_special_tokens": MARKERS + harmony})
    tok.save_pretrained(folder)
    return folder


def vllm_harmony(text: str, tok) -> tuple[tuple, tuple]:
    """gpt-oss: vLLM's ``HarmonyParser`` on the real harmony token ids (its reasoning
    parser only finds the boundary); streamed is not compared here."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.harmony import HarmonyParser
    from vllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser

    ids = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).encode(text, allowed_special="all")
    HarmonyParser.reasoning_parser_cls = GptOssReasoningParser
    HarmonyParser.tool_parser_cls = None
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}])
    reasoning, content, _ = HarmonyParser(tok).parse(text, request, model_output_token_ids=ids)
    return (reasoning, content), (None, None)


def vllm_split(name: str, kwargs: dict | None, text: str, tok) -> tuple[tuple, tuple]:
    if name == "openai_gptoss":
        return vllm_harmony(text, tok)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager

    cls = ReasoningParserManager.get_reasoning_parser(name)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}],
                                    chat_template_kwargs=kwargs)
    parser = cls(tok, chat_template_kwargs=kwargs or {})
    whole = parser.extract_reasoning(text, request)
    parser = cls(tok, chat_template_kwargs=kwargs or {})
    ids = tok.encode(text, add_special_tokens=False)
    prev_ids: list[int] = []
    prev_text = ""
    reasoning = content = ""
    for i in range(len(ids)):
        cur_ids = ids[:i + 1]
        cur_text = tok.decode(cur_ids, skip_special_tokens=False)
        delta = cur_text[len(prev_text):]
        msg = parser.extract_reasoning_streaming(prev_text, cur_text, delta, prev_ids, cur_ids, [ids[i]])
        if msg is not None:
            reasoning += msg.reasoning or ""
            content += msg.content or ""
        prev_ids, prev_text = cur_ids, cur_text
    return tuple(whole), (reasoning or None, content or None)


def ours(name: str, kwargs: dict | None, text: str) -> tuple[tuple, tuple]:
    spec = REASONING_PARSERS[name]
    split = spec.new_split(kwargs)
    reasoning = content = ""
    for ch in text:
        r, c = split.feed(ch)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    reasoning, content = reasoning + r, content + c
    return spec.split(text, kwargs), ((reasoning if split.reasoned else None) or None, content or None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="record vLLM's splits for the tests")
    args = ap.parse_args()
    import vllm
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(Path(d)))
    recorded, same, total = [], 0, 0
    print(f"vLLM {vllm.__version__}: whole-text split, streamed split (token by token); ours: whole, streamed")
    for name, kwargs, text in CASES:
        try:
            v_whole, v_stream = vllm_split(name, kwargs, text, tok)
        except Exception as exc:  # a parser vLLM cannot build on this tokenizer
            print(f"{name:14} {text[:40]!r}: vLLM raised {type(exc).__name__}: {str(exc)[:80]}")
            continue
        o_whole, o_stream = ours(name, kwargs, text)
        total += 1
        same += o_whole == v_whole
        flag = "same" if o_whole == v_whole else "DIFFERENT"
        print(f"{name:14} {text[:40]!r}\n  vLLM  {v_whole!r}  streamed {v_stream!r}\n"
              f"  ours  {o_whole!r}  streamed {o_stream!r}  [{flag}]")
        recorded.append({"parser": name, "chat_template_kwargs": kwargs, "text": text,
                         "reasoning": v_whole[0], "content": v_whole[1]})
    print(f"\n{same}/{total} whole-text splits the same as vLLM {vllm.__version__}")
    if args.write:
        out = ROOT / "tests" / "data" / "reasoning_vllm_cases.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"vllm": vllm.__version__, "cases": recorded}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
