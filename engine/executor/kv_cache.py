"""Paged KV cache block manager: pure Python, speaks block ids, never touches a tensor.

The pool holds ``num_blocks`` blocks of ``tokens_per_block`` token slots. A sequence owns an
ordered block table; token position p lives in ``block_table[p // tokens_per_block]``.

Reuse (``enable_reuse``): every *full* block of a sequence gets a chained hash

    h0 = hash((None, tokens[0:T]))   h1 = hash((h0, tokens[T:2T]))   ...

so equal hashes mean equal prefixes. A full, computed block is registered under its hash; a
later sequence whose prompt starts with the same tokens takes a reference on it instead of
recomputing it. When the last reference goes, a registered block is not wiped: it stays in the
free queue with its hash, and is evicted (its hash dropped) only when allocation needs it.

Sliding windows (``free_blocks_outside_window``): when every layer of the model attends only to
its last W tokens, a block whose positions all lie before ``first uncomputed position - W + 1`` is
never read again. It goes back to the pool, and its block-table entry becomes ``FREED_BLOCK``
(-1) so the table keeps its indexing (position p still lives in entry p // tokens_per_block);
the attention kernels never read entries before the window (kernels/attention.py). With reuse
on, only blocks already registered are freed, so a freed block stays findable by its hash until
it is evicted, like any block whose sequence finished.

Host tier (``host_tier``, engine/executor/kv_host_tier.py): an optional hook that keeps evicted
registered blocks in host memory. At eviction (``allocate``) the manager hands it the evicted
blocks' ids and hashes in one call (it copies their KV out); at prefix matching
(``acquire_cached_prefix``) a block missing on the GPU but held by the tier is "onboarded": the tier
gives up the entry, a free GPU block is allocated, the tier copies the KV into it, and the block is
registered and used like a GPU hit. The manager itself still never touches a tensor. Each hash is in
at most one tier: registering a hash on the GPU drops the tier's copy.

Invariants (checked by tests/executor/test_kv_cache.py and the hypothesis property test):
- a block is in the free queue iff its ref_count is 0;
- ``hash_to_block`` maps only to blocks whose ``block_hash`` is that hash;
- num_free_blocks + blocks with ref_count > 0 == num_blocks;
- with a host tier: no hash is both in ``hash_to_block`` and in the tier, and no slot stays claimed
  between calls (tests/executor/test_kv_host_tier.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

FREED_BLOCK = -1  # a block-table entry whose block went back to the pool (outside every layer's window)


def cache_token_ids(seq) -> list:
    """What blocks of ``seq`` are keyed by: its token ids, except that a prompt with table rows
    (``prompt_cache_keys``, engine/executor/prompt_table.py) is keyed by the rows' content."""
    keys = getattr(seq, "prompt_cache_keys", None)
    return seq.token_ids if keys is None else keys + seq.token_ids[len(keys):]


