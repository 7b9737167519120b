"""KV events (engine/executor/kv_events.py): the executor's prefix cache publishes block stored /
removed batches in vLLM's shape, to an in-process callback and a ZMQ PUB socket."""
from __future__ import annotations

import time

import pytest
from executor_testing import collect

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError
from engine.executor.kv_cache import chain_block_hashes
from engine.executor.kv_events import BlockRemoved, BlockStored, KVEventQueue
from engine.executor.request import Request

T = 4  # the tiny engine's tokens per block
POOL_TOKENS = 96  # 24 blocks: the second prompt below needs all of them


def run(executor, prompt: list[int], batches: list) -> None:
    """One request to its end, then until the iteration that finished it has published its batch
    (responses go out inside the iteration, the batch at its end)."""
    seen = len(batches)
    (request_id,) = executor.enqueue_requests([Request(prompt, 1, end_id=-1)])
    collect(executor, [request_id])
    deadline = time.monotonic() + 5
    while len(batches) == seen and time.monotonic() < deadline:
        time.sleep(0.005)


def events_of(batches, kind):
    return [event for batch in batches for event in batch.events if isinstance(event, kind)]


def test_stored_then_evicted_blocks_reach_the_callback_and_a_zmq_subscriber(tiny_engine, tmp_path):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=POOL_TOKENS, kv_cache_events_endpoint=endpoint,
                            kv_cache_events_topic="kv-events")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    batches = []
    with Executor(tiny_engine, config, device="cpu") as executor:
        executor.subscribe_kv_events(batches.append)
        subscriber.connect(endpoint)
        subscriber.poll(200)  # let the subscription reach the PUB socket (ZMQ drops earlier messages)
        prompt = [(5 * k + 3) % 128 for k in range(13)]  # 3 full blocks + 1 token
        run(executor, prompt, batches)
        stored = events_of(batches, BlockStored)
        assert len(stored) == 1  # one chain, one event
        hashes = chain_block_hashes(prompt, T, [])
        assert stored[0].block_hashes == hashes and len(hashes) == 3
        assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[:12]
        assert stored[0].block_size == T and stored[0].medium == "GPU"
        assert not events_of(batches, BlockRemoved)

        run(executor, [(7 * k + 1) % 128 for k in range(POOL_TOKENS - 1)], batches)  # takes every block: evicts the first
        removed = {h for event in events_of(batches, BlockRemoved) for h in event.block_hashes}
        assert set(hashes) <= removed
        second = events_of(batches, BlockStored)[1:]
        assert all(b.parent_block_hash == a.block_hashes[-1] for a, b in zip(second, second[1:]))

        frames = []
        while subscriber.poll(500):
            frames.append(subscriber.recv_multipart())
    subscriber.close(linger=0)
    assert [f[0] for f in frames] == [b"kv-events"] * len(batches)
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(batches)))
    decoded = [msgpack.unpackb(f[2]) for f in frames]
    assert decoded == [batch.to_wire() for batch in batches]
    assert decoded[0][1][0][:4] == ["BlockStored", hashes, None, prompt[:12]]


def test_queue_merges_a_chain_and_splits_at_a_new_prompt():
    queue = KVEventQueue(block_size=2)
    queue.stored(1, None, (0, 1))
    queue.stored(2, 1, (2, 3))
    queue.stored(9, None, (5, 5))  # another prompt's first block: a new event
    queue.removed(1)
    queue.removed(2)
    batch = queue.drain()
    assert [e.to_wire() for e in batch.events] == [
        ["BlockStored", [1, 2], None, [0, 1, 2, 3], 2, None, "GPU"],
        ["BlockStored", [9], None, [5, 5], 2, None, "GPU"],
        ["BlockRemoved", [1, 2], "GPU"]]
    assert queue.drain() is None


def test_endpoint_is_validated_and_reaches_the_config_from_model_parameters():
    from serving.executor_config import executor_settings, to_executor_config

    with pytest.raises(ExecutorConfigError, match="kv_cache_events_endpoint"):
        ExecutorConfig(kv_cache_events_endpoint="5557").validate()
    params = {"kv_cache_events_endpoint": "tcp://*:5557", "kv_cache_events_topic": "kv"}
    config, ignored = to_executor_config(ExecutorConfig, executor_settings(params, {}))
    config.validate()
    assert (config.kv_cache_events_endpoint, config.kv_cache_events_topic) == ("tcp://*:5557", "kv")
    assert not set(params) & set(ignored)
