"""The OpenAI Agents SDK against a running raydecode server's ``/v1/responses``: a function
tool run (whole and streamed) and two plain turns, the second continuing the first by the
SDK's own history. Not a benchmark: a by-hand check with a client the suite cannot install
(the SDK pins its own ``openai``); run it from a venv of its own::

    python -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    raydecode serve MODEL --served-model-name tiny --tool-call-parser hermes \\
        --enable-auto-tool-choice --structured-outputs-config '{"disable_any_whitespace": true}'
    /tmp/agents/bin/python tests/bench/agents_sdk_check.py --base-url http://127.0.0.1:8000/v1

(compact JSON keeps a random test model from writing whitespace inside a call forever).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Literal

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

calls: list[str] = []


@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"sunny in {city}"


async def main(base_url: str, model_name: str) -> None:
    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=model_name, openai_client=AsyncOpenAI(base_url=base_url, api_key="none"))
    tool_agent = Agent(name="a", instructions="Be brief.", tools=[get_weather], model=model,
                       tool_use_behavior="stop_on_first_tool",
                       model_settings=ModelSettings(tool_choice="required", max_tokens=300, temperature=0,
                                                    parallel_tool_calls=False))
    result = await Runner.run(tool_agent, "Weather in Paris?", max_turns=3)
    print("run: tools called", calls, "items", [type(i).__name__ for i in result.new_items], "->", result.final_output)
    calls.clear()
    streamed = Runner.run_streamed(tool_agent, "Weather in Rome?", max_turns=3)
    kinds = set()
    async for event in streamed.stream_events():
        kinds.add(event.data.type if event.type == "raw_response_event" else event.type)
    print("streamed: tools called", calls, "->", streamed.final_output, "events", sorted(kinds))
    chat_agent = Agent(name="b", instructions="Be brief.", model=model,
                       model_settings=ModelSettings(max_tokens=60, temperature=0))
    first = await Runner.run(chat_agent, "Say hi.")
    second = await Runner.run(chat_agent, [*first.to_input_list(), {"role": "user", "content": "Again."}])
    print("plain turns:", repr(first.final_output)[:40], repr(second.final_output)[:40])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    asyncio.run(main(args.base_url, args.model))
