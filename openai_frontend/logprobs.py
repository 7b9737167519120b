"""Log-probs as the OpenAI API returns them: tokens named by the tokenizer, in the chat shape
(``logprobs.content``) and the completions shape (``tokens``, ``token_logprobs``, ...).

The engine sends, per generated token, its id, its log-prob and the k most likely ids with
theirs (``num_top_log_probs``; engine/executor/sampler.py says from which distribution). Here
ids become text: a token's ``bytes`` are exactly the bytes it adds to the output (for a
byte-level BPE token that holds part of a multi-byte character, those partial bytes), and its
``token`` is those bytes as UTF-8, with the bytes of an incomplete character written as
``\\xNN`` escapes (as OpenAI shows them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# JSON has no -Infinity; a banned alternative (probability 0) reads as this, as in vLLM.
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


@dataclass
class Alternative:
    token: str
    bytes: bytes
    logprob: float


@dataclass
class TokenLogprob:
    """One generated token: what it is, its log-prob, the alternatives asked for, and where its
    text starts in the choice's text (summing the tokens' texts before it)."""

    token: str
    bytes: bytes
    logprob: float
    top: list[Alternative]
    text_offset: int


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE writes byte b as this character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenNamer:
    """token id -> (text, bytes), cached; built once per frontend from the engine's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _gpt2_unicode_to_byte() if type(decoder).__name__ == "ByteLevel" else None
        self._special_ids = set(tokenizer.all_special_ids)
        self.name = lru_cache(maxsize=1 << 16)(self._name)

    def _name(self, token_id: int) -> tuple[str, bytes]:
        raw = self._bytes(token_id)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:  # part of a character split over tokens
            return raw.decode("utf-8", errors="backslashreplace"), raw

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode("utf-8")
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece marks a space with U+2581
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def entries(self, token_ids: list[int], log_probs: list[float], top: list[list[tuple[int, float]]] | None,
                text_offset: int) -> list[TokenLogprob]:
        """Entries of consecutive tokens whose first one starts at ``text_offset``."""
        out = []
        for i, (token_id, logprob) in enumerate(zip(token_ids, log_probs)):
            text, raw = self.name(token_id)
            alternatives = [Alternative(*self.name(alt_id), _finite(alt_logprob))
                            for alt_id, alt_logprob in (top[i] if top else ())]
            out.append(TokenLogprob(text, raw, _finite(logprob), alternatives, text_offset))
            text_offset += len(text)
        return out


def _finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one chunk: its delta's tokens)."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)}
                                          for a in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a text completion (or of one chunk)."""
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{a.token: a.logprob for a in e.top} for e in entries],
            "text_offset": [e.text_offset for e in entries]}
