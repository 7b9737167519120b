"""Requests, responses, and the per-sequence state the executor keeps between iterations.

Public types (the Triton ``tensorrt_llm`` model builds and reads these): ``Request`` with its
``SamplingConfig`` and ``OutputConfig``; ``Response`` with its ``Result``, ``FinishReason`` and
``RequestPerfMetrics``.

Internal types: ``Sequence`` is the unit the scheduler schedules. A request owns one sequence
per returned sequence (``num_return_sequences``) or per beam (``beam_width``); every sequence
shares the request's prompt.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; ``NOT_FINISHED`` on every non-final streaming response."""

    NOT_FINISHED = "not_finished"
    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class SamplingConfig:
    """Per-request decoding knobs. ``None`` means "the default".

    Greedy unless ``top_k > 1`` or ``top_p`` is set (TRT-LLM's rule: with neither top-k nor
    top-p the decoder takes the argmax, whatever the temperature); ``temperature == 0`` is
    also greedy. ``top_k == 0`` means no top-k limit.
    """

    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    num_return_sequences: int | None = 1

    @property
    def is_greedy(self) -> bool:
        if self.temperature == 0 or self.top_k == 1:
            return True
        return not (self.top_k or 0) > 1 and self.top_p is None


@dataclass
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool | None = None  # None: the ExecutorConfig default
    return_perf_metrics: bool = False


@dataclass
class Request:
    """One generation request, as the Triton model hands it to ``Executor.enqueue_request``.

    ``stop_words``/``bad_words`` are lists of token sequences; a stop sequence stays in the
    output (as TRT-LLM does), ``end_id`` does not. ``embedding_bias`` is a (vocab,) float
    tensor added to the logits before sampling.
    """

    input_token_ids: list[int]
    max_tokens: int
    end_id: int | None = None
    pad_id: int | None = None
    streaming: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    stop_words: list[list[int]] | None = None
    bad_words: list[list[int]] | None = None
    embedding_bias: Any = None  # torch.Tensor | list[float] | numpy array of shape (vocab,)


@dataclass
class RequestPerfMetrics:
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0


@dataclass
class Result:
    """Tokens of one result stream (one ``sequence_index``); one list per beam.

    Streaming: only tokens produced since the previous response of this stream (beam search
    streams the whole hypothesis so far, since beams may rewrite history). Non-streaming: one
    final result holding prompt + output unless ``exclude_input_from_output``.
    """

    output_token_ids: list[list[int]]
    is_final: bool
    finish_reasons: list[FinishReason]
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    context_logits: torch.Tensor | None = None  # (prompt_len, vocab) float32
    generation_logits: torch.Tensor | None = None  # (beams, new_tokens, vocab) float32
    sequence_index: int = 0
    perf: RequestPerfMetrics | None = None


@dataclass
class Response:
    request_id: int
    error: str | None = None
    result: Result | None = None

    @property
    def has_error(self) -> bool:
        return self.error is not None

    @property
    def is_final(self) -> bool:
        return self.error is not None or (self.result is not None and self.result.is_final)


def now_ns() -> int:
    return time.time_ns()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One token stream being generated, and how much of it has KV in the cache.

    ``token_ids`` = prompt + generated tokens. The scheduler's one idea: a sequence needs KV
    for every token it knows, so each iteration it is given up to
    ``len(token_ids) - num_computed_tokens`` new tokens; when its chunk reaches the end, the
    last token's logits produce the next token. After preemption ``num_computed_tokens``
    drops to 0 and the whole stream (prompt and output so far) is simply recomputed.

        token_ids:   [ p0 p1 p2 p3 p4 | g0 g1 g2 ]
                       <-- computed (KV cached) -->|<- scheduled ->|
        num_computed_tokens = 7 ; this step computes g2 and samples g3
    """

    def __init__(self, seq_id: int, state: "RequestState", sequence_index: int, beam_index: int = 0):
        self.seq_id = seq_id
        self.state = state
        self.sequence_index = sequence_index
        self.beam_index = beam_index
        self.token_ids: list[int] = list(state.request.input_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids, in order
        self.status = SequenceStatus.WAITING
        self.finish_reason = FinishReason.NOT_FINISHED
        self.arrival_order = 0  # set by the scheduler; preemption picks the largest (newest)
        # output bookkeeping
        self.num_emitted = 0  # generated tokens already sent in a response
        self.log_probs: list[float] = []
        self.cum_log_prob = 0.0
        self.generation_logits: list[torch.Tensor] = []
        self.generator: torch.Generator | None = None
        self.pending_logprobs = None  # beam search: (vocab,) log-probs waiting for sibling beams

    @property
    def request_id(self) -> int:
        return self.state.request_id

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.state.request.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {self.status.value})")


class RequestState:
    """Executor-side bookkeeping of one accepted request: its sequences and its timings."""

    def __init__(self, request_id: int, request: Request, exclude_input_from_output: bool):
        self.request_id = request_id
        self.request = request
        self.exclude_input = exclude_input_from_output
        self.sequences: list[Sequence] = []
        self.perf = RequestPerfMetrics(arrival_time_ns=now_ns())
        self.is_cancelled = False
        self.context_logits: torch.Tensor | None = None
        self.context_logits_parts: list[torch.Tensor] = []
        self.finished_streams: set[int] = set()  # sequence_index values whose final response went out

    @property
    def is_beam_search(self) -> bool:
        return self.request.sampling.beam_width > 1

    @property
    def num_streams(self) -> int:
        return 1 if self.is_beam_search else (self.request.sampling.num_return_sequences or 1)
