"""The ``cuda_ipc`` transport of disaggregated serving, and the ``auto`` choice between it and ``shm``: a
context_only request's KV pulled GPU to GPU by a generation executor in another process of the same host.
engine/executor/disaggregated.py decides when it is used; this file holds the files, the handles and the pull.

Sharing the pool (context side, ``PoolShare``): the KV pool is one tensor allocated at start for the
executor's life, so it is shared once: ``untyped_storage()._share_cuda_()`` (what torch.multiprocessing's
reduce_tensor does) gives the cudaIpcMemHandle of the caching allocator's segment that holds it, the pool's
offset in it, a ref-counter file and an event. torch swaps the storage's deleter for one that keeps the
segment (in its "limbo") while a consumer's ref counter is above zero, so a generation process that still
maps the pool when the context executor shuts down reads live memory. The handles go to one file per
executor, ``<dir>/tritonllm-kv-<exporter>.ipc`` (mode 0600, JSON; dir as for shm: TRITONLLM_KV_TRANSFER_DIR,
else /dev/shm): a blob names it by its exporter id; the blob carries no handle of its own, so a crafted blob
can name only a pool this host's executors shared. The generation side opens it once per peer
(``PeerPools``, cached by exporter): torch's rebuild (``rebuild_cuda_tensor``) on *its* index of the context
GPU, found by the GPU's UUID (two processes may number GPUs differently), so the mapped pool is a tensor on
the context GPU in this process, and kv_pull.PullStreams moves the blocks exactly as the in-process ``local``
transport does (gather on the context GPU into a staging of the pull's own, one peer copy, scatter; made
once, allocation-free after). That process then holds a CUDA context and one chunk's staging on the context
GPU too (~0.5 GB and 64 MB).

The offer (both ``cuda_ipc`` and ``auto``): the prompt's blocks stay pinned in the context pool (as for
``local``), and one file per pin says where the pin is in its life; every transition is an atomic rename or
an unlink, so the two processes need no other channel (no socket, no notification):
    <offer>.pending  the prompt's KV is not final on the context GPU yet (its ready event has not passed)
    <offer>          claimable (the context loop renamed .pending once the event passed: ``service``)
    <offer>.ipc      claimed by a generation side's cuda_ipc pull (it writes its kv_peer.identity into it)
    <offer>.shm      claimed for ``shm``: the context loop gathers the blocks into the shm file (as an shm export
                     does: its .partial first), frees them, and deletes this marker; the claimer's reader waits
                     while the marker exists, then reads the file as shm's reader does (``claim_for_shm``)
    (none)           released: the pull is done (the claimer deleted <offer>.ipc): the pin is freed
Ordering: the ready event is not shared (an interprocess event would cost an IPC open per request and has
lifetime rules of its own); the offer only becomes claimable once the event has passed, polled by the
context loop. An export follows the first token, which the host read after the prefill's forward, so the
event has nearly always passed at export and <offer> is made at once; the pull itself then waits for nothing
on the context side (``ready=None``). Why files: the pin must stay until the other process's copy is done,
and both processes see one host's /dev/shm.

Freeing, as for shm / nixl: fetched (released), expired (the context loop takes an unclaimed <offer> away at
TRITONLLM_KV_TRANSFER_TIMEOUT_S, so no late claim can read freed blocks), a claimer that died (kv_peer.gone on
the identity in <offer>.ipc, looked at every kv_peer.CHECK_S; else one more timeout), a cancel during the pull
(the pull keeps its blocks until the copy is done), a cancel before the claim (the offer is taken and dropped at
once). A context process that dies fails a claim still waiting for it (kv_peer.gone on the blob's ``peer``).

``auto`` (the context side does not know who will fetch): the context side pins and offers, shares its pool
if it is on CUDA; the generation side chooses (``choose``): ``cuda_ipc`` when the blob comes from this host
(same boot id), both pools are on CUDA, the context GPU is visible here, the two GPUs can access each other
(or are one) and the handles open; else ``shm`` (on demand, through the offer); a blob from another host
goes through ``nixl`` when the context side put NIXL's fields in it, else is refused by name. NIXL must
register the pool at export, before anyone knows whether a remote host will fetch, so an auto export does
so only where the context side sets TRITONLLM_KV_TRANSFER_AUTO_NIXL=1 (off by default: an agent and a
registered pool per context executor, and NIXL is not verified on GPUs yet). Such a pin is claimed either
way, once: a NIXL claim takes the offer file first (``Offer.take_for_nixl``). The choice is printed once per
executor and kind.
"""
from __future__ import annotations

