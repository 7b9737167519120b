"""Requests, responses, and the per-sequence state the executor keeps between iterations.

Public types (the Triton ``tensorrt_llm`` model builds and reads these): ``Request`` with its
``SamplingConfig``, ``OutputConfig`` and ``ExternalDraftTokens``; ``Response`` with its ``Result``, ``FinishReason`` and
``RequestPerfMetrics``.

Internal types: ``Sequence`` is the unit the scheduler schedules. A request owns one sequence
per returned sequence (``num_return_sequences``) or per beam (``beam_width``); every sequence
shares the request's prompt.
"""
from __future__ import annotations

import enum
import math
import operator
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.executor.mrope_rotary import Mrope, mrope_error, normalize_mrope
from engine.executor.prompt_table import PromptTable, normalize_prompt_table, prompt_cache_keys, prompt_table_error
from engine.executor.top_log_probs import MAX_TOP_LOG_PROBS, num_top_log_probs_error

if TYPE_CHECKING:  # torch only where a tensor is read: serving/requests.py (and so the BLS's
    import torch  # stubs, which never run the engine) converts Triton inputs without importing it


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
    """What a result carries besides its tokens.

    ``num_top_log_probs`` k (0 = off, at most ``MAX_TOP_LOG_PROBS``): for every generated token,
    the k most likely token ids and their log-probs, most likely first, taken from the same
    distribution as ``log_probs`` (engine/executor/sampler.py says which one). k > 0 implies
    ``return_log_probs``. Not with beam search.
    """

    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool | None = None  # None: the ExecutorConfig default
    return_perf_metrics: bool = False
    num_top_log_probs: int = 0
    # Whisper engines: each generated token's time in the audio (Result.token_timestamps;
    # engine/encoder_decoder/whisper_alignment.py)
    return_token_timestamps: bool = False


# What a guide may be (the reference's GuidedDecodingParams types): any JSON, JSON that validates
# against a schema, a regular expression, an EBNF grammar (xgrammar's dialect, GBNF-like), or
# xgrammar's structural tag (free text with constrained segments, e.g. tool calls).
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
# What the guide holds for each type that takes one ("json" takes none: any JSON object or array).
GUIDE_CONTENTS = {"json_schema": "a JSON schema", "regex": "a regular expression",
                  "ebnf_grammar": "an EBNF grammar with a root rule", "structural_tag": "a structural tag (JSON)"}


def guide_error(guide_type: str, guide: str | None) -> str | None:
    """Why (guide type, guide) is no guide, naming the Triton input (the executor and the Triton
    models check the pair with this one rule), or None."""
    if guide_type not in GUIDE_TYPES:
        shown = guide_type if len(guide_type) <= 80 else guide_type[:80] + "..."
        return f"guided_decoding_guide_type value of '{shown}' is not supported; allowed: {', '.join(GUIDE_TYPES)}"
    if guide_type != "json" and not guide:
        return (f"guided_decoding_guide is empty; guide type '{guide_type}' needs one "
                f"({GUIDE_CONTENTS[guide_type]})")
    return None


@dataclass
class GuidedDecodingParams:
    """A request's output grammar: ``guide_type`` one of GUIDE_TYPES; ``guide`` its text (the schema,
    pattern, grammar or structural-tag JSON; ``json`` takes none)."""

    guide_type: str
    guide: str | None = None


@dataclass
class LoraRequest:
    """The LoRA adapter a request runs with (engine/lora/), keyed by ``task_id``.

    Three ways to name it: TensorRT-LLM's rows (``weights`` (rows, in*r + r*out) and ``config``
    (rows, 3) ``[module_id, layer_idx, adapter_size]``, sent with the task's first request; later
    ones send the id alone), a PEFT directory (``path``: adapter_config.json and the weights,
    read on first use; TensorRT-LLM's LLM-API ``lora_id``/``lora_name``/``lora_path``), or the
    id alone of an adapter already cached. ``name`` labels it in metrics.
    """

    task_id: int
    weights: Any = None  # numpy/torch (rows, row_len) or (1, rows, row_len)
    config: Any = None  # numpy/torch int (rows, 3) or (1, rows, 3)
    path: str | None = None
    name: str | None = None


