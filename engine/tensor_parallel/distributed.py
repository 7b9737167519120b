"""Leader mode across ranks: process groups, the leader's runner and the workers' loop.

One rank per device. Rank 0 (the leader, inside ``tritonserver``) owns the queue, the scheduler
and the KV block tables; ranks 1..N-1 (``python -m engine.tensor_parallel.worker``) own nothing but their weight
shard and KV pool shard. Every step the leader broadcasts the step's plan and then every rank
runs the same tensor-parallel forward, whose all-reduces and all-gathers keep them in lockstep:

    leader (executor thread)                  worker r (main thread)
    ------------------------                  ----------------------
    send(FORWARD, batch)  --- control --->    recv() -> FORWARD, batch
    runner.forward(batch) <== tp group ==>    runner.forward(batch)   (logits dropped)
    -> logits to the sampler                  recv() ...

Two process groups: the ``tp_group`` carries the model's collectives (NCCL on GPUs, gloo on
CPU); the ``control`` group (always gloo, CPU tensors) carries the replies and, off one node,
the plans, so a dead peer shows up as a TCP error on the next message rather than as a hung
GPU kernel. The plans themselves (their encoding, and the shared-memory channel used when every
rank is on one node) are engine/tensor_parallel/step_protocol.py.

Faults. Nothing waits forever: every collective runs under the group timeout: ``step_timeout_s``
for plans, forwards and heartbeats, ``startup_timeout_s`` while loading and inside CALLs (graph
capture and kernel compilation are long, and not equally long on every rank). A rank that dies
closes its sockets and the leader's next collective fails at once; a rank that hangs fails it
after the timeout. (NCCL cannot raise in the middle of a GPU kernel: there the leader survives the
watchdog's abort of a timed-out collective and treats a forward that outlived the timeout as lost.)
While idle, the leader sends a HEARTBEAT every ``heartbeat_s`` (a broadcast plus an all-reduce
that every rank must answer), which also keeps the workers' blocking ``recv`` from timing out.
After the first fault the leader's runner is *failed* for good: every later call raises
``RankFailureError`` with the first error, and ``failure`` says why (the model is not ready).

Environment (the launcher sets these; torchrun's and Slurm's names work too):
``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`` (or PMI_*/PMIX_*, RANK/WORLD_SIZE/LOCAL_RANK,
SLURM_*), ``TRITONLLM_DIST_ADDR``/``TRITONLLM_DIST_PORT`` (or MASTER_ADDR/MASTER_PORT),
``TRITONLLM_DIST_TIMEOUT_S``, ``TRITONLLM_DIST_STARTUP_TIMEOUT_S``, ``TRITONLLM_DIST_HEARTBEAT_S``.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.tensor_parallel.rank_info import RankInfo, rank_info_from_env
from engine.tensor_parallel.step_protocol import Op, RankFailureError, StepChannel

logger = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_HEARTBEAT_S = 2.0
# ModelRunner methods that change or use every rank's state, so LeaderRunner mirrors them (encode_into:
# an encoder-decoder's encoder pass and cross-K/V write, engine/encoder_decoder/runner.py).
MIRRORED_METHODS = frozenset({"allocate_kv_cache", "allocate_state_cache", "capture_cuda_graphs", "warmup", "enable_lora",
                              "load_adapter", "encode_into"})


@dataclass(frozen=True)
class DistSettings:
    """Rendezvous address and timeouts, read once from the environment."""

    addr: str
    port: int
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S

    @classmethod
    def from_env(cls, info: RankInfo, environ: Mapping[str, str] = os.environ) -> "DistSettings":
        addr = environ.get("TRITONLLM_DIST_ADDR") or environ.get("MASTER_ADDR")
        port = environ.get("TRITONLLM_DIST_PORT") or environ.get("MASTER_PORT")
        if addr is None and info.local_size != info.world_size:
            raise ValueError(
                f"ranks span several nodes ({info.world_size} ranks, {info.local_size} on this node) but "
                "TRITONLLM_DIST_ADDR is not set; set it to rank 0's host name "
                "(scripts/launch_triton_server.py --dist_addr does)"
            )
        settings = cls(
            addr=addr or "127.0.0.1",
            port=int(port or 29511),
            step_timeout_s=float(environ.get("TRITONLLM_DIST_TIMEOUT_S", DEFAULT_STEP_TIMEOUT_S)),
            startup_timeout_s=float(environ.get("TRITONLLM_DIST_STARTUP_TIMEOUT_S", DEFAULT_STARTUP_TIMEOUT_S)),
            heartbeat_s=float(environ.get("TRITONLLM_DIST_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)),
        )
        if not 0 < settings.heartbeat_s < settings.step_timeout_s:
            raise ValueError(
                f"TRITONLLM_DIST_HEARTBEAT_S ({settings.heartbeat_s}) must be > 0 and below "
                f"TRITONLLM_DIST_TIMEOUT_S ({settings.step_timeout_s}): idle workers time out otherwise"
            )
        return settings


def resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``None``/``"cuda"`` -> this rank's GPU (``cuda:<local_rank>``) when CUDA is there, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def check_world_matches_engine(engine_dir: str, world_size: int) -> EngineConfig:
    """Load the engine header and insist that it was sharded for exactly ``world_size`` ranks
    (tp_size x pp_size)."""
    config = EngineConfig.load(engine_dir)
    build = config.build
    if build.world_size != world_size:
        mapping = f"tp_size {build.tp_size}" + (f" x pp_size {build.pp_size}" if build.pp_size > 1 else "")
        raise ValueError(
            f"engine {engine_dir!r} was built with {mapping} but is running on world_size "
            f"{world_size}; launch with --world_size {build.world_size} or rebuild with "
            f"python -m engine.build --tp_size/--pp_size whose product is {world_size}"
        )
    return config


def _rank_runner(engine_dir: str, ctx: "DistContext", config: EngineConfig, runner_class):
    """This rank's local runner: its tensor-parallel shard, or with pp_size > 1 its pipeline
    stage (engine/pipeline/runner.py; runner_class is then not used)."""
    if config.build.pp_size > 1:
        from engine.pipeline.runner import make_stage_runner

        return make_stage_runner(engine_dir, ctx, config)
    return runner_class(engine_dir, rank=ctx.rank, device=ctx.device, tp_group=ctx.tp_group)


# ---- process groups -------------------------------------------------------------------------


@dataclass
class DistContext:
    """This rank's place in the job and its two process groups (see the module docstring)."""

    info: RankInfo
    settings: DistSettings
    device: torch.device
    tp_group: Any        # the default (world) group: NCCL on GPUs, gloo on CPU
    control: Any         # gloo group for plans and heartbeats
    timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # what collectives wait now (step or startup timeout)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def use_step_timeout(self) -> None:
        """Collectives wait at most ``step_timeout_s`` (serving: plans, forwards, heartbeats)."""
        self._set_timeout(self.settings.step_timeout_s)

    @contextlib.contextmanager
    def long_call(self):
        """Collectives wait up to ``startup_timeout_s`` inside: loading, graph capture and kernel
        compilation take long, and not equally long on every rank. Every rank enters and leaves at
        the same point of the plan sequence."""
        self._set_timeout(self.settings.startup_timeout_s)
        try:
            yield
        finally:
            self.use_step_timeout()

    def _set_timeout(self, seconds: float) -> None:
        self.timeout_s = seconds  # also bounds the shared-memory plan channel's waits
        timeout = datetime.timedelta(seconds=seconds)
        for group in (self.tp_group, self.control):
            try:
                group.set_timeout(timeout)
            except (RuntimeError, AttributeError) as err:  # a backend without it keeps the startup timeout
                logger.warning("could not set the %s group's timeout to %.0f s: %s", group, seconds, err)