import base64
import functools
import json
import os
import re
import socket
import sys
import time

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from engine.executor import kv_peer
from engine.executor.kv_transfer_shm import WAIT_POLL_S, transfer_dir

TRANSPORTS = ("cuda_ipc", "auto")  # the kv_transfer names this file serves
AUTO_NIXL_ENV = "TRITONLLM_KV_TRANSFER_AUTO_NIXL"  # "1" on the context side: auto blobs also carry NIXL's fields
POLL_S = 0.002  # the context loop's poll of its offers while any pin is offered (a stat; a claimer's /proc at CHECK_S)
NEEDS_CUDA = "kv_transfer 'cuda_ipc' needs the context executor's KV pool on a CUDA device"
_NAME = re.compile(r"tritonllm-kv-[0-9a-f]{32}(-[0-9]+\.offer|\.ipc)")


def host_id() -> str:
    """This boot of this host (its processes see the same GPUs; the transports also assume they see the same
    transfer directory, as the engine processes of one tritonserver do)."""
    return kv_peer.identity()["boot"] or socket.gethostname()


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with that UUID (None: not visible here)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


def _gone(who) -> bool:
    """Whether the process of a claim or a handle-set file (kv_peer.identity) is known to have exited (only a
    process of this host and PID namespace can be checked; an unknown one is taken for alive)."""
    return who is not None and kv_peer.gone(who) is not None


def offer_path(exporter: str, handle: int) -> str:
    return os.path.join(transfer_dir(), f"tritonllm-kv-{exporter}-{handle}.offer")


def shm_path(offer: str) -> str:
    """The shm file an offer claimed for ``shm`` becomes (what kv_transfer_shm.ShmWriter names it)."""
    return offer[:-len(".offer")] + ".kv"


def _tag(value):
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _untag(value):
    return base64.b64decode(value["b64"]) if isinstance(value, dict) else value


def fields_error(fields: dict) -> str | None:
    """A blob's offer fields checked (paths must be ours: a generation side renames them)."""
    offer, ipc, name = fields.get("offer"), fields.get("ipc"), f"tritonllm-kv-{fields['exporter']}"
    if not (isinstance(offer, str) and os.path.isabs(offer) and _NAME.fullmatch(os.path.basename(offer))
            and os.path.basename(offer) == f"{name}-{fields['handle']}.offer"
            and isinstance(fields.get("host"), str) and isinstance(fields.get("block_ids"), list)
            and all(isinstance(b, int) and b >= 0 for b in fields["block_ids"])
            and (ipc is None or isinstance(ipc, str) and os.path.isabs(ipc) and os.path.basename(ipc) == f"{name}.ipc"
                 and _NAME.fullmatch(os.path.basename(ipc)))):
        return ("context_phase_params: truncated or corrupted blob (offer, host, ipc, block_ids); send the "
                "context_phase_params output of a context_only request unchanged")
    return None


