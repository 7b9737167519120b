"""The rank job of test_lora_merged.py's tensor-parallel test, in a module of their own: a rank
imports the module its job lives in (jobs are pickled by reference), and this one imports only
what a rank needs."""
from __future__ import annotations

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


def lora_rank_logits(rank: int, engine_dir: str, adapter_dir: str) -> torch.Tensor:
    """One rank's job (gloo_ranks.py's shared pair): lora_reference_steps on this rank's tp 2 shard."""
    import torch.distributed as dist

    from engine.executor.runner import ModelRunner

    return lora_reference_steps(ModelRunner(engine_dir, rank=rank, tp_group=dist.group.WORLD), adapter_dir)
