"""``lora_prefetch_dir``: adapters loaded when the executor starts, so their first requests wait
for nothing.

Each subdirectory is one adapter, named ``<id>`` or ``<id>-<name>`` (the id is the
``lora_task_id`` / ``lora_id`` requests use), holding either TensorRT-LLM's two arrays
(``model.lora_weights.npy``, ``model.lora_config.npy``: what tools/hf_lora_convert.py writes) or a
PEFT adapter (``adapter_config.json`` and its weights). They go into the host tier, and into the
device slots while free ones last. A directory that does not follow this is an error at start,
naming it.
"""
from __future__ import annotations

import os
import re

import numpy as np

from engine.lora.adapter import LoraError, adapter_from_trtllm, load_peft_adapter

ENTRY = re.compile(r"^(\d+)(?:-(.+))?$")


def prefetch_adapters(cache, directory: str) -> list[int]:
    """Load every adapter of ``directory`` into ``cache`` (engine/lora/cache.py); their ids."""
    if not os.path.isdir(directory):
        raise LoraError(f"lora_prefetch_dir {directory!r} is not a directory")
    keys = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not os.path.isdir(path):
            continue
        match = ENTRY.match(entry)
        if match is None:
            raise LoraError(f"lora_prefetch_dir: {path!r} is not named <id> or <id>-<name> (the adapter's lora_task_id)")
        key, name = int(match.group(1)), match.group(2)
        weights_file = os.path.join(path, "model.lora_weights.npy")
        if os.path.isfile(weights_file):
            config_file = os.path.join(path, "model.lora_config.npy")
            if not os.path.isfile(config_file):
                raise LoraError(f"lora_prefetch_dir: {path!r} has model.lora_weights.npy but no model.lora_config.npy")
            adapter = adapter_from_trtllm(np.load(weights_file), np.load(config_file), cache.model_config,
                                          cache.max_rank, f"lora_task_id {key} ({path})")
            cache.add(key, adapter, name=name)
        else:
            cache.add(key, load_peft_adapter(path, cache.model_config, cache.max_rank), name=name,
                      path=os.path.abspath(path))
        keys.append(key)
    for key in keys[:cache.pools.num_slots]:  # into the free slots: a request will hit them
        cache.preload(key)
    return keys
