"""A tokenizer.json run by the tokenizers library alone, for the text models (no transformers import).

The `preprocessing` and `postprocessing` stubs only encode text, decode ids, turn an id into its
token and read the special tokens and vocabulary sizes. transformers' TokenizersBackend, the class
``load_tokenizer`` gives a plain fast tokenizer's folder, does each of those with one call into the
same Rust tokenizer; what it adds is its import (~1 CPU-s: the package's lazy-import table is built
by reading every one of its 1,600 files) at every start of each of those stubs.

``backend_alone_is_enough`` says when the Rust tokenizer alone is the tokenizer TokenizersBackend
would build; ``PlainTokenizer`` then answers those calls as TokenizersBackend does (transformers 5.24,
tokenization_utils_tokenizers.py, TokenizersBackend.__init__, _encode_plus and _decode):
- it loads tokenizer.json as it is (TokenizerFast.from_file), then changes the backend only where
  the folder asks for it: truncation or padding in tokenizer.json (set again, and dropped per
  encode call), a missing post-processor or add_bos_token / add_eos_token (update_post_processor),
  a special token of tokenizer_config.json (named, or listed in extra_special_tokens) that tokenizer.json
  does not hold as a special added token (add_tokens), an added_tokens_decoder entry that differs from tokenizer.json's, split_special_tokens,
  a vocabulary over 100,000 with a pre-tokenizer (its Mistral regex patch), special_tokens_map.json or
  added_tokens.json beside (merged into its arguments). A folder with any of those is not eligible
  (``plain_tokenizer`` returns None), nor is one naming a setting outside ``INERT_SETTINGS``.
- encode(text, add_special_tokens) is the backend's encoding of [text]; decode(ids,
  skip_special_tokens, clean_up_tokenization_spaces=False) the backend's decode; convert_ids_to_tokens
  its id_to_token; vocab_size and len() its vocabulary without and with the added tokens; the special
  tokens are tokenizer_config.json's strings.
tests/serving/test_tokenization.py holds both to the same answers on the default model's folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Lists of more special tokens (the second is the first's old name): TokenizersBackend adds each one
# tokenizer.json lacks, so each must be one of its special added tokens (a dict of named tokens is not eligible).
EXTRA_SPECIAL_TOKEN_LISTS = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json keys that do not touch encode, decode or ids to tokens (without padding or
# truncation asked for, as the text models call them), besides the special tokens and added tokens
# checked one by one. clean_up_tokenization_spaces is only eligible when false (``decode``).
INERT_SETTINGS = {"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length", "chat_template",
                  "padding_side", "truncation_side", "model_input_names", "clean_up_tokenization_spaces", "processor_class",
                  "added_tokens_decoder", *EXTRA_SPECIAL_TOKEN_LISTS, *SPECIAL_TOKEN_NAMES}
ADDED_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
MISTRAL_PATCH_VOCAB = 100000  # TokenizersBackend patches the pre-tokenizer of a larger vocabulary


def backend_alone_is_enough(config: dict, saved: dict) -> bool:
    """Whether TokenizersBackend.from_pretrained on a folder of this tokenizer_config.json (``config``) and
    tokenizer.json (``saved``), and nothing beside them that it merges, would run tokenizer.json unchanged
    (the module's docstring lists what it would change). The caller has checked that AutoTokenizer
    resolves the folder to TokenizersBackend (serving.tokenization._plain_fast_tokenizer)."""
    if set(config) - INERT_SETTINGS or config.get("clean_up_tokenization_spaces"):
        return False
    if saved.get("truncation") is not None or saved.get("padding") is not None or saved.get("post_processor") is None:
        return False
    added = {token.get("id"): token for token in saved.get("added_tokens", [])}
    for index, token in config.get("added_tokens_decoder", {}).items():
        if not index.isdigit() or int(index) not in added or \
                any(token.get(flag) != added[int(index)].get(flag) for flag in ADDED_TOKEN_FLAGS):
            return False
    special = {token.get("content") for token in added.values() if token.get("special")}
    named = [config.get(name) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None]
    for name in EXTRA_SPECIAL_TOKEN_LISTS:
        extra = config.get(name) or []
        if not isinstance(extra, list):
            return False
        named += extra
    return all(isinstance(token, str) and token in special for token in named)


def plain_tokenizer(tokenizer_dir: str) -> PlainTokenizer | None:
    """``PlainTokenizer`` of the folder, or None where TokenizersBackend would change its
    tokenizer.json (special_tokens_map.json or added_tokens.json beside it, ``backend_alone_is_enough``,
    and its Mistral patch: known from the loaded vocabulary). Each file is read once."""
    from tokenizers import Tokenizer

    folder = Path(tokenizer_dir)
    if (folder / "special_tokens_map.json").exists() or (folder / "added_tokens.json").exists():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        saved = json.loads(text)
    except (OSError, ValueError):
        return None
    if not backend_alone_is_enough(config, saved):
        return None
    tokenizer = PlainTokenizer(Tokenizer.from_str(text), config)
    if len(tokenizer) > MISTRAL_PATCH_VOCAB and tokenizer.backend_tokenizer.pre_tokenizer is not None:
        return None
    return tokenizer


class PlainTokenizer:
    """TokenizersBackend's answers for the calls of the text models, from tokenizer.json alone
    (eligible folders only: ``plain_tokenizer`` makes it): ``backend`` is tokenizer.json's Rust tokenizer,
    ``config`` tokenizer_config.json's settings."""

    def __init__(self, backend, config: dict):
        self.backend_tokenizer = backend
        for name in SPECIAL_TOKEN_NAMES:
            setattr(self, name, config.get(name))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("PlainTokenizer does not clean up tokenization spaces (load_tokenizer's tokenizer does)")
        return self.backend_tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)
