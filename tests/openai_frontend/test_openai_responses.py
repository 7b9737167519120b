"""Response shapes: the per-token fast SSE encoding equals the generic one; usage adds up."""
import json

import pytest

from openai_frontend import sse
from openai_frontend.responses import ResponseShape


def parsed(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    return json.loads(data[6:])


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("with_usage_field", [True, False])
@pytest.mark.parametrize("text", ["Paris", ' "quoted" \\ \n', "海についての", "\x00TEXT\x00"])
def test_text_chunk_fast_path_equals_the_generic_chunk(chat, with_usage_field, text):
    shape = ResponseShape(chat=chat, model='m "odd"')
    encoder = sse.TextChunkEncoder(shape, with_usage_field)
    for index in (0, 3, 12):
        assert parsed(encoder.text(index, text)) == shape.chunk(index, text, with_usage_field=with_usage_field)


def test_whole_response_and_usage():
    shape = ResponseShape(chat=True, model="m")
    body = shape.completion(["a", "b"], ["stop", "length"], prompt_tokens=7, completion_tokens=5)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "b"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    last = shape.usage_chunk(7, 5)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 12 and last["id"] == body["id"]
    assert ResponseShape(chat=False, model="m").chunk(1, None, "stop")["choices"][0] == \
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"}



@pytest.mark.parametrize("message,status", [
    ("Model 'tensorrt_llm' is not ready", 503), ("Request for unknown model: 'tensorrt_llm' is not found", 503),
    ("the server is shutting down", 503), ("top_p must be in (0, 1], got 2.0", 400),
    ("the engine process exited (killed by SIGKILL)", 500)])
def test_triton_errors_get_the_right_status(message, status):
    from openai_frontend.triton_client import triton_error

    error = triton_error(message)
    assert error.status == status and message in error.message
