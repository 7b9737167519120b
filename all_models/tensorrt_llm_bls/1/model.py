"""Triton `tensorrt_llm_bls` model: the ensemble's pipeline as Business Logic Scripting.

preprocessing -> tensorrt_llm -> postprocessing, with the ensemble's inputs and outputs; with
`num_draft_tokens` > 0, a draft tensorrt_llm model (`tensorrt_llm_draft_model_name`) and the target
take turns (speculative decoding, serving/bls.py speculative_generate). A stream
(decoupled model and `stream` true) decodes each chunk's ids in a short window with one token
of context and sends the new text, or the whole text so far with `accumulate_tokens`; string stop
words cut the text and stop generation. Glue only: the rules live in serving/bls.py.

`execute` is a coroutine, so one instance serves many requests at once (Triton's Python backend
runs every request's coroutine on the instance's one event loop thread; with a blocking execute an
instance served one request at a time). All sends therefore come from that one thread. The only
blocking calls are the `tensorrt_llm` stream's iterator (read by a helper thread per request, which
hands the responses to the loop) and the stop request (run in a helper thread).
"""
import asyncio
import json
import os
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.bls import (IMAGE_PREPROCESSING_INPUTS, IMAGE_PREPROCESSING_OUTPUTS, LLM_INPUTS_FROM_ENCODERS,  # noqa: E402
                         LLM_INPUTS_FROM_PREPROCESSING, LLM_INPUTS_FROM_REQUEST, PASS_THROUGH_OUTPUTS,
                         PREPROCESSING_INPUTS, TOKEN_IDS_OUTPUT, GuardedSender, StreamText, encoder_inputs, has_images,
                         num_draft_tokens, speculative_generate, validate, wants_token_ids, with_batch_dim)
from serving.cancellation import send_stop_request  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402
from serving.responses import (ERROR_MESSAGE_OUTPUT, ERRORS_AS_OUTPUT, only_requested, pad_beams,  # noqa: E402
                               requested_outputs, stack_responses)
from serving.text import string_rows, to_str  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCELLATION_CHECK_PERIOD_S = 0.1
MAX_BLOCKING_THREADS = 1024
_STREAM_END = object()


def _numpy(tensor):
    if tensor.is_cpu():
        return tensor.as_numpy()
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(tensor.to_dlpack()).cpu().numpy()


