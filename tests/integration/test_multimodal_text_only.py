"""Images sent to a text-only model (the shared SmolLM2 server): a named per-request error from the
BLS, Triton's own for the text ensemble (it declares no image input), and the next request runs."""
import numpy as np
import pytest

from test_grpc_stream import Stream

pytestmark = pytest.mark.integration


def _send(server, model: str, inputs: dict) -> tuple[str, str | None]:
    stream = Stream(server)
    try:
        stream.send(model, inputs)
        items = stream.until_final()
    finally:
        stream.close()
    errors = [str(error) for _, error, _ in items if error is not None]
    texts = [r.as_numpy("text_output") for r, _, _ in items if r is not None]
    return "".join(t.reshape(-1)[0].decode() for t in texts if t is not None and t.size), errors[0] if errors else None


def check_images_refused_by_a_text_model(server):
    plain = {"text_input": np.array([[b"Hello"]], dtype=object), "max_tokens": np.array([[2]], np.int32),
             "stream": np.array([[False]])}
    image = {"image_input": np.zeros((1, 1, 3, 8, 8), np.float16)}
    text, error = _send(server, "tensorrt_llm_bls", {**plain, **image})
    assert error is not None and "image_input: images and video sent to a text-only model" in error
    text, error = _send(server, "ensemble", {**plain, **image})
    assert error is not None and "image_input" in error  # Triton: the text ensemble has no such input
    text, error = _send(server, "tensorrt_llm_bls", plain)
    assert error is None and text


def test_images_sent_to_a_text_only_model_are_refused_by_name(triton_server):
    check_images_refused_by_a_text_model(triton_server)
