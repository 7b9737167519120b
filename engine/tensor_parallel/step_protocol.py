"""The step protocol of leader mode: what rank 0 sends every rank before each step, and how.

A plan is an ``Op`` plus, for FORWARD, the ForwardBatch packed into one int32 tensor
(``encode_batch``), or for CALL a pickled (method, args, kwargs, reduce). ``StepChannel`` carries
plans in a strict step order: through a shared-memory segment when every rank is on one node
(engine/tensor_parallel/shm_broadcast.py), else as broadcasts over the gloo control group. Replies
(``all_reduce_min``: heartbeats, agreed KV sizes) always go over gloo. engine/tensor_parallel/distributed.py
builds the groups and runs the leader and the workers on top of this.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import pickle
import struct
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

HEADER_LEN = 4  # [op, step, payload_len, arg]


class RankFailureError(RuntimeError):
    """A rank died, hung, or fell out of step; the multi-rank runner cannot run any more steps."""


class Op(enum.IntEnum):
    FORWARD = 1    # payload: encoded ForwardBatch; arg: all_logits flag
    CALL = 2       # followed by one broadcast object: (method, args, kwargs, reduce)
    HEARTBEAT = 3  # followed by an all-reduce every rank must answer
    SHUTDOWN = 4


# ---- the compact plan encoding ------------------------------------------------------------------


def _field_kind(field: dataclasses.Field) -> str:
    """'nested' (list[list[int]]), 'list' (list[int]), 'optional' (list[int] | None), 'optional_rows'
    (list[list[int] | None] | None: tree_parents), 'scalar' (int), 'flag' (bool: sent as 0/1, received
    as a bool) or 'local' (list | None: never sent), from the annotation."""
    text = field.type if isinstance(field.type, str) else repr(field.type)
    text = text.replace(" ", "")
    if text == "list[list[int]]":
        return "nested"
    if text == "list[list[int]|None]|None":
        return "optional_rows"
    if text == "list[int]":
        return "list"
    if text == "list[int]|None":
        return "optional"
    if text in ("int", "<class'int'>"):
        return "scalar"
    if text in ("bool", "<class'bool'>"):
        return "flag"
    if text == "list|None":
        return "local"  # host objects of one process (Llama 3.2 Vision's cross masks): never sent, None on workers
    raise TypeError(f"ForwardBatch field {field.name!r} has type {text}, which the step protocol cannot send")


@functools.cache
def _field_kinds(batch_class) -> tuple[tuple[str, str], ...]:
    """(name, _field_kind) of each field of the batch class, in declaration order: read once per class
    (the annotations' text, ~15 fields, costs ~10 us a step otherwise)."""
    return tuple((field.name, _field_kind(field)) for field in dataclasses.fields(batch_class))


def encode_batch(batch) -> torch.Tensor:
    """Pack a ForwardBatch into one flat int32 tensor, field by field in declaration order.

    list[int] -> [len, v0, v1, ...]; list[list[int]] -> [rows, len_0, ..., len_{rows-1}, flat...];
    int -> [v]; bool -> [0 or 1]; list[int] | None -> like list[int], None as [-1]; list[list[int] | None] | None
    -> like list[list[int]] with a None row's length -1, a None field as [-1]. Example: block_tables
    [[3, 4], [7]] -> [2, 2, 1, 3, 4, 7]; tree_parents [None, [-1, 0]] -> [2, -1, 2, -1, 0].
    """
    flat: list[int] = []
    for name, kind in _field_kinds(type(batch)):
        value = getattr(batch, name)
        if kind == "local":
            if value is not None:
                raise TypeError(f"ForwardBatch field {name!r} holds host objects the step protocol does not "
                                "send: this model does not run with tensor or pipeline parallelism")
            continue
        if kind in ("scalar", "flag"):
            flat.append(int(value))
        elif kind in ("optional", "optional_rows") and value is None:
            flat.append(-1)
        elif kind in ("list", "optional"):
            flat.append(len(value))
            flat.extend(value)
        elif kind == "nested":  # (no None rows: lengths and values through C loops, a row each per step)
            flat.append(len(value))
            flat.extend(map(len, value))
            flat.extend(chain.from_iterable(value))
        else:
            flat.append(len(value))
            flat.extend(-1 if row is None else len(row) for row in value)
            for row in value:
                flat.extend(row or ())
    # Through struct.pack: torch.tensor over a Python list costs ~90 ns a value, array("i", list) ~25
    # (each item parsed on its own), struct.pack ~12: rank 0 encodes a plan every step, ~2,800 values
    # for a 256-sequence decode step.
    try:
        packed = struct.pack(f"{len(flat)}i", *flat)
    except struct.error as err:  # a value outside int32: an error, never wrapped around
        raise OverflowError(f"a ForwardBatch value does not fit int32 ({err})") from None
    return torch.frombuffer(bytearray(packed), dtype=torch.int32)


def decode_batch(payload: torch.Tensor, batch_class):
    """Inverse of ``encode_batch``: ``decode_batch(encode_batch(b), type(b)) == b``."""
    values = payload.tolist()
    cursor = 0
    kwargs = {}
    for name, kind in _field_kinds(batch_class):
        if kind == "local":
            kwargs[name] = None
            continue
        if kind in ("scalar", "flag"):
            kwargs[name] = bool(values[cursor]) if kind == "flag" else values[cursor]
            cursor += 1
            continue
        count = values[cursor]
        cursor += 1
        if kind in ("optional", "optional_rows") and count < 0:
            kwargs[name] = None
            continue
        if kind in ("list", "optional"):
            kwargs[name] = values[cursor:cursor + count]
            cursor += count
            continue
        lengths = values[cursor:cursor + count]
        cursor += count
        rows = []
        for length in lengths:
            rows.append(None if length < 0 else values[cursor:cursor + length])
            cursor += max(length, 0)
        kwargs[name] = rows
    if cursor != len(values):
        raise RankFailureError(f"plan payload has {len(values)} ints but the batch used {cursor}: protocol mismatch")
    return batch_class(**kwargs)


# ---- the channel: one leader sends, every worker receives -------------------------------------------


@dataclass
class Message:
    op: Op
    step: int
    arg: int = 0
    batch: Any = None    # FORWARD: the decoded ForwardBatch
    call: Any = None     # CALL: (method, args, kwargs, reduce)


class StepChannel:
    """Plans from rank 0 to every rank, in a strict step order: through a shared-memory segment
    when every rank is on this node (engine/tensor_parallel/shm_broadcast.py), else over the gloo control group.
    Creating one is collective (every rank, at the same point); replies (``all_reduce_min``)
    always go over gloo."""

    def __init__(self, ctx: "DistContext", *, batch_class=None):
        self.ctx = ctx
        self.group = ctx.control
        self.batch_class = batch_class
        self.step = 0
        self.shm = open_plan_segment(ctx)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def send(self, op: Op, *, batch=None, arg: int = 0, call=None) -> None:
        payload = encode_batch(batch) if batch is not None else None  # may raise: nothing sent yet
        if self.shm is not None:
            data = pickle.dumps((int(op), self.step + 1, arg, None if payload is None else payload.numpy().tobytes(),
                                 call), protocol=pickle.HIGHEST_PROTOCOL)
            if self.shm.fits(data):
                self.step += 1
                self.shm.send(data, self.ctx.timeout_s)
                return
            self.shm.send(pickle.dumps(None), self.ctx.timeout_s)  # "this one comes over gloo"
        self.step += 1
        header = torch.tensor([int(op), self.step, 0 if payload is None else payload.numel(), arg], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.group)
        if call is not None:
            dist.broadcast_object_list([call], 0, group=self.group)

    def recv(self) -> Message:
        if self.shm is not None:
            packed = pickle.loads(self.shm.recv(self.ctx.timeout_s))
            if packed is not None:
                op, step, arg, payload, call = packed
                self.step += 1
                if step != self.step:
                    raise RankFailureError(f"received plan step {step}, expected {self.step}: ranks are out of step")
                message = Message(Op(op), step, arg, call=call)
                if message.op == Op.FORWARD:
                    message.batch = decode_batch(torch.frombuffer(bytearray(payload), dtype=torch.int32),
                                                 self.batch_class)
                return message
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, step, payload_len, arg = header.tolist()
        self.step += 1
        if step != self.step:
            raise RankFailureError(f"received plan step {step}, expected {self.step}: ranks are out of step")
        message = Message(Op(op), step, arg)
        if message.op == Op.FORWARD:
            payload = torch.empty(payload_len, dtype=torch.int32)
            dist.broadcast(payload, 0, group=self.group)
            message.batch = decode_batch(payload, self.batch_class)
        elif message.op == Op.CALL:
            box = [None]
            dist.broadcast_object_list(box, 0, group=self.group)
            message.call = box[0]
        return message

    def all_reduce_min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor)