class PoolShare:
    """Context side: the pool's CUDA IPC handles, written once to the handle-set file (deleted at close)."""

    def __init__(self, pool: torch.Tensor, exporter: str):
        self.path = os.path.join(transfer_dir(), f"tritonllm-kv-{exporter}.ipc")
        share = pool.untyped_storage()._share_cuda_()  # (device, handle, size, offset, refcounter, its offset, event, sync)
        content = {"pid": os.getpid(), "process": kv_peer.identity(), "host": host_id(), "device_uuid": device_uuid(pool.device),
                   "dtype": str(pool.dtype).replace("torch.", ""), "size": list(pool.shape),
                   "stride": list(pool.stride()), "offset": pool.storage_offset(),
                   "share": [_tag(value) for value in share]}
        partial = f"{self.path}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        os.replace(partial, self.path)

    def close(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


class PeerPools:
    """Generation side: context pools opened from their handle-set files, once per peer (exporter)."""

    def __init__(self):
        self._pools: dict[str, tuple[torch.Tensor, dict]] = {}  # exporter -> (mapped pool, kv_peer.identity)
        self._failed: dict[str, str] = {}  # exporter -> why its handles did not open (not retried per request)

    def open(self, path: str, exporter: str) -> torch.Tensor:
        """The peer's pool, mapped into this process on its GPU; raises RuntimeError naming the cause. ``path``
        is the exporter's own handle-set file (kv_transfer_cuda_ipc.fields_error checked the name)."""
        if exporter in self._pools:
            return self._pools[exporter][0]
        if exporter in self._failed:
            raise RuntimeError(self._failed[exporter])
        try:
            return self._open(path, exporter)
        except Exception as err:
            self._failed[exporter] = str(err) if isinstance(err, RuntimeError) else repr(err)
            raise RuntimeError(self._failed[exporter]) from None

    def _open(self, path: str, exporter: str) -> torch.Tensor:
        for exited in [e for e, (_, who) in self._pools.items() if _gone(who)]:
            del self._pools[exited]  # (an exited peer's mapping: torch closes its handle with the last reference)
        try:
            with open(path) as f:
                content = json.load(f)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"the context executor's CUDA IPC handles ({path}) cannot be read: {err}") from None
        if _gone(content["process"]):
            raise RuntimeError(f"the context process {content['pid']} has exited")
        index = local_index(content["device_uuid"])
        if index is None:
            raise RuntimeError(f"the context GPU {content['device_uuid']} is not visible in this process "
                               f"(CUDA_VISIBLE_DEVICES)")
        _, *share = [_untag(value) for value in content["share"]]  # (its device index is the context's own)
        pool = rebuild_cuda_tensor(torch.Tensor, torch.Size(content["size"]), tuple(content["stride"]),
                                   content["offset"], torch.UntypedStorage, getattr(torch, content["dtype"]), index,
                                   share[0], share[1], share[2], False, *share[3:])
        self._pools[exporter] = (pool, content["process"])
        return pool


class IpcSide:
    """One executor's cuda_ipc / auto state: its pool's share (context side, made at the first export from a CUDA
    pool), the peers' pools it opened and the choices it made (generation side). Invariant: an executor's pool
    is allocated once, at load, before any export (runner.allocate_kv_cache), so one share serves its life and
    a peer's mapping, cached by exporter, never goes stale."""

    def __init__(self):
        self.share: PoolShare | None = None
        self.share_error: str | None = None  # (sharing failed once: auto offers without handles from then on)
        self.peers = PeerPools()
        self.chosen: dict[str, int] = {}  # "cuda_ipc" | "shm" -> imports that used it
        self.why: dict[str, str] = {}  # "cuda_ipc" | "shm" -> the reason of the latest such choice

    def describe(self, pool: torch.Tensor, exporter: str, transport: str) -> dict:
        """The blob's fields of an offer (besides ``offer`` and ``block_ids``); raises for an explicit cuda_ipc
        whose pool cannot be shared."""
        where = {"host": host_id(), "hostname": socket.gethostname()}
        if pool.device.type != "cuda":
            if transport == "cuda_ipc":
                raise RuntimeError(NEEDS_CUDA)
            return where
        where["device_uuid"] = device_uuid(pool.device)
        if self.share is None and self.share_error is None:
            try:
                self.share = PoolShare(pool, exporter)
            except Exception as err:  # (memory torch cannot share: an allocator configured otherwise)
                self.share_error = repr(err)
                print(f"[disaggregated] the KV pool cannot be shared through CUDA IPC: {err!r}; kv_transfer auto "
                      f"falls back to shm", file=sys.stderr, flush=True)
        if self.share is None:
            if transport == "cuda_ipc":
                raise RuntimeError(f"kv_transfer 'cuda_ipc': the KV pool cannot be shared ({self.share_error})")
            return where
        return {**where, "ipc": self.share.path}

    def note(self, asked: str, how: str, why: str) -> None:
        """Count a generation side's choice; print it the first time (per kind) this executor makes it."""
        if how not in self.chosen:
            print(f"[disaggregated] kv_transfer {asked}: {how} ({why})", file=sys.stderr, flush=True)
        self.chosen[how] = self.chosen.get(how, 0) + 1
        self.why[how] = why

    def close(self) -> None:
        if self.share is not None:
            self.share.close()


