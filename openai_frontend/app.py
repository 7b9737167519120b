"""The aiohttp application: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics.
/health and /v1/models agree: both answer 503 (model_not_ready) until Triton and its models are ready.

Why aiohttp (not FastAPI + uvicorn): it is already installed with ``tritonclient[all]`` (its
HTTP aio client), so the frontend adds no dependency; it needs no request-model layer, whose
validation errors would have to be reshaped into OpenAI's 400 bodies anyway (protocol.py
validates and names the field); and with ``handler_cancellation`` a client that hangs up cancels
its handler at once, unary or streamed, which is what cancels the Triton request.

Per request: parse and validate (400) -> served model or LoRA adapter? (404) -> Triton ready? (503) -> render
and count the prompt -> one engine request per choice -> a whole response or SSE chunks. With a
reasoning model, each chat choice's text goes through its reasoning parser (reasoning.py), and with
tools the content through its tool-call parser (tool_calls.py) on the way out.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from openai_frontend import sse
from openai_frontend.audio import (TIMESTAMPED_FORMATS, Transcript, delta_event, done_event, read_audio_request, render, stream_headers,
                                   text_delta, text_prefix)
from openai_frontend.chat_template import PromptBuilder
from openai_frontend.detokenizer import fast_decode
from openai_frontend.errors import APIError, bad_request, model_not_found, server_error
from openai_frontend.generation import ChoiceEvent, choice_specs, generate_choices
from openai_frontend.logprobs import TokenNamer
from openai_frontend.lora_modules import LoraModule
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.protocol import GenerationRequest, image_parts, parse_chat_request, parse_completion_request
from openai_frontend.reasoning import chat_parsers, request_reasoning
from openai_frontend.reasoning_parsers import ReasoningParser
from openai_frontend.reasoning_parsers import get_parser as get_reasoning_parser
from openai_frontend.reasoning_parsers import parser_for_template as reasoning_for_template
from openai_frontend.responses import ResponseShape
from openai_frontend.tool_calls import finish_reason, keep_markers_decoder, turn_stops
from openai_frontend.tool_parsers import ToolParser, coalesce, get_parser, merge_calls, parser_for_template
from openai_frontend.triton_client import TritonClient
from openai_frontend.vision import ChatImages, VisionSettings, text_only_error
from serving.tokenization import first_token_id

log = logging.getLogger("openai_frontend")
ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
             "/v1/models": "models", "/v1/audio/transcriptions": "audio", "/v1/audio/translations": "audio"}


@dataclass
class FrontendConfig:
    grpc_url: str  # Triton's gRPC endpoint, "host:port"
    tokenizer_dir: str  # the engine directory (tokenizer files, config.json with its limits)
    served_model_name: str  # the `model` clients name
    # The model requests go to: the engine's own (direct: the frontend tokenizes and decodes), or a
    # tensorrt_llm_bls (text in and out); __main__ says why, and why never the ensemble.
    triton_model: str = "tensorrt_llm"
    llm_model: str = "tensorrt_llm"  # the model holding the engine (its readiness counts too)
    add_special_tokens: bool = True  # as preprocessing's parameter: prompt token counts match
    tool_call_parser: str | None = None  # tool_parsers.PARSERS name; None: the one the chat template teaches
    # reasoning_parsers.PARSERS name, or "none"; None: the one the chat template teaches (else none)
    reasoning_parser: str | None = None
    # LoRA adapters served as models of their own (lora_modules.py): name -> adapter, in flag order
    lora_modules: dict[str, LoraModule] = field(default_factory=dict)
    # A vision-language engine's encoder and image limits (openai_frontend/vision.py); None: text only
    vision: VisionSettings | None = None
    # A Whisper engine's whisper_bls model (openai_frontend/audio.py); None: no /v1/audio endpoints
    audio_model: str | None = None


@dataclass
class Frontend:
    config: FrontendConfig
    prompts: PromptBuilder
    namer: TokenNamer  # names the tokens of log-probs
    decode: Callable[[list[int]], str]  # ids -> text for the direct path (openai_frontend/detokenizer.py)
    metrics: FrontendMetrics
    started: int
    tool_parser: type[ToolParser]  # reads tool calls in the text of tool_choice "auto"
    reasoning_parser: type[ReasoningParser] | None = None  # splits a reasoning model's chat text (None: off)
    # markers -> ids -> text that keeps them where they are special tokens (None: ``decode`` keeps them)
    marker_decoders: dict = field(default_factory=dict)
    client: TritonClient | None = None  # made on startup, inside the running event loop
    images: ChatImages | None = None  # image_url parts, encoded in this process (vision models only)

    def decode_keeping(self, markers: tuple[str, ...]) -> Callable[[list[int]], str]:
        """ids -> text for the direct path that keeps the parsers' ``markers`` (tool-call and
        reasoning markers that are special tokens: tool_calls.keep_markers_decoder)."""
        if not markers:
            return self.decode
        if markers not in self.marker_decoders:
            self.marker_decoders[markers] = keep_markers_decoder(self.prompts.tokenizer, markers)
        return self.marker_decoders[markers] or self.decode

    def check_model(self, model: str) -> LoraModule | None:
        """The adapter ``model`` names (None: the base model); a 404 listing the served models
        when it names neither."""
        if model == self.config.served_model_name:
            return None
        if model in self.config.lora_modules:
            return self.config.lora_modules[model]
        raise model_not_found(model, [self.config.served_model_name, *self.config.lora_modules])


FRONTEND = web.AppKey("frontend", Frontend)


def create_app(config: FrontendConfig) -> web.Application:
    prompts = PromptBuilder(config.tokenizer_dir, config.add_special_tokens)
    tool_parser = get_parser(config.tool_call_parser or parser_for_template(prompts.template_text))
    log.info("tool calls are read as %s (%s)", tool_parser.name,
             "--tool_call_parser" if config.tool_call_parser else "from the chat template")
    reasoning_parser = get_reasoning_parser(config.reasoning_parser or reasoning_for_template(prompts.template_text))
    log.info("reasoning is read as %s (%s)", reasoning_parser.name if reasoning_parser else "none (off)",
             "--reasoning_parser" if config.reasoning_parser else "from the chat template")
    frontend = Frontend(config, prompts, TokenNamer(prompts.tokenizer), fast_decode(prompts.tokenizer),
                        FrontendMetrics(), started=int(time.time()), tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser,
                        images=ChatImages(config.vision, prompts.tokenizer) if config.vision else None)
    for markers in (tool_parser.special_tokens, *((reasoning_parser.special_tokens,
                                                    tool_parser.special_tokens + reasoning_parser.special_tokens)
                                                   if reasoning_parser else ())):
        frontend.decode_keeping(markers)  # made now: a vocabulary's scan is not a request's wait
    if frontend.images is not None:
        log.info("images: %s encoder from %s, at most %d per request", frontend.images.prompts.model_type,
                 config.vision.encoder_dir, frontend.images.prompts.max_num_images)
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=64 * 2**20)
    app[FRONTEND] = frontend
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", translations)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(_open_client)
    app.on_cleanup.append(_close_client)
    return app


async def _open_client(app: web.Application) -> None:
    frontend = app[FRONTEND]
    config, tokenizer = frontend.config, frontend.prompts.tokenizer
    end_id = first_token_id(tokenizer, tokenizer.eos_token)  # as preprocessing derives them
    pad_id = first_token_id(tokenizer, tokenizer.pad_token)
    frontend.client = TritonClient(config.grpc_url, config.triton_model, config.llm_model, end_id=end_id,
                                   pad_id=end_id if pad_id is None else pad_id)


async def _close_client(app: web.Application) -> None:
    await app[FRONTEND].client.close()
    if app[FRONTEND].images is not None:
        app[FRONTEND].images.close()


@web.middleware
async def _errors_and_metrics(request: web.Request, handler):
    """APIError -> its OpenAI body and status; every /v1 request counted and timed."""
    start = time.perf_counter()
    status = "500"
    try:
        response = await handler(request)
        status = "cancelled" if request.get("hung_up") else str(response.status)
        return response
    except APIError as error:
        status = str(error.status)
        return web.json_response(error.body(), status=error.status)
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    except web.HTTPException as error:  # no such route or method: OpenAI's shape too
        status = str(error.status)
        if error.status < 400:
            raise
        return web.json_response(APIError(error.status, f"{request.method} {request.path}: {error.reason}",
                                          error_type="invalid_request_error").body(), status=error.status)
    except Exception as error:
        log.exception("request failed")
        return web.json_response(server_error(f"internal error: {error}").body(), status=500)
    finally:
        endpoint = ENDPOINTS.get(request.path) or ("models" if request.path.startswith("/v1/models") else None)
        if endpoint:
            request.app[FRONTEND].metrics.observe(endpoint, status, time.perf_counter() - start)


# ----------------------------------------------------------------------------- small endpoints

def _model_card(frontend: Frontend, lora: LoraModule | None = None) -> dict:
    """The base model's card, or an adapter's: its own id, its directory as ``root`` and the base
    model as ``parent`` (as vLLM lists adapters)."""
    card = {"id": frontend.config.served_model_name, "object": "model", "created": frontend.started,
            "owned_by": "tritonllm"}
    if lora is not None:
        card.update(id=lora.name, root=lora.path, parent=frontend.config.served_model_name)
    return card


# /v1/models answers as /health does: 503 model_not_ready until Triton and its models are ready. A
# client waiting for the model list to appear then never gets a 503 for the first request it sends.
async def list_models(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    await frontend.client.ensure_ready()
    cards = [_model_card(frontend)] + [_model_card(frontend, lora) for lora in frontend.config.lora_modules.values()]
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    lora = frontend.check_model(request.match_info["model"])
    await frontend.client.ensure_ready()
    return web.json_response(_model_card(frontend, lora))


async def health(request: web.Request) -> web.Response:
    await request.app[FRONTEND].client.ensure_ready()
    return web.Response(text="ready\n")


async def metrics(request: web.Request) -> web.Response:
    frontend = request.app[FRONTEND]
    return web.Response(body=frontend.metrics.render(), headers={"Content-Type": frontend.metrics.content_type})


# ----------------------------------------------------------------------------- generation

async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def transcriptions(request: web.Request) -> web.Response:
    return await _audio(request, "transcribe")


async def translations(request: web.Request) -> web.Response:
    return await _audio(request, "translate")


async def _audio(request: web.Request, task: str) -> web.StreamResponse:
    """OpenAI's audio endpoints through whisper_bls (openai_frontend/audio.py)."""
    frontend = request.app[FRONTEND]
    if frontend.config.audio_model is None:
        raise APIError(404, f"{request.path}: this server's model is not a speech model (start the frontend with "
                            "--audio_model whisper_bls for a Whisper engine)", error_type="invalid_request_error")
    audio = await read_audio_request(request)
    if audio.model is not None:
        frontend.check_model(str(audio.model))
    await frontend.client.ensure_ready()
    prefix = text_prefix(audio.language, task, timestamps=audio.response_format in TIMESTAMPED_FORMATS)
    results = frontend.client.transcribe(frontend.config.audio_model, audio.samples, prefix, audio.prompt,
                                         audio.words)
    async with aclosing(results):
        if not audio.stream:
            last = Transcript("")
            async for last in results:
                pass
            return render(last, audio, task)
        first = await anext(results, None)  # before the 200: an error here still gets its own status
        response = web.StreamResponse(headers={**sse.HEADERS, **stream_headers(audio)})
        await response.prepare(request)
        text = ""
        try:
            while first is not None:
                delta = text_delta(text, first.text)
                if delta:
                    await response.write(sse.event(delta_event(delta)))
                text, first = first.text, await anext(results, None)
            await response.write(sse.event(done_event(text)))
            await response.write(sse.DONE)
        except APIError as error:  # after the 200 has gone out: as an event, as OpenAI streams errors
            await response.write(sse.event(error.body()))
            await response.write(sse.DONE)
        except ConnectionError:  # the client hung up: closing `results` cancels the Triton call
            request["hung_up"] = True
            return response
        await response.write_eof()
        return response


