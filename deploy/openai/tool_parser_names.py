"""Every ``--tool-call-parser`` name (vLLM's) and its parser class."""

from __future__ import annotations

from deploy.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolCallParser
from deploy.openai.trailing_call_parsers import (
    DeepSeekV3ToolParser,
    GraniteToolParser,
    HarmonyToolParser,
    InternLMToolParser,
    Llama4PythonicToolParser,
    MistralToolParser,
    PythonicToolParser,
)
from deploy.openai.xml_call_parser import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": Llama4PythonicToolParser,
    "mistral": MistralToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's two names for one parser
    "deepseek_v3": DeepSeekV3ToolParser,
    "granite": GraniteToolParser,
    "internlm": InternLMToolParser,
    "openai": HarmonyToolParser,
}
