"""Whisper's sequential long-form decoding, as transformers' WhisperForConditionalGeneration.generate
does it (its long-form loop, with condition_on_prev_tokens off, one temperature, no fallback):

- the log-mels: of the whole clip at once (no padding, no truncation) when it is longer than the
  extractor's window; a clip that fits is padded to the window first (padding="max_length", as its
  processor does for short-form input), unless ``zero_pad``;
- a window: the ``nb_max_frames`` frames from ``seek`` on, zero-padded to the window (unless
  ``zero_pad``); each is one tensorrt_llm request with the same prompt;
- after a window (``finish``), its generated ids become segments and ``seek`` moves
  (transformers' ``_retrieve_segment``): without timestamp tokens the whole window is one segment and
  the next window starts where it ended; with them (a prompt without <|notimestamps|>; the engine
  applies Whisper's timestamp rules, engine/encoder_decoder/whisper_timestamps.py) each pair of
  timestamps closes a segment, and the next window starts at the last closed timestamp, or after
  the window when the ids end on a single timestamp (no speech after it).

Frames are mel frames (10 ms at 16 kHz, hop 160); a timestamp token is one encoder position (two
frames, 0.02 s) after the previous one; the first is <|notimestamps|> + 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.whisper import SAMPLE_RATE

INPUT_STRIDE = 2  # mel frames per encoder position (the conv front-end's stride)
TIME_PRECISION = 0.02  # seconds per timestamp token


@dataclass
class Window:
    """One tensorrt_llm request's audio: (frames, n_mels) float32 log-mels, and where it starts
    (``seek``, mel frames into the clip) and how many of its frames are the clip's."""

    features: np.ndarray
    seek: int
    frames: int


@dataclass
class Segment:
    start: float  # seconds into the clip
    end: float
    ids: list[int]  # the text's ids (timestamp tokens left out)
    span: tuple[int, int] = (0, 0)  # [first, last) of its window's generated ids, timestamp tokens included


@dataclass
class LongForm:
    """The windows of one clip, decoded in turn: ``next_window()``, decode it, ``finish(ids)``."""

    features: np.ndarray  # (n_mels, total frames) log-mels of the clip
    window_frames: int  # the extractor's nb_max_frames
    seconds_per_frame: float
    zero_pad: bool
    timestamp_begin: int | None  # the first timestamp id when the prompt asks for timestamps
    audio_seconds: float
    seek: int = 0
    segments: list[Segment] = field(default_factory=list)

    @classmethod
    def of(cls, extractor, samples: np.ndarray, zero_pad: bool, timestamp_begin: int | None = None) -> "LongForm":
        """The clip's log-mels by the checkpoint's feature extractor (module docstring)."""
        if samples.size > extractor.n_samples:
            options = {"padding": "longest", "truncation": False}
        else:
            options = {"padding": "longest" if zero_pad else "max_length"}
        features = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np", **options)["input_features"][0]
        return cls(np.asarray(features, np.float32), extractor.nb_max_frames, extractor.hop_length / SAMPLE_RATE,
                   zero_pad, timestamp_begin, samples.size / SAMPLE_RATE)

    @property
    def total_frames(self) -> int:
        return self.features.shape[1]

    def next_window(self) -> Window | None:
        """The window at ``seek`` (None: the clip is done)."""
        if self.seek >= self.total_frames:
            return None
        piece = self.features[:, self.seek:self.seek + self.window_frames]
        frames = piece.shape[1]
        if frames < self.window_frames and not self.zero_pad:  # transformers pads the last window with 0 features
            piece = np.pad(piece, ((0, 0), (0, self.window_frames - frames)))
        return Window(np.ascontiguousarray(piece.T, dtype=np.float32), self.seek, frames)

    def finish(self, window: Window, ids: list[int]) -> list[Segment]:
        """Record the ids generated for ``window`` (end id left out) as segments and move ``seek``;
        returns the new segments."""
        segments, offset = self._segments(window, list(ids))
        self.segments += segments
        self.seek += offset
        return segments

    def _time(self, frames: float) -> float:
        return round(frames * self.seconds_per_frame, 3)

    def _segments(self, window: Window, ids: list[int]) -> tuple[list[Segment], int]:
        begin, start = self.timestamp_begin, window.seek
        if begin is None:  # no timestamps: the window is one segment
            end = min(self._time(start + window.frames), round(self.audio_seconds, 3))  # not into the padding
            return [Segment(self._time(start), end, ids, (0, len(ids)))], window.frames
        stamps = [t >= begin for t in ids]
        text = lambda tokens: [t for t in tokens if t < begin]  # noqa: E731
        to_frames = lambda token: (token - begin) * INPUT_STRIDE  # noqa: E731
        single_ending = stamps[-2:] == [False, True]
        closes = [i + 1 for i in range(len(ids) - 1) if stamps[i] and stamps[i + 1]]
        if not closes:  # no pair: one segment up to the last timestamp (or the window's end)
            end = start + window.frames
            last = [t for t in ids if t >= begin]
            if last and last[-1] != begin:
                end = start + to_frames(last[-1])
            return [Segment(self._time(start), self._time(end), text(ids), (0, len(ids)))], window.frames
        if single_ending:
            closes.append(len(ids))
        else:
            closes[-1] += 1  # the last pair's second timestamp stays in the last segment
        segments, first = [], 0
        for n, close in enumerate(closes):
            tokens = ids[first:close]
            end_at = -1 if n < len(closes) - 1 or single_ending else -2
            segments.append(Segment(self._time(start + to_frames(tokens[0])), self._time(start + to_frames(tokens[end_at])),
                                    text(tokens), (first, close)))
            first = close
        # single ending: nothing is said after it; else decode again from the last closed timestamp
        offset = window.frames if single_ending else to_frames(ids[first - 2])
        return segments, offset if offset > 0 else window.frames  # (0 would decode the same window forever)
