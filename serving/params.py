"""Reading `parameters` of a Triton model config (plain Python; no Triton import).

Templates are often left partly unfilled, so a string value that is empty or still looks like a
`${placeholder}` counts as "not set" for every type, exactly like the reference models.
"""
from __future__ import annotations

import json
from typing import Any, Callable

_TRUE = {"1", "true", "t", "y", "yes"}
_FALSE = {"0", "false", "f", "n", "no"}


def is_unset(value: str | None) -> bool:
    """True for a missing value, an empty string or an unfilled `${...}` placeholder."""
    if value is None:
        return True
    value = value.strip()
    return value == "" or (value.startswith("${") and value.endswith("}"))


def parse_bool(value: str | None) -> bool | None:
    """`true/false/1/0/t/f/y/n/yes/no` (any case) -> bool; unset or anything else -> None."""
    if is_unset(value):
        return None
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return None


def parse_int(value: str | None) -> int | None:
    if is_unset(value):
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def parse_float(value: str | None) -> float | None:
    if is_unset(value):
        return None
    try:
        return float(value.strip())
    except ValueError:
        return None


def parse_str(value: str | None) -> str | None:
    return None if is_unset(value) else value.strip()


def parse_int_list(value: str | None) -> list[int] | None:
    """`"1,2,3"` -> [1, 2, 3]; unset -> None; a non-integer item raises ValueError."""
    if is_unset(value):
        return None
    return [int(item) for item in value.split(",") if item.strip()]


PARSERS: dict[type, Callable[[str | None], Any]] = {
    bool: parse_bool, int: parse_int, float: parse_float, str: parse_str,
}


def model_parameters(model_config: dict | str) -> dict[str, str]:
    """The raw `parameters` of a model config (dict or JSON text) as name -> string_value."""
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    raw = model_config.get("parameters", {}) or {}
    return {name: entry.get("string_value", "") for name, entry in raw.items()}


def get_parameter(params: dict[str, str], name: str, kind: type = str):
    """Typed value of parameter `name`, or None when missing, unset or unparsable."""
    return PARSERS[kind](params.get(name))
