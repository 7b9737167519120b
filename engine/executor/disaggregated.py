"""Disaggregated serving: a context_only request's KV handed to a generation_only request.

The anchor's request types (Request.request_type):
- ``context_and_generation`` (default): the usual request.
- ``context_only``: runs the prefill, returns the first token (max_tokens is taken as 1) and an opaque
  ``context_phase_params`` blob. Its prompt's KV blocks stay pinned in this executor's pool (one extra
  reference each) until a generation_only request fetches them or ``timeout_s`` frees them.
- ``generation_only``: carries that blob (Request.context_phase_params) and the same prompt; its KV
  blocks are copied into this executor's pool, the context's first token is appended, and decoding
  goes on from there. Its output equals the context_and_generation request's (greedy: token for token).

Transports (a context_only Request's ``kv_transfer``; else ``transport``, TRITONLLM_KV_TRANSFER on the
context side, default ``local``):
- ``local``: both executors live in one process (one Triton model serving both request types, or two
  Executors in a program); the blocks stay pinned in the context pool and the copy is a
  device-to-device index copy between the pools (on CUDA a peer copy between GPUs of one host).
- ``shm``: another process of the same host (two Triton models, each with its engine process); the
  blocks go to a file in host shared memory and are freed once written (kv_transfer_shm.py).
  A writer thread on the context side and reader threads on the generation side move the bytes chunk
  by chunk through buffers of their own, so neither loop waits for the file nor allocates for it.
- ``nixl``: another host (or process): the blocks stay pinned in the context pool, which a NIXL agent
  registered; the generation side claims them by a notification and READs them into its own pool
  (kv_transfer_nixl.py). Optional: needs NIXL (nixl-cu12 or nixl-cu13), refused by name without it.
- ``cuda_ipc``: another process of the same host, GPU to GPU: the blocks stay pinned, the context pool is
  shared once through CUDA IPC and the generation side pulls from it as ``local`` does; a file per pin (the
  offer) says when it may be pulled and when it was (kv_transfer_cuda_ipc.py).
- ``auto``: pinned and offered as for ``cuda_ipc``; the generation side chooses ``cuda_ipc`` where it can,
  else ``shm`` through the offer (kv_transfer_cuda_ipc.choose). What disaggregated_serving_bls sends when its
  two models are two engine processes.
NCCL would be a further name; the blob names its transport.

Blob (version 1): MAGIC + one version byte + UTF-8 JSON
    {"transport": "local" | "shm" | "nixl", "pid", "peer" (kv_peer.identity: same-host death checks),
     "exporter": uuid hex, "handle": int, "request_id": int,
     "path" (shm), "agent", "metadata", "mem", "pool", "block_ids" (nixl),
     "layout": {"kv_shape": [L, 2, T, H, D], "dtype": str, "tokens_per_block": T},
     "prompt_len": int, "prompt_digest": hex, "first_token": int, "num_blocks": int}
Opaque to clients; only what the executor itself wrote is accepted (magic, version, fields checked).

Threads: the pinned blocks belong to the context executor's BlockManager, which only its loop thread
touches. The generation executor's loop ``claim``s a handle (then expiry no longer touches it), starts
the pull, and ``release``s the handle once the pull is done; the context loop frees released and
expired handles in ``service`` at its next step (its condition is notified).

Ordering on CUDA (engine/executor/kv_pull.py): no loop waits for the other GPU. The context loop records
an event right after launching a context_only request's last prefill chunk (``ReadyEvents``); the pin
carries it and the pull's streams wait on it. The generation loop polls its pulls at each step
(``service``; while idle it wakes every ``POLL_S``); a finished pull releases the source pin, and its
sequence gets its first token and joins the scheduler, the loop's stream waiting on the pull's event.
Until then the sequence holds no blocks of its own (the pull does): a cancel meanwhile leaves the
pull to finish and free them. ``kv_cache_transfer_ms``: the copy on the GPU (events); for shm the reader
thread's time (reading the file and copying it in).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from engine.executor import kv_peer, kv_transfer_cuda_ipc, kv_transfer_nixl, kv_transfer_shm
from engine.executor.kv_pull import Pull, PullStreams, ReadyEvents
from engine.executor.kv_transfer_shm import ShmWriter

REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")
TRANSPORTS = ("local", "shm", "nixl", "cuda_ipc", "auto")
MAGIC = b"TLLMCTX"
VERSION = 1
DEFAULT_TIMEOUT_S = float(os.environ.get("TRITONLLM_KV_TRANSFER_TIMEOUT_S", "60"))
POLL_S = 0.0005  # an idle generation loop's wake-up period while a pull is in progress

_EXPORTERS: dict[str, "Disaggregation"] = {}  # exporter uuid -> live executor's side (local transport)
_EXPORTERS_LOCK = threading.Lock()


class ContextPhaseError(ValueError):
    """A context_phase_params blob that cannot be used here; the message names the field and why."""


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:32]


def encode(fields: dict) -> bytes:
    return MAGIC + bytes([VERSION]) + json.dumps(fields, separators=(",", ":")).encode()


def decode(blob) -> dict:
    """The fields of a blob written by ``encode``; ContextPhaseError naming what is wrong otherwise."""
    data = bytes(blob).rstrip(b"\0")  # a row of a batch arrives zero-padded to the longest blob
    if not data.startswith(MAGIC) or len(data) <= len(MAGIC):
        raise ContextPhaseError("context_phase_params: not a context phase blob of this backend (bad header); "
                                "send the context_phase_params output of a context_only request unchanged")
    if data[len(MAGIC)] != VERSION:
        raise ContextPhaseError(f"context_phase_params: version {data[len(MAGIC)]} is not supported; "
                                f"this backend reads version {VERSION}")
    try:
        fields = json.loads(data[len(MAGIC) + 1:].decode())
        for name, kind in (("transport", str), ("exporter", str), ("handle", int), ("layout", dict),
                           ("prompt_len", int), ("prompt_digest", str), ("first_token", int)):
            if not isinstance(fields.get(name), kind):
                raise ValueError(name)
    except (ValueError, UnicodeDecodeError) as err:
        raise ContextPhaseError(f"context_phase_params: truncated or corrupted blob ({err}); send the "
                                f"context_phase_params output of a context_only request unchanged") from None
    return fields


def kv_layout(runner) -> dict:
    """What must match between the two pools for a block copy to be meaningful."""
    pool = runner.kv_cache  # (L, 2, num_blocks, T, H, D)
    num_layers, two, _, tokens, heads, head_dim = pool.shape
    return {"kv_shape": [num_layers, two, tokens, heads, head_dim], "dtype": str(pool.dtype).replace("torch.", ""),
            "tokens_per_block": runner.tokens_per_block}


_COPY_STREAMS: PullStreams | None = None


def copy_blocks(src_pool, src_ids: list[int], dst_pool, dst_ids: list[int]) -> float:
    """dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]], across devices, through the serving path's
    pull (kv_pull.py); returns when the copy is done (benchmarks), with its time in ms. One PullStreams for all
    calls (one thread: the benchmark's), so its buffers are made once, as a serving executor's are."""
    global _COPY_STREAMS
    if _COPY_STREAMS is None:
        _COPY_STREAMS = PullStreams()
    pull = _COPY_STREAMS.pull(src_pool, src_ids, dst_pool, dst_ids)
    pull.wait()
    return pull.elapsed_ms()


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


class _Import:
    """A generation_only sequence whose KV is on its way (shm: the file being read, then a pull in progress)."""
    __slots__ = ("seq", "fields", "dst_ids", "pull", "source", "extra_ms", "reading")

    def __init__(self, seq, fields: dict, dst_ids: list[int], pull=None, source=None, reading=None):
        self.seq, self.fields, self.dst_ids, self.pull = seq, fields, dst_ids, pull
        self.source = source  # local transport: the context side, released when the pull is done
        self.reading = reading  # shm: the reader thread's future of (the blocks copied in, ms)
        self.extra_ms = 0.0  # shm: reading the file and copying it in

    def ready(self) -> bool:
        return self.reading.done() if self.reading is not None else self.pull.done()


class Disaggregation:
    """One executor's side: exports of its context_only requests, imports of its generation_only ones.

    ``executor``: the Executor (its runner, blocks, scheduler and condition are used; the calls come
    from its loop thread, except ``claim``/``release``, made by a peer's loop).
    """

    def __init__(self, executor, timeout_s: float = DEFAULT_TIMEOUT_S, transport: str | None = None):
        self.executor = executor
        self.timeout_s = timeout_s
        self.transport = transport or os.environ.get("TRITONLLM_KV_TRANSFER", "local")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"TRITONLLM_KV_TRANSFER '{self.transport}' is not supported; allowed: {', '.join(TRANSPORTS)}")
        if self.transport == "nixl" and not kv_transfer_nixl.available():
            raise ValueError(f"TRITONLLM_KV_TRANSFER: {kv_transfer_nixl.MISSING}")
        if self.transport == "cuda_ipc" and executor.runner.kv_cache.device.type != "cuda":
            raise ValueError(f"TRITONLLM_KV_TRANSFER: {kv_transfer_cuda_ipc.NEEDS_CUDA}")
        self.ipc = kv_transfer_cuda_ipc.IpcSide()  # cuda_ipc / auto: the pool's share, peers' pools, choices
        self._nixl: kv_transfer_nixl.NixlSide | None = None  # this executor's NIXL agent (made on first use)
        self.exporter_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._pins: dict[int, _Pin] = {}
        self._handles = iter(range(1, 1 << 62))
        self.num_expired = 0
        self.num_transfers = 0  # generation_only requests whose KV arrived here
        self.kv_cache_transfer_ms = 0.0  # cumulative time of those copies
        self.num_quarantined_blocks = 0  # never freed: a failed NIXL READ into them could not be cancelled
        self._quarantined: list = []  # (their pulls: the READs' handles stay alive with them)
        self._offer_errors: set[int] = set()  # handles whose offer files raised (reported once each)
        self.ready = ReadyEvents(executor.runner.device)  # context side: prompts' KV final on the device
        self.pulls = PullStreams()  # generation side
        self._importing: list[_Import] = []  # (generation loop only)
        self.writer = ShmWriter()  # context side, shm
        self._readers: ThreadPoolExecutor | None = None  # generation side, shm (made on first use)
        with _EXPORTERS_LOCK:
            _EXPORTERS[self.exporter_id] = self

    # ----- request checks (enqueue time) -----
    def request_error(self, request) -> str | None:
        kind = getattr(request, "request_type", "context_and_generation")
        if kind not in REQUEST_TYPES:
            return f"request_type: '{kind}' is not supported; allowed: {', '.join(REQUEST_TYPES)}"
        if kind == "context_and_generation":
            if request.context_phase_params is not None:
                return ("context_phase_params: only a generation_only request takes context_phase_params; "
                        "set request_type generation_only or send the request without them")
            return None
        ex = self.executor
        for bad, what in ((request.sampling.beam_width > 1, "beam_width > 1"),
                          ((request.sampling.num_return_sequences or 1) > 1, "num_return_sequences > 1"),
                          (request.prompt_table is not None, "prompt tables"),
                          (request.output.return_context_logits and kind == "generation_only",
                           "return_context_logits on generation_only"),
                          (ex.state_slots is not None, "models with recurrent state"),
                          (ex.encoder_stage is not None, "encoder-decoder models"),
                          (ex.runner.model_config.kv_window is not None, "sliding-window KV"),
                          (ex.runner.build_config.tp_size > 1, "tensor parallelism")):
            if bad:
                return f"request_type: {kind} is not supported with {what}; send request_type context_and_generation"
        if kind == "context_only" and request.context_phase_params is not None:
            return "context_phase_params: a context_only request takes none; they are its output"
        transfer = getattr(request, "kv_transfer", None)
        if transfer is not None and transfer not in TRANSPORTS:
            return f"kv_transfer: '{transfer}' is not supported; allowed: {', '.join(TRANSPORTS)}"
        if transfer == "nixl" and kind == "context_only" and not kv_transfer_nixl.available():
            return kv_transfer_nixl.MISSING
        if transfer == "cuda_ipc" and kind == "context_only" and ex.runner.kv_cache.device.type != "cuda":
            return kv_transfer_cuda_ipc.NEEDS_CUDA
        if kind == "generation_only":
            if request.context_phase_params is None:
                return ("context_phase_params: a generation_only request needs the context_phase_params output "
                        "of its context_only request")
            try:
                self._check(decode(request.context_phase_params), request)
            except ContextPhaseError as err:
                return str(err)
        return None

    def _check(self, fields: dict, request) -> None:
        here = kv_layout(self.executor.runner)
        if fields["layout"] != here:
            theirs = fields["layout"]
            diff = ", ".join(f"{k} {theirs.get(k)} vs {v}" for k, v in here.items() if theirs.get(k) != v)
            raise ContextPhaseError(f"context_phase_params: the context engine's KV layout differs from this "
                                    f"engine's ({diff}); context and generation must run the same engine")
        if fields["prompt_len"] != len(request.input_token_ids) or \
                fields["prompt_digest"] != prompt_digest(request.input_token_ids):
            raise ContextPhaseError("context_phase_params: they belong to another prompt; send the generation_only "
                                    "request with the same input_ids as its context_only request")
        if fields["transport"] == "shm" and isinstance(fields.get("path"), str):
            return
        if fields["transport"] == "nixl":
            _check_nixl(fields)
            return
        if fields["transport"] in kv_transfer_cuda_ipc.TRANSPORTS:
            if (error := kv_transfer_cuda_ipc.fields_error(fields)) is not None:
                raise ContextPhaseError(error)
            return
        if fields["transport"] != "local" or fields.get("pid") != os.getpid():
            raise ContextPhaseError(f"context_phase_params: transport '{fields['transport']}' from process "
                                    f"{fields.get('pid')} cannot be read here ('local' works within process "
                                    f"{os.getpid()}); send the context_only request with parameter kv_transfer shm "
                                    f"(or set TRITONLLM_KV_TRANSFER=shm on the context side) when the "
                                    f"generation side runs in another process")

    # ----- context side (its loop thread) -----
    def export(self, seq) -> str | None:
        """``seq`` (context_only) got its first token: pin its prompt's blocks, attach the blob. An export that
        fails (the shm file or its gather, NIXL describing the pool) pins nothing and returns the request's error:
        it fails that request alone (Executor._finish), its blocks freed with the sequence."""
        transport = seq.state.request.kv_transfer or self.transport
        ready = self.ready.take(seq.request_id)
        try:
            self._export(seq, transport, ready)
        except Exception as err:  # (OSError: a full /dev/shm; torch.OutOfMemoryError; NIXL errors)
            print(f"[disaggregated] exporting request {seq.request_id}'s KV ({transport}) failed: {err!r}",
                  file=sys.stderr, flush=True)
            return (f"context_phase_params: exporting the context phase's KV (kv_transfer {transport}) failed: "
                    f"{err!r}; run the context_only request again")
        return None

    def _export(self, seq, transport: str, ready) -> None:
        ex = self.executor
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        num_blocks = ex.blocks.blocks_for_tokens(seq.num_prompt_tokens)
        block_ids = list(seq.block_ids[:num_blocks])
        handle = next(self._handles)
        where = {}
        if transport == "shm":  # pinned until the writer thread has copied them out (then service frees them)
            where["path"], writing = self.writer.start_write(ex.runner.kv_cache, block_ids, self.exporter_id, handle,
                                                             ready)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, time.monotonic() + self.timeout_s, where["path"], writing=writing)
            writing.add_done_callback(lambda _: self._wake())
        elif transport == "nixl":  # pinned as for local; the blob tells a remote agent where they are
            where = {**self.nixl_side().describe(), "block_ids": block_ids}  # (may raise: before the pin)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, time.monotonic() + self.timeout_s, ready=ready, nixl=True)
        elif transport in kv_transfer_cuda_ipc.TRANSPORTS:  # pinned as for local; the offer file says when it is pulled
            where = {**self.ipc.describe(ex.runner.kv_cache, self.exporter_id, transport), "block_ids": block_ids,
                     "offer": kv_transfer_cuda_ipc.offer_path(self.exporter_id, handle)}  # (may raise: before the pin)
            nixl = transport == "auto" and os.environ.get(kv_transfer_cuda_ipc.AUTO_NIXL_ENV) == "1"
            if nixl:  # (another host may fetch it: kv_transfer_cuda_ipc.choose)
                where.update(self.nixl_side().describe())
            deadline = time.monotonic() + self.timeout_s
            offer = kv_transfer_cuda_ipc.Offer(where["offer"], ready, deadline, self.timeout_s)
            ex.blocks.acquire(block_ids)
            pin = _Pin(block_ids, deadline, ready=ready, offer=offer, nixl=nixl)
        else:
            ex.blocks.acquire(block_ids)  # scheduler.finish drops the sequence's ref; this one stays
            pin = _Pin(block_ids, time.monotonic() + self.timeout_s, ready=ready)
        with self._lock:
            self._pins[handle] = pin
        first = seq.token_ids[seq.num_prompt_tokens] if seq.num_generated_tokens else seq.state.request.end_id
        seq.state.context_phase_params = encode({
            "transport": transport, **where, "pid": os.getpid(), "exporter": self.exporter_id, "handle": handle,
            "request_id": seq.request_id, "layout": kv_layout(ex.runner), "prompt_len": len(prompt),
            "prompt_digest": prompt_digest(prompt), "first_token": -1 if first is None else int(first),
            "num_blocks": num_blocks, "peer": kv_peer.identity()})

    def prepare(self, request):
        """A context_only request stops after its first token, whatever max_tokens it carried."""
        if getattr(request, "request_type", None) != "context_only":
            return request
        self.ready.enabled = True  # from now on each launch looks for finished context_only prompts
        return replace(request, max_tokens=1) if request.max_tokens != 1 else request

    def has_work(self) -> bool:
        """A pin to free now (released by its fetcher, or expired), or a finished pull."""
        if any(item.ready() for item in self._importing):
            return True
        if self._nixl is not None:
            self._nixl.poll()
            if self._nixl.done or any(self._claim_to_answer(*claim[:2]) for claim in self._nixl.claims):
                return True
        now = time.monotonic()
        with self._lock:
            return any(pin.state == "released" or (pin.state == "pinned" and pin.deadline <= now)
                       or (pin.offer is not None and pin.offer.changed(pin.ready, now))
                       or (pin.path is not None and pin.block_ids and pin.settled())  # (shm: written)
                       for pin in self._pins.values())

    def _claim_to_answer(self, agent: str, handle: int) -> bool:
        """A NIXL claim the context loop has news for: new (not acknowledged yet), or its prompt's KV now final
        (or its pin gone). A claim waiting for its prefill does not wake the loop at every poll."""
        if (agent, handle) not in self._nixl.acknowledged:
            return True
        with self._lock:
            pin = self._pins.get(handle)
            return pin is None or pin.state != "pinned" or pin.deadline <= time.monotonic() or pin.ready is None \
                or pin.ready.query()  # (ready None: the pin was replaced, e.g. an auto offer turned shm)

    def wait_timeout(self) -> float | None:
        """How long the idle loop may sleep before a pin expires or a pull should be polled (None: neither)."""
        if any(item.reading is None for item in self._importing):  # (a reader thread notifies when it is done)
            return POLL_S
        with self._lock:
            if any(pin.nixl for pin in self._pins.values()):  # (claims and READs' ends come as notifications)
                return kv_transfer_nixl.POLL_S
            if any(pin.offer is not None for pin in self._pins.values()):  # (claims and releases are files)
                return kv_transfer_cuda_ipc.POLL_S
            deadlines = [pin.deadline for pin in self._pins.values() if pin.state == "pinned"]
        if self._nixl is not None:  # a late claim still gets its "gone" answer
            deadlines.append(time.monotonic() + kv_transfer_nixl.IDLE_POLL_S)
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic()) + 0.001

    def service(self) -> bool:
        """Free released and expired pins (context side) and finish done pulls (generation side); at each step.
        True when blocks may have been freed (the pool's gauges changed)."""
        if self._nixl is not None:
            self._answer_nixl()
        importing = len(self._importing)
        if importing:
            self._finish_pulls()
        if self.ready.pending:
            self.ready.forget(self.executor._active)
        now = time.monotonic()
        self._advance_offers(now)  # (before the expiry below, with its clock: an offer is taken back first)
        with self._lock:
            written = [pin for pin in self._pins.values() if pin.path is not None and pin.block_ids and pin.settled()]
            copied = [pin.block_ids for pin in written]  # (shm: the writer is done with them)
            for pin in written:
                pin.block_ids = []
            done = [h for h, pin in self._pins.items() if pin.settled() and (
                    pin.state == "released" or (pin.state == "pinned" and pin.deadline <= now)
                    or (pin.nixl and pin.state == "claimed" and pin.deadline + self.timeout_s <= now)  # reader died
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
        return bool(pins) or bool(copied) or len(self._importing) != importing

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(len(pin.block_ids) for pin in self._pins.values())

    def claim(self, handle: int):
        """(the pinned block ids, their ready event) of a handle; the fetcher must ``release`` it."""
        with self._lock:
            pin = self._pins.get(handle)
            if pin is None or pin.state != "pinned" or pin.deadline <= time.monotonic() or pin.offer is not None:
                raise ContextPhaseError("context_phase_params: the context phase's KV cache is gone (fetched "
                                        f"already, or freed after its {self.timeout_s:g} s timeout); run the "
                                        "context_only request again")
            pin.state = "claimed"
            return pin.block_ids, pin.ready

    def release(self, handle: int) -> None:
        with self._lock:
            pin = self._pins.get(handle)
            if pin is not None:
                pin.state = "released"
        self._wake()

    def shutdown(self) -> None:
        for item in self._importing:  # (a pull reads the source pool: done before its pin is released)
            if item.pull is not None:
                item.pull.wait()
            if item.source is not None:
                item.source.release(item.fields["handle"])
        self._importing = []
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        self.writer.shutdown()  # (files being written are in place before they are deleted below)
        if self._nixl is not None:
            self._nixl.close()
        self.ipc.close()
        with _EXPORTERS_LOCK:
            _EXPORTERS.pop(self.exporter_id, None)
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for pin in pins:
            if pin.path is not None:
                kv_transfer_shm.expire(pin.path)
            if pin.offer is not None:
                pin.offer.close()

    # ----- generation side (its loop thread) -----
    def import_kv(self, seq) -> str | None:
        """Start bringing ``seq``'s (generation_only, no blocks yet) prompt KV into this pool; an error message
        (the request fails) or None. When the copy is done, ``executor._continue_generation_only(seq,
        first_token)`` (at once if the copy was synchronous: off CUDA)."""
        ex = self.executor
        try:
            fields = decode(seq.state.request.context_phase_params)
            self._check(fields, seq.state.request)
            if fields["transport"] == "shm":
                return self._import_file(seq, fields)
            if fields["transport"] == "nixl":
                return self._import_nixl(seq, fields)
            if fields["transport"] in kv_transfer_cuda_ipc.TRANSPORTS:
                return self._import_offer(seq, fields)
            with _EXPORTERS_LOCK:
                source = _EXPORTERS.get(fields["exporter"])
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
        reading = self._readers.submit(_read_file, fields["path"], pool, dst_ids, after, self.timeout_s,
                                       fields.get("peer"), offer)
        self._importing.append(_Import(seq, fields, dst_ids, reading=reading))
        reading.add_done_callback(lambda _: self._wake())
        return None

    # ----- nixl (kv_transfer_nixl.py) -----
    def nixl_side(self) -> kv_transfer_nixl.NixlSide:
        if self._nixl is None:
            self._nixl = kv_transfer_nixl.NixlSide(self.executor.runner.kv_cache)
        return self._nixl

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
            pull = kv_transfer_nixl.NixlPull(self.nixl_side(), fields, dst_ids, self.timeout_s,
                                             lambda: seq.is_finished, kv_transfer_nixl.after_step(ex.runner.device))
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

    # ----- cuda_ipc / auto (kv_transfer_cuda_ipc.py) -----
    def _import_offer(self, seq, fields: dict) -> str | None:
        """cuda_ipc where this process can map the context pool, else (auto) shm through the offer."""
        ex = self.executor
        pool = ex.runner.kv_cache
        num_blocks = ex.blocks.blocks_for_tokens(fields["prompt_len"])
        if (error := self._block_count_error(fields, num_blocks) or self._no_room(num_blocks)) is not None:
            return error
        try:
            with _EXPORTERS_LOCK:
                in_process = fields["exporter"] in _EXPORTERS
            how, src, why = kv_transfer_cuda_ipc.choose(fields, pool, self.ipc.peers, in_process)
        except ValueError as err:
            return str(err)
        self.ipc.note(fields["transport"], how, why)
        if how == "nixl":
            try:
                _check_nixl(fields)
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
            time.monotonic() + self.timeout_s, lambda: seq.is_finished, fields.get("peer"))
        self._start(_Import(seq, fields, dst_ids, pull))
        return None

    def _advance_offers(self, now: float) -> None:
        """Context side: the offered pins' files -> their states; a claim for shm writes the blocks to the shm
        file (the pin becomes an shm pin, its blocks freed once written)."""
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
            # ("expired": the pin stays "pinned" past its deadline: freed below and counted as expired)

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
            self._pins[handle] = _Pin(pin.block_ids, now + self.timeout_s, path, writing=writing)
        writing.add_done_callback(lambda _: self._wake())

    def _answer_nixl(self) -> None:
        """Context side: answer claims (granted once the prompt's KV is final) and free pins whose READ ended."""
        side = self._nixl
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

    def _wake(self) -> None:
        with self.executor._cv:
            self.executor._cv.notify()

    def _start(self, item: _Import) -> None:
        if item.pull.done():  # off CUDA: copied already
            self._arrived(item)
        else:
            self._importing.append(item)

    def _finish_pulls(self) -> None:
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

    def stats(self) -> dict:
        """This side's fields of the executor's IterationStats."""
        return {"num_kv_transfers_total": self.num_transfers, "kv_cache_transfer_ms_total": self.kv_cache_transfer_ms,
                "num_kv_blocks_quarantined": self.num_quarantined_blocks}


def _check_nixl(fields: dict) -> None:
    for name, kind in (("agent", str), ("metadata", str), ("mem", str), ("pool", dict), ("block_ids", list)):
        if not isinstance(fields.get(name), kind):
            raise ContextPhaseError(f"context_phase_params: truncated or corrupted blob ({name}); send the "
                                    f"context_phase_params output of a context_only request unchanged")
    pool = fields["pool"]
    if not all(isinstance(pool.get(k), int) for k in ("addr", "num_blocks", "device")) or \
            not all(isinstance(b, int) and 0 <= b < pool["num_blocks"] for b in fields["block_ids"]):
        raise ContextPhaseError("context_phase_params: truncated or corrupted blob (pool, block_ids); send the "
                                "context_phase_params output of a context_only request unchanged")


def _read_file(path: str, pool, dst_ids: list[int], after, wait_s: float, peer, offer: str | None = None):
    """A reader thread: (the blocks are in place: False when gone, ms spent); ``offer``: claimed for shm first
    (auto)."""
    started = time.perf_counter()
    if offer is not None and kv_transfer_cuda_ipc.claim_for_shm(offer, wait_s, peer) is None:
        return False, (time.perf_counter() - started) * 1e3
    copied = kv_transfer_shm.read_blocks(path, pool, dst_ids, after, wait_s, peer)
    return copied, (time.perf_counter() - started) * 1e3
