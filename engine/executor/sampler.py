"""Stateless sampler: (logits, SamplingMetadata) -> next token ids (+ their log-probs).

Per-request settings become per-batch tensors once per step (``build_sampling_metadata``);
``sample`` then runs a fixed pipeline on the (batch, vocab) float32 logits:

    embedding bias -> penalties -> banned tokens (bad words, end_id before min_tokens)
      -> log-probs -> greedy argmax | (temperature -> top-k -> top-p -> Gumbel-max draw)

Definitions (what the tests pin):
- repetition_penalty r over tokens seen in prompt or output: logit > 0 -> logit / r, else logit * r.
- presence_penalty p over tokens seen in the output: logit -= p.
- frequency_penalty f over tokens seen in the output: logit -= f * count.
- log-probs are ``log_softmax`` of the processed logits (after bias, penalties, bans and, for
  sampled rows, temperature), before top-k/top-p truncation (``normalize_log_probs=False``:
  the processed logit itself).
- top log-probs (``OutputConfig.num_top_log_probs`` k) are the k largest entries of that same
  score row, so the chosen token's log-prob is always comparable with them (a greedy token is
  the top-1 and its log-prob equals the top-1's). Why not the raw model distribution, as vLLM
  reports by default: ``output_log_probs`` and ``cum_log_probs`` (tensorrtllm_backend's
  outputs, and beam scores) already are these processed log-probs, and a chosen log-prob from
  one distribution listed among alternatives from another would contradict itself. Without
  penalties, bias or bans, greedy rows and rows at temperature 1 get the model's own
  distribution; at another temperature t, ``log_softmax(logits / t)``.
- Sampling is one Gumbel-max launch for the whole batch (``kernels.sampling.sample_tokens``): an
  exact categorical draw with no host sync, whose noise depends only on the sequence's seed and
  its step (number of tokens generated so far), so a seeded request reproduces its tokens
  whatever else shares the batch, and two seeds give two streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.encoder_decoder.whisper_timestamps import TimestampBatch, apply_timestamp_rules, timestamp_batch
from engine.executor.request import Sequence
from kernels.grammar_mask import apply_token_bitmask_
from kernels.sampling import greedy_tokens, sample_tokens


@dataclass
class SamplingMetadata:
    """Per-batch sampling tensors; a field is None when no row in the batch needs it."""

    all_greedy: bool
    is_greedy: torch.Tensor | None  # (B,) bool; None when all_greedy
    temperature: torch.Tensor | None  # (B,) float32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # (B,) int64, vocab_size where unset
    top_p: torch.Tensor | None  # (B,) float32, 1.0 where unset
    draw_temperature: torch.Tensor | None  # (B,) float32: 1.0 on sampled rows, 0.0 (argmax) on greedy rows
    needs_top_k_top_p: bool  # some sampled row has a top-k or top-p limit (else skip the sort)
    seeds: torch.Tensor | None  # (B,) int64: the sequence's seed
    offsets: torch.Tensor | None  # (B,) int64: the sequence's step (tokens generated so far)
    repetition_penalty: torch.Tensor | None  # (B,) float32, 1.0 where unset
    presence_penalty: torch.Tensor | None  # (B,) float32, 0.0 where unset
    frequency_penalty: torch.Tensor | None  # (B,) float32, 0.0 where unset
    prompt_token_ids: torch.Tensor | None  # (B, max_prompt) int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # (B, max_output) int64, padded with vocab_size
    banned: torch.Tensor | None  # (2, n) int64 (row, token) pairs forced to -inf
    embedding_bias: torch.Tensor | None  # (B, vocab) float32, zeros where unset
    return_log_probs: bool
    normalize_log_probs: bool = True  # False: report the processed logit of the chosen token instead
    # Top log-probs: rows that ask (ascending) and the largest k among them; () and 0 when none asks.
    top_log_prob_rows: tuple[int, ...] = ()
    max_top_log_probs: int = 0
    # Guided decoding (engine/executor/guided.py): (k, ceil(vocab / 32)) int32 allowed-token bits of
    # the k constrained rows, and (B,) int64 the bitmask row of each logits row (-1: unconstrained).
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None
    # Whisper rows decoding with timestamp tokens (engine/encoder_decoder/whisper_timestamps.py)
    timestamps: TimestampBatch | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    log_probs: torch.Tensor | None  # (B,) float32: log-prob of each chosen token
    # (R, K) for the R rows of md.top_log_prob_rows, K = md.max_top_log_probs; descending per row
    top_log_prob_ids: torch.Tensor | None = None  # int64
    top_log_probs: torch.Tensor | None = None  # float32


def _on_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a device tensor without stalling the host: ``torch.tensor(..., device=cuda)``
    copies from pageable memory and waits for the stream, i.e. for the step already in flight,
    which undid overlapped scheduling for every step with a sampled, min_tokens or penalized row
    (+0.7 ms per step at batch 1 on the 8B shape, H100). Pinned memory and a non-blocking copy
    queue behind that step instead; the caching host allocator keeps the buffer until the copy ran."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return _on_device([r + [pad] * (width - len(r)) for r in rows], torch.int64, device)


def banned_tokens(seq: Sequence) -> list[int]:
    """Tokens seq may not produce next: end_id before min_tokens, each bad word's last token when
    the sequence already ends with the rest of that word, and a Whisper request's suppressed tokens
    (engine/encoder_decoder/encoder_stage.py; its begin-suppressed ones at the first step)."""
    request = seq.state.request
    banned = []
    min_tokens = request.sampling.min_tokens or 0
    # (a guided sequence's mask holds the end back instead: guided.TokenMasks, the grammar first)
    if request.end_id is not None and seq.num_generated_tokens < min_tokens and seq.grammar is None:
        banned.append(request.end_id)
    for word in request.bad_words or ():
        prefix = word[:-1]
        if not prefix or seq.token_ids[len(seq.token_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    if request.whisper_suppress is not None:  # (a placeholder counts as generated: overlap-safe)
        suppress, first = request.whisper_suppress
        banned += suppress if seq.num_generated_tokens else (*suppress, *first)
    return banned


def _may_ban(request) -> bool:
    """Cheap pre-check of banned_tokens (which runs once per sequence per step otherwise)."""
    return (bool(request.bad_words) or (request.end_id is not None and bool(request.sampling.min_tokens))
            or request.whisper_suppress is not None)


def draw_settings(config, vocab_size: int) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) a sampled row is drawn with: an unset temperature is 1, an unset
    top-k the whole vocabulary, an unset top-p 1 (what the request's SamplingConfig leaves open)."""
    return config.temperature or 1.0, config.top_k or vocab_size, 1.0 if config.top_p is None else config.top_p


