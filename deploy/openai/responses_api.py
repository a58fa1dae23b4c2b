"""The Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``), the
subset vLLM serves, as an adapter over the chat endpoint: a ``ResponsesRequest`` becomes
a chat request (``to_chat``: ``instructions`` a system message, the input items messages,
function tools and ``tool_choice`` the chat forms, ``text.format`` a ``response_format``,
``reasoning.effort`` the template's), the engine answers it as a chat completion, and
the answer becomes a ``Response`` (``response_object``) or, streamed, the typed events
(``ResponseEvents``: ``response.created`` ... ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.reasoning_text.delta`` ...
``response.completed``). Reasoning (a server with a reasoning parser) is a ``reasoning``
item, tool calls ``function_call`` items.

``ResponseStore`` keeps responses for ``previous_response_id`` and ``GET``: off unless
the server enables it (as vLLM's, whose store is off by default), bounded in entries and
age, and per ingress replica. A request with ``store`` on a server without a store is
answered and not stored (vLLM's choice). Built-in tools (web search, file search, code
interpreter, computer use, MCP, image generation) are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from deploy.openai.errors import APIError, RequestError
from deploy.openai.protocol import OpenAIBaseModel

#: the tool types OpenAI runs itself: named in the refusal
BUILT_IN_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use",
                            "computer_use_preview", "mcp", "image_generation", "local_shell", "shell",
                            "apply_patch", "custom"})


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_not_found(response_id: str, param: str = "response_id") -> APIError:
    """vLLM's 404 for a response id nothing is kept under."""
    return APIError(404, f"Response with id '{response_id[:100]}' not found.", "invalid_request_error", param)


class ResponsesRequest(OpenAIBaseModel):
    """The request fields we take; unknown ones are ignored (as vLLM), the ones we
    cannot honour refused by name in ``check_supported``."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    seed: int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    background: bool | None = False
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    # vLLM's extras: passed to the chat request, which checks them
    request_id: str | None = None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    top_k: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    structured_outputs: Any = None
    thinking_token_budget: Any = None
    vllm_xargs: Any = None

    #: the extras above, as the chat request takes them
    PASSED: ClassVar[tuple[str, ...]] = (
        "include_reasoning", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
        "structured_outputs", "thinking_token_budget", "vllm_xargs")

    @field_validator("input")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("must not be empty")
        return value

    def check_supported(self) -> None:
        if self.background:
            raise RequestError("background: background responses are not supported", "background")
        if self.conversation is not None:
            raise RequestError("conversation: conversations are not supported; use previous_response_id",
                               "conversation")
        if self.prompt is not None:
            raise RequestError("prompt: stored prompt templates are not supported", "prompt")
        if self.truncation == "auto":
            raise RequestError("truncation: only 'disabled' is supported (a prompt over the context is a 400)",
                               "truncation")
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind in BUILT_IN_TOOLS:
                raise RequestError(f"tools[{i}].type: the built-in tool {kind!r} is not supported (function tools "
                                   "only)", f"tools[{i}].type")
            if kind != "function":
                raise RequestError(f"tools[{i}].type: must be 'function', got {str(kind)[:64]!r}",
                                   f"tools[{i}].type")


# -- the request as a chat request ------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined (images are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{where}[{j}].text: must be a string", f"{where}[{j}].text")
            texts.append(text)
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise RequestError(f"{where}[{j}].type: {str(kind)[:64]!r} content is not supported (text only)",
                               f"{where}[{j}].type")
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: message items by role, ``function_call`` items an
    assistant turn's tool calls (consecutive ones one turn), ``function_call_output``
    items tool messages, a ``reasoning`` item the next assistant turn's reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning"] = reasoning
            reasoning = None
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role: must be user, system, developer or assistant, got "
                                   f"{str(role)[:32]!r}", f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn = assistant()
                turn["content"] = (turn["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise RequestError(f"{where}.name: a function call needs its name", f"{where}.name")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where}.call_id: a function call needs its call_id", f"{where}.call_id")
            if not isinstance(arguments, str):
                raise RequestError(f"{where}.arguments: must be a JSON string", f"{where}.arguments")
            turn = assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where}.call_id: the output's call_id is required", f"{where}.call_id")
            if not isinstance(output, str):
                output = _text_of(output, f"{where}.output")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, f"{where}.content")
        elif kind == "item_reference":
            raise RequestError(f"{where}.type: item references are not supported; send the items, or "
                               "previous_response_id", f"{where}.type")
        else:
            raise RequestError(f"{where}.type: {str(kind)[:64]!r} items are not supported", f"{where}.type")
    for m in messages:
        m.pop("_closed", None)
    return messages


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise RequestError(f"tool_choice: {str(kind)[:64]!r} is not supported (auto, none, required or a function)",
                       "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format.type: must be text, json_object or json_schema, got {str(kind)[:64]!r}",
                       "text.format.type")


def to_chat(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request (as its JSON) that answers ``request`` after the conversation
    ``history`` (the messages of the responses before it)."""
    request.check_supported()
    messages = list(history)
    if request.instructions:  # not carried over from a previous response (OpenAI's rule)
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": request.instructions})
    messages += input_messages(request.input)
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": bool(request.stream),
        "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "seed": request.seed, "user": request.user, "priority": request.priority,
        "chat_template_kwargs": request.chat_template_kwargs,
    }
    body.update({name: getattr(request, name) for name in request.PASSED})
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.top_logprobs:
        body.update(logprobs=True, top_logprobs=request.top_logprobs)
    if request.tools:
        body["tools"] = [_chat_tool(t) for t in request.tools]
        body["tool_choice"] = _tool_choice(request.tool_choice)
        body["parallel_tool_calls"] = request.parallel_tool_calls
    elif isinstance(request.tool_choice, dict) or request.tool_choice == "required":
        raise RequestError("tool_choice: needs tools", "tool_choice")
    fmt = _response_format(request.text)
    if fmt is not None:
        body["response_format"] = fmt
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    return {k: v for k, v in body.items() if v is not None}


