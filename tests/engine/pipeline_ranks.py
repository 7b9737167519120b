"""The job the pipeline-parallel engine test sends gloo_ranks.py's shared pair: an engine built
with pp_size 2 (tp_size 1), rank r running stage r, driven through engine_testing.tp_reference_steps
(a prefill of two sequences on shuffled blocks, then a mixed chunk + decode step); and the
architectures held to pp 1 beside the main three (PP_MORE_LAYERS)."""
from __future__ import annotations

import os

import torch

from engine_testing import tp_reference_steps

# Every architecture check_pipeline_supported admits beyond test_pipeline_parallel.py's PP_FAMILIES:
# tiny_hf family -> its pp 2 split. Where layers differ, the split gives stage 1 a first layer unlike the
# model's layer 0, so a layer reading its stage-local index at run time would compute another layer's
# attention: gpt-oss layer 1 full (layer 0 slides), SmolLM3 layer 1 NoPE, Llama 4 layer 1 NoPE and MoE
# (layer 0 chunked rope and dense). With trim_to_stage changed by hand to reset use_rope, sliding_window
# and Llama 4's chunk and temperature from the local index, those three gave logits off by 0.3, 1.7 and
# 2.3 (the others, whose layers are alike, unchanged).
PP_MORE_LAYERS = {"mistral": [1, 1], "qwen2_qkv_bias": [1, 1], "qwen3": [2, 1], "phi3_longrope": [2, 1],
                  "smollm3_nope": [1, 2], "mixtral": [1, 1], "gpt_oss": [1, 1], "llama4": [1, 3]}