def init_distributed(info: RankInfo, device: torch.device, settings: DistSettings) -> DistContext:
    """Join the job's process groups; blocks until every rank has joined (startup timeout)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if info.rank == 0:
            # On an NCCL timeout, abort the communicators but keep the leader alive (torch's default
            # tears the process down), so it can fail requests and report the model not ready.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one node share its cores; torch's default (all cores each) thrashes.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_size))
    timeout = datetime.timedelta(seconds=settings.startup_timeout_s)
    logger.info("rank %d/%d joining %s group at %s:%d", info.rank, info.world_size, backend,
                settings.addr, settings.port)
    dist.init_process_group(
        backend, init_method=f"tcp://{settings.addr}:{settings.port}",
        rank=info.rank, world_size=info.world_size, timeout=timeout,
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    if backend == "nccl":
        # NCCL sets up its communicator on the first collective; do it now, eagerly, and not
        # later inside a CUDA-graph capture (where it is not allowed).
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return DistContext(info, settings, device, dist.group.WORLD, control, timeout_s=settings.startup_timeout_s)


def agree_on_engine(ctx: DistContext, engine_config: EngineConfig) -> None:
    """Every rank must have loaded the same engine; raise on all ranks if any differs."""
    digest = zlib.crc32(repr(sorted(engine_config.to_dict().items())).encode())
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine, group=ctx.control)
    differing = [r for r, d in enumerate(everyone) if int(d) != digest]
    if differing:
        raise RankFailureError(
            f"ranks {differing} loaded an engine whose config.json differs from rank {ctx.rank}'s; "
            "every rank must be given the same --engine_dir"
        )


def _apply_call(runner, call) -> Any:
    method, args, kwargs, _ = call
    return getattr(runner, method)(*args, **kwargs)


# FORWARD's arg: bit 0 all_logits; bit 1 set by LeaderRunner.launch (several pipelined steps in
# flight, engine/pipeline/in_flight.py): no sampled-token broadcast follows (rank 0 alone reads the ring).
ALL_LOGITS, NO_TOKEN_BROADCAST = 1, 2

# A runner raising one of these has refused its input before any collective: every rank refuses
# the same plan the same way, so the ranks stay in step and the leader's caller gets the error.
REFUSALS = (ValueError, TypeError)


def run_worker_loop(runner, channel: StepChannel) -> None:
    """A worker's life after loading: follow the leader's plans until SHUTDOWN (or a fault raises)."""
    while True:
        message = channel.recv()
        if message.op == Op.SHUTDOWN:
            return
        if message.op == Op.HEARTBEAT:
            channel.all_reduce_min(0)
            continue
        try:
            if message.op == Op.FORWARD:
                runner.forward(message.batch, all_logits=bool(message.arg & ALL_LOGITS))
                if message.batch.sampled_tokens_slot >= 0 and not message.arg & NO_TOKEN_BROADCAST:
                    # the leader sends what it sampled
                    receive_sampled_tokens(runner, message.batch, channel.ctx.tp_group)
                continue
            with channel.ctx.long_call():
                result = _apply_call(runner, message.call)
                if message.call[3] == "min":
                    channel.all_reduce_min(int(result))
        except REFUSALS as err:  # the leader refused the same plan; wait for the next one
            logger.warning("step %d refused on this rank as on the leader: %s", message.step, err)


def _sampled_tokens_span(runner, batch) -> torch.Tensor:
    """The ring half a step's sampled tokens go to (the whole half: workers do not know the count)."""
    half = runner.sampled_ring_slots // 2  # (draft slots past the two halves are not the ring's)
    start = batch.sampled_tokens_slot - batch.sampled_tokens_slot % half
    return runner.sampled_tokens[start:start + half]


