"""Helpers for the tensor-parallel tests: tiny engines and multi-process rank launching.

``start_ranks`` starts rank 0 (any command) and ranks 1..N-1 (``python -m engine.tensor_parallel.worker``) as
plain subprocesses with OpenMPI's environment variables, the way ``mpirun`` would, so the
engine-level tests need no MPI installation.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
import transformers

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict

from free_ports import free_port  # tests also import it from here

# Every split is even for tp_size 2: 4 q heads, 2 kv heads, hidden 64, intermediate 96, vocab 96.
TINY_LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 7], [60, 1, 12, 88, 3, 3, 3, 45, 20, 11, 9]]


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random Llama whose weights all matter (norm weights near 1, the rest small noise)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    return model


def build_tiny_engine(hf_model, out_dir: str, *, tp_size: int, pp_size: int = 1, pp_layers=None) -> str:
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=64, max_seq_len=128,
                        max_num_tokens=256, tokens_per_block=8, tp_size=tp_size, pp_size=pp_size, pp_layers=pp_layers)
    build_from_hf(hf_model.config, getter_from_state_dict(hf_model.state_dict(), "tiny"), None, out_dir,
                  build, progress=False)
    return out_dir


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world_size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world_size),
        "TRITONLLM_DIST_ADDR": "127.0.0.1", "TRITONLLM_DIST_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    env.update(extra)
    return env


def start_ranks(leader_cmd: list[str], engine_dir: str, world_size: int, **extra_env: str):
    """(leader Popen, [worker Popen]) of one job; stdout/stderr piped."""
    port = free_port()
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    leader = subprocess.Popen(leader_cmd, env=rank_env(0, world_size, port, **extra_env), **pipes)
    workers = [
        subprocess.Popen([sys.executable, "-m", "engine.tensor_parallel.worker", "--engine_dir", engine_dir, "--device", "cpu"],
                         env=rank_env(rank, world_size, port, **extra_env), **pipes)
        for rank in range(1, world_size)
    ]
    return leader, workers


def run_ranks(leader_cmd: list[str], engine_dir: str, world_size: int, out: str, *, timeout: float = 180,
              **extra_env: str) -> dict:
    """Run one job to its end (every rank exits 0, SHUTDOWN reached every worker); the JSON the leader
    wrote to ``out``."""
    leader, workers = start_ranks(leader_cmd, engine_dir, world_size, **extra_env)
    try:
        leader_log, _ = leader.communicate(timeout=timeout)
        assert leader.returncode == 0, leader_log
        for worker in workers:
            worker_log, _ = worker.communicate(timeout=30)
            assert worker.returncode == 0, worker_log
    finally:
        stop([leader, *workers])
    with open(out) as f:
        return json.load(f)


def kill_idle_worker(leader_cmd: list[str], engine_dir: str, out: str, hang: bool = False,
                     **extra_env: str) -> tuple[dict, float]:
    """A two-rank job whose leader prints IDLE once it has generated (heartbeats every 0.5 s): SIGKILL
    the worker then (``hang``: SIGSTOP, alive with its sockets open and never answering, until the leader
    has exited); (the JSON the leader wrote to ``out``, seconds from the signal to the leader's exit 0).
    ``extra_env``: more variables for both ranks (TRITONLLM_SHM_PLANS, say)."""
    leader, (worker,) = start_ranks(leader_cmd, engine_dir, 2, **{"TRITONLLM_DIST_HEARTBEAT_S": "0.5", **extra_env})
    try:
        before_idle = []  # what the leader logged on the way (a refused batch's warning, say)
        for line in leader.stdout:
            if line.strip() == "IDLE":  # generated, now idle
                break
            before_idle.append(line)
        else:
            raise AssertionError("the leader exited before it was idle:\n" + "".join(before_idle))
        killed_at = time.monotonic()
        worker.send_signal(signal.SIGSTOP if hang else signal.SIGKILL)
        leader_log, _ = leader.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if hang:
            worker.send_signal(signal.SIGCONT)
        stop([leader, worker])
    assert leader.returncode == 0, leader_log
    with open(out) as f:
        return json.load(f), elapsed


def stop(processes) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
