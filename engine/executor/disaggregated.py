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

The blob (its format, codec and checks): context_phase.py. The context side (pins, offers, NIXL answers):
kv_export.py; the generation side (imports over each transport): kv_import.py. This file: the request types'
checks and the executor loop's hooks, over both.

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

import os
import time
import uuid
import weakref
from dataclasses import replace

from engine.executor import kv_transfer_cuda_ipc, kv_transfer_nixl
from engine.executor.context_phase import ContextPhaseError, check, decode
from engine.executor.kv_export import KvExports
from engine.executor.kv_import import KvImports
from engine.executor.kv_pull import PullStreams, ReadyEvents

REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")
TRANSPORTS = ("local", "shm", "nixl", "cuda_ipc", "auto")
DEFAULT_TIMEOUT_S = float(os.environ.get("TRITONLLM_KV_TRANSFER_TIMEOUT_S", "60"))
POLL_S = 0.0005  # an idle generation loop's wake-up period while a pull is in progress

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


class Disaggregation:
    """One executor's side: exports of its context_only requests (``exports``, kv_export.py), imports of its
    generation_only ones (``imports``, kv_import.py).

    ``executor``: the Executor (its runner, blocks, scheduler and condition are used; the calls come
    from its loop thread, except ``exports.claim``/``release``, made by a peer's loop).
    """

    def __init__(self, executor, timeout_s: float = DEFAULT_TIMEOUT_S, transport: str | None = None):
        # A weak reference: the executor holds this part (and through it its imports and exports), and a strong one
        # back would put every executor in a reference cycle, its KV pool freed only when the collector ran.
        self.executor = weakref.proxy(executor)
        self.timeout_s = timeout_s  # (read at each use by both sides)
        self.transport = transport or os.environ.get("TRITONLLM_KV_TRANSFER", "local")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"TRITONLLM_KV_TRANSFER '{self.transport}' is not supported; allowed: {', '.join(TRANSPORTS)}")
        if (unusable := self._unusable(self.transport)) is not None:
            raise ValueError(f"TRITONLLM_KV_TRANSFER: {unusable}")
        self.ipc = kv_transfer_cuda_ipc.IpcSide()  # cuda_ipc / auto: the pool's share, peers' pools, choices
        self._nixl: kv_transfer_nixl.NixlSide | None = None  # this executor's NIXL agent (made on first use)
        self.ready = ReadyEvents(executor.runner.device)  # context side: prompts' KV final on the device
        self.imports = KvImports(self)  # generation side
        self.exports = KvExports(self, uuid.uuid4().hex)  # context side (registered: local transport)

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
        if kind == "context_only" and (unusable := self._unusable(transfer)) is not None:
            return unusable
        if kind == "generation_only":
            if request.context_phase_params is None:
                return ("context_phase_params: a generation_only request needs the context_phase_params output "
                        "of its context_only request")
            try:
                check(decode(request.context_phase_params), request, ex.runner)
            except ContextPhaseError as err:
                return str(err)
        return None

    def _unusable(self, transport: str | None) -> str | None:
        """Why a context side of this executor cannot export over ``transport`` (None: it can)."""
        if transport == "nixl" and not kv_transfer_nixl.available():
            return kv_transfer_nixl.MISSING
        if transport == "cuda_ipc" and self.executor.runner.kv_cache.device.type != "cuda":
            return kv_transfer_cuda_ipc.NEEDS_CUDA
        return None

    # ----- the executor's hooks -----
    def export(self, seq) -> str | None:
        """Context side: ``seq`` (context_only) got its first token (KvExports.export)."""
        return self.exports.export(seq)

    def import_kv(self, seq) -> str | None:
        """Generation side: start bringing ``seq``'s prompt KV into this pool (KvImports.import_kv)."""
        return self.imports.import_kv(seq)

    def prepare(self, request):
        """A context_only request stops after its first token, whatever max_tokens it carried."""
        if getattr(request, "request_type", None) != "context_only":
            return request
        self.ready.enabled = True  # from now on each launch looks for finished context_only prompts
        return replace(request, max_tokens=1) if request.max_tokens != 1 else request

    def nixl_side(self) -> kv_transfer_nixl.NixlSide:
        """This executor's NIXL agent over its pool (both sides), made on first use."""
        if self._nixl is None:
            self._nixl = kv_transfer_nixl.NixlSide(self.executor.runner.kv_cache)
        return self._nixl

    def has_work(self) -> bool:
        """A pin to free now (released by its fetcher, or expired), or a finished pull."""
        if self.imports.has_work():
            return True
        if self._nixl is not None:
            self._nixl.poll()
            if self._nixl.done or any(self.exports.claim_to_answer(self._nixl, *claim[:2])
                                      for claim in self._nixl.claims):
                return True
        return self.exports.has_work()

    def wait_timeout(self) -> float | None:
        """How long the idle loop may sleep before a pin expires or a pull should be polled (None: neither)."""
        if self.imports.polling:  # (a reader thread notifies when it is done)
            return POLL_S
        poll, deadlines = self.exports.wake_ups()
        if poll is not None:
            return poll
        if self._nixl is not None:  # a late claim still gets its "gone" answer
            deadlines.append(time.monotonic() + kv_transfer_nixl.IDLE_POLL_S)
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic()) + 0.001

    def service(self) -> bool:
        """Free released and expired pins (context side) and finish done pulls (generation side); at each step.
        True when blocks may have been freed (the pool's gauges changed)."""
        if self._nixl is not None:
            self.exports.answer_nixl(self._nixl)
        importing = self.imports.num_importing
        if importing:
            self.imports.finish_pulls()
        if self.ready.pending:
            self.ready.forget(self.executor._active)
        freed = self.exports.service(time.monotonic())
        return freed or self.imports.num_importing != importing

    def _wake(self) -> None:
        with self.executor._cv:
            self.executor._cv.notify()

    @property
    def num_pinned_blocks(self) -> int:
        return self.exports.num_pinned_blocks

    @property
    def num_importing(self) -> int:
        return self.imports.num_importing

    def stats(self) -> dict:
        """This side's fields of the executor's IterationStats."""
        return {"num_kv_transfers_total": self.imports.num_transfers,
                "kv_cache_transfer_ms_total": self.imports.kv_cache_transfer_ms,
                "num_kv_blocks_quarantined": self.imports.num_quarantined_blocks}

    def shutdown(self) -> None:
        self.imports.shutdown()
        self.exports.writer.shutdown()  # (files being written are in place before they are deleted below)
        if self._nixl is not None:
            self._nixl.close()
        self.ipc.close()
        self.exports.shutdown()
