"""The generation side of disaggregated serving (engine/executor/disaggregated.py): a generation_only request's
prompt KV brought into this executor's pool over the transport its blob names -- ``local`` (a pull from a peer
executor's pool, kv_pull.py), ``shm`` (a reader thread copies the file in, kv_transfer_shm.py), ``nixl`` (a READ,
kv_transfer_nixl.py), ``cuda_ipc`` / ``auto`` (a pull from the mapped context pool, or shm through the offer,
kv_transfer_cuda_ipc.py).

The generation loop polls its imports at each step (``finish_pulls``); a finished one releases the source pin, and
its sequence gets its blocks, its first token and its place in the scheduler, the loop's stream waiting on the
pull's event. Until then the sequence holds no blocks of its own (the import does): a cancel meanwhile leaves the
import to finish and free them.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from engine.executor import kv_export, kv_peer, kv_transfer_cuda_ipc, kv_transfer_nixl, kv_transfer_shm
from engine.executor.context_phase import ContextPhaseError, check, check_nixl, decode
from engine.executor.kv_pull import Pull, PullStreams


class _Import:
    """A generation_only sequence whose KV is on its way (shm: the file being read, then a pull in progress)."""
    __slots__ = ("seq", "fields", "dst_ids", "pull", "source", "extra_ms", "reading")

    def __init__(self, seq, fields: dict, dst_ids: list[int], pull=None, source=None, reading=None):
        self.seq, self.fields, self.dst_ids, self.pull = seq, fields, dst_ids, pull
        self.source = source  # local transport: the context side (kv_export.KvExports), released when the pull is done
        self.reading = reading  # shm: the reader thread's future of (the blocks copied in, ms)
        self.extra_ms = 0.0  # shm: reading the file and copying it in

    def ready(self) -> bool:
        return self.reading.done() if self.reading is not None else self.pull.done()


class KvImports:
    """One executor's imports (its loop thread only). ``side``: its Disaggregation (executor, timeout_s, the IPC
    side, the NIXL agent and the loop's wake-up are its)."""

    def __init__(self, side):
        self.side = side
        self.executor = side.executor
        self.num_transfers = 0  # generation_only requests whose KV arrived here
        self.kv_cache_transfer_ms = 0.0  # cumulative time of those copies
        self.num_quarantined_blocks = 0  # never freed: a failed NIXL READ into them could not be cancelled
        self._quarantined: list = []  # (their pulls: the READs' handles stay alive with them)
        self.pulls = PullStreams()
        self._importing: list[_Import] = []
        self._readers: ThreadPoolExecutor | None = None  # shm (made on first use)

    def import_kv(self, seq) -> str | None:
        """Start bringing ``seq``'s (generation_only, no blocks yet) prompt KV into this pool; an error message
        (the request fails) or None. When the copy is done, ``executor._continue_generation_only(seq,
        first_token)`` (at once if the copy was synchronous: off CUDA)."""
        ex = self.executor
        try:
            fields = decode(seq.state.request.context_phase_params)
            check(fields, seq.state.request, ex.runner)
            if fields["transport"] == "shm":
                return self._import_file(seq, fields)
            if fields["transport"] == "nixl":
                return self._import_nixl(seq, fields)
            if fields["transport"] in kv_transfer_cuda_ipc.TRANSPORTS:
                return self._import_offer(seq, fields)
            source = kv_export.exporter(fields["exporter"])
            if source is None:
                raise ContextPhaseError("context_phase_params: the context executor that made them has shut down")
            num_blocks = ex.blocks.blocks_for_tokens(fields["prompt_len"])
            if (no_room := self._no_room(num_blocks)) is not None:
                raise ContextPhaseError(no_room)
            src_ids, ready = source.claim(fields["handle"])
        except ContextPhaseError as err:
            return str(err)
        try:
            dst_ids = ex.blocks.allocate(num_blocks)
            pull = self.pulls.pull(source.executor.runner.kv_cache, src_ids, ex.runner.kv_cache, dst_ids, ready)
        except BaseException:
            source.release(fields["handle"])
            raise
        self._start(_Import(seq, fields, dst_ids, pull, source))
        return None

    def _no_room(self, num_blocks: int) -> str | None:
        """The error of an import whose prompt needs more blocks than this pool has free (None: room)."""
        free = self.executor.blocks.num_free_blocks
        if num_blocks > free:
            return f"context_phase_params: {num_blocks} KV blocks needed, {free} free; retry later"
        return None

    def _import_file(self, seq, fields: dict, offer: str | None = None) -> str | None:
        ex = self.executor
        num_blocks = ex.blocks.blocks_for_tokens(fields["prompt_len"])
        if (no_room := self._no_room(num_blocks)) is not None:
            return no_room
        dst_ids = ex.blocks.allocate(num_blocks)
        pool = ex.runner.kv_cache
        if self._readers is None:
            self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-shm-read")
        after = kv_transfer_shm.after_loop(pool.device)  # (a step in flight may still write blocks freed under it)
        reading = self._readers.submit(_read_file, fields["path"], pool, dst_ids, after, self.side.timeout_s,
                                       fields.get("peer"), offer)
        self._importing.append(_Import(seq, fields, dst_ids, reading=reading))
        reading.add_done_callback(lambda _: self.side._wake())
        return None

    def _import_nixl(self, seq, fields: dict) -> str | None:
        """Claim the blob's blocks from the context agent; the READ starts once granted (NixlPull.done)."""
        if not kv_transfer_nixl.available():
            return f"context_phase_params: {kv_transfer_nixl.MISSING}"
        ex = self.executor
        num_blocks = ex.blocks.blocks_for_tokens(fields["prompt_len"])
        if (error := self._block_count_error(fields, num_blocks) or self._no_room(num_blocks)) is not None:
            return error
        dst_ids = ex.blocks.allocate(num_blocks)
        try:
            # the READ starts once a step in flight, which may still write blocks freed under it, has passed
            after = kv_transfer_shm.after_loop(ex.runner.device)
            pull = kv_transfer_nixl.NixlPull(self.side.nixl_side(), fields, dst_ids, self.side.timeout_s,
                                             lambda: seq.is_finished, after)
        except Exception as err:  # (metadata NIXL could not load: another build, a corrupted blob)
            ex.blocks.free(dst_ids)
            return f"context_phase_params: the context side's NIXL agent cannot be reached: {err}"
        self._importing.append(_Import(seq, fields, dst_ids, pull))
        return None

    @staticmethod
    def _block_count_error(fields: dict, num_blocks: int) -> str | None:
        if num_blocks != len(fields["block_ids"]):
            return (f"context_phase_params: {len(fields['block_ids'])} block ids for a {fields['prompt_len']}-token "
                    f"prompt ({num_blocks} expected); send the context_only request's output unchanged")
        return None

    def _import_offer(self, seq, fields: dict) -> str | None:
        """cuda_ipc where this process can map the context pool, else (auto) shm through the offer."""
        ex = self.executor
        pool = ex.runner.kv_cache
        num_blocks = ex.blocks.blocks_for_tokens(fields["prompt_len"])
        if (error := self._block_count_error(fields, num_blocks) or self._no_room(num_blocks)) is not None:
            return error
        ipc = self.side.ipc
        try:
            in_process = kv_export.exporter(fields["exporter"]) is not None
            how, src, why = kv_transfer_cuda_ipc.choose(fields, pool, ipc.peers, in_process)
        except ValueError as err:
            return str(err)
        ipc.note(fields["transport"], how, why)
        if how == "nixl":
            try:
                check_nixl(fields)
            except ContextPhaseError as err:
                return str(err)
            return self._import_nixl(seq, fields)
        if how == "shm":
            return self._import_file(seq, {**fields, "path": kv_transfer_cuda_ipc.shm_path(fields["offer"])},
                                     offer=fields["offer"])
        if max(fields["block_ids"]) >= src.shape[2]:
            return ("context_phase_params: truncated or corrupted blob (block_ids beyond the context pool); send "
                    "the context_phase_params output of a context_only request unchanged")
        dst_ids = ex.blocks.allocate(num_blocks)
        pull = kv_transfer_cuda_ipc.IpcPull(
            fields["offer"], lambda: self.pulls.pull(src, fields["block_ids"], pool, dst_ids),
            time.monotonic() + self.side.timeout_s, lambda: seq.is_finished, fields.get("peer"))
        self._start(_Import(seq, fields, dst_ids, pull))
        return None

    def _start(self, item: _Import) -> None:
        if item.pull.done():  # off CUDA: copied already
            self._arrived(item)
        else:
            self._importing.append(item)

    # ----- at each step (the generation loop) -----
    def has_work(self) -> bool:
        """An import done (its pull, or its reader thread)."""
        return any(item.ready() for item in self._importing)

    @property
    def polling(self) -> bool:
        """A pull in progress, polled (a reader thread notifies when it is done)."""
        return any(item.reading is None for item in self._importing)

    def finish_pulls(self) -> None:
        done = [item for item in self._importing if item.ready()]
        if not done:
            return
        self._importing = [item for item in self._importing if item not in done]
        for item in done:
            if item.reading is None:
                self._arrived(item)
            elif self._file_read(item):  # shm: the reader copied the blocks in
                self._start(item)

    def _file_read(self, item: _Import) -> bool:
        """A reader thread finished: the blocks are in place (True), or fail the request / drop a cancelled one."""
        ex = self.executor
        reading, item.reading = item.reading, None
        try:
            copied, item.extra_ms = reading.result()
            error = None if copied else (
                "context_phase_params: the context phase's KV cache is gone (fetched already, or deleted after the "
                "context side's timeout); run the context_only request again")
        except kv_peer.PeerGone as err:  # (its process died while writing the file)
            copied, error = False, str(err)
        except Exception as err:  # (I/O: a full or vanished transfer directory)
            copied, error = False, f"context_phase_params: reading the context phase's KV file failed: {err!r}"
        if not copied or item.seq.is_finished:
            ex.blocks.free(item.dst_ids)
            if error is not None and not item.seq.is_finished:
                ex._fail(item.seq.state, error)
            return False
        item.pull = Pull()  # (done: the reader thread copied the blocks in and synchronized its stream)
        return True

    def _arrived(self, item: _Import) -> None:
        """A pull is done: the source pin goes back; the sequence (unless it ended meanwhile) gets its blocks,
        its first token and its place in the scheduler."""
        ex = self.executor
        error = getattr(item.pull, "error", None)  # nixl: gone, unanswered or a failed READ
        if error is not None:
            if getattr(item.pull, "quarantined", False):  # (a READ NIXL could not cancel may still write them)
                self._quarantined.append(item.pull)
                self.num_quarantined_blocks += len(item.dst_ids)
                print(f"[disaggregated] {len(item.dst_ids)} KV blocks quarantined for this executor's life (a failed "
                      f"NIXL READ into them could not be cancelled); {self.num_quarantined_blocks} in all",
                      file=sys.stderr, flush=True)
            else:
                ex.blocks.free(item.dst_ids)
            if not item.seq.is_finished:
                ex._fail(item.seq.state, error)
            return
        self.kv_cache_transfer_ms += item.pull.elapsed_ms() + item.extra_ms
        self.num_transfers += 1
        if item.source is not None:
            item.source.release(item.fields["handle"])
        seq = item.seq
        if seq.is_finished:  # cancelled or failed while its KV was on its way
            ex.blocks.free(item.dst_ids)
            return
        item.pull.order_before()  # the loop's stream: its next step reads the blocks
        seq.block_ids = item.dst_ids
        seq.num_computed_tokens = item.fields["prompt_len"]
        seq.state.perf.kv_cache_alloc_new_blocks += len(item.dst_ids)
        seq.state.perf.kv_cache_alloc_total_blocks += len(item.dst_ids)
        ex._continue_generation_only(seq, item.fields["first_token"])

    @property
    def num_importing(self) -> int:
        return len(self._importing)

    def shutdown(self) -> None:
        for item in self._importing:  # (a pull reads the source pool: done before its pin is released)
            if item.pull is not None:
                item.pull.wait()
            if item.source is not None:
                item.source.release(item.fields["handle"])
        self._importing = []
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)


def _read_file(path: str, pool, dst_ids: list[int], after, wait_s: float, peer, offer: str | None = None):
    """A reader thread: (the blocks are in place: False when gone, ms spent); ``offer``: claimed for shm first
    (auto)."""
    started = time.perf_counter()
    if offer is not None and kv_transfer_cuda_ipc.claim_for_shm(offer, wait_s, peer) is None:
        return False, (time.perf_counter() - started) * 1e3
    copied = kv_transfer_shm.read_blocks(path, pool, dst_ids, after, wait_s, peer)
    return copied, (time.perf_counter() - started) * 1e3
