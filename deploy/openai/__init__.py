"""The OpenAI (and vLLM-extension) HTTP protocol, as vLLM's ``entrypoints/openai`` splits
it: request models apart from the code that serves them.

Modules:
  protocol            the request bodies (validated at the edge) and their mapping to SamplingParams
  text_validation     every string of a body valid Unicode text; ``printable`` for echoes
  errors              RequestError (a 400 naming the field) and the OpenAI error object
  responses           what both endpoints' responses share: ids, usage, TokenText, finite logprobs
  serving_completion  /v1/completions responses: CompletionChoices (a stream's state), chunks
  serving_chat        /v1/chat/completions responses: chat_response, ChatChunks (a stream's state)
  structured          response_format / structured_outputs / guided_* -> one output constraint
  tools               tool_choice and tools -> ToolPlan: constraint, template tools, parsers
  tool_parsers        tool calls out of generated text, whole or streamed (one parser per choice)
  trailing_call_parsers  the formats whose calls run to the end of the output (pythonic, mistral)
  xml_call_parser     Qwen3-Coder's XML calls, values typed by the tools' schemas
  tool_parser_names   every --tool-call-parser name and its parser
  responses_api       /v1/responses as an adapter over the chat endpoint, its events and store
"""
