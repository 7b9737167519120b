"""Tokenizer loading and streaming-safe detokenization (plain Python; no Triton import).

Streaming invariant kept by this module: the text of a stream, concatenated, equals the text
of the same tokens decoded at once, and no chunk ends inside a multi-byte character (a CJK
character or an emoji is often split over several byte-level tokens; decoding such a token
alone yields U+FFFD).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes, so a held-back tail longer than this many tokens is
# not an unfinished character but invalid bytes: release it rather than stall the stream.
MAX_HELD_TOKENS = 8


def load_tokenizer(tokenizer_dir: str):
    """AutoTokenizer as the reference models load it; pad falls back to eos.

    A folder whose tokenizer_config.json names the generic fast tokenizer (``TokenizersBackend``,
    what transformers writes for a tokenizer.json-only tokenizer: the embedded default model's
    engine) and nothing that could make AutoTokenizer choose another class (no ``auto_map``, no
    model type in config.json, as in an engine directory) gets that class directly: the one
    AutoTokenizer would return, without AutoConfig, whose import takes torch in (2-3 s of CPU and
    ~200 MiB in each of the preprocessing and postprocessing stubs, which never use torch)."""
    if _plain_fast_tokenizer(tokenizer_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(tokenizer_dir, legacy=False, padding_side="left")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, legacy=False, padding_side="left",
                                                  trust_remote_code=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_text_tokenizer(tokenizer_dir: str):
    """The tokenizer of the text models (`preprocessing`, `postprocessing`, and the llmapi `tensorrt_llm`
    model, which encodes prompts and stop words and decodes with ``fast_decoder``): ``load_tokenizer``'s, or
    where that is TokenizersBackend running tokenizer.json unchanged, the same answers to their
    calls from the tokenizers library alone (serving/plain_tokenizer.py), without transformers'
    import: ~1 CPU-s less at each start of each of those stubs."""
    if _plain_fast_tokenizer(tokenizer_dir):
        from serving.plain_tokenizer import plain_tokenizer

        tokenizer = plain_tokenizer(tokenizer_dir)
        if tokenizer is not None:
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return tokenizer
    return load_tokenizer(tokenizer_dir)


def _plain_fast_tokenizer(tokenizer_dir: str) -> bool:
    """Whether AutoTokenizer.from_pretrained(tokenizer_dir) resolves to TokenizersBackend by the
    tokenizer_config.json's class name alone (see load_tokenizer)."""
    folder = Path(tokenizer_dir)
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if (folder / "config.json").exists() else {}
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in tokenizer_config
            and (folder / "tokenizer.json").exists() and not config.get("model_type")
            and not config.get("tokenizer_class"))


def first_token_id(tokenizer, token: str | None) -> int | None:
    """The first id of `token` encoded without special tokens (how end/pad ids are derived)."""
    if token is None:
        return None
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if ids else None


