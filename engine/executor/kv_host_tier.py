"""KV cache host-memory tier: reusable blocks evicted from the GPU pool wait in host memory.

TensorRT-LLM's ``kv_cache_host_memory_bytes`` / ``kv_cache_onboard_blocks``. With prefix reuse on,
when the BlockManager (engine/executor/kv_cache.py) evicts a registered block to make room, its KV
(every layer's K and V) is copied to a slot of a host pool and its hash stays findable there; a
prefix match that misses on the GPU but hits here gets a fresh GPU block and the KV is copied back
("onboarding"), after which the sequence uses it exactly like a GPU hit.

Two parts, so that the bookkeeping is testable without tensors:
- ``HostKVTier``: which hash lives in which host slot (LRU over slots, bounded by the byte budget),
  the object the BlockManager calls (its ``host_tier`` hook). It speaks slot and block ids.
- ``HostKVPool``: the host tensor and the copies between it and the runner's device pool.

Each hash lives in at most one tier: onboarding takes the entry out of host memory (the slot is
free again), and a block registered on the GPU drops a host copy of the same hash.

Ordering invariant (why no synchronisation is needed): every copy is enqueued, when the
BlockManager asks for it, on the current CUDA stream of the executor thread, the stream every
forward runs on. The BlockManager runs inside ``Scheduler.schedule``, which precedes the launch of
the step it plans. So:
- an offload (device -> host) of a block evicted while planning step N+1 is queued after step N's
  kernels and before step N+1's forward, the first one that can write the reallocated block. With
  the overlap scheduler step N may still be running; it does not write an evicted block's positions
  (a registered block was complete before registration), and the copy waits behind it anyway;
- an onboard (host -> device) is queued before the forward that reads the block, and after every
  earlier offload into the slot it reads (host slots are only ever written by these copies, in
  program order on the one stream);
- a host slot freed by onboarding is reused by a later offload that is queued after the onboard.
The host pool is never read or written by the CPU, so non-blocking copies into and out of pinned
memory need no event.

Leader mode (tensor parallelism): the BlockManager runs on rank 0 only, so each copy goes to every
rank as a CALL of ModelRunner.copy_kv_host_blocks in the step plan (``LeaderCopies``); every rank
keeps a host pool of the same slots for its own KV shard (``kv_cache_host_memory_bytes`` is per
rank). Plans reach the workers in order, so on each rank a copy lands between the same two
forwards as on rank 0 and the invariant above holds there too.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

# Copies go through an integer view of the pool with the element's width: index ops are defined for
# every integer type on CPU and CUDA (not for float8), and the bytes move unchanged.
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
STAGING_BYTES = 64 << 20  # the device staging buffer of one batched copy stays under this


class HostKVPool:
    """The host copy of KV blocks and the copies to and from the device pool.

    Device pool (runner.kv_cache): (num_layers, 2, num_blocks, tokens_per_block, kv_heads, head_dim), a
    view of head-major blocks (runner.allocate_kv_cache); the gathers and scatters below go through it.
    Host pool: (num_slots, num_layers, 2, tokens_per_block, kv_heads, head_dim), slot-major so that
    one slot is one contiguous run of bytes (a device <-> pinned-host copy of it is one async memcpy;
    a non-contiguous host side would make torch stage it through pageable memory and block).
    Pinned on CUDA; plain CPU memory when the device pool is on the CPU.
    """

    def __init__(self, device_pool: Callable[[], torch.Tensor], num_slots: int):
        self._device_pool = device_pool  # read at each copy: the runner owns (and may replace) its pool
        pool = device_pool()
        num_layers, two, _, tokens, heads, head_dim = pool.shape
        self.int_dtype = _SAME_WIDTH_INT[pool.element_size()]
        self.block_bytes = num_layers * two * tokens * heads * head_dim * pool.element_size()
        self.num_slots = num_slots
        self.host = torch.empty((num_slots, num_layers, two, tokens, heads, head_dim), dtype=self.int_dtype,
                                pin_memory=pool.device.type == "cuda")
        self._chunk = max(1, STAGING_BYTES // self.block_bytes)

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def _by_block(self) -> torch.Tensor:
        """The device pool seen block-major, (num_blocks, L, 2, T, H, D): a view, no copy; indexing
        its first dimension gathers or scatters whole blocks in one kernel."""
        return self._device_pool().view(self.int_dtype).permute(2, 0, 1, 3, 4, 5)

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        host = torch.tensor(ids, dtype=torch.int64)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host

    @torch.inference_mode()
    def copy_to_host(self, block_ids: list[int], slots: list[int]) -> None:
        """host[slots[i]] = pool[:, :, block_ids[i]] for every i (slots distinct)."""
        by_block = self._by_block()
        if by_block.device.type != "cuda":
            self.host.index_copy_(0, torch.tensor(slots), by_block.index_select(0, torch.tensor(block_ids)))
            return
        for start in range(0, len(block_ids), self._chunk):
            blocks, dest = block_ids[start:start + self._chunk], slots[start:start + self._chunk]
            # One gather for the chunk, (n, L, 2, T, H, D) contiguous on the device, then one async
            # memcpy into pinned memory per run of consecutive slots.
            staged = by_block.index_select(0, self._index(blocks, by_block.device))
            for first, count, at in _runs(dest):
                self.host[first:first + count].copy_(staged[at:at + count], non_blocking=True)

    @torch.inference_mode()
    def copy_to_device(self, slots: list[int], block_ids: list[int]) -> None:
        """pool[:, :, block_ids[i]] = host[slots[i]] for every i (block ids distinct)."""
        by_block = self._by_block()
        if by_block.device.type != "cuda":
            by_block.index_copy_(0, torch.tensor(block_ids), self.host.index_select(0, torch.tensor(slots)))
            return
        for start in range(0, len(slots), self._chunk):
            src, blocks = slots[start:start + self._chunk], block_ids[start:start + self._chunk]
            # One async memcpy per run of consecutive slots into a device staging buffer, then one
            # scatter of the chunk into the pool.
            staged = torch.empty((len(src),) + tuple(self.host.shape[1:]), dtype=self.int_dtype, device=by_block.device)
            for first, count, at in _runs(src):
                staged[at:at + count].copy_(self.host[first:first + count], non_blocking=True)
            by_block.index_copy_(0, self._index(blocks, by_block.device), staged)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, length, position in ids) of each run of consecutive ids: [4, 5, 6, 9] ->
    [(4, 3, 0), (9, 1, 3)]."""
    runs: list[tuple[int, int, int]] = []
    for position, value in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][1] == value:
            first, count, at = runs[-1]
            runs[-1] = (first, count + 1, at)
        else:
            runs.append((value, 1, position))
    return runs