def receive_sampled_tokens(runner, batch, tp_group) -> None:
    """Worker side of LeaderRunner.store_sampled_tokens: the leader's tokens into this rank's ring,
    where the next plan's placeholder ids read them (engine/executor/overlap.py)."""
    dist.broadcast(_sampled_tokens_span(runner, batch), src=0, group=tp_group)


# ---- the leader ----------------------------------------------------------------------------------


class LeaderRunner:
    """Rank 0's runner: the ModelRunner interface, with every step mirrored on all ranks.

    ``forward`` broadcasts the plan, runs rank 0's shard and returns the full logits (the model
    all-gathers the vocab shards). KV sizing is agreed by all ranks (the minimum of what fits on
    each); the methods in ``MIRRORED_METHODS`` (``allocate_kv_cache`` ...) run on every rank.
    Other attributes (configs, ``vocab_size``, ``device`` ...) come from the wrapped runner.

    Thread safety: one lock orders plans, so the heartbeat thread never interleaves with a step.
    After a fault every call raises ``RankFailureError``; ``failure`` holds the first error.
    """

    def __init__(self, runner, ctx: DistContext):
        self.runner = runner
        self.ctx = ctx
        self.channel = StepChannel(ctx)
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._busy_since: float | None = None  # when the running step started (None: idle)
        self._busy_op: Op | None = None
        self._awaiting_sampled_tokens = False  # between a sampling FORWARD and its store_sampled_tokens
        self.steps_in_flight = 0  # launched, not finished (launch/finish: pipeline stages)
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tp-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self.shutdown)

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet: __init__ failed early
            raise AttributeError(name)
        value = getattr(self.runner, name)
        if name in MIRRORED_METHODS and callable(value):
            return functools.partial(self.call_on_all_ranks, name)
        return value

    @property
    def is_healthy(self) -> bool:
        return self.failure is None

    # -- mirrored calls

    def forward(self, batch, *, all_logits: bool = False) -> torch.Tensor:
        logits = self._run(Op.FORWARD, lambda: self.runner.forward(batch, all_logits=all_logits),
                           batch=batch, arg=ALL_LOGITS if all_logits else 0)
        # The workers now wait in the sampled-token broadcast: no heartbeat may come between.
        self._awaiting_sampled_tokens = batch.sampled_tokens_slot >= 0
        return logits

    def launch(self, batch):
        """Several steps in flight (pipeline stages of one rank each, engine/pipeline/in_flight.py):
        the plan goes out and rank 0's stage launches (StageRunner.launch); ``finish`` gives the
        logits. No sampled-token broadcast follows (only rank 0's stage reads the ring), and no
        heartbeat goes out while a launched step is unfinished: the last stage may be blocked
        sending its logits, and the plans and transfers keep their order on every rank."""
        launched = self._run(Op.FORWARD, lambda: self.runner.launch(batch), batch=batch, arg=NO_TOKEN_BROADCAST)
        self._awaiting_sampled_tokens = False
        self.steps_in_flight += 1
        return launched

    def finish(self, launched):
        """The logits of a launched step (its transfers waited on); a lost rank fails the runner."""
        with self._lock:
            self.steps_in_flight -= 1
            self._raise_if_failed()
            try:
                return self.runner.finish(launched)
            except Exception as err:
                self._fail(f"forward step failed: {_first_sentence(err)}")
                raise RankFailureError(self.failure) from err

    def store_sampled_tokens(self, token_ids: torch.Tensor, batch) -> None:
        """Keep the step's sampled tokens in rank 0's ring and broadcast them to every rank's
        (a device collective on the tp group, queued behind the forward: the host does not wait).
        Every FORWARD with ``sampled_tokens_slot >= 0`` is followed by exactly one such call
        (a launched step's: no broadcast)."""
        with self._lock:
            self._raise_if_failed()
            try:
                self.runner.store_sampled_tokens(token_ids, batch)
                if self._awaiting_sampled_tokens:
                    dist.broadcast(_sampled_tokens_span(self.runner, batch), src=0, group=self.ctx.tp_group)
                self._awaiting_sampled_tokens = False
            except Exception as err:
                self._fail(f"sending the sampled tokens failed: {_first_sentence(err)}")
                raise RankFailureError(self.failure) from err

    def num_kv_blocks_for(self, **kwargs) -> int:
        """The block count every rank can hold: the minimum over ranks of what fits on each."""
        call = ("num_kv_blocks_for", (), kwargs, "min")

        def local_then_agree() -> int:
            return self.channel.all_reduce_min(int(_apply_call(self.runner, call)))

        return self._run(Op.CALL, local_then_agree, call=call)

    def call_on_all_ranks(self, method: str, *args, **kwargs):
        """Run ``runner.<method>(*args, **kwargs)`` on every rank; rank 0's result is returned.

        For methods that run collectives (allocation that captures graphs, warm-up forwards):
        the workers must make the same calls in the same order, or the collectives deadlock.
        A runner with ``call_for_workers(call) -> call`` says what the workers' plan carries instead
        (an encoder-decoder's encode_into: the features' shapes, their values then broadcast over the
        tp group by the call itself rather than pickled into the plan).
        """
        call = (method, args, kwargs, None)
        for_workers = getattr(self.runner, "call_for_workers", None)
        sent = call if for_workers is None else for_workers(call)
        return self._run(Op.CALL, lambda: _apply_call(self.runner, call), call=sent)

    def _run(self, op: Op, local_step, **message):
        with self._lock:
            self._raise_if_failed()
            self._busy_since = time.monotonic()
            self._busy_op = op
            try:
                self.channel.send(op, **message)
                if op == Op.CALL:
                    with self.ctx.long_call():
                        return local_step()
                result = local_step()
                self._check_step_time(op)
                return result
            except REFUSALS:  # a bad plan, refused alike on every rank: the ranks are still in step
                raise
            except Exception as err:  # a gloo/NCCL error or timeout: some rank is gone
                self._fail(f"{op.name.lower()} step failed: {_first_sentence(err)}")
                raise RankFailureError(self.failure) from err
            finally:
                self._busy_since = None
                self._last_send = time.monotonic()

    def _check_step_time(self, op: Op) -> None:
        """A step that outlived the timeout ended only because NCCL's watchdog aborted a collective
        on a lost rank: its result is garbage (gloo raises instead, so this is for GPUs)."""
        elapsed = time.monotonic() - self._busy_since
        if elapsed > self.ctx.settings.step_timeout_s:
            raise RuntimeError(f"the {op.name.lower()} step took {elapsed:.0f} s, past the "
                               f"{self.ctx.settings.step_timeout_s:.0f} s timeout (a rank is lost)")

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankFailureError(self.failure)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = (f"tensor-parallel rank failure ({self.ctx.world_size} ranks): {reason}; "
                            "the model cannot serve until the server is restarted")
            logger.error(self.failure)

    # -- liveness

    def _heartbeat_loop(self) -> None:
        interval = self.ctx.settings.heartbeat_s
        while not self._stopped.wait(interval / 2):
            self._check_stuck_step()
            if not self._lock.acquire(blocking=False):
                continue  # a step is running: it proves liveness itself
            try:
                # Checked under the lock: shutdown may have come between the wait and here, and no
                # plan may follow its SHUTDOWN.
                if (not self._stopped.is_set() and self.failure is None and not self._awaiting_sampled_tokens
                        and not self.steps_in_flight and time.monotonic() - self._last_send >= interval):
                    self._send_heartbeat()
            finally:
                self._lock.release()

    def _send_heartbeat(self) -> None:
        try:
            self.channel.send(Op.HEARTBEAT)
            self.channel.all_reduce_min(0)
        except Exception as err:
            self._fail(f"heartbeat failed: {_first_sentence(err)}")
        self._last_send = time.monotonic()

    def _check_stuck_step(self) -> None:
        """A forward that outlives the timeout (e.g. stuck in an NCCL kernel) marks the runner failed."""
        started = self._busy_since
        limit = self.ctx.settings.step_timeout_s + self.ctx.settings.heartbeat_s
        if started is not None and self._busy_op == Op.FORWARD and time.monotonic() - started > limit:
            self._fail(f"a step has not finished after {limit:.0f} s (a rank is hung)")

    # -- shutdown

    def shutdown(self) -> None:
        """Stop the heartbeat, tell the workers to exit, leave the process groups. Idempotent.

        The heartbeat thread is joined first (a heartbeat in flight ends within the group timeout):
        a daemon thread still inside a gloo call when the interpreter finalizes is killed as it
        takes the GIL back, and that unwinds through C++ noexcept frames -> std::terminate
        ("terminate called without an active exception") after an otherwise clean exit."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join(self.ctx.settings.step_timeout_s + self.ctx.settings.heartbeat_s)
        if self._lock.acquire(timeout=self.ctx.settings.step_timeout_s):
            try:
                if self.failure is None:
                    self.channel.send(Op.SHUTDOWN)
            except Exception as err:
                logger.warning("could not tell the workers to shut down: %s", err)
            finally:
                self.channel.close()
                self._lock.release()
        if _destroy_groups(self.runner):
            _join_group_threads(self.ctx, self.channel, self.runner)


def _first_sentence(err: Exception) -> str:
    """gloo's errors append a paragraph of generic advice; the first sentence is the news."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(". This is typically")[0]