async def _json_body(request: web.Request):
    try:
        return json.loads(await request.read())
    except ValueError as error:
        raise bad_request(None, f"the request body is not valid JSON: {error}", code="invalid_json") from None


def _prompts(frontend: Frontend, parsed: GenerationRequest, chat: bool, image_rows: list[int] | None = None,
             kinds: list[str] | None = None, grids=None) -> list[tuple[str, list[int], int]]:
    """(prompt text, its token ids, tokens to generate) per prompt; ``image_rows``: each image's (or
    video's) table rows (a chat request's media parts, in order; ``kinds``: their types; ``grids``: the
    encoder's grids, a Qwen3-VL video's timestamps with them)."""
    builder = frontend.prompts
    images = frontend.images if chat else None
    if chat:
        tools = parsed.tools.shown if parsed.tools is not None else None
        texts = [builder.render_chat(parsed.messages, tools, frontend.tool_parser,
                                     images.placeholder if images is not None else None,
                                     images.video_placeholder if images is not None else None,
                                     parsed.template_kwargs)]
    else:
        texts = parsed.prompts
    prompts = []
    for text in texts:
        ids = builder.encode(text)
        if images is not None:  # each image placeholder -> its image's fake ids (vision.py)
            ids = images.expand(ids, image_rows or [], kinds, grids)
        max_tokens = builder.max_tokens_for(len(ids), parsed.params.max_tokens, "messages" if chat else "prompt",
                                            parsed.max_tokens_field)
        prompts.append((text, ids, max_tokens))
    return prompts


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    frontend = request.app[FRONTEND]
    body = await _json_body(request)
    parsed = parse_chat_request(body) if chat else parse_completion_request(body)
    lora = frontend.check_model(parsed.model)
    parts = image_parts(parsed.messages) if chat else []
    _check_images(frontend, parts)
    await frontend.client.ensure_ready()
    frames = frontend.images.frame_request(parsed.media_kwargs) if parts and parsed.media_kwargs else None
    table, image_rows, grids = (await frontend.images.encode(parts, *([frames] if frames else []))
                                if parts else (None, None, None))
    # an adapter's prompts too: the base model's template and tokenizer
    prompts = _prompts(frontend, parsed, chat, image_rows, [part["type"] for part in parts], grids)
    prompt_tokens = sum(len(ids) for _, ids, _ in prompts)
    shape = ResponseShape(chat=chat, model=parsed.model)
    specs = choice_specs(prompts, parsed.params)
    for spec in specs:  # every choice gets the request's prompt-embedding table (images only)
        if frontend.images is not None and frontend.images.cross_attention:  # Llama 3.2 Vision: cross-attention
            spec.vision = frontend.images.cross_inputs(spec.prompt_ids, table, image_rows) if parts else None
            continue
        spec.prompt_table = table
        if grids is not None:  # Qwen2-VL: its prompt's M-RoPE rows
            spec.mrope = frontend.images.mrope(spec.prompt_ids, grids)
    reasoning = request_reasoning(parsed, frontend.reasoning_parser) if chat else None
    if chat:  # (gpt-oss's turn ends at a call's <|call|>)
        parsed.params.stop += [s for s in turn_stops(parsed.tools, frontend.tool_parser) if s not in parsed.params.stop]
    parsers, markers = chat_parsers(parsed.tools, frontend.tool_parser, reasoning, prompts[0][0],
                                    guided=parsed.params.guide is not None) if chat else (None, ())
    decode = frontend.decode_keeping(markers)  # the parsers' markers that are special tokens: kept
    async with aclosing(generate_choices(frontend.client, specs, parsed.params, shape.id, frontend.namer,
                                         decode, lora)) as events:
        if parsed.stream:
            return await _stream(request, events, shape, prompt_tokens, parsed.include_usage, parsers)
        return await _whole(events, shape, len(specs), prompt_tokens, parsers, reasoning is not None)