class HostKVTier:
    """Which block hash lives in which host slot; the BlockManager's ``host_tier`` hook.

    A slot is in exactly one of: ``free_slots``, ``entries`` (findable: hash -> slot, least recently
    offloaded first) or ``claimed`` (taken by an onboarding in progress: no longer findable, not yet
    free, so an offload made by the same onboarding's allocation cannot overwrite it).

    ``copier``: an object with copy_to_host(block_ids, slots) and copy_to_device(slots, block_ids)
    (a HostKVPool, or a recorder in tests).
    """

    def __init__(self, num_slots: int, copier):
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.copier = copier
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.entries: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.slot_tokens: dict[int, tuple[int, ...]] = {}  # slot -> its block's tokens (rules out collisions)
        self.claimed: set[int] = set()
        self.num_host_evictions = 0  # cumulative: entries dropped to make room for newer ones

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    def offload(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> int:
        """Copy evicted GPU blocks (block id, hash, tokens) to host slots; returns how many were copied.
        A hash already here is only marked recently used. The least recently offloaded entries make
        room; never one written by this same call (more blocks than slots: the rest are dropped)."""
        block_ids, slots = [], []
        for block_id, block_hash, tokens in blocks:
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
                continue
            slot = self._take_slot(written_now=len(slots))
            if slot is None:
                break
            self.entries[block_hash] = slot
            self.slot_tokens[slot] = tokens
            block_ids.append(block_id)
            slots.append(slot)
        if block_ids:
            self.copier.copy_to_host(block_ids, slots)
        return len(block_ids)

    def _take_slot(self, written_now: int) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        # Every entry written by this call is younger than every other: if the oldest entry is one
        # of them, so are all, and reusing its slot would overwrite a copy queued a moment ago.
        if len(self.entries) <= written_now:
            return None
        _, slot = self.entries.popitem(last=False)
        del self.slot_tokens[slot]
        self.num_host_evictions += 1
        return slot

    def contains(self, block_hash: int, tokens: tuple[int, ...]) -> bool:
        slot = self.entries.get(block_hash)
        return slot is not None and self.slot_tokens[slot] == tokens

    def claim(self, block_hashes: list[int]) -> list[int]:
        """Take these (found) entries out of the index; their slots stay reserved until ``onboard``."""
        slots = [self.entries.pop(block_hash) for block_hash in block_hashes]
        self.claimed.update(slots)
        return slots

    def onboard(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy claimed slots into freshly allocated GPU blocks; the slots are free afterwards (a
        later offload into one is queued after this copy on the same stream)."""
        if slots:
            self.copier.copy_to_device(slots, block_ids)
        for slot in slots:
            self.claimed.remove(slot)
            del self.slot_tokens[slot]
            self.free_slots.append(slot)

    def discard(self, block_hash: int) -> None:
        """The GPU registered this hash again (recomputed): the host copy is redundant; free its slot."""
        slot = self.entries.pop(block_hash, None)
        if slot is not None:
            del self.slot_tokens[slot]
            self.free_slots.append(slot)

    def check_invariants(self) -> None:
        indexed = set(self.entries.values())
        free = set(self.free_slots)
        assert len(free) == len(self.free_slots), "a slot is free twice"
        assert len(indexed) == len(self.entries), "two hashes share a slot"
        assert not (indexed & free) and not (indexed & self.claimed) and not (free & self.claimed)
        assert len(indexed) + len(free) + len(self.claimed) == self.num_slots
        assert set(self.slot_tokens) == indexed | self.claimed


class LeaderCopies:
    """The copier of leader mode: each copy runs on every rank (``runner.call_on_all_ranks``), each
    rank on its own shard's pool and host pool; the host pools are made on every rank here."""

    def __init__(self, leader_runner, num_slots: int, block_bytes: int):
        self._runner = leader_runner
        self.num_slots = num_slots
        self.block_bytes = block_bytes  # one rank's share of a block
        self.nbytes = num_slots * block_bytes  # per rank
        self._runner.call_on_all_ranks("copy_kv_host_blocks", num_slots, "", [], [])

    def copy_to_host(self, block_ids: list[int], slots: list[int]) -> None:
        self._runner.call_on_all_ranks("copy_kv_host_blocks", self.num_slots, "to_host", list(block_ids), list(slots))

    def copy_to_device(self, slots: list[int], block_ids: list[int]) -> None:
        self._runner.call_on_all_ranks("copy_kv_host_blocks", self.num_slots, "to_device", list(block_ids), list(slots))


def make_host_tier(runner, *, host_memory_bytes: int, onboard_blocks: bool, enable_reuse: bool) -> HostKVTier | None:
    """The host tier the executor's BlockManager uses, or None when there is none.

    None when the byte budget is 0, when prefix reuse is off (no block is reusable, nothing to keep),
    when the budget is below one block, or when ``onboard_blocks`` is False: TRT-LLM then lets its
    kernels read such blocks from host memory; ours read KV only from the device pool, so a host hit
    that is not brought back is a miss, and keeping blocks there would only cost copies.
    ``runner``: a ModelRunner, or leader mode's LeaderRunner (the budget is then per rank).
    """
    if host_memory_bytes <= 0 or not enable_reuse or not onboard_blocks:
        return None
    if runner.kv_cache is None:
        raise RuntimeError("the runner's KV pool must be allocated before the host tier")
    num_slots = host_memory_bytes // runner.kv_block_bytes
    if num_slots == 0:
        return None
    if runner.build_config.tp_size > 1:
        return HostKVTier(num_slots, LeaderCopies(runner, num_slots, runner.kv_block_bytes))
    return HostKVTier(num_slots, HostKVPool(lambda: runner.kv_cache, num_slots))