@dataclass
class ExternalDraftTokens:
    """Draft tokens sent with a request (TensorRT-LLM's ExternalDraftTokensConfig), verified at the
    request's first generation step (engine/executor/speculative/).

    ``logits`` (len(token_ids), vocab) float: the draft model's logits at each draft position;
    given, sampled requests use rejection sampling against them. ``acceptance_threshold``: without
    logits, a sampled request accepts a draft whose target probability is at least this; None
    treats each draft as certain (a point mass), which keeps the target's distribution exactly.
    Greedy requests accept a draft iff it is the target's argmax, whatever these two hold.
    """

    token_ids: list[int]
    logits: Any = None  # torch.Tensor (len(token_ids), vocab) float, or None
    acceptance_threshold: float | None = None


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
    guided_decoding: GuidedDecodingParams | None = None  # constrains every returned sequence
    lora: LoraRequest | None = None  # the adapter every returned sequence runs with
    external_draft: ExternalDraftTokens | None = None  # drafts verified at the first generation step
    # decoding_mode lookahead: this request's (window, ngram, verification set) sizes, each within the
    # executor's (speculative/lookahead.py LookaheadSizes); None: the executor's.
    lookahead_config: Any = None
    # Prompt ids >= vocab_size take rows of this table (image features; engine/executor/prompt_table.py).
    prompt_table: PromptTable | None = None
    # M-RoPE (Qwen2-VL): rotary rows of the prompt tokens and the delta after them (engine/executor/mrope_rotary.py).
    mrope: Mrope | None = None
    # Encoder-decoder engines (engine/encoder_decoder/): the encoder's input tokens; input_token_ids is
    # then the decoder prompt (empty: [decoder_start_token_id]).
    encoder_input_ids: list[int] | None = None
    # Whisper engines: the encoder's log-mel features, (frames, num_mel_bins) float (torch or numpy).
    # Llama 3.2 Vision engines: the images' vision states, (images x tiles x patches, hidden) float.
    encoder_input_features: Any = None
    # Llama 3.2 Vision engines: which vision states each token attends to, (rows, vision states) bool,
    # one row per prompt position (and output positions; tokens past the last row use it), as the
    # anchor's cross_attention_mask (engine/encoder_decoder/mllama_cross.py).
    cross_attention_mask: Any = None
    # Whisper engines: the timestamp-token rules (engine/encoder_decoder/whisper_timestamps.py
    # TimestampRules) when the decoder prompt asks for timestamps; set at arrival, not by callers.
    whisper_timestamps: Any = None
    # Whisper engines: (ids never produced, ids not produced first) of the generation config's
    # suppress_tokens / begin_suppress_tokens (transformers applies both by default); set at arrival.
    whisper_suppress: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # Disaggregated serving (engine/executor/disaggregated.py): context_and_generation | context_only |
    # generation_only; a generation_only request carries its context_only request's output blob.
    request_type: str = "context_and_generation"
    context_phase_params: bytes | None = None
    # A context_only request's transport (disaggregated.TRANSPORTS); None: the executor's default
    # (TRITONLLM_KV_TRANSFER). "shm" when the generation_only request runs in another process.
    kv_transfer: str | None = None


