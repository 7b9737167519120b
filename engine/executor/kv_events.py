"""KV cache events for cache-aware routers: which prefix blocks this executor holds, as a stream.

The block manager (engine/executor/kv_cache.py) calls a ``KVEventQueue`` where the prefix cache
registers a full block (stored: the block became findable by its hash) and where it drops a hash
(removed: evicted for reuse). The executor drains the queue once per iteration into one batch
and hands it to its sinks: a ZMQ PUB socket and/or an in-process callback.

Event and wire shape follow vLLM's KV event stream (``--kv-events-config``), which Dynamo's and
Ray Serve's KV routers and the vLLM production-stack router consume:

    batch  = [ts (float seconds), [event, ...]]                    msgpack array
    event  = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
           | ["BlockRemoved", block_hashes, medium]
           | ["AllBlocksCleared"]
    ZMQ    = multipart [topic (utf-8), sequence number (8 bytes, big endian), msgpack(batch)]

A BlockStored event holds one run of consecutive chain blocks: block_hashes[i]'s parent is
block_hashes[i-1], the first one's is parent_block_hash (None for a prompt's first block), and
token_ids is the run's tokens, block_size per block. Hashes are the manager's chained hashes
(signed 64-bit ints); they are stable only within one process (Python's hash of None changes
between processes before 3.12), so a router keys each worker's blocks by that worker's stream.
medium is always "GPU": the host tier (kv_host_tier.py) publishes nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

MEDIUM = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM

    def to_wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium]


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM

    def to_wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


@dataclass
class KVEventBatch:
    ts: float
    events: list = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.ts, [event.to_wire() for event in self.events]]


class KVEventQueue:
    """What the block manager writes to. Consecutive stored blocks of one chain merge into one
    BlockStored event, consecutive removals into one BlockRemoved, so a prompt costs one event."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size))

    def removed(self, block_hash: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain(self) -> KVEventBatch | None:
        if not self.events:
            return None
        batch, self.events = KVEventBatch(time.time(), self.events), []
        return batch


def _require(module: str, package: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise ImportError(f"kv_cache_events_endpoint is set but the Python package {package!r} is missing: "
                          f"pip install {package} (or leave kv_cache_events_endpoint empty)") from exc


class ZmqEventPublisher:
    """A ZMQ PUB socket bound at ``endpoint`` (e.g. tcp://*:5557) sending vLLM-shaped frames."""

    def __init__(self, endpoint: str, topic: str = "kv-events"):
        zmq = _require("zmq", "pyzmq")
        self._msgpack = _require("msgpack", "msgpack")
        self._context = zmq.Context.instance()
        self.socket = self._context.socket(zmq.PUB)
        self.socket.bind(endpoint)
        self.topic = topic.encode()
        self.sequence = 0

    def __call__(self, batch: KVEventBatch) -> None:
        payload = self._msgpack.packb(batch.to_wire(), use_bin_type=True)
        self.socket.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), payload))
        self.sequence += 1

    def close(self) -> None:
        self.socket.close(linger=500)  # (ms) frames already queued still go out to connected subscribers


class KVEventPublisher:
    """The executor's end: ``publish()`` once per iteration drains the queue into every sink.
    A sink is a callable taking a KVEventBatch (the ZMQ publisher is one; tests pass a list's append)."""

    def __init__(self, queue: KVEventQueue, sinks: list[Callable[[KVEventBatch], Any]] | None = None):
        self.queue = queue
        self.sinks = list(sinks or [])

    def publish(self) -> KVEventBatch | None:
        batch = self.queue.drain()
        if batch is not None:
            for sink in self.sinks:
                sink(batch)
        return batch

    def close(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()


def make_kv_event_publisher(block_size: int, endpoint: str = "",
                            topic: str = "kv-events") -> KVEventPublisher | None:
    """None when no endpoint is configured (the block manager then records nothing); callbacks
    are added later with ``publisher.sinks.append``."""
    if not endpoint:
        return None
    return KVEventPublisher(KVEventQueue(block_size), [ZmqEventPublisher(endpoint, topic)])
