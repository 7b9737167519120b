"""The executor's LoRA adapter slots: how many the runner gets, and the adapter cache over them.

Made before the KV pool, which takes the device memory they leave. The cache's admission side
(per-request adapters, a slot per running request) is engine/executor/admission.py.
"""
from __future__ import annotations

from engine.executor.device_memory import free_device_bytes
from engine.executor.executor_config import ExecutorConfig
from engine.lora.cache import AdapterCache, RunnerSlots
from engine.lora.prefetch import prefetch_adapters

CPU_LORA_SLOTS = 8


def start_adapters(runner, cfg: ExecutorConfig, max_batch_size: int) -> AdapterCache | None:
    """The runner's adapter slots (``max_loras``, or what ``lora_cache_gpu_memory_fraction`` of the free
    device memory holds, at most one per batch row) and the cache that fills them; None without LoRA."""
    if not cfg.enable_lora:
        return None
    if cfg.max_loras is not None:
        num_slots = cfg.max_loras
    elif runner.device.type == "cuda":
        free_bytes = free_device_bytes(runner.device)
        num_slots = int(free_bytes * cfg.lora_cache_gpu_memory_fraction) // runner.lora_slot_bytes(cfg.max_lora_rank)
    else:
        num_slots = CPU_LORA_SLOTS
    num_slots = max(1, min(num_slots, max_batch_size))
    runner.enable_lora(num_slots, cfg.max_lora_rank)
    adapters = AdapterCache(RunnerSlots(runner), runner.model_config, max_rank=cfg.max_lora_rank,
                            host_bytes=cfg.lora_cache_host_memory_bytes)
    if cfg.lora_prefetch_dir:
        prefetch_adapters(adapters, cfg.lora_prefetch_dir)
    return adapters