@dataclass
class RequestPerfMetrics:
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    # Speculative decoding (the reference's names): drafts verified, and how many were accepted.
    acceptance_rate: float = 0.0  # total_accepted_draft_tokens / total_draft_tokens
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


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
    # num_top_log_probs k > 0: per beam, per token of output_token_ids' generated part, k entries
    top_log_prob_ids: list[list[list[int]]] | None = None
    top_log_probs: list[list[list[float]]] | None = None
    # Host tensors; numpy arrays once through an engine process's wire (engine_process.py).
    context_logits: torch.Tensor | None = None  # (prompt_len, vocab) float32
    generation_logits: torch.Tensor | None = None  # (beams, new_tokens, vocab) float32
    sequence_index: int = 0
    perf: RequestPerfMetrics | None = None
    context_phase_params: bytes | None = None  # a context_only request's final result: for its generation_only one
    # OutputConfig.return_token_timestamps (final results): per beam, seconds of each token of output_token_ids
    token_timestamps: list[list[float]] | None = None


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
        self.num_registered_blocks = 0  # block_ids[:n] are findable by hash (or reuse is off)
        self.num_window_freed_blocks = 0  # block_ids[:n] are FREED_BLOCK (left the attention window)
        # With a prompt table: the prompt as the prefix cache keys it (fake ids -> table content;
        # engine/executor/prompt_table.py); None: token_ids themselves. May be set to a Future of them.
        self._prompt_cache_keys: list | Future | None = None
        self.prompt_keys_error: str | None = None  # hashing the table failed (PromptKeysError): the request's error
        self.status = SequenceStatus.WAITING
        self.finish_reason = FinishReason.NOT_FINISHED
        self.arrival_order = 0  # set by the scheduler; preemption picks the largest (newest)
        # output bookkeeping
        self.num_emitted = 0  # generated tokens already sent in a response
        # Overlapped scheduling: the last n token_ids are placeholders for tokens still on the
        # device (engine/executor/overlap.py); they are never emitted.
        self.num_unresolved_tokens = 0
        self.log_probs: list[float] = []
        self.cum_log_prob = 0.0
        self.top_log_prob_ids: list[list[int]] = []  # per generated token: k ids (num_top_log_probs k > 0)
        self.top_log_probs: list[list[float]] = []  # per generated token: their k log-probs, descending
        self.generation_logits: list[torch.Tensor] = []
        self.seed = 0  # sampling stream of this sequence (request seed + sequence_index, or random)
        self.pending_logprobs = None  # beam search: (vocab,) log-probs waiting for sibling beams
        self.grammar = None  # guided decoding: this sequence's xgrammar GrammarMatcher (engine/executor/guided.py)
        # Speculative decoding: tokens proposed to follow token_ids, verified by the next step that
        # samples this sequence (never part of token_ids until accepted; engine/executor/speculative/).
        self.draft_token_ids: list[int] = []
        self.draft_logits = None  # (len(draft_token_ids), vocab) the draft's logits, when they came with the drafts
        self.draft_probs = None  # (len(draft_token_ids), vocab) on the CPU: the law a draft model drew them from
        self.draft_acceptance_threshold: float | None = None  # sampled drafts without logits (acceptance.py)
        self.draft_parents: list[int] | None = None  # drafts as a token tree (engine/executor/tree_batch.py); None: a chain

    @property
    def prompt_cache_keys(self) -> list | None:
        """The keys; a Future set at admission (request.py normalize_all digests tables off the enqueuing call)
        is waited for here, on first read: the prefix cache's, when the scheduler first gives the sequence blocks."""
        keys = self._prompt_cache_keys
        if isinstance(keys, Future):
            keys = self._prompt_cache_keys = keys.result()
        if isinstance(keys, PromptKeysError):  # the executor fails the request at its next step (prompt_keys_error);
            # until then it is keyed by objects of its own, so it shares no block with any other prompt
            self.prompt_keys_error = keys.message
            keys = self._prompt_cache_keys = [object() for _ in range(self.num_prompt_tokens)]
        return keys

    @prompt_cache_keys.setter
    def prompt_cache_keys(self, keys: list | Future | None) -> None:
        self._prompt_cache_keys = keys

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
    def num_known_generated_tokens(self) -> int:
        """Generated tokens whose values the host has (placeholders of in-flight steps excluded)."""
        return len(self.token_ids) - self.num_unresolved_tokens - self.num_prompt_tokens

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
        self.is_queued = False  # admitted to the scheduler, never scheduled yet (counts toward max_queue_size)
        self.context_logits: torch.Tensor | None = None
        self.context_logits_parts: list[torch.Tensor] = []
        self.finished_streams: set[int] = set()  # sequence_index values whose final response went out
        self.grammar_future = None  # guided decoding: Future of the CompiledGrammar (engine/executor/guided.py)
        self.adapter_future = None  # LoRA: Future of the adapter's parse, until the cache has it (engine/lora/cache.py)
        self.lora_key = None  # LoRA: the adapter's cache key while this request counts as its user
        self.lora_slot = -1  # LoRA: the device slot this request holds, -1 while it holds none
        self.context_phase_params: bytes | None = None  # context_only: set when its first token is known
        self.prompt_cache_keys: tuple | None = None  # (ids, table, keys) made at enqueue: normalize_all

    @property
    def is_beam_search(self) -> bool:
        return self.request.sampling.beam_width > 1

    @property
    def num_streams(self) -> int:
        return 1 if self.is_beam_search else (self.request.sampling.num_return_sequences or 1)