def choose(fields: dict, dst_pool: torch.Tensor, peers: PeerPools, in_process: bool = False) \
        -> tuple[str, torch.Tensor | None, str]:
    """Generation side: (``cuda_ipc``, the mapped source pool, why), (``shm``, None, why) or, for an auto blob from
    another host that carries NIXL's fields, (``nixl``, None, why) for an offer blob;
    raises ValueError (its message a request's error) where the blob's own transport cannot be served.
    ``in_process``: the context executor lives in this process (CUDA does not open a process's own handles)."""
    asked = fields["transport"]
    if fields["host"] != host_id():
        if asked == "auto" and isinstance(fields.get("agent"), str):
            return "nixl", None, f"the context side runs on another host ({fields.get('hostname')})"
        raise ValueError(f"context_phase_params: the context side runs on another host ({fields.get('hostname')}); "
                         f"'{asked}' moves KV within one host; send the context_only request with kv_transfer "
                         f"nixl to move it across hosts (or set {AUTO_NIXL_ENV}=1 on the context side)")
    reason = None
    if in_process:
        reason = "the context executor is in this process (kv_transfer local copies between its pools)"
    elif fields.get("ipc") is None:
        reason = "the context pool is not on a CUDA device" if fields.get("device_uuid") is None else \
            "the context side could not share its pool"
    elif dst_pool.device.type != "cuda":
        reason = "this executor's pool is not on a CUDA device"
    else:
        try:
            src = peers.open(fields["ipc"], fields["exporter"])
            if src.device != dst_pool.device and not _peer_access(dst_pool.device, src.device):
                reason = f"{src.device} and {dst_pool.device} cannot access each other (no peer access)"
            else:
                return "cuda_ipc", src, f"context GPU {fields['device_uuid']} (here {src.device}) -> {dst_pool.device}"
        except Exception as err:  # (a handle that will not open: an IPC-less sandbox, a driver refusing it)
            reason = f"the context pool's CUDA IPC handles did not open ({err})"
    if asked == "cuda_ipc":
        raise ValueError(f"context_phase_params: kv_transfer 'cuda_ipc' cannot be served here: {reason}; send the "
                         f"context_only request with kv_transfer auto (or shm)")
    return "shm", None, reason


@functools.lru_cache(maxsize=None)
def _peer_access(device: torch.device, peer: torch.device) -> bool:
    return torch.cuda.can_device_access_peer(device, peer)


