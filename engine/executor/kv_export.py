"""The context side of disaggregated serving (engine/executor/disaggregated.py): a context_only request's prompt
KV pinned in this executor's pool, its blob written, and the pins served to generation sides until they are
fetched or expire -- ``local`` claims from a peer executor of this process, ``shm`` files written by a writer
thread, ``cuda_ipc`` / ``auto`` offer files (kv_transfer_cuda_ipc.py), NIXL claims answered (kv_transfer_nixl.py).

Threads: the pinned blocks belong to the context executor's BlockManager, which only its loop thread touches.
A generation executor's loop ``claim``s a handle (then expiry no longer touches it) and ``release``s it once its
pull is done; the context loop frees released and expired pins in ``service`` at its next step.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from engine.executor import kv_peer, kv_transfer_cuda_ipc, kv_transfer_nixl, kv_transfer_shm
from engine.executor.context_phase import ContextPhaseError, encode, kv_layout, prompt_digest
from engine.executor.kv_transfer_shm import ShmWriter

_EXPORTERS: dict[str, "KvExports"] = {}  # exporter uuid -> a live executor's context side (local transport)
_EXPORTERS_LOCK = threading.Lock()


def exporter(exporter_id: str) -> "KvExports | None":
    """The context side of this process that wrote a blob (None: another process's, or shut down)."""
    with _EXPORTERS_LOCK:
        return _EXPORTERS.get(exporter_id)


class _Pin:
    __slots__ = ("block_ids", "deadline", "state", "path", "ready", "writing", "nixl", "offer")

    def __init__(self, block_ids: list[int], deadline: float, path: str | None = None, ready=None, writing=None,
                 nixl: bool = False, offer=None):
        self.offer = offer  # cuda_ipc / auto: its kv_transfer_cuda_ipc.Offer (the files say claimed / released)
        self.nixl = nixl  # claimed by a remote NIXL agent's notification; released by its READ's
        self.block_ids = block_ids  # pinned in the pool (local, nixl; shm: until written, then [])
        self.path = path  # shm: the file, deleted at the deadline if still unclaimed
        self.ready = ready  # CUDA: the event after the prompt's last prefill chunk (kv_pull.ReadyEvents)
        self.writing = writing  # shm: the writer thread's future (the file is in place once it is done)
        self.deadline = deadline
        self.state = "pinned"  # -> "claimed" (a generation side copies) -> "released"; or expired

    def settled(self) -> bool:
        """Not still being written (shm): only then may the context side expire or forget it."""
        return self.writing is None or self.writing.done()

    def due(self, now: float) -> bool:
        """Released by its fetcher, or expired unclaimed."""
        return self.state == "released" or (self.state == "pinned" and self.deadline <= now)

    def written(self) -> bool:
        """shm: the writer is done with the blocks it still pins (the context loop frees them)."""
        return self.path is not None and bool(self.block_ids) and self.settled()


class KvExports:
    """One executor's pins. ``side``: its Disaggregation (executor, timeout_s, ready events, the IPC share, the
    NIXL agent and the loop's wake-up are its)."""

    def __init__(self, side, exporter_id: str):
        self.side = side
        self.executor = side.executor  # (a generation side reads its pool: local transport)
        self.exporter_id = exporter_id
        self._lock = threading.Lock()
        self._pins: dict[int, _Pin] = {}
        self._handles = iter(range(1, 1 << 62))
        self.num_expired = 0
        self._offer_errors: set[int] = set()  # handles whose offer files raised (reported once each)
        self.writer = ShmWriter()  # shm
        with _EXPORTERS_LOCK:
            _EXPORTERS[self.exporter_id] = self

    def export(self, seq) -> str | None:
        """``seq`` (context_only) got its first token: pin its prompt's blocks, attach the blob. An export that
        fails (the shm file or its gather, NIXL describing the pool) pins nothing and returns the request's error:
        it fails that request alone (Executor._finish), its blocks freed with the sequence."""
        transport = seq.state.request.kv_transfer or self.side.transport
        ready = self.side.ready.take(seq.request_id)
        try:
            self._export(seq, transport, ready)
        except Exception as err:  # (OSError: a full /dev/shm; torch.OutOfMemoryError; NIXL errors)
            print(f"[disaggregated] exporting request {seq.request_id}'s KV ({transport}) failed: {err!r}",
                  file=sys.stderr, flush=True)
            return (f"context_phase_params: exporting the context phase's KV (kv_transfer {transport}) failed: "
                    f"{err!r}; run the context_only request again")
        return None

    def _export(self, seq, transport: str, ready) -> None:
        ex, timeout_s = self.executor, self.side.timeout_s
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        num_blocks = ex.blocks.blocks_for_tokens(seq.num_prompt_tokens)
        block_ids = list(seq.block_ids[:num_blocks])
        handle = next(self._handles)
        where = {}
        if transport == "shm":  # pinned until the writer thread has copied them out (then service frees them)
            where["path"], writing = self.writer.start_write(ex.runner.kv_cache, block_ids, self.exporter_id, handle,
                                                             ready)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, time.monotonic() + timeout_s, where["path"], writing=writing)
            writing.add_done_callback(lambda _: self.side._wake())
        elif transport == "nixl":  # pinned as for local; the blob tells a remote agent where they are
            where = {**self.side.nixl_side().describe(), "block_ids": block_ids}  # (may raise: before the pin)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, time.monotonic() + timeout_s, ready=ready, nixl=True)
        elif transport in kv_transfer_cuda_ipc.TRANSPORTS:  # pinned as for local; the offer file says when it is pulled
            where = {**self.side.ipc.describe(ex.runner.kv_cache, self.exporter_id, transport), "block_ids": block_ids,
                     "offer": kv_transfer_cuda_ipc.offer_path(self.exporter_id, handle)}  # (may raise: before the pin)
            nixl = transport == "auto" and os.environ.get(kv_transfer_cuda_ipc.AUTO_NIXL_ENV) == "1"
            if nixl:  # (another host may fetch it: kv_transfer_cuda_ipc.choose)
                where.update(self.side.nixl_side().describe())
            deadline = time.monotonic() + timeout_s
            offer = kv_transfer_cuda_ipc.Offer(where["offer"], ready, deadline, timeout_s)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, deadline, ready=ready, offer=offer, nixl=nixl)
        else:
            ex.blocks.acquire(block_ids)  # scheduler.finish drops the sequence's ref; this one stays
            pin = _Pin(block_ids, time.monotonic() + timeout_s, ready=ready)
        with self._lock:
            self._pins[handle] = pin
        first = seq.token_ids[seq.num_prompt_tokens] if seq.num_generated_tokens else seq.state.request.end_id
        seq.state.context_phase_params = encode({
            "transport": transport, **where, "pid": os.getpid(), "exporter": self.exporter_id, "handle": handle,
            "request_id": seq.request_id, "layout": kv_layout(ex.runner), "prompt_len": len(prompt),
            "prompt_digest": prompt_digest(prompt), "first_token": -1 if first is None else int(first),
            "num_blocks": num_blocks, "peer": kv_peer.identity()})

    # ----- the loop's wake-ups -----
    def has_work(self) -> bool:
        """A pin to free now (released by its fetcher, or expired), or an offer whose files changed."""
        now = time.monotonic()
        with self._lock:
            return any(pin.due(now) or (pin.offer is not None and pin.offer.changed(pin.ready, now)) or pin.written()
                       for pin in self._pins.values())

    def claim_to_answer(self, nixl, agent: str, handle: int) -> bool:
        """A NIXL claim the context loop has news for: new (not acknowledged yet), or its prompt's KV now final
        (or its pin gone). A claim waiting for its prefill does not wake the loop at every poll."""
        if (agent, handle) not in nixl.acknowledged:
            return True
        with self._lock:
            pin = self._pins.get(handle)
            return pin is None or pin.state != "pinned" or pin.deadline <= time.monotonic() or pin.ready is None \
                or pin.ready.query()  # (ready None: the pin was replaced, e.g. an auto offer turned shm)

    def wake_ups(self) -> tuple[float | None, list[float]]:
        """(a polling period while claims and releases come as notifications or files, else None; the pinned
        pins' deadlines)."""
        with self._lock:
            if any(pin.nixl for pin in self._pins.values()):  # (claims and READs' ends come as notifications)
                return kv_transfer_nixl.POLL_S, []
            if any(pin.offer is not None for pin in self._pins.values()):  # (claims and releases are files)
                return kv_transfer_cuda_ipc.POLL_S, []
            return None, [pin.deadline for pin in self._pins.values() if pin.state == "pinned"]

    # ----- at each step (the context loop) -----
    def service(self, now: float) -> bool:
        """Offers' files -> their pins' states, then free released and expired pins (and shm pins' blocks once
        written). True when blocks were freed."""
        self._advance_offers(now)  # (before the expiry below, with its clock: an offer is taken back first)
        timeout_s = self.side.timeout_s
        with self._lock:
            written = [pin for pin in self._pins.values() if pin.written()]
            copied = [pin.block_ids for pin in written]  # (shm: the writer is done with them)
            for pin in written:
                pin.block_ids = []
            done = [h for h, pin in self._pins.items() if pin.settled() and (
                    pin.due(now)
                    or (pin.nixl and pin.state == "claimed" and pin.deadline + timeout_s <= now)  # reader died
                    or (pin.path is not None and not os.path.exists(pin.path)))]  # shm: fetched (or its write failed)
            pins = [self._pins.pop(h) for h in done]
        self._offer_errors.difference_update(done)
        for block_ids in copied:
            self.executor.blocks.free(block_ids)
        for pin in pins:
            if pin.path is not None:  # shm: only a file no generation side took counts as expired
                if pin.writing.exception() is not None:  # (its reader says "gone"; the cause is here)
                    print(f"[disaggregated] writing the KV file {pin.path} failed: {pin.writing.exception()!r}",
                          file=sys.stderr, flush=True)
                self.num_expired += kv_transfer_shm.expire(pin.path)
                continue
            self.num_expired += pin.state == "pinned"
            if pin.offer is not None and pin.state == "pinned":  # (expired: its offer went already, unless its
                try:  # files failed: then no claim may come for the freed blocks)
                    pin.offer.close()
                except OSError:
                    pass
            self.executor.blocks.free(pin.block_ids)
        return bool(pins) or bool(copied)

    def _advance_offers(self, now: float) -> None:
        """The offered pins' files -> their states; a claim for shm writes the blocks to the shm file (the pin
        becomes an shm pin, its blocks freed once written)."""
        with self._lock:
            offered = [(handle, pin) for handle, pin in self._pins.items()
                       if pin.offer is not None and pin.state != "released"]
        for handle, pin in offered:
            try:
                state = pin.offer.advance(pin.ready, now)
            except OSError as err:  # (the transfer directory failing: this pin's alone, not every active request's;
                if handle not in self._offer_errors:  # it stays pinned and its deadline frees it, see service)
                    self._offer_errors.add(handle)
                    print(f"[disaggregated] the offer of handle {handle} cannot be read: {err!r}", file=sys.stderr,
                          flush=True)
                continue
            if state in ("claimed", "released"):
                pin.state = state
            elif state == "shm":
                self._offer_to_shm(handle, pin, now)
            # ("expired": the pin stays "pinned" past its deadline: freed in service and counted as expired)

    def _offer_to_shm(self, handle: int, pin: _Pin, now: float) -> None:
        ex = self.executor
        try:
            path, writing = self.writer.start_write(ex.runner.kv_cache, pin.block_ids, self.exporter_id, handle,
                                                    pin.ready)
        except Exception as err:  # (the claimer's reader finds no file: "gone")
            print(f"[disaggregated] writing the offered KV of handle {handle} to shm failed: {err!r}",
                  file=sys.stderr, flush=True)
            pin.offer.shm_started()
            pin.state = "released"
            return
        pin.offer.shm_started()
        with self._lock:  # (its blocks stay pinned until the writer thread has copied them out: service frees them)
            self._pins[handle] = _Pin(pin.block_ids, now + self.side.timeout_s, path, writing=writing)
        writing.add_done_callback(lambda _: self.side._wake())

    def answer_nixl(self, side) -> None:
        """Answer ``side``'s (this executor's NIXL agent) claims (granted once the prompt's KV is final) and free
        pins whose READ ended."""
        side.poll()
        waiting, now = [], time.monotonic()
        for agent, handle, metadata in side.claims:
            with self._lock:
                pin = self._pins.get(handle)
                live = pin is not None and pin.nixl and pin.state == "pinned" and pin.deadline > now
                wait = live and pin.ready is not None and not pin.ready.query()  # (its prefill is still on the GPU)
                if live and not wait and pin.offer is not None:  # (auto: no cuda_ipc / shm claim can take it now)
                    live = pin.offer.take_for_nixl()
                if live and not wait:
                    pin.state = "claimed"
            try:
                side.answer(agent, handle, metadata, None if wait else live)  # (None: seen, answered later)
                if wait:
                    waiting.append((agent, handle, metadata))
            except Exception as err:  # (a claim whose metadata NIXL cannot load: a foreign or corrupted notification)
                print(f"[disaggregated] NIXL claim of handle {handle} from agent {agent!r} not answered: {err!r}",
                      file=sys.stderr, flush=True)
                if live and not wait:
                    with self._lock:
                        pin.state = "pinned"  # (unanswered: a later claim may take it, else it expires)
        side.claims = waiting  # (answered or dropped: one bad claim is not retried at every step)
        done, side.done = side.done, []
        for _, handle in done:
            with self._lock:
                pin = self._pins.get(handle)
                if pin is not None and pin.nixl and pin.state == "claimed":
                    pin.state = "released"

    # ----- a peer's generation loop (local transport) -----
    def claim(self, handle: int):
        """(the pinned block ids, their ready event) of a handle; the fetcher must ``release`` it."""
        with self._lock:
            pin = self._pins.get(handle)
            if pin is None or pin.state != "pinned" or pin.deadline <= time.monotonic() or pin.offer is not None:
                raise ContextPhaseError("context_phase_params: the context phase's KV cache is gone (fetched "
                                        f"already, or freed after its {self.side.timeout_s:g} s timeout); run the "
                                        "context_only request again")
            pin.state = "claimed"
            return pin.block_ids, pin.ready

    def release(self, handle: int) -> None:
        with self._lock:
            pin = self._pins.get(handle)
            if pin is not None:
                pin.state = "released"
        self.side._wake()

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(pin.block_ids) for pin in self._pins.values())

    def shutdown(self) -> None:
        """Unregistered; the pins' files (shm, offers) deleted. (The writer was shut down first: files being
        written are in place before they are deleted here.)"""
        with _EXPORTERS_LOCK:
            _EXPORTERS.pop(self.exporter_id, None)
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for pin in pins:
            if pin.path is not None:
                kv_transfer_shm.expire(pin.path)
            if pin.offer is not None:
                pin.offer.close()
