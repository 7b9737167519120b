"""The adapter cache: a host tier of parsed adapters behind the device slots of engine/lora/pool.py.

Keys are the requests' adapter ids (``lora_task_id``, or ``lora_id`` with a PEFT directory).

- Host tier: parsed adapters (``LoraAdapter``), least recently used first, bounded by
  ``host_bytes``. It always holds the adapters in slots and those of active requests (so a
  slot can be refilled whenever a waiting request needs it); the rest are dropped oldest first
  past the bound. A PEFT adapter dropped is read again from its directory when asked for; a
  ``lora_task_id`` dropped must be sent with its weights again (TensorRT-LLM's rule).
- Device slots: ``num_slots`` of them. A running request holds its adapter's slot until it ends;
  a slot no request holds keeps its adapter (a later request hits it) until a newcomer needs the
  room: the least recently released one is overwritten. When every slot is held, a newcomer
  waits (``acquire`` returns None) until a request ends: it never fails for want of a slot.

Parsing (TensorRT-LLM's rows or a PEFT directory) runs on loader threads; the executor's loop
owns everything else here (no locks): it calls ``prepare`` when a request arrives, ``loaded`` when
the parse finished, ``acquire`` when the scheduler admits the request, ``release`` when it ends.
"""
from __future__ import annotations

import os
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from engine.lora.adapter import LoraAdapter, LoraError, adapter_from_trtllm, load_peft_adapter, read_peft_config
from engine.lora.stats import LoraCacheStats

LOADER_THREADS = 2


class RunnerSlots:
    """The cache's view of a runner's pools (engine/executor/runner.py): loads go through the
    runner, so in leader mode every rank loads its own shards of the adapter."""

    def __init__(self, runner):
        self.runner = runner
        self.num_slots = runner.lora_pools.num_slots

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        self.runner.load_adapter(slot, adapter)

    def check(self, adapter: LoraAdapter) -> None:
        self.runner.check_adapter(adapter)


