"""An executor is in no reference cycle of its own: dropped after shutdown, it and its KV pool are freed at once,
without waiting for the cyclic collector (a pool left for the collector made the next executor's pool, sized from
the free device memory, one block: 2026-11-30's GPU suite)."""
from __future__ import annotations

import gc
import weakref

from executor_testing import collect

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import Request


def test_a_dropped_executor_and_its_pool_are_freed_without_the_collector(tiny_engine):
    gc.collect()
    gc.disable()
    try:
        executor = Executor(tiny_engine, ExecutorConfig(max_tokens_in_paged_kv_cache=512))
        ids = executor.enqueue_requests([Request([1, 2, 3, 4, 5], 3)])
        assert len(collect(executor, ids)[ids[0]]) >= 1
        executor.shutdown()
        pool, alive = weakref.ref(executor.runner.kv_cache), weakref.ref(executor)
        del executor
        assert alive() is None and pool() is None
    finally:
        gc.enable()
