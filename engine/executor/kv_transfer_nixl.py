"""The ``nixl`` transport of disaggregated serving: a context_only request's KV blocks READ by the generation
side straight from the context side's pool through NIXL (the transfer library TensorRT-LLM, Dynamo, vLLM and
SGLang use; UCX underneath: RDMA, TCP, shared memory or CUDA IPC, whichever UCX finds between the two
agents). Made for another host: no shared memory and no shared filesystem are assumed, only a network path
that UCX can use. engine/executor/disaggregated.py decides when it is used; NIXL is an optional dependency
(``nixl-cu12`` or ``nixl-cu13``, the build for torch's CUDA major; the ``nixl`` meta package works too), refused
by name when it is not importable.

Design:
- Each executor that uses the transport owns one NIXL agent (``NixlSide``, made on first use; UCX backend),
  its whole KV pool registered with it (DRAM on CPU, VRAM on GPU). One registration, for the pool's life:
  blocks are addressed inside it.
- Export (context loop): the prompt's blocks stay pinned in the pool (as for ``local``); the blob carries the
  agent's name, its metadata (~0.5 KB, zlib + base64: what a remote agent needs to connect and to READ the
  registered pool), the pool's address, its number of blocks and the pinned block ids. No side channel.
- Import (generation loop, ``NixlPull``): add the remote agent from the blob's metadata, send it a ``claim``
  notification carrying this agent's own metadata; the context side answers ``granted`` (the pin was still
  live and its prompt's KV is final: CUDA ready event) or ``gone`` (fetched already, expired). Only after
  ``granted`` the generation side READs every (block, layer, K/V) row of the prompt into its own freshly
  allocated blocks, with a ``done`` notification that NIXL delivers to the context side once the data has
  moved; the context side then frees the pin. The claim is what makes a late READ impossible: blocks freed at
  the timeout are never read, because nothing is granted after it.
- Neither loop blocks: both poll (``NixlSide.poll``: new notifications, at each step and from the idle
  loop every ``POLL_S`` while a pin or an import is pending; ``NixlPull.done``: the transfer's state).
- A generation_only request cancelled while its READ runs keeps its blocks until the READ is done (as the
  local pull); cancelled before the grant, it sends ``done`` without reading, so the pin goes at once.
- Backstop: the context side's timeout (TRITONLLM_KV_TRANSFER_TIMEOUT_S) frees unclaimed pins; a claimed
  pin whose ``done`` never comes (the generation side died mid-READ) is freed one more timeout later.

Descriptors: the pool is (L, 2, num_blocks, T, H, D); one block of one (layer, K/V) is T*H*D contiguous
elements at ``base + ((layer * 2 + kv) * num_blocks + block) * row_bytes``. Both sides list the rows in the
same order (block-major, then layer, then K/V), so row i of the local list receives row i of the remote one;
NIXL merges adjacent rows.

Across hosts: UCX picks the transports; UCX_TLS / UCX_NET_DEVICES select them, and UCX_TCP_* the TCP ports
(docs/features/disaggregated-serving.md). Notifications travel on the same UCX connection.
"""
from __future__ import annotations

import base64
import glob
import importlib
import os
import sys
import time
import uuid
import zlib

import numpy as np
import torch

from engine.executor import kv_peer

MISSING = "kv_transfer 'nixl' needs NIXL (pip install nixl-cu12==1.5.1, or nixl-cu13==1.5.1 with a CUDA 13 torch)"
POLL_S = 0.002  # an idle loop's poll of NIXL notifications while a nixl pin or import is pending
IDLE_POLL_S = 0.05  # ... and otherwise, once the executor has an agent (a late claim gets its "gone" answer)
# A claim the context side does not acknowledge within this fails at once: its process is gone or unreachable
# (across hosts no pid can be checked). Its loop acknowledges a claim at its next step or idle poll.
ACK_TIMEOUT_S = float(os.environ.get("TRITONLLM_KV_TRANSFER_ACK_TIMEOUT_S", "5"))
# notification kinds: kind + 8-byte handle [+ metadata]; _WAIT: a claim seen, its prompt's KV not final yet
_CLAIM, _GRANTED, _GONE, _DONE, _WAIT = b"C", b"G", b"X", b"D", b"W"


def package_names(cuda_version: str | None) -> list[str]:
    """NIXL's packages in the order tried: the build for torch's CUDA major version first. The two builds differ
    in UCX's CUDA memory hooks (libucm_cuda), which link that major's runtime (libcudart.so.12 / .13): in a
    process whose torch loaded the other one they do not load."""
    builds = ["nixl_cu12", "nixl_cu13"]
    if cuda_version and cuda_version.split(".")[0] == "13":
        builds.reverse()
    return builds + ["nixl"]


