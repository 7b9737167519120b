"""A check the vision-language executor tests run on the CPU: every step with prompt-table or M-RoPE
rows also runs the prefill graphs' table-twin forward (engine/executor/table_graphs.py: fake ids zeroed,
the dense PromptEmbeds, rotary through the static step table; the buffers shared by all steps and
filled with junk before each) eagerly, and its hidden states must equal the eager forward's bitwise.
The GPU tests then replay the captured twins (the same forward) and compare greedy ids."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.executor.overlap import resolve_placeholders
from engine.executor.table_graphs import table_step_buffers
from engine.models.prompt_embeds import embeddable_ids


@contextmanager
def dense_table_steps_checked(executor):
    """Yields the list of checked steps' token counts (a test asserts it is not empty). A CPU executor
    (the tests pass device="cpu": on a GPU machine the default is CUDA, whose steps replay the twins instead)."""
    runner = executor.runner
    buffers = table_step_buffers(runner.model, runner.engine_config, runner.build_config.max_num_tokens, runner.dtype,
                                 runner.device)
    assert buffers is not None, "a vision-language engine gets the table twins"
    forward, checked = runner.forward, []

    def checking(batch, **kw):
        embeds, rotary = kw.get("prompt_embeds"), kw.get("rotary")
        if (embeds is not None or rotary is not None) and kw.get("span_ahead") is None:
            ids, positions, meta = runner._prepare(batch)
            with torch.inference_mode():
                want = runner.model(resolve_placeholders(embeddable_ids(ids, runner.vocab_size), runner.sampled_tokens), positions, runner.kv_cache, meta,
                                    **({} if embeds is None else {"prompt_embeds": embeds}),
                                    **({} if rotary is None else {"rotary": rotary.resolve(runner.model.cos_sin_cache)}))
                dense_ids, dense_positions = ids.numpy().copy(), positions.numpy().copy()
                buffers.fill_host(dense_ids, dense_positions, rotary)
                buffers.mask.fill_(True)  # what earlier steps may have left: fill_device must clear it
                buffers.embeds.normal_()
                buffers.fill_device(embeds, rotary, len(ids))
                got = buffers.forward(runner.model, len(ids))(  # (the captured graph resolves placeholders itself)
                    resolve_placeholders(torch.from_numpy(dense_ids), runner.sampled_tokens), torch.from_numpy(dense_positions),
                    runner.kv_cache, meta)
            assert torch.equal(got, want), f"step of {len(ids)} tokens: the table twin's forward differs"
            checked.append(len(ids))
        return forward(batch, **kw)

    runner.forward = checking
    try:
        yield checked
    finally:
        runner.forward = forward


@contextmanager
def table_twins_replayed(executor):
    """CUDA: yields the list of steps that replayed a table twin (engine/executor/prefill_graphs.py)."""
    graphs, replayed = executor.runner.prefill_graphs, []
    assert graphs is not None and graphs.table is not None, "a vision-language engine captures the table twins"
    fill = graphs.table.fill_device

    def counting(prompt_embeds, rotary, bucket):
        replayed.append(bucket)
        return fill(prompt_embeds, rotary, bucket)

    graphs.table.fill_device = counting
    try:
        yield replayed
    finally:
        graphs.table.fill_device = fill