class _LogitsOnEveryRank:
    """A StageRunner whose forward gives zeros where it returns None (ranks other than 0), so the
    same session code drives every rank; only rank 0's logits are compared."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, batch, **kwargs):
        logits = self.runner.forward(batch, **kwargs)
        return torch.zeros(len(batch.logits_indices), self.runner.vocab_size) if logits is None else logits


def pp_rank_logits(rank: int, engine_dirs: dict, micro_batches: int) -> dict:
    """name -> this rank's tp_reference_steps logits (rank 0: the step's; rank 1: zeros), the
    layers its KV pool holds, and how many sends of its last step are not waited on yet."""
    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)
    try:
        out = {}
        for name, engine_dir in engine_dirs.items():
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            logits = tp_reference_steps(_LogitsOnEveryRank(runner))
            out[name] = (logits, runner.kv_cache.shape[0], len(runner._unwaited_sends))
            runner.wait_sends()  # (else the last step's logits send may be dropped with the runner)
        return out
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def step_draws(rows: int, vocab_size: int) -> list[int]:
    """Packed draws (engine/executor/packed_draws.py) for a step of ``rows`` rows: every third row
    greedy, the others at temperature 0.7 with a top-k of 5 on odd rows and a top-p of 0.9 on every
    fourth, each with its own seed (one past 2**31: both halves used) and offset."""
    from types import SimpleNamespace

    from engine.executor.packed_draws import pack_draws
    from engine.executor.request import SamplingConfig

    def seq(row):
        sampling = SamplingConfig(temperature=0.0 if row % 3 == 0 else 0.7, top_k=5 if row % 2 else 0,
                                  top_p=0.9 if row % 4 == 1 else None)
        return SimpleNamespace(state=SimpleNamespace(request=SimpleNamespace(sampling=sampling)),
                               seed=(1 << 31) + 17 * row, num_generated_tokens=row)
    return pack_draws([seq(row) for row in range(rows)], vocab_size)


class _SampledOnLastStage(_LogitsOnEveryRank):
    """A StageRunner whose every step is marked for sampling on the last stage (``draws``: with
    step_draws' settings, else greedy): rank 0's forward returns the token ids the last stage sent,
    kept in ``ids``; zeros stand for the logits."""

    def __init__(self, runner, draws: bool = False):
        super().__init__(runner)
        self.ids = []
        self.draws = draws

    def forward(self, batch, **kwargs):
        from dataclasses import replace

        draws = step_draws(len(batch.logits_indices), self.runner.vocab_size) if self.draws else None
        ids = self.runner.forward(replace(batch, sample_on_last_stage=True, last_stage_draws=draws), **kwargs)
        if ids is not None:
            self.ids.append(ids)
        return torch.zeros(len(batch.logits_indices), self.runner.vocab_size)


def pp_rank_last_stage_ids(rank: int, engine_dir: str, micro_batches: int, draws: bool = False) -> tuple:
    """tp_reference_steps twice on fresh stage runners: first as today (rank 0 receives the logits),
    then with every step sampled on the last stage (``draws``: step_draws' settings, else greedy).
    Returns (rank 0's logits of the first pass or None, rank 0's ids of the second or None, (dtype,
    shape) of each tensor this rank sent rank 0 in the second pass)."""
    import pytest
    import torch.distributed as dist

    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)
    try:
        runner = StageRunner(engine_dir, rank=rank, device="cpu")
        logits = tp_reference_steps(_LogitsOnEveryRank(runner))
        runner.wait_sends()
        sent = []
        with pytest.MonkeyPatch.context() as patch:
            isend = dist.isend

            def recorded_isend(tensor, dst, *args, **kwargs):
                if dst == 0:
                    sent.append((tensor.dtype, tuple(tensor.shape)))
                return isend(tensor, dst, *args, **kwargs)

            patch.setattr(dist, "isend", recorded_isend)
            sampled = _SampledOnLastStage(StageRunner(engine_dir, rank=rank, device="cpu"), draws)
            tp_reference_steps(sampled)
            sampled.runner.wait_sends()
        return (logits, torch.cat(sampled.ids), sent) if rank == 0 else (None, None, sent)
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def graph_reference_steps(runner) -> torch.Tensor:
    """Prompts of three sequences, four decode steps of all three, one of sequence 1 alone, then a
    mixed chunk + decode step; every step's logits, stacked. On CUDA (or emulated) the decode steps
    replay graphs, the others run eagerly."""
    from engine_testing import PagedSession, random_tokens

    prompts = [random_tokens(n, seed=20 + n) for n in (5, 9, 3)]
    session = PagedSession(runner, num_blocks=16)
    runner.capture_cuda_graphs()
    out = session.step(list(enumerate(prompts)))
    for step in range(4):
        out += session.step([(seq, [(7 * seq + 3 * step) % 50]) for seq in range(3)])
    out += session.step([(1, [11])])
    out += session.step([(0, random_tokens(6, seed=30)), (2, [13])])
    return torch.cat(out)


def pp_graph_logits(rank: int, engine_dir: str, micro_batches: int, graphed_ranks: tuple[int, ...]) -> tuple:
    """graph_reference_steps on this rank's stage, CUDA graphs emulated (graph_emulation.py) on
    ``graphed_ranks`` only: (rank 0's logits or zeros, this rank's (decode, prefill) graph replays)."""
    import pytest
    from graph_emulation import emulate_cuda_graphs

    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)
    try:
        with pytest.MonkeyPatch.context() as patch:
            replays = emulate_cuda_graphs(patch) if rank in graphed_ranks else {}
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            logits = graph_reference_steps(_LogitsOnEveryRank(runner))
            runner.wait_sends()
            return logits, (replays["StageStep-decode"], replays["StageStep-prefill"]) if replays else (0, 0)
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def pp_p2p_order(rank: int, engine_dir: str) -> list[str]:
    """This rank's point-to-point calls over one step of two micro-batches that both carry logits
    rows (a decode row and a prompt's last token in each), e.g. ["send", "recv", "send", "recv"]."""
    import pytest
    import torch.distributed as dist

    from engine.executor.runner import ForwardBatch
    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    calls = []

    def recorded(kind, fn):
        def call(*args, **kwargs):
            calls.append(kind)
            return fn(*args, **kwargs)
        return call

    os.environ[MICRO_BATCHES_ENV] = "2"
    try:
        with pytest.MonkeyPatch.context() as patch:
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            runner.allocate_kv_cache(8)
            for name, kind in (("send", "send"), ("isend", "send"), ("recv", "recv"), ("irecv", "recv")):
                patch.setattr(dist, name, recorded(kind, getattr(dist, name)))
            runner.forward(ForwardBatch(token_ids=[1, 2, 3, 4, 5, 6], positions=[0, 1, 2, 0, 1, 2], seq_lens_q=[3, 3],
                                        context_lens=[3, 3], block_tables=[[0], [1]], logits_indices=[2, 5]))
            runner.wait_sends()
        return calls
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def pipelined_executor_run(rank: int, pp2_dir: str, requests: list, cancel_after: int | None = None,
                           then: list | None = None, steps: str = "2", sample_on_last_stage: bool = True) -> dict | None:
    """An Executor on rank 0 over a LeaderRunner of stage 0 (rank 1 the worker loop of stage 1),
    with two steps in flight (engine/pipeline/in_flight.py). ``requests`` are enqueued together;
    with ``cancel_after`` the first is cancelled once it streamed that many responses; ``then``
    (requests needing the one-step path, e.g. penalties) run after, on the same executor. Returns
    (rank 0) each request's streamed tokens and finish reason, the launch/finish calls, the
    first block of every sequence of each launched step and the count of one-step forwards.
    ``steps`` "auto": STEPS_IN_FLIGHT_ENV unset, in_flight_gain replaced by a stand-in that pays
    from 3 sequences on (the tiny model's own figures never would), and every launched step cut in
    two micro-batches. ``sample_on_last_stage`` False: SAMPLE_ON_LAST_STAGE_ENV=0. ``out["sampled_on_last_stage"]``
    (``out["then_sampled_on_last_stage"]``): each launched or one-step batch's ("launch" | "forward",
    its sample_on_last_stage, whether it carried draws), of ``requests`` (``then``)."""
    import torch.distributed as dist

    from engine.executor import Executor, ExecutorConfig
    from engine.executor.runner import ForwardBatch
    from engine.pipeline import in_flight
    from engine.pipeline.in_flight import STEPS_IN_FLIGHT_ENV
    from engine.pipeline.runner import SAMPLE_ON_LAST_STAGE_ENV, StageRunner
    from engine.tensor_parallel import distributed
    from engine.tensor_parallel.rank_info import RankInfo
    from engine.tensor_parallel.step_protocol import StepChannel
    from engine_testing import EXECUTOR_POOL

    settings = distributed.DistSettings("127.0.0.1", 0, step_timeout_s=120.0, heartbeat_s=0.5)
    ctx = distributed.DistContext(RankInfo(rank, 2, rank, 2), settings, torch.device("cpu"), dist.group.WORLD,
                                  dist.new_group(backend="gloo"))
    if not sample_on_last_stage:
        os.environ[SAMPLE_ON_LAST_STAGE_ENV] = "0"
    try:
        runner = StageRunner(pp2_dir, rank=rank, device="cpu")
    finally:
        os.environ.pop(SAMPLE_ON_LAST_STAGE_ENV, None)
    if rank == 1:
        channel = StepChannel(ctx, batch_class=ForwardBatch)
        distributed.run_worker_loop(runner, channel)  # until the executor's shutdown
        channel.close()
        return None
    leader = distributed.LeaderRunner(runner, ctx)
    launches = []
    launch = leader.launch

    micro_batches, last_stage = [], []

    def recording_launch(batch):
        launches.append([table[0] for table in batch.block_tables])
        micro_batches.append(batch.micro_batches)
        last_stage.append(("launch", batch.sample_on_last_stage, batch.last_stage_draws is not None))
        return launch(batch)

    leader.launch = recording_launch
    forwards = []
    forward = leader.forward

    def counting_forward(batch, **kwargs):
        forwards.append(len(batch.seq_lens_q))
        last_stage.append(("forward", batch.sample_on_last_stage, batch.last_stage_draws is not None))
        return forward(batch, **kwargs)

    leader.forward = counting_forward
    patched = {"make_runner": lambda *args, **kwargs: leader, "_destroy_groups": lambda *args, **kwargs: False}
    saved = {name: getattr(distributed, name) for name in patched}  # (the shared pair keeps its groups)
    saved_gain, saved_choice = in_flight.in_flight_gain, in_flight.choose_micro_batches
    if steps == "auto":
        in_flight.in_flight_gain = lambda cost, pp_size, depth, *, seqs, **work: 2.0 if seqs >= 3 else 0.5
        in_flight.choose_micro_batches = lambda work, pp_size, most: 2  # (launched steps cut in two)
    else:
        os.environ[STEPS_IN_FLIGHT_ENV] = steps
    try:
        for name, value in patched.items():
            setattr(distributed, name, value)
        with Executor(pp2_dir, ExecutorConfig(**EXECUTOR_POOL), device="cpu") as executor:
            calls = []
            if executor.pipelined is not None:  # (steps "1": one step at a time, every step a forward)
                executor.pipelined.calls = calls
            out = {"tokens": _run_streaming(executor, requests, cancel_after)}
            out["calls"], out["launches"], out["forwards"] = list(calls), list(launches), list(forwards)
            out["micro_batches"] = list(micro_batches)
            out["sampled_on_last_stage"] = list(last_stage)
            if then:
                out["then"] = _run_streaming(executor, then, None)
                out["then_calls"] = calls[len(out["calls"]):]
                out["then_sampled_on_last_stage"] = last_stage[len(out["sampled_on_last_stage"]):]
        return out
    finally:
        os.environ.pop(STEPS_IN_FLIGHT_ENV, None)
        in_flight.in_flight_gain, in_flight.choose_micro_batches = saved_gain, saved_choice
        for name, value in saved.items():
            setattr(distributed, name, value)


def _run_streaming(executor, requests: list, cancel_after: int | None) -> list:
    """(tokens, finish reason) of each request, streamed; the first cancelled after ``cancel_after`` responses."""
    import time

    ids = executor.enqueue_requests(requests)
    tokens, reasons, counts = {i: [] for i in ids}, {}, {i: 0 for i in ids}
    deadline = time.monotonic() + 120
    while len(reasons) < len(ids):
        assert time.monotonic() < deadline, f"no final response for {set(ids) - set(reasons)}"
        for response in executor.await_responses(timeout=0.5):
            assert response.error is None, response.error
            tokens[response.request_id] += response.result.output_token_ids[0]
            counts[response.request_id] += 1
            if response.result.is_final:
                reasons[response.request_id] = response.result.finish_reasons[0].name
            if cancel_after is not None and response.request_id == ids[0] and counts[ids[0]] == cancel_after:
                executor.cancel_request(ids[0])
    return [(tokens[i], reasons[i]) for i in ids]