def sampling_law(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                 top_p: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, vocab) -> each row's law: softmax(logits / temperature) over its top-k and its top-p
    nucleus (limits skipped when None). What a draft is drawn from and judged by (speculative/)."""
    scores = logits / temperature.unsqueeze(1)
    if top_k is not None:
        scores = apply_top_k_top_p(scores, top_k, top_p)
    return scores.softmax(dim=-1)


def draws_alone(seq: Sequence) -> bool:
    """Whether ``sample`` does nothing for this sequence's row but draw its token from the raw logits
    (greedy, or temperature / top-k / top-p with its seed): no beams, log-probs or top log-probs, no
    returned logits, no penalties, bans, embedding bias, Whisper timestamps or grammar. A step whose
    rows all do can be sampled wherever its logits are (engine/pipeline/runner.py: on the last stage,
    which sends rank 0 the ids instead of the logits; engine/executor/packed_draws.py)."""
    request = seq.state.request
    config, output = request.sampling, request.output
    return (config.beam_width <= 1 and seq.grammar is None
            and not (output.return_log_probs or output.num_top_log_probs or output.return_context_logits
                     or output.return_generation_logits)
            and (config.repetition_penalty is None or config.repetition_penalty == 1.0)
            and not config.presence_penalty and not config.frequency_penalty
            and not _may_ban(request) and request.embedding_bias is None and request.whisper_timestamps is None)


def greedy_alone(request) -> bool:
    """Whether ``build_sampling_metadata`` gives this request's rows nothing of their own: greedy (no beams), no
    penalties, bans, embedding bias or Whisper timestamps, no log-probs or top log-probs. Rows that all are get
    ``greedy_metadata()``, whatever the rows: the executor keeps the ids of its active requests that are not
    (Executor._sampler_request_ids), and while there are none it samples a step with no pass over its rows."""
    config, output = request.sampling, request.output
    return (config.is_greedy and config.beam_width <= 1
            and (config.repetition_penalty is None or config.repetition_penalty == 1.0)
            and not config.presence_penalty and not config.frequency_penalty
            and not _may_ban(request) and request.embedding_bias is None and request.whisper_timestamps is None
            and not output.return_log_probs and not output.num_top_log_probs)


def greedy_metadata() -> SamplingMetadata:
    """``build_sampling_metadata`` of rows that are all ``greedy_alone``: the argmax of the raw logits, no per-row
    tensor (a new object each call: the executor sets a step's grammar masks on it)."""
    return SamplingMetadata(
        all_greedy=True, is_greedy=None, temperature=None, top_k=None, top_p=None, draw_temperature=None,
        needs_top_k_top_p=False, seeds=None, offsets=None, repetition_penalty=None, presence_penalty=None,
        frequency_penalty=None, prompt_token_ids=None, output_token_ids=None, banned=None, embedding_bias=None,
        return_log_probs=False)


def build_sampling_metadata(seqs: list[Sequence], vocab_size: int, device, return_log_probs: bool) -> SamplingMetadata:
    """Gather per-sequence settings into batch tensors (one sequence per logits row). Runs once per
    step over the whole batch: each per-row pass costs ~0.1 ms at 256 rows on the host."""
    requests = [s.state.request for s in seqs]
    configs = [r.sampling for r in requests]
    greedy = [c.is_greedy or c.beam_width > 1 for c in configs]  # (a beam's rows: state.is_beam_search)
    temperature = top_k = top_p = draw_temperature = seeds = offsets = None
    settings = []
    if not all(greedy):
        settings = [(1.0, vocab_size, 1.0) if g else draw_settings(c, vocab_size) for c, g in zip(configs, greedy)]
        temperature = _on_device([t for t, _, _ in settings], torch.float32, device)
        top_k = _on_device([k for _, k, _ in settings], torch.int64, device)
        top_p = _on_device([p for _, _, p in settings], torch.float32, device)
        draw_temperature = _on_device([0.0 if g else 1.0 for g in greedy], torch.float32, device)
        seeds = _on_device([s.seed for s in seqs], torch.int64, device)
        offsets = _on_device([s.num_generated_tokens for s in seqs], torch.int64, device)
    has_penalty = any((c.repetition_penalty is not None and c.repetition_penalty != 1.0) or c.presence_penalty
                      or c.frequency_penalty for c in configs)
    rep = pres = freq = None
    if has_penalty:  # three more passes over the batch only when some row needs them
        rep = [c.repetition_penalty if c.repetition_penalty is not None else 1.0 for c in configs]
        pres = [c.presence_penalty or 0.0 for c in configs]
        freq = [c.frequency_penalty or 0.0 for c in configs]
    # Bans, top log-probs, Whisper timestamps and embedding biases are rare: one pass tells whether
    # any row has one before each gets its own.
    rare = any(_may_ban(r) or r.output.num_top_log_probs or r.whisper_timestamps is not None
               or r.embedding_bias is not None for r in requests)
    banned = [(row, tok) for row, s in enumerate(seqs) if _may_ban(s.state.request)
              for tok in banned_tokens(s) if 0 <= tok < vocab_size] if rare else None
    top_counts = [r.output.num_top_log_probs for r in requests] if rare else ()
    top_rows = tuple(row for row, k in enumerate(top_counts) if k)
    return SamplingMetadata(
        all_greedy=all(greedy),
        is_greedy=None if all(greedy) else _on_device(greedy, torch.bool, device),
        temperature=temperature, top_k=top_k, top_p=top_p,
        draw_temperature=draw_temperature,
        needs_top_k_top_p=any(k < vocab_size or p < 1.0 for _, k, p in settings),
        seeds=seeds, offsets=offsets,
        repetition_penalty=_on_device(rep, torch.float32, device) if has_penalty else None,
        presence_penalty=_on_device(pres, torch.float32, device) if has_penalty else None,
        frequency_penalty=_on_device(freq, torch.float32, device) if has_penalty else None,
        # (clamped: a prompt-table position's fake id >= vocab_size counts as padding, no token)
        prompt_token_ids=_padded([s.token_ids[:s.num_prompt_tokens] for s in seqs], vocab_size, device)
        .clamp_(max=vocab_size) if has_penalty else None,
        output_token_ids=_padded([s.generated_token_ids for s in seqs], vocab_size, device) if has_penalty else None,
        banned=_on_device(banned, torch.int64, device).T if banned else None,
        embedding_bias=_embedding_bias(seqs, vocab_size, device) if rare else None,
        return_log_probs=return_log_probs or bool(top_rows),
        top_log_prob_rows=top_rows,
        max_top_log_probs=min(max(top_counts, default=0), vocab_size),
        timestamps=_timestamps(seqs, vocab_size, device) if rare else None,
    )


def _timestamps(seqs: list[Sequence], vocab_size: int, device) -> TimestampBatch | None:
    rows = [(row, s.state.request.whisper_timestamps, s.generated_token_ids) for row, s in enumerate(seqs)
            if s.state.request.whisper_timestamps is not None]
    return timestamp_batch(rows, vocab_size, device) if rows else None


def _embedding_bias(seqs: list[Sequence], vocab_size: int, device) -> torch.Tensor | None:
    biases = [s.state.request.embedding_bias for s in seqs]
    if all(b is None for b in biases):
        return None
    rows = [torch.zeros(vocab_size) if b is None else torch.as_tensor(b, dtype=torch.float32).reshape(vocab_size)
            for b in biases]
    return torch.stack(rows).to(device)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, L) ids padded with vocab_size -> (B, vocab) occurrence counts (padding dropped)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = token_counts(md.output_token_ids, vocab_size)
    seen = (token_counts(md.prompt_token_ids, vocab_size) + output_counts) > 0
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.presence_penalty.unsqueeze(1) * (output_counts > 0)
    return logits - md.frequency_penalty.unsqueeze(1) * output_counts


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Bias, penalties, bans and grammar masks: the logits every decoding mode (greedy, sampled,
    beams) starts from. The input is never written (it may be a CUDA graph's output)."""
    raw, logits = logits, logits.float()
    if md.token_bitmask is not None:
        logits = apply_token_bitmask_(logits.clone() if logits is raw else logits, md.token_bitmask,
                                      md.token_bitmask_rows)
    if md.embedding_bias is not None:
        logits = logits + md.embedding_bias
    if md.repetition_penalty is not None:
        logits = apply_penalties(logits, md)
    if md.banned is not None:
        # (torch.full: made on the device; a tensor from a host value would be a blocking copy)
        logits = logits.index_put((md.banned[0], md.banned[1]), torch.full((), float("-inf"), device=logits.device))
    if md.timestamps is not None:  # last: Whisper's rule compares probabilities after every other mask
        logits = apply_timestamp_rules(logits, md.timestamps)
    return logits


# Logits per top-k / top-p pass. The sort, its int64 order and the nucleus masks take ~30 bytes a
# logit: 1,024 rows of a 128k vocabulary at once would want ~4 GB beside the KV pool; passes over
# chunks of rows keep that to ~0.5 GB (engine/executor/memory_profile.py reserves what a step needs).
TOP_K_TOP_P_CHUNK_LOGITS = 1 << 24


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside the row's top-k and outside its top-p nucleus (the top token
    always stays); in passes of at most TOP_K_TOP_P_CHUNK_LOGITS logits."""
    rows_per_pass = max(1, TOP_K_TOP_P_CHUNK_LOGITS // max(1, logits.shape[1]))
    if logits.shape[0] <= rows_per_pass:
        return _top_k_top_p_rows(logits, top_k, top_p)
    out = torch.empty_like(logits)
    for start in range(0, logits.shape[0], rows_per_pass):
        rows = slice(start, start + rows_per_pass)
        out[rows] = _top_k_top_p_rows(logits[rows], top_k[rows], top_p[rows])
    return out


def _top_k_top_p_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def worst_case_metadata(rows: int, vocab_size: int, device) -> SamplingMetadata:
    """Every row sampled (temperature 0.7) from a top-p nucleus, with normalized log-probs and the
    five top log-probs: the sampler's largest temporaries for ``rows`` logits rows (the memory
    profile's, engine/executor/memory_profile.py). Penalties, biases and grammar masks add (rows,
    vocab) passes of the same size as these."""
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=device)  # noqa: E731
    return SamplingMetadata(
        all_greedy=False, is_greedy=full(False, torch.bool), temperature=full(0.7, torch.float32),
        top_k=full(vocab_size, torch.int64), top_p=full(0.9, torch.float32),
        draw_temperature=full(1.0, torch.float32), needs_top_k_top_p=True, seeds=full(0, torch.int64),
        offsets=full(0, torch.int64), repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        prompt_token_ids=None, output_token_ids=None, banned=None, embedding_bias=None, return_log_probs=True,
        top_log_prob_rows=tuple(range(rows)), max_top_log_probs=min(5, vocab_size))


def sample(logits: torch.Tensor, md: SamplingMetadata, greedy: torch.Tensor | None = None) -> SamplerOutput:
    """Next token for every row of ``logits`` (B, vocab); see the module docstring for the pipeline.
    ``greedy``: greedy_tokens(logits) already picked (a decode graph's head graph, ModelRunner.greedy_of),
    taken where every row is greedy and nothing changed the logits."""
    raw, logits = logits, process_logits(logits, md)
    if md.all_greedy:
        token_ids = greedy if greedy is not None and logits is raw else greedy_tokens(logits)
    else:
        scaled = logits / torch.where(md.temperature > 0, md.temperature, 1.0).unsqueeze(1)
        logits = torch.where(md.is_greedy.unsqueeze(1), logits, scaled)
        candidates = apply_top_k_top_p(logits, md.top_k, md.top_p) if md.needs_top_k_top_p else logits
        token_ids = sample_tokens(candidates.contiguous(), md.draw_temperature, md.seeds, md.offsets)
    out = SamplerOutput(token_ids=token_ids, log_probs=None)
    if md.return_log_probs:
        scores = logits.log_softmax(dim=-1) if md.normalize_log_probs else logits
        out.log_probs = scores.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if md.top_log_prob_rows:
            out.top_log_probs, out.top_log_prob_ids = top_log_probs(scores, md)
    return out


def top_log_probs(scores: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, K) values and ids of the K = max_top_log_probs best scores of each asking row, descending;
    one topk launch over those rows only (all of them without a gather when every row asks)."""
    rows = md.top_log_prob_rows
    if len(rows) != scores.shape[0]:
        scores = scores[_on_device(list(rows), torch.int64, scores.device)]
    return scores.topk(md.max_top_log_probs, dim=-1, largest=True, sorted=True)
