"""Choices: one engine request each, their text cut at stop strings, their tokens counted, and
several of them (``n``, or a list of prompts) merged into one stream of events.

Nothing here knows HTTP: the app turns events into JSON bodies or SSE chunks.
"""
from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from openai_frontend.detokenizer import IncrementalDetokenizer
from openai_frontend.logprobs import TokenLogprob, TokenNamer
from openai_frontend.lora_modules import LoraModule
from openai_frontend.protocol import SamplingParams
from openai_frontend.stop_strings import StopTrimmer
from openai_frontend.triton_client import Chunk, TritonClient


@dataclass
class ChoiceEvent:
    """New text of choice ``index``; the choice's last event carries its ``finish_reason``."""

    index: int
    text: str
    completion_tokens: int  # generated so far by this choice (exact: the engine's own count)
    finish_reason: str | None = None  # "stop" (stop string or end of sequence) | "length"
    logprobs: list[TokenLogprob] | None = None  # with log-probs asked for: the tokens of this event


@dataclass
class ChoiceSpec:
    index: int
    prompt: str
    prompt_ids: list[int]  # the prompt as the frontend's tokenizer encodes it
    max_tokens: int
    seed: int | None
    prompt_table: object = None  # np.ndarray (rows, hidden) FP16: the request's image features (vision.py)
    mrope: object = None  # Qwen2-VL: (flat rotary rows, delta) of this prompt (vision.py ChatImages.mrope)
    vision: object = None  # Llama 3.2 Vision: its images' tensorrt_llm inputs (vision.py ChatImages.cross_inputs)


def choice_specs(prompts: list[tuple[str, list[int], int]], params: SamplingParams) -> list[ChoiceSpec]:
    """(prompt, its token ids, max tokens) per prompt -> ``n`` choices each, indexed prompt-major
    as OpenAI does. With a seed, choice k of a prompt uses seed + k: the choices differ, and the
    same request gives the same choices again."""
    specs = []
    for p, (prompt, prompt_ids, max_tokens) in enumerate(prompts):
        for k in range(params.n):
            seed = None if params.seed is None else params.seed + k
            specs.append(ChoiceSpec(p * params.n + k, prompt, prompt_ids, max_tokens, seed))
    return specs


class LogprobTrack:
    """The log-prob entries of one choice, released with the text they belong to.

    Entries wait until an event carries text (the stop trimmer may hold text back), and after a
    stop string only the entries of tokens that start before the cut are kept: the entries'
    texts, concatenated, cover the choice's text and at most one token more.
    """

    def __init__(self, namer: TokenNamer):
        self.namer = namer
        self.pending: list[TokenLogprob] = []
        self.next_offset = 0  # where the next token's text starts (sum of the tokens' texts so far)
        self.text_length = 0  # characters of the choice's text released so far

    def push(self, chunk: Chunk) -> None:
        entries = self.namer.entries(chunk.token_ids or [], chunk.log_probs or [], chunk.top, self.next_offset)
        self.pending += entries
        if entries:
            self.next_offset = entries[-1].text_offset + len(entries[-1].token)

    def release(self, text: str, stopped: bool) -> list[TokenLogprob]:
        self.text_length += len(text)
        out, self.pending = self.pending, []
        if stopped:  # tokens past the stop string's start are not part of the answer
            out = [e for e in out if e.text_offset < self.text_length]
        return out


async def generate_choice(client: TritonClient, spec: ChoiceSpec, params: SamplingParams,
                          request_id: str, namer: TokenNamer | None = None,
                          decode: Callable[[list[int]], str] | None = None,
                          lora: LoraModule | None = None) -> AsyncIterator[ChoiceEvent]:
    """One choice's events, generated with the LoRA adapter ``lora`` when given. On the client's
    direct path the chunks carry ids and no text: they are decoded here with ``decode`` (ids ->
    text, openai_frontend/detokenizer.py)."""
    trimmer = StopTrimmer(params.stop)
    track = LogprobTrack(namer) if params.logprobs is not None and namer is not None else None
    detokenizer = IncrementalDetokenizer(decode) if client.direct else None
    tokens = 0
    # aclosing: leaving (a stop string, or this generator being closed) cancels the call at once.
    async with aclosing(client.generate(spec.prompt, spec.prompt_ids, params, spec.max_tokens, spec.seed,
                                        f"{request_id}-{spec.index}", lora, spec.prompt_table, spec.mrope,
                                        spec.vision)) as chunks:
        async for chunk in chunks:
            tokens += chunk.num_tokens
            if detokenizer is not None:
                chunk.text = detokenizer.push(chunk.token_ids or [])
            text = trimmer.push(chunk.text)
            if track is not None:
                track.push(chunk)
            if text:
                logprobs = None if track is None else track.release(text, trimmer.stopped)
                yield ChoiceEvent(spec.index, text, tokens, logprobs=logprobs)
            if trimmer.stopped:
                break  # the entry model has stopped the engine already (direct: leaving cancels the call)
    # (Direct path: a character still incomplete at the end, as U+FFFD; it may complete a stop string.)
    text = trimmer.push(detokenizer.finish() if detokenizer is not None else "") + trimmer.flush()
    # The engine leaves the end-of-sequence token out of its output, so a choice that reached
    # max_tokens generated exactly that many tokens and was cut by the limit.
    reason = "length" if not trimmer.stopped and tokens >= spec.max_tokens else "stop"
    logprobs = None if track is None else track.release(text, trimmer.stopped)
    yield ChoiceEvent(spec.index, text, tokens, reason, logprobs)


async def generate_choices(client: TritonClient, specs: list[ChoiceSpec], params: SamplingParams,
                           request_id: str | None = None, namer: TokenNamer | None = None,
                           decode: Callable[[list[int]], str] | None = None,
                           lora: LoraModule | None = None) -> AsyncIterator[ChoiceEvent]:
    """Every choice's events, interleaved as they come. Closing this iterator (or cancelling
    its consumer) cancels every choice still running. ``namer`` names the tokens of log-probs;
    ``decode`` turns ids into text on the client's direct path; ``lora``: the adapter every
    choice runs with (None: the base model)."""
    request_id = request_id or uuid.uuid4().hex
    streams = [generate_choice(client, spec, params, request_id, namer, decode, lora) for spec in specs]
    if len(streams) == 1:  # no tasks and no queue on the common path
        async with aclosing(streams[0]) as events:
            async for event in events:
                yield event
        return
    async for event in _merge(streams):
        yield event


_DONE = object()


async def _merge(streams: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait(item)
            queue.put_nowait(_DONE)
        except Exception as error:  # the consumer raises it; the other choices are cancelled
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
