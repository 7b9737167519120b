"""Qwen (v1)'s tiktoken vocabulary as a Hugging Face fast tokenizer, read as data.

Qwen (v1) checkpoints ship their tokenizer as remote code: ``QWenTokenizer`` wraps the tiktoken
library around ``qwen.tiktoken``, a file of ``<base64 token bytes> <rank>`` lines. Running that code
is what this project does not do (engine/convert_decoder.py reads their weights as data too), so
the build converts the file into a byte-level BPE ``tokenizer.json`` that transformers and the
serving models load like any other (engine directory -> preprocessing / postprocessing).

Facts of the format and of Qwen's tokenizer carried over:
- tiktoken's BPE merges, within each piece the pattern splits off, the adjacent pair whose
  concatenation has the lowest rank, until no pair is a token; a piece that is a token is taken
  whole. A BPE model whose merges are ordered by the merged token's rank, with ``ignore_merges``,
  gives the same ids (transformers' TikTokenConverter builds it so).
- Qwen's split pattern (``QWEN_PATTERN``: one digit per piece), text NFC-normalised before encoding,
  special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and ``<|extra_0|>`` ...
  ``<|extra_204|>`` numbered from 151643 (the real file's rank count; here: the file's rank count),
  recognised in any text; ``<|endoftext|>`` is the end of a document (eos and pad).
"""
from __future__ import annotations

import base64
import binascii
import os

from engine.hf_checkpoint import CheckpointError

QWEN_VOCAB_FILE = "qwen.tiktoken"
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_ENDOFTEXT = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = (QWEN_ENDOFTEXT, "<|im_start|>", "<|im_end|>") + tuple(f"<|extra_{i}|>" for i in range(205))


class TiktokenVocabError(CheckpointError):
    """A tiktoken file that cannot be read: names the file, the line and what was wrong (the build
    reports it as it reports any bad checkpoint file)."""


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """``<base64 bytes> <rank>`` lines -> {token bytes: rank}; the ranks must be 0 .. n-1, each once
    (ids of the special tokens follow them)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError("expected two fields")
                token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
            except (ValueError, binascii.Error) as err:
                raise TiktokenVocabError(f"{path} line {number}: {err}; each line must be '<base64 token> "
                                         "<rank>'") from None
            if token in ranks:
                raise TiktokenVocabError(f"{path} line {number}: token {token!r} appears twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenVocabError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}, each once")
    return ranks


def tiktoken_tokenizer(ranks: dict[bytes, int], pattern: str, special_tokens: tuple[str, ...], eos_token: str):
    """A transformers fast tokenizer with tiktoken's ids: BPE over bytes (ids = ranks), the pattern's
    pieces, NFC normalisation, ``special_tokens`` numbered from len(ranks)."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_source) -> dict[bytes, int]:  # the ranks read above (no tiktoken package)
            return ranks

    backend = _Converter(vocab_file="", pattern=pattern, extra_special_tokens=list(special_tokens)).converted()
    backend.normalizer = normalizers.NFC()
    assert backend.token_to_id(special_tokens[0]) == len(ranks)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, pad_token=eos_token,
                                   clean_up_tokenization_spaces=False)


def qwen1_tokenizer(directory: str):
    """The fast tokenizer of a Qwen (v1) directory's ``qwen.tiktoken``, or None when it has none."""
    path = os.path.join(directory, QWEN_VOCAB_FILE)
    if not os.path.isfile(path):
        return None
    return tiktoken_tokenizer(read_tiktoken_ranks(path), QWEN_PATTERN, QWEN_SPECIAL_TOKENS, QWEN_ENDOFTEXT)
