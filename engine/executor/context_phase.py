"""The context_phase_params blob of disaggregated serving (engine/executor/disaggregated.py): its codec and the
checks a generation side makes before it uses one.

Blob (version 1): MAGIC + one version byte + UTF-8 JSON
    {"transport": "local" | "shm" | "nixl" | "cuda_ipc" | "auto", "pid", "peer" (kv_peer.identity: same-host
     death checks), "exporter": uuid hex, "handle": int, "request_id": int,
     "path" (shm), "agent", "metadata", "mem", "pool", "block_ids" (nixl), "offer", ... (cuda_ipc / auto),
     "layout": {"kv_shape": [L, 2, T, H, D], "dtype": str, "tokens_per_block": T},
     "prompt_len": int, "prompt_digest": hex, "first_token": int, "num_blocks": int}
Opaque to clients; only what the executor itself wrote is accepted (magic, version, fields checked).
"""
from __future__ import annotations

import hashlib
import json
import os

from engine.executor import kv_transfer_cuda_ipc

MAGIC = b"TLLMCTX"
VERSION = 1


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


def check(fields: dict, request, runner) -> None:
    """``fields`` (decoded) usable by ``request`` on ``runner``'s pool; ContextPhaseError naming why not."""
    here = kv_layout(runner)
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
        check_nixl(fields)
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


def check_nixl(fields: dict) -> None:
    """The nixl fields (agent, metadata, mem, pool, block_ids) present and in range."""
    for name, kind in (("agent", str), ("metadata", str), ("mem", str), ("pool", dict), ("block_ids", list)):
        if not isinstance(fields.get(name), kind):
            raise ContextPhaseError(f"context_phase_params: truncated or corrupted blob ({name}); send the "
                                    f"context_phase_params output of a context_only request unchanged")
    pool = fields["pool"]
    if not all(isinstance(pool.get(k), int) for k in ("addr", "num_blocks", "device")) or \
            not all(isinstance(b, int) and 0 <= b < pool["num_blocks"] for b in fields["block_ids"]):
        raise ContextPhaseError("context_phase_params: truncated or corrupted blob (pool, block_ids); send the "
                                "context_phase_params output of a context_only request unchanged")
