"""The Triton side: one gRPC stream per generated choice to the entry model, and a cached
readiness check.

The entry model is ``tensorrt_llm`` itself by default (the direct path): the frontend sends the
prompt's token ids and reads the generated ids, which it decodes itself
(openai_frontend/detokenizer.py) and counts exactly; stop strings are cut in the frontend, whose
leaving the stream cancels the request. One Triton hop per token instead of the BLS's
preprocessing call and postprocessing call per chunk in Python stubs: on an H100 (8B shape) 1-4%
more throughput up to 64 streams, 22% more at 256, half the inter-token latency at 64
(benchmarks/results/serving.md). Batching, metrics and leader mode stay in the ``tensorrt_llm`` model
either way.

``--triton_model tensorrt_llm_bls`` sends text instead (the rest of this note is about that path).
Why the BLS and not the ensemble: the token count needs ``output_log_probs``, and with log-probs
on, ``tensorrt_llm`` sends every token at once (no UTF-8 holdback), which the BLS decodes with a
window reaching back into the previous chunk but the ensemble's postprocessing decodes chunk by
chunk: a multi-byte character split over two tokens came out as U+FFFD there (tried with
Japanese text).

Why requests are built here rather than with ``tritonclient.grpc.aio``'s ``stream_infer``: the
only way a decoupled stream says "this request is over" is the empty final response, asked for
with the request parameter ``triton_enable_empty_final_response``, which that client refuses as
reserved. So the stream is made on the same generated gRPC stub (``service_pb2_grpc``) with
``tritonclient``'s own protobufs. Readiness goes through ``tritonclient.grpc.aio`` as usual.

Every choice asks for ``output_log_probs``: one log-prob per generated token is the exact count
of generated tokens (``usage.completion_tokens``), which the text outputs cannot give. A choice
with ``logprobs`` also sends ``num_top_log_probs`` (0 included), for which the BLS returns the
tokens' ids (``output_ids``) and, with k > 0, ``top_log_prob_ids``/``top_log_probs``.
Cancelling the consuming task (a client that hung up) cancels the gRPC call; Triton then marks
the request cancelled and the entry model stops the generation within a step.

A request for a LoRA adapter (lora_modules.py) carries ``lora_id``, ``lora_name`` and
``lora_path`` on either path; the BLS and the ensemble hand them on to ``tensorrt_llm``.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, serialize_byte_tensor

from openai_frontend.audio import Segment, Transcript
from openai_frontend.errors import APIError, bad_request, not_ready, server_error
from openai_frontend.lora_modules import LoraModule
from openai_frontend.protocol import SamplingParams

READINESS_TTL_S = 1.0  # a readiness answer is reused this long (one check per second at most)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1),
                   ("grpc.max_receive_message_length", 2**31 - 1)]


@dataclass
class Chunk:
    """One response of the entry model: new text and how many tokens produced it; with log-probs
    asked for, those tokens, their log-probs and top[i] = [(id, log-prob)] * k, most likely first."""

    text: str
    num_tokens: int
    token_ids: list[int] | None = None
    log_probs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)  # batch of 1: every tensor is [1, ...]


def _sampling_inputs(params: SamplingParams, seed: int | None, top_p: str, top_k: str) -> dict[str, np.ndarray]:
    """Temperature, top-p and the optional sampling fields, under the entry model's names for
    top-p and top-k (``top_p``/``top_k`` on the BLS, ``runtime_top_p``/``runtime_top_k`` on
    ``tensorrt_llm``). The engine is greedy unless top_p or top_k > 1 is given (TRT-LLM's rule);
    OpenAI samples by default, so top_p always goes (1.0 = the whole distribution); temperature 0
    is greedy."""
    inputs = {"temperature": _scalar(params.temperature, np.float32), top_p: _scalar(params.top_p, np.float32)}
    optional = {top_k: (params.top_k, np.int32), "min_tokens": (params.min_tokens, np.int32),
                "presence_penalty": (params.presence_penalty, np.float32),
                "frequency_penalty": (params.frequency_penalty, np.float32),
                "repetition_penalty": (params.repetition_penalty, np.float32),
                "seed": (seed, np.uint64)}
    for name, (value, dtype) in optional.items():
        if value is not None:
            inputs[name] = _scalar(value, dtype)
    return inputs


def _guide_inputs(params: SamplingParams) -> dict[str, np.ndarray]:
    """Structured output (openai_frontend/guides.py): the guide's type and text (none for json)."""
    guide = params.guide
    if guide is None:
        return {}
    inputs = {"guided_decoding_guide_type": np.array([[guide.type.encode("utf-8")]], dtype=object)}
    if guide.text is not None:
        inputs["guided_decoding_guide"] = np.array([[guide.text.encode("utf-8")]], dtype=object)
    return inputs


def _lora_inputs(lora: LoraModule | None) -> dict[str, np.ndarray]:
    """The adapter a request runs with (lora_modules.py), the same three inputs on every entry
    model: the engine loads ``lora_path`` on first use and caches it under ``lora_id``."""
    if lora is None:
        return {}
    return {"lora_id": _scalar(lora.id, np.uint64),
            "lora_name": np.array([[lora.name.encode("utf-8")]], dtype=object),
            "lora_path": np.array([[lora.path.encode("utf-8")]], dtype=object)}


def generation_inputs(prompt: str, params: SamplingParams, max_tokens: int,
                      seed: int | None, lora: LoraModule | None = None) -> dict[str, np.ndarray]:
    """``tensorrt_llm_bls``'s (or the ensemble's) inputs for one choice: text in, text out."""
    inputs = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=object),
        "max_tokens": _scalar(max_tokens, np.int32),
        "stream": _scalar(True, np.bool_),
        "exclude_input_in_output": _scalar(True, np.bool_),
        "return_log_probs": _scalar(True, np.bool_),
        **_sampling_inputs(params, seed, top_p="top_p", top_k="top_k"),
        **_guide_inputs(params),
        **_lora_inputs(lora),
    }
    if params.logprobs is not None:
        inputs["num_top_log_probs"] = _scalar(params.logprobs, np.int32)
    if params.stop:
        inputs["stop_words"] = np.array([[word.encode("utf-8") for word in params.stop]], dtype=object)
    return inputs