class IpcPull:
    """A generation_only request's cuda_ipc pull: claim the offer (rename), pull the blocks from the mapped pool
    (kv_pull.PullStreams), release (unlink the claim). The ``Pull`` interface plus ``error``; ``done`` never
    raises (the generation loop polls it outside its error handling)."""

    def __init__(self, offer: str, start, deadline: float, cancelled, peer=None):
        self.offer, self.claim = offer, f"{offer}.ipc"
        self._context = kv_peer.Watch(peer)  # (peer: the context's kv_peer.identity)
        self._start_pull = start  # () -> kv_pull.Pull: the copy from the mapped pool into our blocks
        self.deadline, self.cancelled = deadline, cancelled
        self.pull, self.error, self._state = None, None, "claiming"

    def done(self) -> bool:
        try:
            return self._advance()
        except Exception as err:  # (a copy that would not start; the claim goes back)
            self._release()
            self.error, self._state = f"context_phase_params: the CUDA IPC pull of the context phase's KV failed: " \
                                      f"{err!r}", "done"
            return True

    def _advance(self) -> bool:
        if self._state == "claiming":
            try:
                os.rename(self.offer, self.claim)
            except FileNotFoundError:
                # (cancelled too: it claims the offer once claimable and gives it back at once, so the context
                # side frees the pin then, not at its deadline)
                if os.path.exists(f"{self.offer}.pending") and time.monotonic() < self.deadline:
                    if (dead := self._context.gone()) is not None:
                        self.error, self._state = dead, "done"
                        return True
                    return False  # (its prefill is still on the context GPU)
                if os.path.exists(self.offer) and time.monotonic() < self.deadline and not self.cancelled():
                    return False  # (.pending renamed to it between our rename and the check above: claim it next)
                if not self.cancelled():
                    self.error = ("context_phase_params: the context phase's KV cache is gone (fetched already, or "
                                  "freed after the context side's timeout); run the context_only request again")
                self._state = "done"
                return True
            with open(self.claim, "w") as f:
                json.dump(kv_peer.identity(), f)  # (the context side frees the pin if this process dies mid-pull)
            if self.cancelled():  # (nothing to copy: the pin goes back at once)
                self._release()
                self._state = "done"
                return True
            self._state = "pulling"
            self.pull = self._start_pull()
        if self._state == "pulling":
            if not self.pull.done():
                return False
            self._release()
            self._state = "done"
        return True

    def _release(self) -> None:
        try:
            os.remove(self.claim)
        except FileNotFoundError:
            pass

    def wait(self) -> None:
        """Shutdown: the copy in flight ends before its claim goes back."""
        if self._state == "pulling":
            self.pull.wait()
            self._release()
            self._state = "done"

    def order_before(self) -> None:
        if self.pull is not None:
            self.pull.order_before()

    def elapsed_ms(self) -> float:
        return self.pull.elapsed_ms() if self.pull is not None else 0.0


class Offer:
    """Context side: one pin's offer file and where it is in its life (see the module docstring)."""
    __slots__ = ("path", "state", "deadline", "timeout_s", "claimer")

    def __init__(self, path: str, ready, deadline: float, timeout_s: float):
        self.path, self.deadline, self.timeout_s = path, deadline, timeout_s
        self.claimer = kv_peer.Watch()  # (its peer: the claim file's kv_peer.identity, once read)
        self.state = "pending" if ready is not None and not ready.query() else "offered"  # -> "claimed"
        open(f"{path}.pending" if self.state == "pending" else path, "wb").close()

    def changed(self, ready, now: float) -> bool:
        """Whether ``advance`` has something to do (the idle loop's check: cheap, never raises)."""
        try:
            if self.state == "pending":
                return now >= self.deadline or ready is None or ready.query()
            if self.state == "offered":
                return now >= self.deadline or not os.path.exists(self.path)
            if self.state == "nixl":
                return False  # (the NIXL transport's own states from here: kv_transfer_nixl)
            return now >= self.deadline + self.timeout_s or not os.path.exists(f"{self.path}.ipc") or \
                self.claimer.due  # (the claimer looked at every kv_peer.CHECK_S, by ``advance``)
        except Exception:
            return True

    def advance(self, ready, now: float) -> str:
        """The pin's state from the files: "pinned" (only before the deadline), "shm" (claimed for shm: the caller
        gathers the blocks into the shm file, then ``shm_started``), "claimed" (a cuda_ipc pull), "released"
        (pulled, or its claimer died, or one more timeout passed: free it) or "expired" (taken back unclaimed:
        free it), or "nixl" (taken by a NIXL claim: that transport's states decide). The context loop's thread."""
        if self.state == "nixl":
            return "nixl"
        if self.state == "pending":
            if now >= self.deadline:
                return "expired" if _take(f"{self.path}.pending") else "released"
            if ready is not None and not ready.query():
                return "pinned"
            try:
                os.rename(f"{self.path}.pending", self.path)  # (only this process renames a .pending)
            except FileNotFoundError:  # (removed by hand: nobody can claim it any more)
                return "released"
            self.state = "offered"
        if self.state == "offered":
            if os.path.exists(self.path):
                if now < self.deadline:
                    return "pinned"
                if _take(self.path):
                    return "expired"
            if os.path.exists(f"{self.path}.shm"):
                return "shm"
            self.state = "claimed"
        claim = f"{self.path}.ipc"
        if not os.path.exists(claim):
            return "released"
        if self.claimer.peer is None and self.claimer.due:
            self.claimer.peer = _claim_identity(claim)
        if now < self.deadline + self.timeout_s and self.claimer.gone() is None:
            return "claimed"
        print(f"[disaggregated] the cuda_ipc claim {claim} ended without its pull (claimer "
              f"{json.dumps(self.claimer.peer) if self.claimer.peer else '?'} gone)", file=sys.stderr, flush=True)
        _take(claim)
        return "released"

    def take_for_nixl(self) -> bool:
        """A NIXL claim (its prompt's KV final): take the offer so that no cuda_ipc / shm claim can; False when one
        took it first. Idempotent."""
        if self.state == "nixl":
            return True
        if self.state in ("pending", "offered") and _take(self.path + (".pending" if self.state == "pending" else "")):
            self.state = "nixl"
            return True
        return False

    def shm_started(self) -> None:
        """The shm file's .partial exists (ShmWriter.start_write): the claimer's reader may stop waiting."""
        _take(f"{self.path}.shm")

    def close(self) -> None:
        """Shutdown: whatever is still offered goes (a claimer mid-pull keeps the mapped pool alive)."""
        for suffix in ("", ".pending", ".shm"):
            _take(self.path + suffix)


