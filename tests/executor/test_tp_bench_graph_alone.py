"""tp_bench's "decode graph alone" replays the inputs of a steady widest decode step, not what the run's last steps
left in the graphs' static buffers (a few rows of the last step, older rows, a small batch's key splits), which
moved the figure from run to run (session 21: 3.91 ms for 17 layers against 4.28 for 16 in one lease)."""
from types import SimpleNamespace

from benchmarks.engine import tp_bench


def fake_graphs(max_batch_size: int):
    runs = []

    def run(token_ids, positions, context_lens, block_tables, *args, **kwargs):
        runs.append((len(token_ids), max(context_lens)))
        return "hidden"

    return SimpleNamespace(max_batch_size=max_batch_size, run=run), runs


def step(rows: int, context: int):
    return [0] * rows, [context - 1] * rows, [context] * rows, [[1, 2]] * rows


def test_the_graph_alone_replays_a_remembered_widest_step():
    graphs, runs = fake_graphs(4)
    tp_bench.remember_a_widest_step(graphs)
    assert tp_bench.replay_inputs_of_a_widest_step(graphs, 4) == "left over from the run's last steps"
    for n in range(1, tp_bench.WIDEST_STEP_SAVED + 5):
        assert graphs.run(*step(4, 100 + n)) == "hidden"  # (the runner's calls go through, results unchanged)
        graphs.run(*step(2, 500))  # narrower steps are not kept
    said = tp_bench.replay_inputs_of_a_widest_step(graphs, 4)
    context = 100 + tp_bench.WIDEST_STEP_SAVED
    assert said == f"decode step {tp_bench.WIDEST_STEP_SAVED} of 4 sequences, contexts {context}-{context}"
    assert runs[-1] == (4, context)  # its inputs went back into the buffers before the timing
    # fewer widest steps than that: the first one's
    graphs, runs = fake_graphs(4)
    tp_bench.remember_a_widest_step(graphs)
    graphs.run(*step(4, 7))
    graphs.run(*step(4, 8))
    assert tp_bench.replay_inputs_of_a_widest_step(graphs, 4).startswith("decode step 1 of 4")
    assert runs[-1] == (4, 7)
    # a run whose widest step was narrower than the graphs' widest: nothing remembered fits
    assert tp_bench.replay_inputs_of_a_widest_step(graphs, 3) == "left over from the run's last steps"
