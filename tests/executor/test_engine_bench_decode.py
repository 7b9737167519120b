"""benchmarks/engine/engine_bench.py's batch-1 decode loops on the tiny CPU engine: the overlapped loop
(each step launched with its token a placeholder for the one the step before sampled on the device, as
the executor overlaps by default) decodes the same greedy tokens as the synchronous loop (each token read
on the host before the next step). Why it matters: the bench reports the overlapped step beside the
synchronous one to say what of a step the host adds (issue 55)."""
from __future__ import annotations

import pytest
import torch

from engine.executor.runner import ModelRunner

from benchmarks.engine.engine_bench import decode_overlapped, decode_synchronous


def test_overlapped_decode_gives_the_synchronous_tokens(tiny_engine):
    runner = ModelRunner(tiny_engine)
    runner.allocate_kv_cache(16)
    page = runner.tokens_per_block
    table = list(range(1, 16))
    prompt = [5, 9, 2, 7, 11]
    runner.forward(decode_batch_of(prompt, page, table))
    first = 3
    tokens, times = decode_synchronous(runner, first, len(prompt), table, page, 6)
    again, overlapped_times = decode_overlapped(runner, first, len(prompt), table, page, 6)
    assert again == tokens and len(set(tokens)) > 1 and len(times) == 6 and len(overlapped_times) == 5


