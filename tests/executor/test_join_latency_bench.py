"""benchmarks/engine/join_latency_bench.py on CPU (tiny shape): every configuration measures every group
size, and the table has a row per group size. (The graphs themselves need a GPU; on CPU both
"eager" and "graphs" runs are eager, so only the harness is checked here.)"""
import pytest

from benchmarks.engine.join_latency_bench import main


def test_join_latency_bench_measures_every_configuration(tmp_path):
    results = main(["--model", "tiny", "--decoding", "2", "--joining", "1,3", "--repeats", "1", "--max_seq_len", "256",
                    "--max_batch_size", "8", "--prompt_len", "16", "--settle_s", "0.2", "--gap_s", "0.1",
                    "--out", str(tmp_path / "join.json"), "--results_md", str(tmp_path / "join.md")])
    assert set(results["runs"]) == {"eager_overlap", "graphs_overlap", "eager_no_overlap", "graphs_no_overlap"}
    for run in results["runs"].values():
        for k in ("1", "3"):
            assert run[k]["ttft_ms"] > 0 and run[k]["prompt_step_ms"] > 0, run
    table = (tmp_path / "join.md").read_text()
    assert "| 1 |" in table and "| 3 |" in table and "Requests joining 2 decoding streams, tiny" in table


def test_a_group_that_gets_no_first_token_in_time_stops_the_run_by_name(tmp_path):
    """Not a None in the table (a warm-up step that ran past its group's window left one there on the H200)."""
    with pytest.raises(RuntimeError, match=r"graphs off, overlap on, k=2: within --wait_s 0.0 s, 2 of 2 joining"):
        main(["--model", "tiny", "--decoding", "1", "--joining", "2", "--repeats", "1", "--max_seq_len", "128",
              "--max_batch_size", "4", "--prompt_len", "8", "--settle_s", "0", "--wait_s", "0",
              "--out", str(tmp_path / "join.json")])
