"""The engine cache: a checkpoint's engine built once (``python -m engine.build``) into
``$TRITONLLM_CACHE/engines`` and reused while neither the checkpoint nor the build options change.

``tritonllm serve CHECKPOINT`` (``make serve MODEL=...``) and the LLM-API repository's
``tensorrt_llm`` model (model.yaml's ``model``, through serving/llmapi_yaml.py ``engine_dir_for``)
share it, and the launcher resolves model.yaml through it before starting leader-mode ranks, so it
lives here, where the Triton models and the command line can both import it. Failures exit with a
message naming the checkpoint (SystemExit), as the command line reports them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from serving.child_python import child_environment

def engine_cache_root() -> Path:
    """Where checkpoint engines are built: $TRITONLLM_CACHE/engines (default ~/.cache/tritonllm)."""
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm")) / "engines"


def checkpoint_fingerprint(checkpoint: Path) -> list[tuple[str, int, int]]:
    """(file, size, mtime in ns) of every file of a checkpoint directory (or of the one .gguf file):
    a changed, added or removed file changes the engine cache key."""
    files = [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())
    return [(str(p.relative_to(checkpoint) if checkpoint.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns)
            for p in files]


def cached_engine_dir(checkpoint: str, build_args: list[str]) -> Path:
    """The cache directory of ``checkpoint``'s engine built with ``build_args``:
    <cache>/<checkpoint name>-<16 hex digits of the key>, the key hashing the checkpoint's absolute
    path, its files' fingerprint, the build arguments and the engine format version."""
    from engine.config import FORMAT_VERSION

    path = Path(checkpoint).resolve()
    key = json.dumps({"checkpoint": str(path), "files": checkpoint_fingerprint(path), "build": build_args,
                      "format_version": FORMAT_VERSION})
    return engine_cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_engine(checkpoint: str, output: str, build_args: list[str]) -> subprocess.CompletedProcess:
    """``python -m engine.build --checkpoint CHECKPOINT --output OUTPUT *build_args``, its output on
    this process's; paths are made absolute, so the caller's working directory does not matter."""
    return subprocess.run([sys.executable, "-m", "engine.build", "--checkpoint", os.path.abspath(checkpoint),
                           "--output", os.path.abspath(output), *build_args], env=child_environment())


def _built(engine: Path) -> bool:
    """engine.build finished writing ``engine``: its config.json is written last (an encoder-decoder
    engine's is decoder/config.json, written after encoder/)."""
    return (engine / "config.json").exists() or (engine / "decoder" / "config.json").exists()


def ensure_checkpoint_engine(checkpoint: str, build_args: list[str]) -> Path:
    """The cached engine of ``checkpoint`` and ``build_args`` (cached_engine_dir), built with
    ``python -m engine.build`` when it is missing. The build writes into a temporary directory that
    is renamed into place once complete, so an interrupted build is never taken for an engine.

    Several processes may ask for the same entry at once (the launcher and its server, model
    instances loading in parallel): an exclusive lock on ``<entry>.lock`` beside it lets one build
    while the others wait, then find the entry and reuse it."""
    import fcntl

    if not Path(checkpoint).exists():
        sys.exit(f"tritonllm: checkpoint {checkpoint} does not exist (a Hugging Face directory or a .gguf file)")
    engine = cached_engine_dir(checkpoint, build_args)
    if _built(engine):
        print(f"tritonllm: reusing the cached engine {engine}", flush=True)
        return engine
    engine.parent.mkdir(parents=True, exist_ok=True)
    # The lock file stays: removing it would let a process that opened it before the removal hold
    # a lock on a file no newcomer sees. The kernel drops the lock when its holder dies.
    with open(engine.with_name(engine.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tritonllm: waiting for another process building {engine} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(engine):  # built by the process we waited for
            print(f"tritonllm: reusing the cached engine {engine}", flush=True)
            return engine
        partial = engine.with_name(engine.name + f".partial-{os.getpid()}")
        print(f"tritonllm: building {checkpoint} into {engine} ...", flush=True)
        build = build_engine(checkpoint, str(partial), build_args)
        if build.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            sys.exit(f"tritonllm: building {checkpoint} failed (see above)")
        shutil.rmtree(engine, ignore_errors=True)  # a leftover engine.build did not finish
        partial.rename(engine)
    return engine


def checkpoint_build_args(args: argparse.Namespace) -> list[str]:
    """engine.build's flags for a checkpoint: the dtype for this machine and the options given
    (``dtype``, ``max_batch_size``, ``tp``, ``pp``, ``max_seq_len``, ``quantization``, ``kv_cache_dtype``,
    ``moe_ep_size``);
    everything else (lengths, block size) the build takes from the checkpoint."""
    dtype = args.dtype
    if dtype is None:  # torch only for this choice (an LLM-API stub that names its dtype imports none)
        import torch

        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    build = ["--dtype", dtype, "--max_batch_size", str(args.max_batch_size), "--tp_size", str(args.tp)]
    if getattr(args, "pp", 1) > 1:  # (left out at 1: the cache keys of existing engines stay as they were)
        build += ["--pp_size", str(args.pp)]
    for name in ("max_seq_len", "quantization", "kv_cache_dtype"):
        if getattr(args, name) is not None:
            build += [f"--{name}", str(getattr(args, name))]
    if getattr(args, "moe_ep_size", 1) > 1:  # (left out at 1, as pp)
        build += ["--moe_ep_size", str(args.moe_ep_size)]
    return build