def _check_images(frontend: Frontend, parts: list[dict]) -> None:
    """Image parts need a vision encoder, the direct path (the table travels beside the ids) and
    at most max_num_images of them."""
    if not parts:
        return
    if frontend.images is None:
        raise text_only_error(parts)
    if not frontend.client.direct:
        raise bad_request(parts[0]["field"], f"images go to the engine's own model: start the frontend with "
                                             f"--triton_model {frontend.config.llm_model} (the default), not "
                                             f"{frontend.config.triton_model}", code="invalid_image")
    frontend.images.check_count(parts)


async def _whole(events, shape: ResponseShape, num_choices: int, prompt_tokens: int,
                 parsers: Callable | None = None, reasoning: bool = False) -> web.Response:
    """``reasoning``: the parsers split reasoning off (each message then has ``reasoning_content``)."""
    texts, reasons, tokens = [""] * num_choices, ["stop"] * num_choices, [0] * num_choices
    logprobs = [None] * num_choices
    async for event in events:
        texts[event.index] += event.text
        tokens[event.index] = event.completion_tokens
        if event.logprobs is not None:
            logprobs[event.index] = (logprobs[event.index] or []) + event.logprobs
        if event.finish_reason:
            reasons[event.index] = event.finish_reason
    calls = None
    reasonings = [None] * num_choices if reasoning else None
    if parsers is not None:  # the text -> reasoning, content and tool calls (as streaming it would give)
        calls = []
        for i, text in enumerate(texts):
            parser = parsers()
            message = parser.parse(text)
            texts[i], reasons[i] = message.content, finish_reason(reasons[i], parser)
            calls.append(merge_calls(message.tool_calls) or None)
            if reasonings is not None:
                reasonings[i] = message.reasoning or None
    return web.json_response(shape.completion(texts, reasons, prompt_tokens, sum(tokens), logprobs, calls,
                                              reasonings))