def open_plan_segment(ctx: "DistContext"):
    """The shared-memory plan segment for this job, or None (gloo). Collective over the control
    group; every rank ends with the same answer. TRITONLLM_SHM_PLANS: 1 on, 0 off, default on for
    GPUs (on CPU the readers' polling would compete with the ranks for the cores)."""
    from engine.tensor_parallel import shm_broadcast

    want = os.environ.get("TRITONLLM_SHM_PLANS", "auto")
    use = (want == "1" or (want == "auto" and ctx.device.type == "cuda")) and \
        ctx.info.local_size == ctx.info.world_size and shm_broadcast.supported()
    segment, name = None, None
    if ctx.rank == 0 and use:
        try:
            segment = shm_broadcast.ShmBroadcast(f"tritonllm_plans_{os.getpid()}_{ctx.settings.port}", writer=True,
                                                 num_readers=ctx.world_size - 1)
            name = segment.name
        except OSError as err:  # e.g. no /dev/shm
            logger.warning("no shared-memory plan channel (%s); plans go over gloo", err)
    box = [name]
    dist.broadcast_object_list(box, 0, group=ctx.control)
    if box[0] is None:
        return None
    ok = 1
    if ctx.rank != 0:
        try:
            segment = shm_broadcast.ShmBroadcast(box[0], writer=False, num_readers=ctx.world_size - 1,
                                                 reader_index=ctx.rank - 1)
        except OSError as err:
            logger.warning("rank %d cannot attach the plan segment %s: %s", ctx.rank, box[0], err)
            ok = 0
    agreed = torch.tensor([ok], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.control)
    if int(agreed) == 0:
        if segment is not None:
            segment.close()
        return None
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid(), group=ctx.control)
    segment.peer_pids = pids[1:] if ctx.rank == 0 else [pids[0]]  # the leader waits on workers, they on it
    return segment