def response_tensors(response):
    """name -> numpy of a BLS call's response; a response error, or an error_message output
    (how tensorrt_llm reports a failure during generation to a BLS caller), is raised."""
    if response.has_error():
        raise RuntimeError(response.error().message())
    tensors = {tensor.name(): _numpy(tensor) for tensor in response.output_tensors()}
    if ERROR_MESSAGE_OUTPUT in tensors:
        raise RuntimeError(tensors[ERROR_MESSAGE_OUTPUT].reshape(-1)[0].decode(errors="replace"))
    return tensors


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        params = model_parameters(self.model_config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.accumulate = bool(get_parameter(params, "accumulate_tokens", bool))
        self.llm_name = get_parameter(params, "tensorrt_llm_model_name", str) or "tensorrt_llm"
        # Requests with num_draft_tokens > 0 run the draft/target loop (serving/bls.py speculative_generate).
        self.draft_name = get_parameter(params, "tensorrt_llm_draft_model_name", str)
        # A vision-language model's image encoder (all_models/multimodal/multimodal_encoders); unset: text only.
        self.encoders_name = get_parameter(params, "multimodal_encoders_name", str)
        self.input_names = [tensor["name"] for tensor in self.model_config["input"]]
        # Threads that wait on blocking Triton calls for the event loop: one per live stream (its
        # response iterator) plus stop requests. The cap only queues work beyond it.
        self.blocking_calls = ThreadPoolExecutor(max_workers=MAX_BLOCKING_THREADS, thread_name_prefix="bls-wait")
        start_server_watchdog()  # this stub waits inside BLS calls

    async def execute(self, requests):
        await asyncio.gather(*(self._serve_or_fail(request) for request in requests))
        return None

    async def _serve_or_fail(self, request):
        # Shared with this request's cancellation watcher: calls after FINAL would crash Triton.
        sender = GuardedSender(request.get_response_sender(), FINAL)
        try:
            await self._serve(request, sender)
        except Exception as error:  # this request fails; the model keeps serving
            self._send_final(sender, pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(str(error))))

    # ----------------------------------------------------------------------------- pipeline

    async def _serve(self, request, sender):
        requested = requested_outputs(request)  # nothing else may be sent (serving/responses.py)
        tensors = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = _numpy(tensor)
        validate(tensors, self.draft_name, self.encoders_name)
        batch_size = tensors["text_input"].shape[0]
        stream = self.decoupled and bool(np.any(tensors.get("stream", np.array([False]))))
        llm_request_id = str(uuid.uuid4())
        llm_inputs = await self._llm_inputs(tensors, batch_size, stream)
        stop_words = string_rows(tensors.get("stop_words")) or [[] for _ in range(batch_size)]
        queries = [row[0] for row in string_rows(tensors["text_input"])]
        with_token_ids = wants_token_ids(tensors)
        streams = {}
        finals = []
        loop = asyncio.get_running_loop()
        stopper = _LlmStopper(lambda: loop.run_in_executor(self.blocking_calls, self._stop_llm, llm_request_id))
        # A client that hangs up (or cancels) between chunks, or during a unary call that sends
        # nothing until the end, is seen by this watcher within one check period.
        watcher = asyncio.ensure_future(self._watch_cancellation(sender, stopper))
        try:
            async for llm_out in self._generate(tensors, llm_inputs, llm_request_id, stopper):
                if "output_ids" not in llm_out or stopper.client_gone:
                    continue  # drain: tensorrt_llm ends the request within a step of the stop
                out = await self._postprocess(llm_out, streams, stop_words, queries, stream)
                if out is None:
                    continue
                if with_token_ids:
                    out[TOKEN_IDS_OUTPUT] = llm_out["output_ids"]
                if stream:
                    self._send(sender, pb_utils.InferenceResponse(output_tensors=self._tensors(out, requested)))
                    if self._all_stopped(streams, batch_size):
                        stopper.stop()  # nothing more will be sent for this request
                else:
                    finals.append(out)
        finally:
            stopper.finish()
            watcher.cancel()
        if stream:
            self._send_final(sender, None)
        else:
            self._send_final(sender, pb_utils.InferenceResponse(
                output_tensors=self._tensors(stack_responses(finals), requested)))

    @staticmethod
    async def _watch_cancellation(sender, stopper):
        while not stopper.finished.is_set():
            await asyncio.sleep(CANCELLATION_CHECK_PERIOD_S)
            if not stopper.finished.is_set() and sender.is_cancelled():
                stopper.client_gone = True
                stopper.stop()
                return

    @staticmethod
    def _send(sender, response):
        try:
            sender.send(response)
        except Exception:  # the client is gone; the watcher stops the generation
            pass

    @staticmethod
    def _send_final(sender, response):
        """Always attempted: Triton releases the request only on its FINAL response."""
        try:
            sender.send_final(response)
        except Exception as error:
            pb_utils.Logger.log_verbose(f"tensorrt_llm_bls: final response not delivered: {error}")

    async def _generate(self, tensors, llm_inputs, request_id, stopper):
        """tensorrt_llm's responses: one call, or with num_draft_tokens the speculative loop's final one."""
        k = num_draft_tokens(tensors)
        if k <= 0:
            async for out in self._call_llm(llm_inputs, request_id):
                yield out
            return
        flag = lambda name: bool(np.any(tensors[name])) if name in tensors and tensors[name].size else False  # noqa: E731
        yield await speculative_generate(
            llm_inputs, max_tokens=int(tensors["max_tokens"].reshape(-1)[0]), num_draft_tokens=k,
            use_draft_logits=flag("use_draft_logits"), exclude_input=flag("exclude_input_in_output"),
            want_perf=flag("return_perf_metrics"),
            call_draft=lambda inputs: self._call_once(self.draft_name, inputs, request_id),
            call_target=lambda inputs: self._call_once(self.llm_name, inputs, request_id),
            cancelled=lambda: stopper.client_gone)

    async def _call_once(self, model_name, inputs, request_id):
        """The response of a non-streamed tensorrt_llm call (the last one holding output_ids)."""
        last = None
        async for out in self._call_llm(inputs, request_id, model_name):
            if "output_ids" in out:
                last = out
        if last is None:
            raise RuntimeError(f"tensorrt_llm_bls: {model_name} answered without output_ids")
        return last

    async def _llm_inputs(self, tensors, batch_size, stream):
        pre_inputs = {PREPROCESSING_INPUTS[name]: value for name, value in tensors.items()
                      if name in PREPROCESSING_INPUTS}
        pre_inputs["REQUEST_OUTPUT_LEN"] = with_batch_dim(pre_inputs["REQUEST_OUTPUT_LEN"], batch_size)
        images = bool(self.encoders_name) and has_images(tensors)
        if images:
            pre_inputs.update({IMAGE_PREPROCESSING_INPUTS[name]: value for name, value in tensors.items()
                               if name in IMAGE_PREPROCESSING_INPUTS})
        pre_out = await self._call("preprocessing", pre_inputs,
                                   list(LLM_INPUTS_FROM_PREPROCESSING) + (IMAGE_PREPROCESSING_OUTPUTS if images else []))
        llm_inputs = {llm: pre_out[name] for name, llm in LLM_INPUTS_FROM_PREPROCESSING.items()
                      if name in pre_out}
        if images:
            encoded = await self._call(self.encoders_name, encoder_inputs(tensors, pre_out),
                                       list(LLM_INPUTS_FROM_ENCODERS))
            llm_inputs.update({llm: encoded[name] for name, llm in LLM_INPUTS_FROM_ENCODERS.items() if name in encoded})
        for name, llm in LLM_INPUTS_FROM_REQUEST.items():
            if name in tensors:
                llm_inputs[llm] = with_batch_dim(tensors[name], batch_size)
        llm_inputs["streaming"] = np.full((batch_size, 1), stream, dtype=np.bool_)
        return llm_inputs

    async def _postprocess(self, llm_out, streams, stop_words, queries, stream):
        """One tensorrt_llm response -> this BLS's outputs (text per row and beam), or None."""
        rows = llm_out["output_ids"].shape[0]
        batch_index = llm_out.get("batch_index", np.zeros((rows, 1), np.int32)).reshape(-1)
        sequence_index = llm_out.get("sequence_index", np.zeros((rows, 1), np.int32)).reshape(-1)
        lengths = llm_out["sequence_length"].reshape(rows, -1)
        # A beam stream resends whole hypotheses (they may change), so it sends whole texts.
        grows = stream and lengths.shape[1] == 1
        states = []
        for row in range(rows):
            for beam in range(lengths.shape[1]):
                key = (int(batch_index[row]), int(sequence_index[row]), beam)
                state = streams.setdefault(key, StreamText(stop_words=stop_words[key[0]], grows=grows,
                                                           accumulate=stream and (self.accumulate or not grows)))
                new = [int(t) for t in llm_out["output_ids"][row, beam, : lengths[row, beam]] if t >= 0]
                if grows:
                    state.window.extend(new)
                else:
                    state.token_ids = new
                states.append(state)
        if all(state.stopped for state in states):
            return None  # generation goes on only until the stop request lands
        texts = await self._texts(states, grows)
        pieces = []
        for state, text in zip(states, texts):
            if not stream and not state.stopped:
                query = queries[0] if len(queries) == 1 else ""
                state.search_start = len(query) if query and text.startswith(query) else 0
            pieces.append(state.update(text, is_final=not stream))
        # 1-D like postprocessing's OUTPUT (item-major, then beam): clients read text_output[0].
        out = {"text_output": np.array([piece.encode("utf-8") for piece in pieces], dtype=object)}
        for name in PASS_THROUGH_OUTPUTS:
            if name in llm_out:
                out[name] = llm_out[name]
        return out

    async def _texts(self, states, grows):
        """Each state's text so far, decoded by the postprocessing model in one call: a growing
        stream's window (two short id lists) or a whole response's ids."""
        rows, decoding = [], []
        for state in states:
            if not grows:
                decoding.append(state)
                rows.append(state.token_ids)
            elif state.window.pending:
                decoding.append(state)
                rows.extend(state.window.windows())
        decoded = iter(await self._decode(rows))
        for state in decoding:
            if grows:
                head_text, window_text = next(decoded), next(decoded)
                state.text += state.window.advance(head_text, window_text)
            else:
                state.text = next(decoded)
        return [state.text for state in states]

    async def _decode(self, rows):
        if not rows:
            return []
        tokens = pad_beams(rows, np.int32, -1)[:, None, :]
        seq_len = np.array([[len(ids)] for ids in rows], dtype=np.int32)
        texts = (await self._call("postprocessing", {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": seq_len},
                                  ["OUTPUT"]))["OUTPUT"].reshape(-1)
        return [to_str(text) for text in texts]

    @staticmethod
    def _all_stopped(streams, batch_size):
        stopped_rows = {key[0] for key, state in streams.items() if state.stopped}
        return len(stopped_rows) == batch_size

    # ----------------------------------------------------------------------------- calls

    @staticmethod
    def _tensors(out, requested):
        return [pb_utils.Tensor(name, value) for name, value in only_requested(out, requested).items()]

    async def _call(self, model_name, inputs, outputs):
        request = pb_utils.InferenceRequest(
            model_name=model_name, requested_output_names=outputs,
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
        return response_tensors(await request.async_exec())

    async def _call_llm(self, inputs, request_id, model_name=None):
        outputs = ["output_ids", "sequence_length", *PASS_THROUGH_OUTPUTS, ERROR_MESSAGE_OUTPUT]
        request = pb_utils.InferenceRequest(
            model_name=model_name or self.llm_name, requested_output_names=outputs, request_id=request_id,
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
            parameters={ERRORS_AS_OUTPUT: True})  # serving/responses.py says why
        if not self.decoupled:
            yield response_tensors(await request.async_exec())
            return
        # The decoupled response iterator blocks in next(): a helper thread reads it and hands
        # each response to this loop, which stays free for the other requests meanwhile.
        loop = asyncio.get_running_loop()
        responses = asyncio.Queue()
        iterator = await request.async_exec(decoupled=True)

        def read_all():
            try:
                for response in iterator:
                    loop.call_soon_threadsafe(responses.put_nowait, response)
            except Exception as error:  # handed to the loop, raised there
                loop.call_soon_threadsafe(responses.put_nowait, error)
            loop.call_soon_threadsafe(responses.put_nowait, _STREAM_END)

        reader = loop.run_in_executor(self.blocking_calls, read_all)
        while (response := await responses.get()) is not _STREAM_END:
            if isinstance(response, Exception):
                raise response
            yield response_tensors(response)
        await reader

    def _stop_llm(self, request_id):
        send_stop_request(pb_utils, self.llm_name, request_id, self.decoupled)

    def finalize(self):
        self.blocking_calls.shutdown(wait=False, cancel_futures=True)
        stop_crash_dumps()


class _LlmStopper:
    """Sends the stop request for one tensorrt_llm request at most once, from either the serving
    coroutine (stop words matched) or the cancellation watcher task (client gone)."""

    def __init__(self, send_stop):
        self._send_stop = send_stop
        self._lock = threading.Lock()
        self.stopped = False
        self.client_gone = False
        self.finished = threading.Event()  # the request is over: the watcher ends

    def stop(self):
        with self._lock:
            if self.stopped or self.finished.is_set():
                return
            self.stopped = True
        self._send_stop()

    def finish(self):
        self.finished.set()