def decode_batch_of(prompt: list[int], page: int, table: list[int]):
    from engine.executor.runner import ForwardBatch

    n = len(prompt)
    return ForwardBatch(prompt, list(range(n)), [n], [n], [table[: -(-n // page)]], [n - 1])


def test_iteration_breakdown_never_replays_a_tensor_parallel_graph_on_rank_0_alone():
    """iteration_breakdown times the widest decode step's CUDA graph on one GPU; at tp_size > 1 rank 0's graph
    holds all-reduces that a replay on rank 0 alone waits in forever (encdec_bench --tp 2 hung so on the H200s,
    2026-11-30, rank 1 waiting for a plan): the figure is left out there. (CPU: a stand-in graph that records a
    replay; the real one needs two GPUs.)"""
    from types import SimpleNamespace

    from benchmarks.engine.engine_bench import iteration_breakdown

    replays = []
    graphs = SimpleNamespace(max_batch_size=8, bucket_for=lambda n: 8,
                             graphs={8: SimpleNamespace(replay=lambda: replays.append(1))})
    step = dict(timestamp_ns=1, num_context_requests=0, iter_latency_ms=5.0)
    history = [SimpleNamespace(num_gen_requests=n, **step) for n in (8, 8, 4)]
    runner = SimpleNamespace(decode_graphs=graphs, build_config=SimpleNamespace(tp_size=2))
    executor = SimpleNamespace(runner=runner, get_iteration_stats_history=lambda: history)
    out = iteration_breakdown(executor, since_ns=0)
    assert out["decode_batch"] == 8 and out["decode_iterations"] == 3 and out["decode_step_ms_median"] == 5.0
    assert "decode_graph_replay_ms" not in out and not replays


def test_decode_step_parts_need_a_decode_graph(tiny_engine):
    """decode_step_parts (engine_bench's executor_decode rows; vlm_bench with TRITONLLM_BENCH_STEP_PARTS=1) times a
    decode graph's replay: a runner without decode graphs (the CPU's) gives None, not a figure."""
    from benchmarks.engine.engine_bench import decode_step_parts

    runner = ModelRunner(tiny_engine)
    runner.allocate_kv_cache(16)
    assert runner.decode_graphs is None and decode_step_parts(runner, 4) is None
    from benchmarks.engine.engine_bench import host_call_costs

    assert host_call_costs(runner) is None  # (its per-call costs: CUDA only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs: GPU only")
def test_decode_step_parts_time_the_graph_the_lm_head_and_the_argmax(tiny_engine):
    """On CUDA: each part of a 5-row decode step timed alone (bucket 8), the logits' size, the back-to-back step no
    shorter than the graph alone less the spread, and rows past the graphs' largest bucket refused."""
    from benchmarks.engine.engine_bench import decode_step_parts

    runner = ModelRunner(tiny_engine, device="cuda")
    runner.allocate_kv_cache(64)
    runner.capture_cuda_graphs()
    page = runner.tokens_per_block
    rows = 5
    tables = [[1 + 4 * row + j for j in range(4)] for row in range(rows)]
    assert runner.decode_graphs.run([3] * rows, [9] * rows, [10] * rows, [t[:-(-10 // page)] for t in tables]) is not None
    parts = decode_step_parts(runner, rows)
    assert parts["rows"] == rows and parts["bucket"] == runner.decode_graphs.bucket_for(rows)
    assert all(parts[k] > 0 for k in ("graph_ms", "graph_sustained_ms", "lm_head_ms", "argmax_ms", "step_sustained_ms",
                                      "lm_head_device_ms", "argmax_device_ms"))
    assert parts["logits_mb"] == rows * runner.vocab_size * 4 / 1e6 and len(parts["sm_clock_mhz"]) == 3
    assert parts["step_sustained_ms"] > 0.5 * parts["graph_sustained_ms"]
    assert decode_step_parts(runner, runner.decode_graphs.max_batch_size + 1) is None


def test_input_copies_ab_and_host_parts_replay_every_step(tiny_engine, monkeypatch):
    """decode_input_copies_ab (the decode section's A/B of the decode graphs' inputs copied one by one against one
    staged copy) on the tiny engine with CUDA graphs emulated on the CPU (tests/engine/graph_emulation.py): every
    step of both loops replays a graph both ways, the tokens are the same, and the switch is left as it was; and
    decode_host_parts times each synchronous step's parts around its replay, then leaves the graph as it was."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "engine"))
    from graph_emulation import emulate_cuda_graphs

    from benchmarks.engine.engine_bench import decode_host_parts, decode_input_copies_ab, decode_outside_graph_text

    replays = emulate_cuda_graphs(monkeypatch)
    runner = ModelRunner(tiny_engine)
    runner.allocate_kv_cache(16)
    assert decode_input_copies_ab(runner, 3, 5, list(range(1, 16)), runner.tokens_per_block) is None  # no graphs
    runner.capture_cuda_graphs()
    prompt = [5, 9, 2, 7, 11]
    runner.forward(decode_batch_of(prompt, runner.tokens_per_block, list(range(1, 16))))
    before = replays.copy()
    ab = decode_input_copies_ab(runner, 3, len(prompt), list(range(1, 16)), runner.tokens_per_block, steps=18,
                                rounds=1)
    assert ab["same_tokens"] and runner.decode_graphs.separate_copies is False
    decode = "LlamaForCausalLM-decode"
    assert replays[decode] - before[decode] == 2 * 2 * 18  # (and as many head graphs: the loops take their ids)
    assert replays["head"] - before["head"] == 2 * 2 * 18
    assert all(ab[f"{way}_{part}_ms"] > 0 for way in ("separate", "one") for part in ("sync", "forward", "overlapped"))
    assert "in one copy: step" in decode_outside_graph_text({"input_copies_ab": ab})
    # decode_host_parts: the synchronous loop part by part, its replays timed through the graph's replay()
    import engine.executor.cuda_graphs as cuda_graphs

    before, graph, graphs = replays.copy(), runner.decode_graphs.graphs[1], runner.decode_graphs
    event, fill = graphs._copied, cuda_graphs.fill_decode_inputs
    host = decode_host_parts(runner, 3, len(prompt), list(range(1, 16)), runner.tokens_per_block, steps=18)
    # (the LM head and pick eager there: no head graph replayed)
    assert sum(replays.values()) - sum(before.values()) == 18 and "replay" not in vars(graph)  # its own again
    assert graphs._copied is event and cuda_graphs.fill_decode_inputs is fill  # the timed stand-ins gone again
    parts = ("enter", "copy_wait", "pack", "copy", "copy_record", "to_launch")
    assert set(host) == {f"{part}_ms" for part in ("to_replay", "replay", "after_replay", "pick", "wait", "step")
                         + parts}
    assert all(value >= 0 for value in host.values()) and host["step_ms"] > 0
    # the parts of the way to the replay are its time, each step's parts summing to it (medians: roughly)
    assert 0.5 * host["to_replay_ms"] <= sum(host[f"{part}_ms"] for part in parts) <= 2 * host["to_replay_ms"]
    assert decode_host_parts(ModelRunner(tiny_engine), 3, 5, [1], runner.tokens_per_block) is None  # no graphs


def test_head_graph_ab_gives_the_same_tokens_both_ways(tiny_engine, monkeypatch):
    """decode_head_graph_ab (the decode section's A/B of the LM head and greedy pick launched after the replay
    against replayed from the batch-1 head graph, cuda_graphs.py) on the emulated graphs: both loops decode the
    same tokens both ways, only the graph way replays head graphs (one a step), and the switch is left as it was."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "engine"))
    from graph_emulation import emulate_cuda_graphs

    from benchmarks.engine.engine_bench import decode_head_graph_ab, decode_outside_graph_text

    replays = emulate_cuda_graphs(monkeypatch)
    runner = ModelRunner(tiny_engine)
    runner.allocate_kv_cache(16)
    prompt, table = [5, 9, 2, 7, 11], list(range(1, 16))
    assert decode_head_graph_ab(runner, 3, len(prompt), table, runner.tokens_per_block) is None  # no graphs
    runner.capture_cuda_graphs()
    runner.forward(decode_batch_of(prompt, runner.tokens_per_block, table))
    before = replays.copy()
    ab = decode_head_graph_ab(runner, 3, len(prompt), table, runner.tokens_per_block, steps=18, rounds=1)
    assert ab["same_tokens"] and runner.decode_graphs.use_head_graphs is True
    assert replays["LlamaForCausalLM-decode"] - before["LlamaForCausalLM-decode"] == 2 * 2 * 18
    assert replays["head"] - before["head"] == 2 * 18  # the graph way's steps only
    assert all(ab[f"{way}_{part}_ms"] > 0 for way in ("eager", "graph") for part in ("sync", "forward", "overlapped"))
    assert "in a head graph: step" in decode_outside_graph_text({"head_graph_ab": ab})
