"""In-flight batching executor: ``from engine.executor import Executor, ExecutorConfig, Request``.

Names resolve lazily, so importing a submodule (``engine.executor.runner``, ``.kv_cache``) does
not pull in the whole executor.
"""
from __future__ import annotations

_EXPORTS = {
    "Executor": "executor", "ExecutorConfig": "executor_config", "ExecutorConfigError": "executor_config",
    "SpeculativeConfig": "executor_config", "ExternalDraftTokens": "request",
    "IterationStats": "stats", "KvCacheStats": "stats",
    "Request": "request", "Response": "request", "Result": "request", "SamplingConfig": "request",
    "OutputConfig": "request", "FinishReason": "request", "RequestPerfMetrics": "request", "LoraRequest": "request",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.executor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"engine.executor.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
