"""LoRA adapters served under model names of their own (``--lora_modules``, as vLLM's flag).

A request whose ``model`` names an adapter runs on the base engine with that adapter: the
frontend sends the entry model ``lora_id``, ``lora_name`` and ``lora_path`` (triton_client.py),
and the engine loads the PEFT directory at ``lora_path`` on first use and caches it under
``lora_id``. The prompt is rendered and counted with the base model's tokenizer and template.

Each item of the flag is ``name=path`` or vLLM's JSON form
``{"name": "...", "path": "...", "base_model_name": "..."}``; items are checked once, at start.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass

FLAG = "--lora_modules"
JSON_KEYS = {"name", "path", "base_model_name"}


@dataclass(frozen=True)
class LoraModule:
    name: str  # the `model` clients name to select the adapter
    path: str  # absolute PEFT directory (adapter_config.json + weights), as the server reads it
    id: int  # lora_id: the engine's cache key for the loaded adapter


def lora_id(name: str) -> int:
    """The adapter's stable ``lora_id``: the same name gives the same id in every process and run.

    Bit 62 keeps these ids apart from the small task ids clients pass through the backend's own
    ``lora_task_id`` input (the engine caches both in one table), and below 2**63 they stay valid
    where the id is held as int64.
    """
    return (1 << 62) | zlib.crc32(name.encode("utf-8"))


def parse_lora_modules(items: list[str], base_model_name: str) -> dict[str, LoraModule]:
    """The registry: adapter name -> LoraModule, in flag order. Raises ValueError naming the flag
    and the item for a malformed item, a name that is empty, repeated or the base model's, a
    ``base_model_name`` other than the served model, or a path without adapter_config.json."""
    modules: dict[str, LoraModule] = {}
    ids: dict[int, str] = {}
    for item in items:
        module = _parse_item(item, base_model_name)
        if module.name == base_model_name:
            raise _item_error(item, f"the name {module.name!r} is the served model's; give the adapter its own name")
        if module.name in modules:
            raise _item_error(item, f"the name {module.name!r} is given twice")
        if module.id in ids:  # a crc32 collision: the engine would serve one adapter for both
            raise _item_error(item, f"the name {module.name!r} gets the same lora_id as {ids[module.id]!r}; "
                                    "rename one of them")
        modules[module.name], ids[module.id] = module, module.name
    return modules


def _parse_item(item: str, base_model_name: str) -> LoraModule:
    if item.lstrip().startswith("{"):
        name, path = _parse_json_item(item, base_model_name)
    else:
        name, equals, path = item.partition("=")
        if not equals:
            raise _item_error(item, "expected name=path or a JSON object with name and path")
    if not name:
        raise _item_error(item, "the adapter name is empty")
    if not path:
        raise _item_error(item, "the adapter path is empty")
    if not os.path.isdir(path):
        raise _item_error(item, f"{path} is not a directory")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise _item_error(item, f"{path} holds no adapter_config.json (expected a PEFT adapter directory)")
    return LoraModule(name=name, path=os.path.abspath(path), id=lora_id(name))


def _parse_json_item(item: str, base_model_name: str) -> tuple[str, str]:
    try:
        fields = json.loads(item)  # an object: the item starts with "{"
    except ValueError as error:
        raise _item_error(item, f"not valid JSON: {error}") from None
    unknown = sorted(set(fields) - JSON_KEYS)
    if unknown:
        raise _item_error(item, f"unknown key {unknown[0]!r} (known: {', '.join(sorted(JSON_KEYS))})")
    for key in JSON_KEYS:
        if key in fields and not isinstance(fields[key], str):
            raise _item_error(item, f"{key} must be a string, got {fields[key]!r}")
    base = fields.get("base_model_name")
    if base is not None and base != base_model_name:
        raise _item_error(item, f"base_model_name {base!r} is not the served model {base_model_name!r}")
    return fields.get("name", ""), fields.get("path", "")


def _item_error(item: str, problem: str) -> ValueError:
    return ValueError(f"{FLAG} {item!r}: {problem}")