def direct_inputs(prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                  end_id: int, pad_id: int, lora: LoraModule | None = None,
                  prompt_table: np.ndarray | None = None, mrope: tuple[np.ndarray, int] | None = None,
                  vision: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """``tensorrt_llm``'s own inputs for one choice (the direct path: the frontend has tokenized
    the prompt and decodes the ids itself; stop strings are cut here, which cancels the call).
    ``prompt_table`` (rows, hidden) FP16: the rows the prompt's ids >= vocab_size take (images).
    ``mrope``: Qwen2-VL's (mrope_rotary_cos_sin in the anchor's flat layout, mrope_position_delta).
    ``vision``: Llama 3.2 Vision's encoder_input_features / cross_attention_mask inputs (serving/mllama.py)."""
    inputs = {
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": _scalar(len(prompt_ids), np.int32),
        "request_output_len": _scalar(max_tokens, np.int32),
        "end_id": _scalar(end_id, np.int32), "pad_id": _scalar(pad_id, np.int32),
        "streaming": _scalar(True, np.bool_),
        "exclude_input_in_output": _scalar(True, np.bool_),
        **_sampling_inputs(params, seed, top_p="runtime_top_p", top_k="runtime_top_k"),
        **_guide_inputs(params),
        **_lora_inputs(lora),
    }
    if params.logprobs is not None:
        inputs["return_log_probs"] = _scalar(True, np.bool_)
        inputs["num_top_log_probs"] = _scalar(params.logprobs, np.int32)
    if prompt_table is not None:
        inputs["prompt_embedding_table"] = np.ascontiguousarray(prompt_table, dtype=np.float16)[None]
        inputs["prompt_vocab_size"] = _scalar(len(prompt_table), np.int32)
    if mrope is not None:
        inputs["mrope_rotary_cos_sin"] = np.asarray(mrope[0], np.float32)[None]
        inputs["mrope_position_deltas"] = _scalar(mrope[1], np.int64)
    inputs.update(vision or {})
    return inputs


LOGPROB_OUTPUTS = ("output_ids", "top_log_prob_ids", "top_log_probs")
DIRECT_OUTPUTS = ("output_ids", "sequence_length")


def infer_request(model: str, inputs: dict[str, np.ndarray], request_id: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        raw = serialize_byte_tensor(array).item() if array.dtype == object else array.tobytes()
        request.raw_input_contents.append(raw)
    if "input_ids" in inputs:  # the direct path: ids out, log-probs only when asked for
        wanted = DIRECT_OUTPUTS + (("output_log_probs", *LOGPROB_OUTPUTS[1:]) if "num_top_log_probs" in inputs else ())
    else:
        wanted = ("text_output", "output_log_probs")
        if "num_top_log_probs" in inputs:
            wanted += LOGPROB_OUTPUTS
    for name in wanted:
        request.outputs.add(name=name)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def read_chunk(response: service_pb2.ModelInferResponse) -> tuple[Chunk, bool]:
    """(the chunk, whether it is the request's last response).

    Read straight from the protobuf (this runs once per streamed token; ``InferResult`` and
    numpy cost several times more): Triton's gRPC responses carry every output in
    ``raw_output_contents``, in the order of ``outputs``. ``text_output`` is BYTES (each element
    a 4-byte little-endian length, then the bytes); ``output_log_probs`` is (1, beams, new
    tokens), so its last dim is the number of tokens this response carries. On the direct path
    ``output_ids`` (1, beams, new tokens) carries them, and the text is left to the caller.
    """
    final = response.parameters["triton_final_response"].bool_param
    chunk = Chunk("", 0)
    arrays = {}
    for index, output in enumerate(response.outputs):
        if output.name == "text_output":
            chunk.text = _bytes_elements(response.raw_output_contents[index]).decode("utf-8", errors="replace")
        elif output.name == "output_log_probs" or output.name in LOGPROB_OUTPUTS:
            if output.name in ("output_log_probs", "output_ids"):  # both (1, beams, new tokens)
                chunk.num_tokens = int(output.shape[-1]) if output.shape else 0
            dtype = np.int32 if output.name in ("output_ids", "top_log_prob_ids") else np.float32
            arrays[output.name] = (response.raw_output_contents[index], dtype, output.shape)
    if "output_ids" in arrays:
        _read_tokens(chunk, {name: np.frombuffer(raw, dtype).reshape(shape) for name, (raw, dtype, shape)
                             in arrays.items()})
    return chunk, final


def _read_tokens(chunk: Chunk, arrays: dict[str, np.ndarray]) -> None:
    """Beam 0 of (1, beams, T) output_ids and, when asked for, output_log_probs and the
    (1, beams, T, k) top log-probs."""
    chunk.token_ids = arrays["output_ids"][0, 0, :chunk.num_tokens].tolist()
    if "output_log_probs" not in arrays:
        return
    chunk.log_probs = arrays["output_log_probs"][0, 0, :chunk.num_tokens].tolist()
    if "top_log_prob_ids" in arrays:
        ids = arrays["top_log_prob_ids"][0, 0, :chunk.num_tokens].tolist()
        values = arrays["top_log_probs"][0, 0, :chunk.num_tokens].tolist()
        chunk.top = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]


def _bytes_elements(raw: bytes) -> bytes:
    """The elements of a serialized BYTES tensor, joined (one element per beam; beam width 1 here)."""
    parts, offset = [], 0
    while offset + 4 <= len(raw):
        length = int.from_bytes(raw[offset:offset + 4], "little")
        parts.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    return b"".join(parts)


AUDIO_OUTPUTS = ("TRANSCRIPTS", "SEGMENT_TEXTS", "SEGMENT_TIMES", "LANGUAGE", "WORDS", "WORD_TIMES")


def read_transcript(response: service_pb2.ModelInferResponse) -> Transcript:
    """whisper_bls's response: TRANSCRIPTS, SEGMENT_TEXTS (one per window) and SEGMENT_TIMES
    ([1, windows, 2] float32 seconds) and LANGUAGE (its code; absent from an older whisper_bls)."""
    raw = {output.name: (response.raw_output_contents[i], list(output.shape)) for i, output in enumerate(response.outputs)}
    text = _bytes_elements(raw["TRANSCRIPTS"][0]).decode("utf-8", "replace")
    segments = []
    if "SEGMENT_TEXTS" in raw and "SEGMENT_TIMES" in raw:
        texts = deserialize_bytes_tensor(raw["SEGMENT_TEXTS"][0])
        times = np.frombuffer(raw["SEGMENT_TIMES"][0], np.float32).reshape(-1, 2)
        segments = [Segment(round(float(start), 3), round(float(end), 3), piece.decode("utf-8", "replace"))
                    for piece, (start, end) in zip(texts, times)]
    language = _bytes_elements(raw["LANGUAGE"][0]).decode("utf-8", "replace") if "LANGUAGE" in raw else ""
    words = []
    if "WORDS" in raw and "WORD_TIMES" in raw:
        times = np.frombuffer(raw["WORD_TIMES"][0], np.float32).reshape(-1, 2)
        words = [Segment(round(float(start), 3), round(float(end), 3), piece.decode("utf-8", "replace"))
                 for piece, (start, end) in zip(deserialize_bytes_tensor(raw["WORDS"][0]), times)]
    return Transcript(text, segments, language, words)


def triton_error(message: str, guide_field: str | None = None) -> APIError:
    """An error response of the entry model: the engine's per-request validation names the field
    (a 400); anything else is the server's fault. An error about the guide (its message names
    ``guided_decoding_guide``: an invalid schema, regex or grammar) is the request's: a 400
    naming the field the guide came from (``guide_field``)."""
    lowered = message.lower()
    if guide_field and "guided_decoding_guide" in message:
        return bad_request(guide_field, f"{guide_field}: the engine refused the output constraint built from it: "
                                        f"{message}", code="invalid_value")
    # (A model that unloads itself to restart its engine is "not ready", then briefly unknown.)
    if any(words in lowered for words in ("not ready", "unavailable", "shutting down", "unknown model")):
        return not_ready(f"the model cannot serve requests right now: {message}")
    if any(word in lowered for word in ("must be", "not allowed", "exceeds", "not supported", "invalid")):
        return bad_request(None, message)
    return server_error(f"generation failed: {message}")


class TritonClient:
    def __init__(self, url: str, model: str = "tensorrt_llm_bls", llm_model: str = "tensorrt_llm",
                 end_id: int | None = None, pad_id: int | None = None):
        self.url = url
        self.model = model  # the entry model requests go to
        self.llm_model = llm_model  # the model that holds the engine (it may be reloading)
        # Direct: requests go to the engine's model itself, with token ids (end_id/pad_id from the
        # frontend's tokenizer, as preprocessing derives them); Chunk.text stays empty.
        self.direct = model == llm_model
        self.end_id, self.pad_id = end_id, pad_id
        self._admin = grpcclient_aio.InferenceServerClient(url)
        self._channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._ready_until = 0.0  # monotonic time until which the last "ready" answer holds
        # The entry model's transaction policy (read once it is ready): a non-decoupled tensorrt_llm
        # (a repository filled with decoupled_mode false) refuses streaming, so the direct path asks
        # it for the whole answer at once, over the same gRPC stream.
        self._decoupled: bool | None = None

    async def close(self) -> None:
        await self._admin.close()
        await self._channel.close()

    async def ensure_ready(self) -> None:
        """Raises a 503 unless the server and both models are ready (checked once a second)."""
        if time.monotonic() < self._ready_until:
            return
        try:
            ready = (await self._admin.is_server_ready()
                     and await self._admin.is_model_ready(self.model)
                     and await self._admin.is_model_ready(self.llm_model))
        except Exception as error:  # the server is down or starting
            raise not_ready(f"Triton at {self.url} does not answer: {error}") from None
        if ready and self._decoupled is None:
            try:
                config = await self._admin.get_model_config(self.model, as_json=True)
                self._decoupled = bool(config.get("config", {}).get("model_transaction_policy", {}).get("decoupled"))
            except Exception:  # unknown: stream, as before (a decoupled model is the usual case)
                pass
        if not ready:
            raise not_ready(f"the model is not ready ({self.model} / {self.llm_model} loading, or the engine "
                            "restarting); retry shortly")
        self._ready_until = time.monotonic() + READINESS_TTL_S

    async def transcribe(self, model: str, samples: np.ndarray, text_prefix: str,
                         prompt: str = "", words: bool = False) -> AsyncIterator[Transcript]:
        """whisper_bls's transcript of 16-kHz ``samples`` so far, once per response, over one gRPC
        stream (a non-decoupled whisper_bls answers once, a decoupled one as it decodes); its
        error as a 400 naming ``file`` when it is about the audio. Leaving early cancels the call."""
        inputs = {"WAV": samples[None].astype(np.float32), "WAV_LENS": np.array([[samples.size]], np.int32),
                  "TEXT_PREFIX": np.array([[text_prefix.encode()]], dtype=object)}
        if prompt:  # OpenAI's previous text (whisper_bls's PROMPT)
            inputs["PROMPT"] = np.array([[prompt.encode()]], dtype=object)
        if words:  # word timestamps (WORDS / WORD_TIMES)
            inputs["WORD_TIMESTAMPS"] = np.array([[True]])
        request = service_pb2.ModelInferRequest(model_name=model)
        for name, array in inputs.items():
            request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
            request.raw_input_contents.append(serialize_byte_tensor(array).item() if array.dtype == object
                                              else array.tobytes())
        for name in AUDIO_OUTPUTS:
            request.outputs.add(name=name)
        request.parameters["triton_enable_empty_final_response"].bool_param = True

        def error(message: str) -> APIError:  # whisper_bls names what was wrong (serving/whisper.py)
            if "TEXT_PREFIX" in message:  # the prefix is made of the request's language and the endpoint's task
                return bad_request("language", message)
            if "PROMPT" in message:
                return bad_request("prompt", message)
            return bad_request("file", message) if "WAV" in message else triton_error(message)

        async with aclosing(self._responses(request, error)) as responses:
            async for result in responses:
                if result.outputs:
                    yield read_transcript(result)

    async def _responses(self, request: service_pb2.ModelInferRequest, error: Callable[[str], APIError]
                         ) -> AsyncIterator[service_pb2.ModelInferResponse]:
        """The responses of ``request`` over one gRPC stream, through its final one (a response
        with an error raises ``error(message)``). Leaving early (or being cancelled) cancels the
        call: Triton then cancels the request."""
        finished = asyncio.Event()

        async def requests():
            yield request
            await finished.wait()  # keep our side open: the stream ends when we are done reading

        call = self._stub.ModelStreamInfer(requests())
        try:
            async for response in call:
                if response.error_message:
                    raise error(response.error_message)
                yield response.infer_response
                if response.infer_response.parameters["triton_final_response"].bool_param:
                    return
            raise server_error("the Triton stream ended before the request's final response")
        except grpc.aio.AioRpcError as rpc_error:
            if rpc_error.code() == grpc.StatusCode.UNAVAILABLE:
                raise not_ready(f"Triton at {self.url} is unavailable: {rpc_error.details()}") from None
            raise server_error(f"Triton stream failed: {rpc_error.details()}") from None
        finally:
            finished.set()
            call.cancel()  # a no-op once the call is over; else Triton cancels the request

    async def generate(self, prompt: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                       seed: int | None, request_id: str, lora: LoraModule | None = None,
                       prompt_table: np.ndarray | None = None, mrope: tuple[np.ndarray, int] | None = None,
                       vision: dict[str, np.ndarray] | None = None
                       ) -> AsyncIterator[Chunk]:
        """Streams one choice, with the LoRA adapter ``lora`` and the image features
        ``prompt_table`` (direct path only) when given. Leaving the iteration early (or being
        cancelled) cancels the call."""
        if self.direct:
            inputs = direct_inputs(prompt_ids, params, max_tokens, seed, self.end_id, self.pad_id, lora, prompt_table,
                                   mrope, vision)
            if self._decoupled is False:
                inputs["streaming"] = _scalar(False, np.bool_)
        else:
            inputs = generation_inputs(prompt, params, max_tokens, seed, lora)
        request = infer_request(self.model, inputs, request_id)
        guide_field = params.guide.field if params.guide else None
        async with aclosing(self._responses(request, lambda message: triton_error(message, guide_field))) as responses:
            async for result in responses:
                chunk, _ = read_chunk(result)
                if chunk.text or chunk.num_tokens:
                    yield chunk