# -- the chat answer as a response ------------------------------------------------------------


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    prompt_details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": prompt_details.get("cached_tokens") or 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
            "total_tokens": chat_usage["total_tokens"]}


def _reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [], "content": content, "status": status}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id or _id("msg"), "role": "assistant", "status": status, "content": content}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseShell:
    """What every ``Response`` object of one request carries besides its output."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.request, self.model = request, model

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id, "reasoning": r.reasoning,
            "store": bool(r.store), "temperature": r.temperature, "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [], "truncation": r.truncation or "disabled", "user": r.user,
        }


def response_object(shell: ResponseShell, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as the ``Response``."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning"):
        output.append(_reasoning_item(message["reasoning"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return shell.response("completed", output, _usage(chat.get("usage")), choice.get("finish_reason"))


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn continues from."""
    return input_messages([item for item in response["output"] if item["type"] in
                           ("message", "function_call", "reasoning")])


class ResponseEvents:
    """A chat stream's chunks (their JSON) as the Responses API's typed events: each
    output item is added, its text or arguments sent as deltas, then done, before the
    next one starts; ``response.completed`` carries the whole response."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed: its kind, id, text
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item state
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        response = self.shell.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, kind, item_id, text = item["index"], item["kind"], item["id"], "".join(item["parts"])
        if kind == "reasoning":
            done = _reasoning_item(text, item_id)
            events = [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=text)]
        elif kind == "message":
            done = _message_item(text, item_id)
            part = done["content"][0]
            events = [self._event("response.output_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=part)]
        else:
            done = _call_item(item["call_id"], item["name"], text, item_id)
            events = [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  name=item["name"], arguments=text)]
        self.output[index] = done
        return [*events, self._event("response.output_item.done", output_index=index, item=done)]

    def _open_item(self, kind: str, **extra: Any) -> list[str]:
        events = self._close()
        index = len(self.output)
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = {"kind": kind, "index": index, "id": _id(prefix), "parts": [], **extra}
        item_id = self.open["id"]
        if kind == "reasoning":
            item = _reasoning_item("", item_id, "in_progress")
        elif kind == "message":
            item = _message_item("", item_id, "in_progress")
        else:
            item = _call_item(extra["call_id"], extra["name"], "", item_id, "in_progress")
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item_id, output_index=index,
                                      content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk."""
        events: list[str] = []
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for field, kind, event, extra in (("reasoning", "reasoning", "response.reasoning_text.delta", {}),
                                              ("content", "message", "response.output_text.delta",
                                               {"logprobs": []})):
                text = delta.get(field)
                if not text:
                    continue
                if self.open is None or self.open["kind"] != kind:
                    events += self._open_item(kind)
                self.open["parts"].append(text)
                events.append(self._event(event, item_id=self.open["id"], output_index=self.open["index"],
                                          content_index=0, delta=text, **extra))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                index = call.get("index", 0)
                if call.get("id") is not None:
                    events += self._open_item("function_call", call_id=call["id"], name=function.get("name", ""))
                    self.calls[index] = self.open
                state = self.calls.get(index)
                if state is None or state is not self.open:
                    continue  # pieces of a call that is no longer the one streaming: not sent by our chat stream
                arguments = function.get("arguments") or ""
                if arguments:
                    state["parts"].append(arguments)
                    events.append(self._event("response.function_call_arguments.delta", item_id=state["id"],
                                              output_index=state["index"], delta=arguments))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def error(self, body: dict[str, Any]) -> list[str]:
        """An error the chat stream sent: the response fails."""
        error = body.get("error") or {}
        response = self.shell.response("failed", self.output, self.usage)
        response["error"] = {"code": str(error.get("code") or "server_error"),
                             "message": str(error.get("message") or "the engine failed")}
        return [self._event("response.failed", response=response)]

    def finish(self) -> tuple[list[str], dict[str, Any]]:
        """The closing events and the whole response: ``response.completed`` also when
        the output hit ``max_output_tokens`` (its status then "incomplete"), as vLLM
        sends it and the ``openai`` client's stream helper expects."""
        events = self._close()
        response = self.shell.response("completed", self.output, self.usage, self.finish_reason)
        return [*events, self._event("response.completed", response=response)], response


def chat_events(text: str, pending: str) -> tuple[list[dict[str, Any] | str], str]:
    """The chat stream's SSE text (possibly several events joined, the last maybe cut)
    as JSON chunks (``"[DONE]"`` for the end); the unfinished rest."""
    pending += text
    out: list[dict[str, Any] | str] = []
    while "\n\n" in pending:
        event, pending = pending.split("\n\n", 1)
        for line in event.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out, pending


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET``: at most ``max_entries``
    (the oldest dropped first) and none older than ``max_age_s``. Each entry: the
    response object and the conversation it ended (chat messages)."""

    def __init__(self, max_entries: int, max_age_s: float) -> None:
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._entries: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        while self._entries and next(iter(self._entries.values()))[0] < cutoff:
            self._entries.popitem(last=False)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._entries[response["id"]] = (time.monotonic(), response, conversation)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and its conversation; a 404 naming ``param`` when it is not kept."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise response_not_found(response_id, param)
        return entry[1], entry[2]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)
