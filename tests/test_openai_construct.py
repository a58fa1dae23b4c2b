"""``deploy.openai.responses.construct`` (pydantic's plain ``model_construct``) dumps the
same JSON as the openai package's own recursive ``model_construct`` for the shapes the
endpoints stream and return."""

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.completion_choice import Logprobs

from deploy.openai.responses import construct


def both(build) -> tuple[str, str]:
    ours = build(construct)
    theirs = build(lambda cls, **fields: cls.model_construct(**fields))
    return ours.model_dump_json(exclude_unset=True), theirs.model_dump_json(exclude_unset=True)


def test_completion_chunk_and_response():
    def build(make):
        logprobs = make(Logprobs, tokens=[" a"], token_logprobs=[-0.5], top_logprobs=[{" a": -0.5}], text_offset=[3])
        choice = make(CompletionChoice, index=1, text=" a", finish_reason=None, logprobs=logprobs, stop_reason=None)
        usage = CompletionUsage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
        return make(Completion, id="cmpl-x", object="text_completion", created=5, model="m", choices=[choice],
                    usage=usage)

    ours, theirs = both(build)
    assert ours == theirs and '"text_offset":[3]' in ours


def test_chat_chunk_with_tool_call_delta_and_an_empty_delta():
    def build(make):
        function = make(ChoiceDeltaToolCallFunction, name="f", arguments='{"x": 1}')
        call = make(ChoiceDeltaToolCall, index=0, id="call-1", type="function", function=function)
        first = make(ChunkChoice, index=0, delta=make(ChoiceDelta, tool_calls=[call]), logprobs=None,
                     finish_reason=None)
        last = make(ChunkChoice, index=1, delta=make(ChoiceDelta), logprobs=None, finish_reason="stop")
        return make(ChatCompletionChunk, id="chatcmpl-x", object="chat.completion.chunk", created=5, model="m",
                    choices=[first, last])

    ours, theirs = both(build)
    assert ours == theirs and '"delta":{}' in ours and '"arguments":"{\\"x\\": 1}"' in ours