def load_api():
    """NIXL's Python API module, or None when it is not installed."""
    _quiet_ucx_exit()
    _detect_cuda_memory_directly()
    for name in package_names(torch.version.cuda):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    return None


def available() -> bool:
    return load_api() is not None


def _quiet_ucx_exit() -> None:
    """The nixl-cu12 1.5.1 wheel's bundled libnl crashes in its exit-time destructor (SIGSEGV in
    rtnl_tc_unregister) once UCX's InfiniBand modules were loaded. On a host without InfiniBand those
    modules serve nothing, so they are not loaded there unless the user set UCX_MODULES."""
    if "UCX_MODULES" not in os.environ and not glob.glob("/sys/class/infiniband/*"):
        os.environ["UCX_MODULES"] = "^ib,rdmacm,mlx5"


def _detect_cuda_memory_directly() -> None:
    """UCX_MEMTYPE_CACHE=n unless the user set it. UCX's memory-type cache learns CUDA allocations only from its
    CUDA hooks (libucm_cuda), and takes an address it has not seen for host memory: without the hooks (a wheel
    built for another CUDA major than torch's runtime; seen on the H200s with nixl-cu12 under torch cu130) the
    VRAM pool registered as host and NIXL refused it (NIXL_ERR_BACKEND). Off, UCX asks its CUDA memory domain
    (cuPointerGetAttributes, the driver) instead: once per registration, since NIXL moves registered memory
    only. Read when UCX loads, so set before the first agent."""
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")


def _handle_bytes(handle: int) -> bytes:
    return int(handle).to_bytes(8, "little")


def pack_metadata(metadata: bytes) -> str:
    return base64.b64encode(zlib.compress(metadata)).decode()


