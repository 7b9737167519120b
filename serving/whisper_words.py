"""Word timestamps (OpenAI's verbose_json ``words``): a segment's tokens grouped into words with
their times, from tensorrt_llm's ``token_timestamps`` (each generated token's time in its window:
engine/encoder_decoder/whisper_alignment.py, = transformers' generate(return_token_timestamps=True)).

Grouping, as openai-whisper and transformers' ASR pipeline group tokens for space-separated
languages: the text pieces (a token's text as it reads after the tokens before it; tokens that only
make a whole character together stay together) start a new word when they begin with a space or are
punctuation (in Chinese, Japanese, Thai, Lao, Burmese and Cantonese every piece is a word, as
those pipelines split them per character); opening punctuation ("'“¡¿([{-) then joins the word after it and closing punctuation
("'.。,，!！?？:：”)]}、) the word before it. Timestamp and other <|...|> tokens are no words.

Times, as that pipeline takes them: a word starts at its first token's time and ends at the time of
the token after its last one (the next token of the window: text or timestamp), or at its last
token's own time when nothing follows (transformers copies the last time for the end token).
"""
from __future__ import annotations

import string
from dataclasses import dataclass

from serving.whisper import SPECIAL_TOKEN

PREPEND = "\"'“¡¿([{-"
UNSPACED = ("zh", "ja", "th", "lo", "my", "yue")  # written without spaces: a word per piece
APPEND = "\"'.。,，!！?？:：”)]}、"


@dataclass
class Word:
    word: str
    start: float  # seconds into the clip
    end: float


def _pieces(tokenizer, ids: list[int]) -> list[tuple[str, list[int]]]:
    """(text, token indices) per piece: each token's text as it reads after the ones before it,
    tokens that decode to part of a character merged with the next."""
    pieces, pending, before = [], [], ""
    for i in range(len(ids)):
        pending.append(i)
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if "\ufffd" in text[len(before):] and i + 1 < len(ids):
            continue
        pieces.append((text[len(before):], pending))
        pending, before = [], text
    return pieces


def segment_words(tokenizer, ids: list[int], times: list[float], text_limit: int | None,
                  next_time: float | None = None, language: str = "") -> list[Word]:
    """The words of one segment's ``ids`` (timestamp tokens included, as generated) whose tokens
    have ``times`` (seconds into the clip); ``text_limit``: the first timestamp id (None: no
    timestamps); ``next_time``: the time of the token after the segment (None: none follows);
    ``language``: a code in UNSPACED makes every piece (a whole character or more) its own word."""
    per_piece = language in UNSPACED
    words: list[tuple[str, list[int]]] = []
    for text, indices in _pieces(tokenizer, ids):
        token = ids[indices[0]]
        if (text_limit is not None and token >= text_limit) or SPECIAL_TOKEN.fullmatch(text.strip() or "-"):
            words.append(("", []))  # a boundary that is no word
            continue
        if per_piece or not words or not words[-1][1] or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(indices)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + list(indices))
    words = _merge_punctuation([w for w in words if w[1]])

    def after(index: int) -> float:
        return times[index + 1] if index + 1 < len(times) else times[index] if next_time is None else next_time

    return [Word(text.strip(), round(float(times[indices[0]]), 3), round(float(after(indices[-1])), 3))
            for text, indices in words if text.strip()]


def _merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """Opening punctuation (a piece " (" ...) joins the next word, closing punctuation (exactly "."
    ...) the previous word, unless that one ends with a space."""
    words = [list(w) for w in words]
    j = len(words) - 1
    for i in range(len(words) - 2, -1, -1):
        text = words[i][0]
        if text.startswith(" ") and text.strip() and text.strip() in PREPEND:
            words[j] = [text + words[j][0], words[i][1] + words[j][1]]
            words[i] = ["", []]
        else:
            j = i
    i = 0
    for j in range(1, len(words)):
        if words[j][1] and words[j][0] in APPEND and not words[i][0].endswith(" "):
            words[i] = [words[i][0] + words[j][0], words[i][1] + words[j][1]]
            words[j] = ["", []]
        elif words[j][1]:
            i = j
    return [(text, indices) for text, indices in words if indices]


def window_words(tokenizer, segments, ids: list[int], times: list[float] | None, offset: float,
                 text_limit: int | None, language: str = "") -> list[Word]:
    """The words of a window's new ``segments`` (serving/whisper_long_form.py; each names its span
    of the window's generated ``ids``), from the ids' ``times`` (seconds into the window; none:
    no words) plus ``offset`` (the window's start in the clip)."""
    if not times:
        return []
    clip_times = [t + offset for t in times[:len(ids)]]
    words = []
    for segment in segments:
        first, last = segment.span
        following = clip_times[last] if last < len(clip_times) else None
        words += segment_words(tokenizer, ids[first:last], clip_times[first:last], text_limit, following, language)
    return words