class AdapterCache:
    """``pools``: the device slots (``write(slot, adapter)``, ``check(adapter)``, ``num_slots``);
    in leader mode, an object that does the same on every rank."""

    def __init__(self, pools, model_config, *, max_rank: int, host_bytes: int):
        self.pools = pools
        self.model_config = model_config
        self.max_rank = max_rank
        self.host_bytes = host_bytes
        self.host: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.host_sizes: dict[int, int] = {}  # key -> its adapter's bytes (LoraAdapter.nbytes walks every tensor)
        self.host_total = 0
        self.paths: dict[int, str] = {}  # key -> the PEFT directory it came from (kept after eviction)
        self.names: dict[int, str] = {}
        self.loading: dict[int, Future] = {}
        self.users: Counter = Counter()  # key -> active requests using it
        num_slots = pools.num_slots
        self.slot_of: dict[int, int] = {}
        self.key_in_slot: list[int | None] = [None] * num_slots
        self.holders = [0] * num_slots
        self.unheld: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # LRU first
        self.stats = LoraCacheStats()
        self._threads = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="lora-loader")

    def snapshot(self) -> LoraCacheStats:
        """A copy the metrics thread may read while the loop goes on."""
        return replace(self.stats, requests=Counter(self.stats.requests))

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ----- arrival -----
    def prepare(self, lora) -> Future | None:
        """A request with ``lora`` (engine.executor.request.LoraRequest) arrived: None when its
        adapter is cached, else the Future of its parse (then call ``loaded``). Raises LoraError
        for what is wrong at once (an unknown id without weights, a bad PEFT directory)."""
        key = lora.task_id
        if lora.name:
            self.names[key] = lora.name
        path = os.path.abspath(lora.path) if lora.path else None
        cached = key in self.host or key in self.slot_of
        if path is not None and key in self.paths and self.paths[key] != path:
            raise LoraError(f"lora_id {key} already names the adapter in {self.paths[key]}; "
                            f"give the adapter in {path} another lora_id")
        if cached:
            return None
        if key in self.loading:
            return self.loading[key]
        if lora.weights is not None:
            future = self._threads.submit(adapter_from_trtllm, lora.weights, lora.config, self.model_config,
                                          self.max_rank, f"lora_task_id {key}")
        elif path is not None or key in self.paths:
            path = path or self.paths[key]
            read_peft_config(path, self.max_rank)  # the cheap checks, now: a bad directory fails at once
            self.paths[key] = path
            future = self._threads.submit(load_peft_adapter, path, self.model_config, self.max_rank)
        else:
            raise LoraError(f"lora_task_id {key} is not in the LoRA cache; send lora_weights and lora_config "
                            "with it (a task's first request carries all three; later ones may send the id alone)")
        self.loading[key] = future
        return future

    def loaded(self, key: int, future: Future) -> None:
        """Take a finished parse into the host tier; raises its error (LoraError: bad adapter)."""
        if self.loading.get(key) is future:
            del self.loading[key]
        adapter = future.result()
        if key in self.host or key in self.slot_of:
            return  # another request's parse of the same id got there first
        self._put_host(key, adapter)

    def add(self, key: int, adapter: LoraAdapter, *, name: str | None = None, path: str | None = None) -> None:
        """Put a parsed adapter in the host tier directly (lora_prefetch_dir)."""
        if name:
            self.names[key] = name
        if path:
            self.paths[key] = path
        self._put_host(key, adapter)

    def preload(self, key: int) -> None:
        """Put a host-tier adapter into a slot without holding it (lora_prefetch_dir): a later
        request hits it. Nothing when every slot is held."""
        slot = self.acquire(key)
        if slot is not None:
            self.holders[slot] -= 1
            self.unheld[slot] = None

    def name_of(self, key: int) -> str:
        return self.names.get(key) or f"lora_task_id {key}"

    def note_request(self, key: int) -> None:
        """An accepted request will use ``key`` (until ``release``)."""
        self.users[key] += 1
        self.stats.requests[self.name_of(key)] += 1

    def forget_request(self, key: int) -> None:
        """An accepted request ended before it held a slot."""
        self._drop_user(key)

    # ----- slots -----
    def acquire(self, key: int) -> int | None:
        """The slot holding ``key``'s adapter for one more request, loading it if needed; None
        when every slot is held by running requests (the request waits)."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.stats.gpu_hits += 1
        else:
            if not self.unheld:
                return None
            slot = next(iter(self.unheld))  # least recently released (free slots come first)
            adapter = self.host.get(key)
            if adapter is None:
                raise LoraError(f"{self.name_of(key)} left the host cache before it was loaded")
            old = self.key_in_slot[slot]
            self.pools.write(slot, adapter)
            if old is not None:
                del self.slot_of[old]
                self.stats.gpu_evictions += 1
            self.key_in_slot[slot], self.slot_of[key] = key, slot
            self.stats.gpu_loads += 1
            self.host.move_to_end(key)
            if old is not None:
                self._trim_host()
        self.holders[slot] += 1
        self.unheld.pop(slot, None)
        self._update_gauges()
        return slot

    def release(self, key: int) -> None:
        """A request that held ``key``'s slot ended."""
        slot = self.slot_of[key]
        self.holders[slot] -= 1
        if self.holders[slot] == 0:
            self.unheld[slot] = None  # most recently released: evicted last
        self._drop_user(key)

    # ----- host tier -----
    def _put_host(self, key: int, adapter: LoraAdapter) -> None:
        self.pools.check(adapter)
        self.host[key] = adapter
        self.host_sizes[key] = adapter.nbytes
        self.host_total += self.host_sizes[key]
        self.stats.host_loads += 1
        self._trim_host()

    def _drop_user(self, key: int) -> None:
        self.users[key] -= 1
        if self.users[key] <= 0:
            del self.users[key]
        self._trim_host()

    def _trim_host(self) -> None:
        """Drop least recently used host entries over ``host_bytes``, but never one in a slot or
        one an active request uses. It runs whenever a request ends: cheap unless over the bound."""
        if self.host_total > self.host_bytes:
            for key in list(self.host):
                if self.host_total <= self.host_bytes:
                    break
                if self.users.get(key) or key in self.slot_of:
                    continue
                del self.host[key]
                self.host_total -= self.host_sizes.pop(key)
                self.stats.host_evictions += 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.stats.adapters_in_gpu = len(self.slot_of)
        self.stats.adapters_in_host = len(self.host)