def decode_tokens(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Decode one chunk so that chunks concatenate to the decode of the whole sequence.

    Cleanup of tokenization spaces is off (it would differ between a chunk and the whole), and a
    SentencePiece word-start token ("▁The") keeps its space even at the start of a chunk.
    """
    token_ids = [int(t) for t in token_ids]
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)
    if token_ids and not text.startswith(" "):
        first = tokenizer.convert_ids_to_tokens(token_ids[0])
        if isinstance(first, str) and first.startswith("\u2581") and text:
            text = " " + text
    return text


def fast_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text with no clean-up of spaces: the fast tokenizer's Rust decode when there is one
    (it runs once per streamed response; transformers' wrapper around the same call costs several
    times more), else ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def holdback_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text for ``Utf8Holdback`` (special tokens kept: only the decoded tail's completeness
    is read)."""
    return fast_decoder(tokenizer, skip_special_tokens=False)


def holdback_decoder_for(tokenizer_dir: str) -> Callable[[list[int]], str]:
    """``holdback_decoder`` of ``load_tokenizer(tokenizer_dir)``, for a process that only decodes a
    stream's tail (the tensorrt_llm stub). A plain fast tokenizer's folder (``_plain_fast_tokenizer``:
    TokenizersBackend loads tokenizer.json as it is) whose tokenizer_config.json adds no token that
    tokenizer.json lacks decodes with the tokenizers library alone: the same Rust decode, without
    importing transformers (~0.5 CPU-s per stub at every server start). Anything else loads it as before."""
    if _plain_fast_tokenizer(tokenizer_dir):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        added = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        known = backend.get_added_tokens_decoder()
        if all(int(i) in known and known[int(i)].content == token.get("content") for i, token in added.items()):
            return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return holdback_decoder(load_tokenizer(tokenizer_dir))


class Utf8Holdback:
    """Holds back the tail of a token stream while it decodes to an unfinished character.

    push(ids) returns the ids that are safe to send now (possibly none); flush() returns the
    rest at the end of the stream. Every pushed id is returned exactly once, in order.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._pending: list[int] = []

    def push(self, token_ids: Sequence[int]) -> list[int]:
        self._pending.extend(int(t) for t in token_ids)
        cut = self._safe_cut()
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return ready

    def flush(self) -> list[int]:
        ready, self._pending = self._pending, []
        return ready

    def _safe_cut(self) -> int:
        """Largest k such that pending[:k] ends on a character boundary."""
        pending = self._pending
        if not pending or len(pending) > MAX_HELD_TOKENS:
            return len(pending)
        for cut in range(len(pending), max(0, len(pending) - 4) - 1, -1):
            if cut == 0 or not self._decode(pending[:cut]).endswith(REPLACEMENT_CHAR):
                return cut
        return 0


class DecodeWindow:
    """Incremental decoding of one growing id sequence through any decoder (the tokenizer in this
    process, or the `postprocessing` model over Triton), a few ids per step.

    Decoding each chunk's ids on their own goes wrong in two ways: a character split over two
    tokens (a byte-level BPE piece holding half of a multi-byte character) decodes as U+FFFD, and a
    decoder may treat the first token of a sequence differently (SentencePiece drops a leading
    space). So each step decodes two short lists, ``windows()``: the head (ids whose text went out
    before) and the window (head + the ids since); ``advance`` keeps only the window's text past
    the head's. Cost per step: two decodes of a few ids, whatever the length so far.

    Invariant: the texts ``advance`` returns, concatenated, equal the decode of every id extended,
    once a final ``advance`` has been made (a trailing incomplete character is held back until it
    completes, or until then, as U+FFFD). ``ids[head:read]`` is the head, ``ids[read:]`` the new
    ids; ``sent`` characters of their text went out already (a chunk that ended inside a character).
    """

    def __init__(self):
        self.ids: list[int] = []
        self._head = 0
        self._read = 0
        self._sent = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        self.ids.extend(int(t) for t in token_ids)

    @property
    def pending(self) -> bool:
        """Ids not yet turned into text."""
        return self._read < len(self.ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """(head ids, window ids) to decode for the next ``advance``."""
        return self.ids[self._head:self._read], self.ids[self._head:]

    def advance(self, head_text: str, window_text: str, final: bool = False) -> str:
        """The new text, given the decodes of ``windows()`` (up to a character still being spelled
        out, unless ``final``)."""
        start = len(head_text) + self._sent
        if not final and window_text.endswith(REPLACEMENT_CHAR):
            # The last character is not complete yet: send what precedes it and wait for the rest.
            ready = window_text[start:].rstrip(REPLACEMENT_CHAR)
            self._sent += len(ready)
            return ready
        # The next window starts where this one's new part began: one token of context is enough
        # for the decoders here (a leading-space rule or a split character).
        self._head, self._read, self._sent = self._read, len(self.ids), 0
        return window_text[start:]


class TextDeltas:
    """Turns successive decodes of a growing token sequence into text deltas.

    update(full_text, is_final) returns the new text since the last call; a trailing U+FFFD
    (an unfinished character) is held back until it completes or the stream ends.
    """

    def __init__(self):
        self.emitted_chars = 0  # characters sent so far (the caller holds the text itself)

    def update(self, full_text: str, is_final: bool = False) -> str:
        stable = full_text if is_final else full_text.rstrip(REPLACEMENT_CHAR)
        # If decoding ever changed earlier text, what was sent cannot be taken back: only
        # text beyond what was emitted goes out.
        delta = stable[self.emitted_chars:]
        self.emitted_chars += len(delta)
        return delta