def unpack_metadata(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


class NixlSide:
    """One executor's NIXL agent and its registered pool; calls come from that executor's loop thread."""

    def __init__(self, pool: torch.Tensor):
        api = load_api()
        if api is None:
            raise RuntimeError(MISSING)
        self.name = f"tritonllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # No progress thread: UCX's spins a core at 100% for the agent's whole life (an idle server burned a core
        # per executor, and the CPU test suite ran 2x slower). Both loops already poll the agent (notifications,
        # transfer states), and those calls progress its worker.
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.pool = pool
        self.mem = "DRAM" if pool.device.type == "cpu" else "VRAM"
        # The pool is a transposed view ((L, 2, N, H, T, D) storage seen as (L, 2, N, T, H, D)): each (layer, K/V,
        # block) row is still one contiguous run of T*H*D elements, rows in (layer, K/V, block) order.
        row = pool[0, 0, 0].numel()
        if pool.stride()[:3] != (2 * pool.shape[2] * row, pool.shape[2] * row, row):
            raise RuntimeError(f"kv_transfer 'nixl': a KV pool of strides {pool.stride()} is not laid out in "
                               f"contiguous block rows")
        self._reg = self.agent.register_memory([(pool.data_ptr(), pool.numel() * pool.element_size(),
                                                 max(pool.get_device(), 0), "")], self.mem)  # once, all of it
        self._metadata = None
        self._remotes: set[str] = set()
        self.claims: list[tuple[str, int, bytes]] = []  # context side: (agent, handle, its metadata), unanswered
        self.done: list[tuple[str, int]] = []  # context side: (agent, handle) whose READ finished
        self.answers: dict[tuple[str, int], bool] = {}  # generation side: (agent, handle) -> granted
        self.acks: set[tuple[str, int]] = set()  # generation side: claims the context side has seen (_WAIT)
        self.acknowledged: set[tuple[str, int]] = set()  # context side: claims waiting, _WAIT sent

    @property
    def metadata(self) -> bytes:
        if self._metadata is None:
            self._metadata = self.agent.get_agent_metadata()
        return self._metadata

    def describe(self) -> dict:
        """The blob's fields that let another agent READ from this pool."""
        return {"agent": self.name, "metadata": pack_metadata(self.metadata), "mem": self.mem,
                "pool": {"addr": self.pool.data_ptr(), "num_blocks": self.pool.shape[2],
                         "device": max(self.pool.get_device(), 0)}}

    def connect(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        return name

    def rows(self, addr: int, num_blocks: int, device: int, block_ids: list[int]) -> np.ndarray:
        """(len(block_ids) * L * 2, 3) [address, bytes, device] of the blocks' rows in a pool like ours."""
        layers_kv = self.pool.shape[0] * self.pool.shape[1]
        row_bytes = self.pool[0, 0, 0].numel() * self.pool.element_size()
        index = np.arange(layers_kv, dtype=np.uint64)[None, :] * np.uint64(num_blocks) + \
            np.asarray(block_ids, dtype=np.uint64)[:, None]
        out = np.empty((index.size, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(addr) + index.reshape(-1) * np.uint64(row_bytes)
        out[:, 1] = row_bytes
        out[:, 2] = device
        return out

    def poll(self) -> bool:
        """Take new notifications into claims / done / answers; True when any came. Never raises: it runs in
        the executor loop's idle wait (Disaggregation.has_work), outside its error handling."""
        try:
            news = self.agent.get_new_notifs()
        except Exception as err:
            print(f"[kv_transfer_nixl] reading NIXL notifications failed: {err!r}", file=sys.stderr, flush=True)
            return False
        for agent, messages in news.items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for message in messages:
                kind, handle = message[:1], int.from_bytes(message[1:9], "little")
                if kind == _CLAIM:
                    self.claims.append((agent, handle, message[9:]))
                elif kind == _DONE:
                    self.done.append((agent, handle))
                elif kind in (_GRANTED, _GONE):
                    self.answers[(agent, handle)] = kind == _GRANTED
                elif kind == _WAIT:
                    self.acks.add((agent, handle))
        return bool(news)

    def answer(self, agent: str, handle: int, metadata: bytes, granted: bool | None) -> None:
        """Context side: tell a claiming agent whether it may READ (its metadata lets us reach it); None: not yet,
        the claim is seen (sent once per claim: the claimant's sign that this process is alive)."""
        if agent not in self._remotes:
            self.connect(metadata)
        if granted is None:
            if (agent, handle) not in self.acknowledged:
                self.agent.send_notif(agent, _WAIT + _handle_bytes(handle))
                self.acknowledged.add((agent, handle))
            return
        self.acknowledged.discard((agent, handle))
        self.agent.send_notif(agent, (_GRANTED if granted else _GONE) + _handle_bytes(handle))

    def claim(self, agent: str, handle: int) -> None:
        self.agent.send_notif(agent, _CLAIM + _handle_bytes(handle) + self.metadata)

    def release(self, agent: str, handle: int) -> None:
        """Generation side: give a granted pin back without reading it (the request ended first)."""
        self.agent.send_notif(agent, _DONE + _handle_bytes(handle))

    def read(self, fields: dict, dst_ids: list[int]):
        """Start READing the blob's blocks into ``dst_ids`` of our pool; the transfer handle."""
        pool = fields["pool"]
        remote = self.rows(pool["addr"], pool["num_blocks"], pool["device"], fields["block_ids"])
        local = self.rows(self.pool.data_ptr(), self.pool.shape[2], max(self.pool.get_device(), 0), dst_ids)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem),
                                            self.agent.get_xfer_descs(remote, fields["mem"]), fields["agent"],
                                            _DONE + _handle_bytes(fields["handle"]))
        return handle, self.agent.transfer(handle)

    def close(self) -> None:
        for name in self._remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # (a peer that went away first)
                pass
        self.agent.deregister_memory(self._reg)


class NixlPull:
    """A generation_only request's READ: claim -> (granted) READ -> done; the ``Pull`` interface of kv_pull.py
    (``done``, ``wait``, ``order_before``, ``elapsed_ms``) plus ``error`` (a message when it failed)."""

    def __init__(self, side: NixlSide, fields: dict, dst_ids: list[int], timeout_s: float, cancelled,
                 after_step=None):
        self.side, self.fields, self.dst_ids = side, fields, dst_ids
        self.cancelled = cancelled  # () -> bool: the request ended (then a grant is given back unread)
        self.deadline = time.monotonic() + timeout_s  # for the context side's answer
        self.ack_deadline = time.monotonic() + min(ACK_TIMEOUT_S, timeout_s)  # ... and for its first sign of life
        self._acked = False
        self._context = kv_peer.Watch(fields.get("peer"))  # (its process, known dead: the pull fails at once)
        self.agent = side.connect(unpack_metadata(fields["metadata"]))
        self.key = (self.agent, fields["handle"])
        self.after_step = after_step  # CUDA: the loop's last step, which may still write the fresh blocks
        self.error: str | None = None
        # A failed READ NIXL could not cancel (its handle's release raised): UCX may still write ``dst_ids``, so
        # they must never be freed (Disaggregation quarantines them); the handle is kept.
        self.quarantined = False
        self._xfer, self._state, self._started, self._ms = None, "claiming", 0.0, 0.0
        side.claim(self.agent, fields["handle"])

    def done(self) -> bool:
        """Moves the pull on (claim answer, READ start, READ state); never raises: a NIXL call that fails ends
        this request alone (``error``), not the generation loop that polls it (Disaggregation.has_work runs
        outside the loop's error handling)."""
        try:
            return self._advance()
        except Exception as err:  # (UCX / NIXL errors: a peer gone mid-READ, descriptors NIXL refused)
            return self._abort(f"context_phase_params: the NIXL transfer of the context phase's KV failed: {err!r}")

    def _advance(self) -> bool:
        if self._state == "claiming":
            granted = self.side.answers.pop(self.key, None)
            if granted is None:
                if (dead := self._context.gone()) is not None:
                    self._give_back()  # (if it answers after all, its pin goes at once)
                    return self._fail(dead)
                if self.key in self.side.acks:
                    self.side.acks.discard(self.key)
                    self._acked = True
                now = time.monotonic()
                if not self._acked and now >= self.ack_deadline:
                    self.side.poll()  # (the loop may not have read its notifications for a while)
                    self._acked = self.key in self.side.acks or self.key in self.side.answers
                    if not self._acked:
                        self._give_back()
                        return self._fail(f"context_phase_params: the context side (NIXL agent {self.agent}) did "
                                          f"not acknowledge the claim of its KV cache within {ACK_TIMEOUT_S:g} s: "
                                          f"its process is gone or unreachable; run the context_only request again")
                    return False
                if now < self.deadline:
                    return False
                return self._fail(f"context_phase_params: the context side (NIXL agent {self.agent}) did not answer "
                                  f"the claim of its KV cache in time; run the context_only request again")
            self.side.acks.discard(self.key)
            if not granted:
                return self._fail("context_phase_params: the context phase's KV cache is gone (fetched already, "
                                  "or freed after the context side's timeout); run the context_only request again")
            if self.cancelled():
                self.side.release(*self.key)
                self._state = "done"
                return True
            self._state = "granted"
        if self._state == "granted":
            if self.after_step is not None and not self.after_step.query():
                return False
            self._started = time.perf_counter()
            self._xfer, status = self.side.read(self.fields, self.dst_ids)
            self._state = "reading"
            if status == "ERR":  # (no READ ran: no "done" notification will reach the context side)
                return self._abort("context_phase_params: the NIXL READ of the context phase's KV failed to start")
        if self._state == "reading":
            status = self.side.agent.check_xfer_state(self._xfer)
            if status == "PROC":
                if (dead := self._context.gone()) is not None:  # (UCX may take long to notice)
                    return self._abort(dead)
                return False
            self._ms = (time.perf_counter() - self._started) * 1e3
            if status != "DONE":
                return self._abort("context_phase_params: the NIXL READ of the context phase's KV failed")
            self._drop_xfer()  # (the data has landed: a release that fails only leaks the handle)
            self._state = "done"
        return True

    def _abort(self, message: str) -> bool:
        """End a pull that failed. A posted READ's handle is released first: NIXL cancels the transfer or
        says (raising) that it cannot, and then UCX may still write the destination blocks: the pull is
        ``quarantined`` (its blocks never go back to the pool). The context side may free its pin either way:
        a READ of freed source blocks only reads stale bytes into blocks nobody will use."""
        if not self._drop_xfer():
            self.quarantined = True
        if self._state in ("granted", "reading"):
            self._give_back()  # (the context side frees its pin now, not one timeout later)
        return self._fail(message)

    def _drop_xfer(self) -> bool:
        """Release the READ's handle; False when NIXL refused (the transfer may still run; the handle is kept)."""
        if self._xfer is None:
            return True
        try:
            self._xfer.release()
        except Exception as err:
            print(f"[kv_transfer_nixl] releasing the READ of handle {self.fields['handle']} failed: {err!r}",
                  file=sys.stderr, flush=True)
            return False
        self._xfer = None
        return True

    def _give_back(self) -> None:
        """A failed READ: the context side may free the pin (best effort; its timeout is the backstop)."""
        try:
            self.side.release(*self.key)
        except Exception:
            pass

    def _fail(self, message: str) -> bool:
        self.error, self._state = message, "done"
        return True

    def wait(self, timeout_s: float = 5.0) -> None:
        """Shutdown: until a READ in progress is over. A pull that has not started its READ starts none: its
        claim (granted or not yet answered) is given back, so the context side frees the pin now."""
        if self._state in ("claiming", "granted"):
            self._give_back()  # (a "done" after the claim: the context side frees the pin once it granted it)
            self._fail("the executor was shut down")
            return
        deadline = time.monotonic() + timeout_s
        while not self.done() and time.monotonic() < deadline:
            self.side.poll()
            time.sleep(0.001)

    def order_before(self) -> None:
        """The READ is complete when its state says DONE (UCX writes the destination itself): nothing to order."""

    def elapsed_ms(self) -> float:
        return self._ms
