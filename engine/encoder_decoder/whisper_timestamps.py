"""Whisper's timestamp-token rules, for a request whose decoder prompt asks for timestamps.

A Whisper prompt without <|notimestamps|> (<|startoftranscript|><|lang|><|task|>) decodes text
between timestamp tokens <|0.00|> <|0.02|> ... (the ids after <|notimestamps|>; one per 0.02 s of the
window). Whisper's decoding (openai-whisper's ApplyTimestampRules, transformers'
WhisperTimeStampLogitsProcessor, whose behaviour this copies) masks the logits before each token:

- <|notimestamps|> never;
- timestamps come in pairs: after a timestamp that follows a timestamp (or that is the first
  token), no timestamp; after one that follows text, no text token below eos (eos and the other
  special tokens stay allowed);
- timestamps never decrease: none below the last one (below it + 1 once the pair is closed);
- the first token is a timestamp, at most ``max_initial`` steps in (transformers'
  max_initial_timestamp_index; None: any);
- when the timestamps' summed probability beats the likeliest text token's, text is masked.

The first rules depend only on the tokens generated so far (host side, ``banned_ranges``); the last
on the step's logits (device side, ``apply_timestamp_rules``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TimestampRules:
    no_timestamps: int  # <|notimestamps|>; the timestamp tokens are the ids after it
    eos: int
    max_initial: int | None = None

    @property
    def begin(self) -> int:
        return self.no_timestamps + 1


def rules_for_prompt(prompt: list[int], start: int, no_timestamps: int, eos: int,
                     max_initial: int | None) -> TimestampRules | None:
    """The rules of a Whisper request: a prompt holding <|startoftranscript|> (``start``) but not
    <|notimestamps|> decodes with timestamps; None otherwise (or when the engine knows no
    <|notimestamps|> id, ``no_timestamps`` < 0). A prompt that ends on <|startoftranscript|> asks
    for the language token next (language detection, which transformers' detect_language runs
    without logits processors): no rules."""
    if no_timestamps < 0 or start not in prompt or no_timestamps in prompt or prompt[-1] == start:
        return None
    return TimestampRules(no_timestamps, eos, max_initial)


def banned_ranges(rules: TimestampRules, generated: list[int], vocab_size: int) -> list[tuple[int, int]]:
    """[lo, hi) id ranges the next token may not be, from the tokens generated so far."""
    begin = rules.begin
    ranges = [(rules.no_timestamps, rules.no_timestamps + 1)]
    last = len(generated) >= 1 and generated[-1] >= begin
    penultimate = len(generated) < 2 or generated[-2] >= begin
    if last:
        ranges.append((begin, vocab_size) if penultimate else (0, rules.eos))
    stamps = [t for t in generated if t >= begin]
    floor = begin if not stamps else stamps[-1] if last and not penultimate else stamps[-1] + 1
    ranges.append((begin, floor))
    if not generated:
        ranges.append((0, begin))
        if rules.max_initial is not None:
            ranges.append((begin + rules.max_initial + 1, vocab_size))
    return [(lo, min(hi, vocab_size)) for lo, hi in ranges if lo < min(hi, vocab_size)]


@dataclass
class TimestampBatch:
    """The rows of a step that decode with timestamps: ``rows`` (k,) int64 logits rows, ``masks``
    (k, vocab) bool (True: masked by the host-side rules), ``begins`` (k,) int64 first timestamp id."""

    rows: torch.Tensor
    masks: torch.Tensor
    begins: torch.Tensor


def timestamp_batch(rows: list[tuple[int, TimestampRules, list[int]]], vocab_size: int, device) -> TimestampBatch:
    """(logits row, rules, generated ids) of each timestamped row -> the step's TimestampBatch."""
    masks = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, (_, rules, generated) in enumerate(rows):
        for lo, hi in banned_ranges(rules, generated, vocab_size):
            masks[i, lo:hi] = True
    return TimestampBatch(torch.tensor([r for r, _, _ in rows], dtype=torch.int64).to(device), masks.to(device),
                          torch.tensor([rules.begin for _, rules, _ in rows], dtype=torch.int64).to(device))


def apply_timestamp_rules(logits: torch.Tensor, batch: TimestampBatch) -> torch.Tensor:
    """(B, vocab) float logits with the timestamped rows masked (a new tensor; no host sync)."""
    rows = logits[batch.rows].masked_fill(batch.masks, float("-inf"))
    is_stamp = torch.arange(logits.shape[1], device=logits.device) >= batch.begins.unsqueeze(1)
    log_probs = rows.log_softmax(dim=-1)
    stamp = log_probs.masked_fill(~is_stamp, float("-inf")).logsumexp(dim=-1)
    text = log_probs.masked_fill(is_stamp, float("-inf")).max(dim=-1).values
    rows = rows.masked_fill(~is_stamp & (stamp > text).unsqueeze(1), float("-inf"))
    return logits.index_put((batch.rows,), rows)
