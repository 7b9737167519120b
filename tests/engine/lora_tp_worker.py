"""The ranks of test_lora_merged.py's tensor-parallel test, in a module of their own: a spawned
rank imports the module its function lives in, and this one imports only what a rank needs."""
from __future__ import annotations

import os

import torch


def lora_reference_steps(runner, adapter_dir: str) -> torch.Tensor:
    """tp_reference_steps' two packed steps with sequence 0 on adapter slot 1, sequence 1 on the base."""
    import dataclasses

    from engine.executor.runner import ModelRunner
    from engine.lora.adapter import load_peft_adapter
    from engine_testing import tp_reference_steps

    runner.enable_lora(2, 16)
    runner.load_adapter(1, load_peft_adapter(adapter_dir, runner.model_config, 16))
    runner.forward = lambda batch, **kw: ModelRunner.forward(runner, dataclasses.replace(batch, lora_slots=[1, -1]), **kw)
    return tp_reference_steps(runner)


def lora_tp_worker(rank: int, world_size: int, init_file: str, engine_dir: str, adapter_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from engine.executor.runner import ModelRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    runner = ModelRunner(engine_dir, rank=rank, tp_group=dist.group.WORLD)
    torch.save(lora_reference_steps(runner, adapter_dir), f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # both ranks are done
    # Leave without tearing gloo down: its pair threads could race the peer's teardown and abort
    # this process at exit ("terminate called without an active exception", about 1 run in 12).
    os._exit(0)