@dataclass
class RequestLimits:
    """What a request is checked against: the engine's build limits and the executor's pool."""

    vocab_size: int
    max_seq_len: int
    max_beam_width: int
    max_num_tokens: int
    enable_chunked_context: bool
    num_kv_blocks: int
    tokens_per_block: int
    max_batch_size: int = 1 << 30
    max_draft_len: int = 8  # the most external draft tokens a request may carry
    hidden_size: int = 0  # the width a prompt_embedding_table's rows must have (ModelConfig.prompt_table_width)
    supports_prompt_tables: bool = True  # the model's forward splices table rows (engine/executor/prompt_table.py)
    prompt_tables_refusal: str = ""  # why not, where it is not the model's architecture (prompt_table_error's words)
    mrope_width: int = 0  # the rotary rows' width an Mrope must have; 0: the model takes none (mrope_rotary.py)


def _token_ids_in_vocab(name: str, token_ids, vocab_size: int) -> str | None:
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        return f"{name} contains token id {bad[0]!r} outside the vocabulary; allowed ids are 0..{vocab_size - 1}"
    return None


_FLOAT_SAMPLING = ("top_p", "temperature", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "length_penalty")


def _sampling_error(s: SamplingConfig, limits: RequestLimits) -> str | None:
    for name in _FLOAT_SAMPLING:
        value = getattr(s, name)
        if value is not None and not math.isfinite(value):
            return f"{name} must be a finite number, got {value}"
    checks = [
        (s.beam_width is not None and not 1 <= s.beam_width <= limits.max_beam_width,
         f"beam_width {s.beam_width} is not allowed; allowed: 1..{limits.max_beam_width} (max_beam_width of the executor)"),
        ((s.beam_width or 1) > limits.max_batch_size,
         f"beam_width {s.beam_width} exceeds max_batch_size ({limits.max_batch_size}): all beams run together"),
        (s.top_p is not None and not 0 < s.top_p <= 1, f"top_p must be in (0, 1], got {s.top_p}"),
        (s.top_k is not None and s.top_k < 0, f"top_k must be >= 0, got {s.top_k}"),
        (s.temperature is not None and s.temperature < 0, f"temperature must be >= 0, got {s.temperature}"),
        (s.min_tokens is not None and s.min_tokens < 0, f"min_tokens must be >= 0, got {s.min_tokens}"),
        (s.repetition_penalty is not None and s.repetition_penalty <= 0,
         f"repetition_penalty must be > 0, got {s.repetition_penalty}"),
        (s.num_return_sequences is not None and s.num_return_sequences < 1,
         f"num_return_sequences must be >= 1, got {s.num_return_sequences}"),
        ((s.beam_width or 1) > 1 and (s.num_return_sequences or 1) > s.beam_width,
         f"num_return_sequences ({s.num_return_sequences}) must be <= beam_width ({s.beam_width}) with beam search"),
    ]
    return next((message for failed, message in checks if failed), None)


def _output_error(output: OutputConfig, beam_width: int) -> str | None:
    k = output.num_top_log_probs
    error = num_top_log_probs_error(k)
    if error:
        return error
    if k and beam_width > 1:
        return (f"num_top_log_probs ({k}) is not supported with beam search (beam_width {beam_width}); "
                "send num_top_log_probs 0 or beam_width 1")
    return None


