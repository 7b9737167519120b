"""What the frontend reads from a filled model repository: the tokenizer directory and the
``add_special_tokens`` flag of ``preprocessing`` (so prompts are counted as they are encoded)."""
from __future__ import annotations

import re
from pathlib import Path


def model_parameter(repo: str, model: str, key: str) -> str | None:
    """``parameters { key: "<key>" value: { string_value: "..." } }`` of ``<repo>/<model>/config.pbtxt``;
    None when absent or still a ``${placeholder}``."""
    path = Path(repo) / model / "config.pbtxt"
    if not path.is_file():
        return None
    pattern = r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    match = re.search(pattern, path.read_text())
    if match is None or not match.group(1) or match.group(1).startswith("${"):
        return None
    return match.group(1)


def tokenizer_settings(repo: str) -> tuple[str, bool]:
    """(tokenizer_dir, add_special_tokens) of the repository's preprocessing model."""
    tokenizer_dir = model_parameter(repo, "preprocessing", "tokenizer_dir")
    if tokenizer_dir is None:
        raise ValueError(f"{repo}/preprocessing/config.pbtxt has no filled tokenizer_dir; "
                         "pass --tokenizer_dir")
    add_special = model_parameter(repo, "preprocessing", "add_special_tokens")
    return tokenizer_dir, (add_special or "true").lower() in ("true", "1", "yes")