async def _stream(request: web.Request, events, shape: ResponseShape, prompt_tokens: int,
                  include_usage: bool, parsers: Callable | None = None) -> web.StreamResponse:
    start = time.perf_counter()
    event = await anext(events, None)  # before the 200: an error here still gets its own status
    frontend = request.app[FRONTEND]
    endpoint = ENDPOINTS[request.path]
    frontend.metrics.first_token.labels(endpoint=endpoint).observe(time.perf_counter() - start)
    response = web.StreamResponse(headers=sse.HEADERS)
    await response.prepare(request)
    tokens: dict[int, int] = {}
    announced: set[int] = set()
    text_chunk = sse.TextChunkEncoder(shape, include_usage)
    choice_parsers: dict[int, object] = {}
    try:
        while event is not None:
            if parsers is not None:
                if event.index not in choice_parsers:
                    choice_parsers[event.index] = parsers()
                chunks = _parsed_chunks(shape, event, announced, include_usage, choice_parsers[event.index])
            else:
                chunks = _chunks(shape, event, announced, include_usage, text_chunk)
            await response.write(chunks)
            tokens[event.index] = event.completion_tokens
            event = await anext(events, None)
        if include_usage:
            await response.write(sse.event(shape.usage_chunk(prompt_tokens, sum(tokens.values()))))
        await response.write(sse.DONE)
    except APIError as error:  # after the 200 has gone out: as an event, as OpenAI streams errors
        await response.write(sse.event(error.body()))
        await response.write(sse.DONE)
    except ConnectionError:  # the client hung up: leaving closes `events`, which cancels Triton's calls
        request["hung_up"] = True
        return response
    await response.write_eof()
    return response