def chain_block_hashes(token_ids: list[int], tokens_per_block: int, known: list[int]) -> list[int]:
    """Extend ``known`` (hashes of the first len(known) full blocks) to every full block of token_ids."""
    if (len(known) + 1) * tokens_per_block > len(token_ids):
        return known  # no new full block: the common decode step costs nothing
    hashes = list(known)
    prev = hashes[-1] if hashes else None
    for start in range(len(hashes) * tokens_per_block, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        prev = hash((prev, tuple(token_ids[start:start + tokens_per_block])))
        hashes.append(prev)
    return hashes


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash to rule out collisions


class SequenceBlocks(Protocol):
    """What the manager needs from a sequence (engine.executor.request.Sequence has it)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    block_hashes: list[int]
    num_registered_blocks: int  # block_ids[:n] are registered (or were already cached): never revisited
    num_window_freed_blocks: int  # block_ids[:n] are FREED_BLOCK: they fell out of the attention window


class HostTier(Protocol):
    """What the manager needs from a second tier (engine.executor.kv_host_tier.HostKVTier has it).
    Blocks are (block id, hash, tokens); the tier copies KV itself, in call order."""

    def offload(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> int: ...  # -> how many it kept
    def contains(self, block_hash: int, tokens: tuple[int, ...]) -> bool: ...
    def claim(self, block_hashes: list[int]) -> list[int]: ...  # found entries -> their slots, reserved
    def onboard(self, slots: list[int], block_ids: list[int]) -> None: ...  # copy back, free the slots
    def discard(self, block_hash: int) -> None: ...


class BlockManager:
    """Ref-counted blocks, a hash -> block map for prefix reuse, and an LRU free queue.

    Why an ``OrderedDict`` for the free queue rather than a ``deque``: a prefix hit revives a
    cached block from the *middle* of the queue, which must be O(1). Eviction order: unhashed
    blocks first (they hold nothing reusable; freed ones go to the front), then hashed blocks
    least recently freed first. A sequence frees its blocks tail first, so its last blocks
    (least likely to be shared) are evicted before its first ones.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = True,
                 host_tier: HostTier | None = None):
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and tokens_per_block ({tokens_per_block}) must be > 0")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_reuse = enable_reuse
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.host_tier = host_tier if enable_reuse else None  # only registered (reusable) blocks go there
        self.total_reused_blocks = 0  # cumulative prefix hits, onboarded ones included
        self.total_new_blocks = 0  # cumulative fresh allocations (onboarding allocations are hits, not new)
        self.total_onboarded_blocks = 0  # cumulative prefix hits brought back from the host tier
        self.total_offloaded_blocks = 0  # cumulative evicted blocks the host tier kept
        self.events = None  # a KVEventQueue (engine/executor/kv_events.py): told of every hash registered/dropped

    # ----- integer API -----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def match_prefix(self, block_hashes: list[int], token_ids: list[int], max_blocks: int) -> list[int]:
        """Cached block ids for the longest prefix of ``block_hashes`` (at most max_blocks). Takes no refs."""
        if not self.enable_reuse:
            return []
        T = self.tokens_per_block
        hits: list[int] = []
        for i, block_hash in enumerate(block_hashes[:max_blocks]):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids[i * T:(i + 1) * T]):
                break
            hits.append(block_id)
        return hits

    def acquire(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (a prefix hit, or a beam sharing its parent's blocks)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the front of the free queue, evicting their cached hashes
        (to the host tier, when there is one)."""
        block_ids = self._take_free_blocks(num_blocks)
        self.total_new_blocks += num_blocks
        return block_ids

    def _take_free_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self.free_queue)} are free")
        block_ids = []
        evicted: list[tuple[int, int, tuple[int, ...]]] = []  # registered blocks losing their hash
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"block {block_id} in the free queue has refs"
            if block.block_hash is not None and self.host_tier is not None:
                evicted.append((block_id, block.block_hash, block.token_ids))
            self._evict_hash(block)
            block.ref_count = 1
            block_ids.append(block_id)
        if evicted:  # one call: the tier copies the batch together, before anything can write these blocks
            self.total_offloaded_blocks += self.host_tier.offload(evicted)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, tail first; a block with no refs joins the free queue.
        FREED_BLOCK entries (already returned when they left the window) are skipped."""
        for block_id in reversed(block_ids):
            if block_id == FREED_BLOCK:
                continue
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...],
                 parent_hash: int | None = None) -> None:
        """Make a full, computed block findable by its hash (first writer wins on duplicates).
        ``parent_hash``: the chain's previous block's hash (None for a first block), for KV events."""
        block = self.blocks[block_id]
        if not self.enable_reuse or block.block_hash is not None or block_hash in self.hash_to_block:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)
        if self.host_tier is not None:
            self.host_tier.discard(block_hash)  # recomputed here: the host copy is redundant

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block.block_id:
                del self.hash_to_block[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = block.token_ids = None

    # ----- sequence-level helpers (the scheduler's vocabulary) -----
    def num_new_blocks_needed(self, seq: SequenceBlocks, num_new_tokens: int) -> int:
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_ids))

    def acquire_cached_prefix(self, seq: SequenceBlocks) -> int:
        """For a sequence with no blocks yet: reuse cached blocks of its prefix; returns blocks reused.

        At least one token is always left to compute (its logits give the next token), and the
        block holding the last token is never shared, so a shared block is never written again.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        token_ids = cache_token_ids(seq)
        seq.block_hashes = chain_block_hashes(token_ids, self.tokens_per_block, seq.block_hashes)
        max_blocks = (len(seq.token_ids) - 1) // self.tokens_per_block
        if not getattr(seq, "can_reuse_prefix", True):  # e.g. context logits need every prompt position
            max_blocks = 0
        hits = self.match_prefix(seq.block_hashes, token_ids, max_blocks)
        self.acquire(hits)
        if self.host_tier is not None and len(hits) < max_blocks:
            hits += self._continue_from_host(seq.block_hashes, token_ids, len(hits), max_blocks)
        self.total_reused_blocks += len(hits)
        seq.block_ids = hits
        seq.num_computed_tokens = len(hits) * self.tokens_per_block
        seq.num_registered_blocks = len(hits)
        return len(hits)

    def _continue_from_host(self, block_hashes: list[int], token_ids: list[int], start: int,
                            max_blocks: int) -> list[int]:
        """Extend a prefix hit that ended on the GPU at block ``start`` through both tiers: each next
        block from the GPU if it is there, else onboarded from the host tier, up to the first block
        in neither. Returns the block ids (GPU hits acquired, onboarded blocks allocated with one
        ref). Onboarding takes free blocks, so the chain also stops where the free queue would run out.
        """
        T = self.tokens_per_block
        chain: list[int | None] = []  # a GPU block id, or None: filled by onboarding below
        host_hashes: list[int] = []
        for i in range(start, max_blocks):
            tokens = tuple(token_ids[i * T:(i + 1) * T])
            block_id = self.hash_to_block.get(block_hashes[i])
            if block_id is not None and self.blocks[block_id].token_ids == tokens:
                takes_a_free_block = self.blocks[block_id].ref_count == 0
                if takes_a_free_block and self.num_free_blocks - 1 < len(host_hashes):
                    break  # acquiring it would leave too few free blocks for the onboarding before it
                self.acquire([block_id])  # off the free queue: the allocation below cannot evict it
                chain.append(block_id)
            elif len(host_hashes) < self.num_free_blocks and self.host_tier.contains(block_hashes[i], tokens):
                host_hashes.append(block_hashes[i])
                chain.append(None)
            else:
                break
        if host_hashes:
            # Claim before allocating: the allocation may offload evicted blocks, and those must not
            # take the slots being read. The tier's copies run in call order: offloads, then onboard.
            slots = self.host_tier.claim(host_hashes)
            onboarded = self._take_free_blocks(len(slots))
            self.host_tier.onboard(slots, onboarded)
            self.total_onboarded_blocks += len(onboarded)
            fill = iter(onboarded)
            chain = [next(fill) if block_id is None else block_id for block_id in chain]
            for i, block_id in enumerate(chain, start):
                if self.blocks[block_id].block_hash is None:
                    self.register(block_id, block_hashes[i], tuple(token_ids[i * T:(i + 1) * T]),
                                  block_hashes[i - 1] if i else None)
        return chain

    def append_slots(self, seq: SequenceBlocks, num_new_tokens: int) -> int | None:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens; None (nothing taken) if the pool is short."""
        needed = self.num_new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return None
        seq.block_ids.extend(self.allocate(needed))
        return needed

    def register_computed_blocks(self, seq: SequenceBlocks) -> None:
        """Register every full block whose tokens all have KV now."""
        if not self.enable_reuse:
            return
        T = self.tokens_per_block
        num_full = min(seq.num_computed_tokens // T, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        token_ids = cache_token_ids(seq)
        seq.block_hashes = chain_block_hashes(token_ids, T, seq.block_hashes)
        for i in range(seq.num_registered_blocks, num_full):
            self.register(seq.block_ids[i], seq.block_hashes[i], tuple(token_ids[i * T:(i + 1) * T]),
                          seq.block_hashes[i - 1] if i else None)
        seq.num_registered_blocks = num_full

    def free_blocks_outside_window(self, seq: SequenceBlocks, window: int) -> int:
        """Return to the pool the blocks of ``seq`` that no query from its first uncomputed position
        on can see (all their positions < num_computed_tokens - window + 1); returns how many.

        Only for a sequence whose blocks no other sequence shares through its table (no forks or
        beams: they copy table prefixes); blocks shared through prefix reuse are ref-counted and
        stay with their other holders.
        """
        T = self.tokens_per_block
        dead = max(0, seq.num_computed_tokens - window + 1) // T
        if self.enable_reuse:
            dead = min(dead, seq.num_registered_blocks)  # register first: a freed entry is never revisited
        first = seq.num_window_freed_blocks
        if dead <= first:
            return 0
        self.free(seq.block_ids[first:dead])
        seq.block_ids[first:dead] = [FREED_BLOCK] * (dead - first)
        seq.num_window_freed_blocks = dead
        return dead - first

    def release(self, seq: SequenceBlocks) -> None:
        """Free all of ``seq``'s blocks; it must recompute from scratch if it runs again."""
        self.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_window_freed_blocks = 0

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
        for block_hash, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash
        if self.host_tier is not None:
            assert not self.host_tier.claimed, "an onboarding left claimed host slots"
            both = set(self.hash_to_block) & set(self.host_tier.entries)
            assert not both, f"hashes in both tiers: {sorted(both)[:5]}"
            self.host_tier.check_invariants()