# How long leaving the process groups may take before this rank gives up on it and exits anyway.
DESTROY_TIMEOUT_S = 15.0


def _destroy_groups(runner=None, timeout_s: float = DESTROY_TIMEOUT_S) -> bool:
    """Leave the process groups, bounded in time; True when they were left cleanly.

    ``runner``'s CUDA graphs are dropped first: they hold captured NCCL collectives, and tearing a
    communicator down under them can block forever. The teardown runs in a daemon thread so a
    communicator that still hangs (a dead peer, a driver fault) costs ``timeout_s``, not the
    process: the caller is exiting, and the OS reclaims what NCCL did not.
    """
    if runner is not None and hasattr(runner, "release_cuda_graphs"):
        try:
            runner.release_cuda_graphs()
        except Exception as err:  # a failed device: the teardown below may still succeed
            logger.warning("could not release the CUDA graphs before leaving the groups: %s", err)
    if gc.get_freeze_count():  # (a process that froze its load's objects, engine/executor/gc_freeze.py: a graph, and
        gc.unfreeze()  # then a group (_join_group_threads), inside a reference cycle would outlive the groups)
        gc.collect()
    if not dist.is_initialized():
        return True
    from engine.models.layers import disable_one_shot_all_reduce

    disable_one_shot_all_reduce()
    outcome: list[BaseException | None] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            outcome.append(None)
        except Exception as err:  # a broken group may refuse; the process is exiting anyway
            outcome.append(err)

    thread = threading.Thread(target=destroy, name="tp-destroy-groups", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("leaving the process groups did not finish within %.0f s; exiting without it", timeout_s)
        return False
    if outcome and outcome[0] is not None:
        logger.warning("destroy_process_group failed: %s", outcome[0])
        return False
    return True


def _join_group_threads(ctx: DistContext, channel, runner) -> None:
    """Drop this process's last references to its (already left) process groups, so their C++
    objects are destroyed now, joining their threads (gloo's work and TCP loops, rank 0's TCPStore
    server), while the interpreter is whole.

    Why: destroy_process_group only forgets the groups; with references left (the context, the
    plan channel, every parallel layer's ``tp_group``) those threads ran on into interpreter
    finalization. There a leader sometimes died after a clean run in std::terminate ("terminate
    called without an active exception"), aborted from a thread faulthandler did not list, i.e. not
    a Python one: likely a gloo work thread that took the GIL to release a tensor's Python object
    and was pthread_exit'ed through C++ noexcept frames. Only after a clean leave: destroying a
    group whose work is stuck would wait on that work forever."""
    groups = [group for group in (getattr(ctx, "tp_group", None), getattr(ctx, "control", None),
                                  getattr(runner, "logits_group", None))  # (a pipeline stage's, pipeline/runner.py)
              if group is not None]
    if not groups:
        return
    model = getattr(runner, "model", None)
    holders = [ctx, channel, runner, *(model.modules() if hasattr(model, "modules") else ())]
    for holder in holders:
        for name, value in list(getattr(holder, "__dict__", {}).items()):
            if any(value is group for group in groups):
                setattr(holder, name, None)
    del groups
    gc.collect()  # a group inside a reference cycle goes now too, not at finalization (unfrozen: _destroy_groups)


# ---- entry points --------------------------------------------------------------------------------


def make_runner(engine_dir: str, *, device: str | torch.device | None = None, runner_class=None,
                environ: Mapping[str, str] = os.environ):
    """The executor's runner: a plain ModelRunner for one rank, a LeaderRunner on rank 0 of many.

    ``runner_class`` (default ModelRunner) builds the local runner, e.g. a benchmark's subclass.
    Raises ValueError when the engine's tp_size differs from the world size, and when called on
    a rank other than 0 (workers run ``python -m engine.tensor_parallel.worker``).
    """
    from engine.executor.runner import ModelRunner

    runner_class = runner_class or ModelRunner
    info = rank_info_from_env(environ)
    config = check_world_matches_engine(engine_dir, info.world_size)
    resolved = resolve_device(device, info.local_rank)
    if info.world_size == 1:
        return runner_class(engine_dir, rank=0, device=resolved)
    if info.rank != 0:
        raise ValueError(f"make_runner runs on rank 0 only; rank {info.rank} must run python -m engine.tensor_parallel.worker")
    ctx = init_distributed(info, resolved, DistSettings.from_env(info, environ))
    runner = _rank_runner(engine_dir, ctx, config, runner_class)
    agree_on_engine(ctx, config)
    ctx.use_step_timeout()
    leader = LeaderRunner(runner, ctx)
    if hasattr(runner, "worker_settings"):  # settings the workers were not started with (an encoder-decoder's)
        leader.call_on_all_ranks("apply_worker_settings", **runner.worker_settings())
    return leader


def default_runner_class(engine_dir: str):
    """A worker's runner class when the caller names none: an encoder-decoder's (with the executor's
    default settings; the leader sends its own: ``make_runner``), else ModelRunner."""
    from engine.encoder_decoder.encoder_stage import encoder_decoder_runner
    from engine.executor.executor_config import ExecutorConfig
    from engine.executor.runner import ModelRunner

    return encoder_decoder_runner(engine_dir, ExecutorConfig()) or ModelRunner


def run_worker(engine_dir: str, *, device: str | torch.device | None = None, runner_class=None,
               environ: Mapping[str, str] = os.environ) -> None:
    """A non-leader rank: join, load this rank's shard, follow plans until SHUTDOWN."""
    from engine.executor.gc_freeze import freeze_after_load
    from engine.executor.runner import ForwardBatch

    runner_class = runner_class or default_runner_class(engine_dir)
    info = rank_info_from_env(environ)
    if info.rank == 0:
        raise ValueError("rank 0 is the leader (tritonserver); engine.tensor_parallel.worker runs on ranks 1..N-1")
    config = check_world_matches_engine(engine_dir, info.world_size)
    ctx = init_distributed(info, resolve_device(device, info.local_rank), DistSettings.from_env(info, environ))
    runner, channel = None, None
    try:
        runner = _rank_runner(engine_dir, ctx, config, runner_class)
        agree_on_engine(ctx, config)
        ctx.use_step_timeout()
        channel = StepChannel(ctx, batch_class=ForwardBatch)
        # As rank 0's engine process does: this rank's load lives as long as it, so no full collection while
        # following plans scans it (engine/executor/gc_freeze.py; _destroy_groups gives it back at the end).
        frozen = freeze_after_load(ctx.device)
        logger.info("rank %d ready on %s (plans over %s; %s)", info.rank, ctx.device,
                    "shared memory" if channel.shm is not None else "gloo",
                    f"{frozen['frozen']} objects of the load frozen" if frozen else "the collector left as it was")
        run_worker_loop(runner, channel)
    finally:
        if channel is not None:
            channel.close()
        _destroy_groups(runner)