def _chunks(shape: ResponseShape, event: ChoiceEvent, announced: set[int], include_usage: bool,
            text_chunk: sse.TextChunkEncoder) -> bytes:
    """The SSE bytes of one event: (chat) the role on a choice's first, its text, its finish."""
    out = []
    if shape.chat and event.index not in announced:
        announced.add(event.index)
        out.append(sse.event(shape.chunk(event.index, None, role=True, with_usage_field=include_usage)))
    if event.logprobs:  # the text's tokens with it (the fast encoder has no room for them)
        out.append(sse.event(shape.chunk(event.index, event.text, logprobs=event.logprobs,
                                         with_usage_field=include_usage)))
    elif event.text:
        out.append(text_chunk.text(event.index, event.text))
    if event.finish_reason:
        out.append(sse.event(shape.chunk(event.index, None, event.finish_reason, with_usage_field=include_usage)))
    return b"".join(out)


def _parsed_chunks(shape: ResponseShape, event: ChoiceEvent, announced: set[int], include_usage: bool,
                 parser) -> bytes:
    """The SSE bytes of one event when the text goes through a reasoning or tool-call parser: (the
    role on a choice's first,) new reasoning, new content, then each call's deltas (a call's first
    delta on its own, then its argument text joined), the event's log-probs on the first of them,
    the finish."""
    out = []
    if event.index not in announced:
        announced.add(event.index)
        out.append(sse.event(shape.chunk(event.index, None, role=True, with_usage_field=include_usage)))
    message = parser.push(event.text)
    if event.finish_reason:
        message.extend(parser.finish())
    logprobs = event.logprobs or None
    if message.reasoning:
        out.append(sse.event(shape.chunk(event.index, None, logprobs=logprobs, reasoning=message.reasoning,
                                         with_usage_field=include_usage)))
        logprobs = None
    if message.content:
        out.append(sse.event(shape.chunk(event.index, message.content, logprobs=logprobs,
                                         with_usage_field=include_usage)))
        logprobs = None
    for delta in coalesce(message.tool_calls):
        out.append(sse.event(shape.chunk(event.index, None, logprobs=logprobs, tool_calls=[delta.to_openai()],
                                         with_usage_field=include_usage)))
        logprobs = None
    if logprobs:  # the tokens' text is held (a marker may be starting): their entries go now
        out.append(sse.event(shape.chunk(event.index, None, logprobs=logprobs, with_usage_field=include_usage)))
    if event.finish_reason:
        out.append(sse.event(shape.chunk(event.index, None, finish_reason(event.finish_reason, parser),
                                         with_usage_field=include_usage)))
    return b"".join(out)