def _guide_error(guide: GuidedDecodingParams, beam_width: int) -> str | None:
    if not isinstance(guide, GuidedDecodingParams):
        return f"guided_decoding must be a GuidedDecodingParams, got {type(guide).__name__}"
    error = guide_error(guide.guide_type, guide.guide)
    if error is None and beam_width > 1:
        error = (f"guided decoding is not supported with beam search (beam_width {beam_width}); "
                 "send beam_width 1 or leave guided_decoding_guide_type out")
    return error


def _lora_error(lora: LoraRequest) -> str | None:
    """The request-level checks of a LoRA request; the adapter's own are engine/lora/'s."""
    if not isinstance(lora, LoraRequest):
        return f"lora must be a LoraRequest, got {type(lora).__name__}"
    if isinstance(lora.task_id, bool) or not isinstance(lora.task_id, int) or lora.task_id < 0:
        return f"lora_task_id must be a non-negative integer, got {lora.task_id!r}"
    if (lora.weights is None) != (lora.config is None):
        given, missing = ("lora_weights", "lora_config") if lora.config is None else ("lora_config", "lora_weights")
        return f"{given} was sent without {missing}; a LoRA task's first request sends lora_task_id, lora_weights and lora_config together"
    if lora.weights is not None and lora.path:
        return "lora_weights and lora_path were both sent; name the adapter one way (TensorRT-LLM rows or a PEFT directory)"
    return None


def external_draft_error(request: Request, limits: RequestLimits) -> str | None:
    """Why a request's external drafts cannot be verified (naming the Triton input), or None."""
    draft = request.external_draft
    if not isinstance(draft, ExternalDraftTokens):
        return f"external_draft must be an ExternalDraftTokens, got {type(draft).__name__}"
    ids = draft.token_ids
    if len(ids) > limits.max_draft_len:
        return (f"draft_input_ids has {len(ids)} tokens; allowed: at most {limits.max_draft_len} "
                "(max_draft_len of the executor)")
    error = _token_ids_in_vocab("draft_input_ids", ids, limits.vocab_size)
    if error:
        return error
    if draft.logits is not None:
        import torch

        shape = tuple(torch.as_tensor(draft.logits).shape)
        if shape != (len(ids), limits.vocab_size):
            return (f"draft_logits has shape {shape}; it must be (number of draft_input_ids, vocab_size) = "
                    f"({len(ids)}, {limits.vocab_size})")
    threshold = draft.acceptance_threshold
    if threshold is not None and not (math.isfinite(threshold) and 0 <= threshold <= 1):
        return f"draft_acceptance_threshold must be in [0, 1], got {threshold}"
    refusals = [
        ((request.sampling.beam_width or 1) > 1, f"beam search (beam_width {request.sampling.beam_width})"),
        (request.guided_decoding is not None, "guided decoding"),
        (request.output.return_context_logits, "return_context_logits"),
        (bool(request.output.num_top_log_probs), "num_top_log_probs"),
    ]
    for refused, what in refusals:
        if refused and ids:
            return (f"draft_input_ids are not supported with {what}; send the request without "
                    f"draft_input_ids/draft_logits, or without {what}")
    return None


