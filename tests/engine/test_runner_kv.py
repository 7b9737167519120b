"""ModelRunner's KV pool sizing and layout."""
from __future__ import annotations

import pytest
import torch

from engine.executor.runner import CPU_KV_BUDGET_BYTES, ModelRunner
from engine_testing import make_engine, tiny_hf


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    engine_dir = make_engine(tiny_hf("llama"), tmp_path_factory.mktemp("kv"), tokens_per_block=16, max_seq_len=256)
    return ModelRunner(engine_dir)


def test_pool_shape_and_block_bytes(runner):
    runner.allocate_kv_cache(5)
    # (layers, K/V, blocks, tokens_per_block, kv_heads, head_dim) for the tiny Llama: 2 layers, 2 kv heads of 16.
    assert runner.kv_cache.shape == (2, 2, 5, 16, 2, 16) and runner.kv_cache.dtype == torch.float32
    assert runner.num_kv_blocks == 5
    assert runner.kv_block_bytes == runner.kv_cache[:, :, 0].numel() * 4


def test_cpu_block_count(runner):
    assert runner.num_kv_blocks_for(max_tokens=33) == 3  # ceil(33 / 16)
    # No limit given: room for max_batch_size (4) sequences of max_seq_len (256) = 4 * 16 blocks,
    # well inside the CPU budget for a model this small.
    assert runner.num_kv_blocks_for() == 64
    assert 64 * runner.kv_block_bytes < CPU_KV_BUDGET_BYTES


def test_forward_needs_a_pool(tmp_path):
    from engine.executor.runner import ForwardBatch

    fresh = ModelRunner(make_engine(tiny_hf("gpt2"), tmp_path))
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        fresh.forward(ForwardBatch([1], [0], [1], [1], [[0]], [0]))