def claim_for_shm(offer: str, wait_s: float, peer=None) -> str | None:
    """A generation side's reader thread: claim the offer for ``shm`` and wait until the context side has begun
    writing its file; that file's path (then kv_transfer_shm.read_blocks), or None: gone (fetched already,
    expired, or the context side never began). ``peer``: the context process (kv_peer.identity); if it dies
    meanwhile, kv_peer.PeerGone at once."""
    deadline, marker, context = time.monotonic() + wait_s, f"{offer}.shm", kv_peer.Watch(peer)
    while True:
        try:
            os.rename(offer, marker)
            break
        except FileNotFoundError:
            if not os.path.exists(f"{offer}.pending") or time.monotonic() > deadline:
                if os.path.exists(offer) and time.monotonic() <= deadline:
                    continue  # (.pending renamed to it between our rename and the check: claim it now)
                return None
            _fail_if_gone(context)
            time.sleep(WAIT_POLL_S)  # (its prefill is still on the context GPU)
    while os.path.exists(marker):  # (the context loop creates the file's .partial, then removes the marker)
        if time.monotonic() > deadline:
            _take(marker)
            return None
        _fail_if_gone(context, marker)
        time.sleep(WAIT_POLL_S)
    return shm_path(offer)


def _fail_if_gone(context: kv_peer.Watch, marker: str | None = None) -> None:
    """While a reader waits: raise kv_peer.PeerGone if the context process is known dead (its marker, which
    nobody would remove, goes)."""
    if (dead := context.gone()) is not None:
        if marker is not None:
            _take(marker)
        raise kv_peer.PeerGone(dead)


def _claim_identity(claim: str) -> dict | None:
    """The claimer's kv_peer.identity from its claim file; None while the file is still empty (the claimer
    writes it just after its rename) or already gone (released)."""
    try:
        with open(claim) as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _take(path: str) -> bool:
    """Remove ``path`` if it is still there (the rename to a private name is what makes it atomic against a
    generation side's claim); True when it was."""
    mine = f"{path}.taken-{os.getpid()}"
    try:
        os.rename(path, mine)
    except FileNotFoundError:
        return False
    os.remove(mine)
    return True