def validate_request(request: Request, limits: RequestLimits) -> str | None:
    """The reason ``request`` cannot run (naming field, value and what is allowed), or None."""
    prompt = list(request.input_token_ids) if request.input_token_ids is not None else []
    if not prompt:
        return "input_token_ids is empty; a request needs at least one prompt token"
    if not isinstance(request.max_tokens, int) or request.max_tokens <= 0:
        return f"max_tokens must be a positive integer, got {request.max_tokens!r}"
    total = len(prompt) + request.max_tokens
    if total > limits.max_seq_len:
        return (f"prompt length ({len(prompt)}) + max_tokens ({request.max_tokens}) = {total} exceeds "
                f"max_seq_len ({limits.max_seq_len}) of the engine")
    if not limits.enable_chunked_context and len(prompt) > limits.max_num_tokens:
        return (f"prompt length ({len(prompt)}) exceeds max_num_tokens ({limits.max_num_tokens}); "
                "enable_chunked_context or send a shorter prompt")
    beams = (request.sampling.beam_width or 1) if request.sampling is not None else 1
    blocks = -(-total // limits.tokens_per_block) * beams  # beams must fit side by side
    if blocks > limits.num_kv_blocks:
        return (f"prompt + max_tokens ({total} tokens){f' x beam_width {beams}' if beams > 1 else ''} needs {blocks} "
                f"KV cache blocks but the cache holds only {limits.num_kv_blocks}; allowed: at most "
                f"{limits.num_kv_blocks * limits.tokens_per_block // beams} tokens per sequence")
    for name, token in (("end_id", request.end_id), ("pad_id", request.pad_id)):
        if token is not None and token != -1 and not 0 <= token < limits.vocab_size:
            return f"{name} must be -1 (none) or a token id 0..{limits.vocab_size - 1}, got {token}"
    error = prompt_table_error(prompt, request.prompt_table, limits.vocab_size, limits.hidden_size,
                               limits.supports_prompt_tables, limits.prompt_tables_refusal)
    error = error or mrope_error(len(prompt), request.max_tokens, request.mrope, limits.mrope_width,
                                 limits.max_seq_len)
    ordinary = prompt if request.prompt_table is None else [t for t in prompt if t < limits.vocab_size]
    error = error or _token_ids_in_vocab("input_token_ids", ordinary, limits.vocab_size)
    for name, words in (("stop_words", request.stop_words), ("bad_words", request.bad_words)):
        for word in words or ():
            error = error or _token_ids_in_vocab(name, word, limits.vocab_size)
    error = error or _sampling_error(request.sampling or SamplingConfig(), limits)
    error = error or _output_error(request.output or OutputConfig(), beams)
    if error is None and request.guided_decoding is not None:
        error = _guide_error(request.guided_decoding, beams)
    if error is None and request.lora is not None:
        error = _lora_error(request.lora)
    if error is None and request.external_draft is not None:
        error = external_draft_error(request, limits)
    if error is None and request.embedding_bias is not None:
        import torch

        size = torch.as_tensor(request.embedding_bias).numel()
        if size != limits.vocab_size:
            error = f"embedding_bias has {size} values; it must have vocab_size ({limits.vocab_size})"
    return error


def _int_list(name: str, values) -> list[int]:
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must hold integer token ids, got {list(values)[:8]!r}") from None


def _normalized_output(output: OutputConfig) -> OutputConfig:
    """A copy; num_top_log_probs as an int (numpy welcome; validate_request checks the range),
    and top log-probs come with the chosen tokens' log-probs."""
    k = output.num_top_log_probs
    try:
        k = 0 if k is None else k if isinstance(k, bool) else operator.index(k)
    except TypeError:
        raise TypeError(f"num_top_log_probs must be an integer in 0..{MAX_TOP_LOG_PROBS}, got {k!r}") from None
    return replace(output, num_top_log_probs=k, return_log_probs=bool(output.return_log_probs or k))


DIGEST_THREADS = min(8, os.cpu_count() or 1)
_digest_pool: ThreadPoolExecutor | None = None


def _forget_digest_pool() -> None:  # a forked child has none of the parent's threads: it makes its own pool
    global _digest_pool
    _digest_pool = None


os.register_at_fork(after_in_child=_forget_digest_pool)


def normalize_all(requests: list[Request], vocab_size: int) -> list[tuple[Request, tuple | None, Exception | None]]:
    """Per request, in order: (normalize_request's copy, (ids, table, keys) when it has a prompt table, None)
    or (request, None, the error normalizing raised); the executor's _admit uses the keys while the request
    still holds that ids list and table. A table's keys come back as a Future: its digests (SHA-256 over the
    rows, ~2.7 ms a 448 x 448 image; hashlib releases the GIL) run on up to DIGEST_THREADS threads, in
    submission order, and the caller does not wait for them. The executor admits
    the request at once and the prefix cache waits only where it first reads that sequence's keys
    (Sequence.prompt_cache_keys, when the scheduler first gives it blocks): 128 tables enqueued together no
    longer hold the first step back by all 128 digests (the H200's "tables ready" run: ~0.35 s before any step)."""
    global _digest_pool
    prepared = []
    for request in requests:
        try:
            request = normalize_request(request)
        except (TypeError, ValueError, AttributeError) as err:
            prepared.append((request, None, err))
            continue
        if request.prompt_table is None:
            prepared.append((request, None, None))
            continue
        if _digest_pool is None:
            _digest_pool = ThreadPoolExecutor(max(1, DIGEST_THREADS), thread_name_prefix="prompt-table-digest")
        keys = _digest_pool.submit(_keys_or_none, request.input_token_ids, request.prompt_table, vocab_size)
        prepared.append((request, (request.input_token_ids, request.prompt_table, keys), None))
    return prepared


@dataclass(frozen=True)
class PromptKeysError:
    """_keys_or_none's result when hashing a table failed for another reason than a table that does not fit
    (e.g. MemoryError): ``message`` is the error its request ends with; the other requests go on."""

    message: str


def _keys_or_none(prompt: list[int], table: PromptTable, vocab_size: int) -> list | PromptKeysError | None:
    try:
        return prompt_cache_keys(prompt, table, vocab_size)
    except (IndexError, RuntimeError, TypeError, ValueError):  # a table that does not fit: validation names it
        return None
    except Exception as err:  # (read in the executor's loop: raised there, it would fail every request)
        return PromptKeysError(f"prompt_embedding_table: hashing its rows for the prefix cache failed "
                               f"({type(err).__name__}: {err})")


def prompt_keys_settled(state: "RequestState") -> bool:
    """Whether ``prompt_keys_error(state)`` is None for good: the table's keys made at enqueue are known and are
    not a PromptKeysError. Its sequences' keys are that same result (or made at admission, never an error), so
    none of them can set ``Sequence.prompt_keys_error`` later; the executor stops checking the request."""
    return not isinstance(_enqueued_keys(state), (Future, PromptKeysError))


def _enqueued_keys(state: "RequestState"):
    """The table keys normalize_all made for ``state`` at enqueue: the keys, a PromptKeysError, None (none made),
    or the Future while it is still running (a finished one is read)."""
    made = state.prompt_cache_keys
    keys = made[2] if made is not None else None
    return keys.result() if isinstance(keys, Future) and keys.done() else keys


def prompt_keys_error(state: "RequestState") -> str | None:
    """The error ``state``'s request must end with when hashing its table failed (PromptKeysError), once known;
    None while its keys are pending or when they were made."""
    keys = _enqueued_keys(state)
    if isinstance(keys, PromptKeysError):
        return keys.message
    return next((seq.prompt_keys_error for seq in state.sequences if seq.prompt_keys_error is not None), None)


def normalize_request(request: Request) -> Request:
    """A copy with plain-int token lists and default configs filled in (numpy ids welcome)."""
    sampling = replace(request.sampling or SamplingConfig())
    sampling.beam_width = sampling.beam_width or 1  # Triton sends 0 or nothing for "no beams"
    sampling.num_return_sequences = sampling.num_return_sequences or 1
    end_id = None if request.end_id is None or request.end_id == -1 else operator.index(request.end_id)
    words = lambda name, ws: None if ws is None else [_int_list(name, w) for w in ws]  # noqa: E731
    return replace(
        request,
        input_token_ids=_int_list("input_token_ids", request.input_token_ids if request.input_token_ids is not None else []),
        max_tokens=operator.index(request.max_tokens),
        end_id=end_id,
        sampling=sampling,
        output=_normalized_output(request.output or OutputConfig()),
        stop_words=words("stop_words", request.stop_words),
        bad_words=words("bad_words", request.bad_words),
        external_draft=None if request.external_draft is None else replace(
            request.external_draft, token_ids=_int_list("draft_input_ids", request.external_draft.token_ids)),
        prompt_table=None if request.prompt_table is None else normalize_prompt_table(request.prompt_table),
        mrope=None if request.mrope is None else normalize_mrope(request.mrope),
        encoder_input_ids=None if request.encoder_input_ids is None
        else _int_list("encoder_input_ids", request.encoder_input_ids),
        lora=None if request.lora is None else replace(
            request.lora, task_id=request.lora.task_id if isinstance(request.lora.task_id, bool)
            else operator.index(request.lora.task_id)),
    )
