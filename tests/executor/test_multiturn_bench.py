"""benchmarks/multiturn_bench.py on CPU (tiny shape, float32): with the prefix cache on, later turns
take the shared system prompt and their own history from the cache (a KV hit rate above zero, none
with it off), and every conversation's tokens are exactly those of the run without reuse."""
from benchmarks.multiturn_bench import main


def test_prefix_reuse_keeps_every_answer_and_hits_the_cache():
    results = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--conversations", "4", "--turns",
                    "3", "--system_len", "100", "--user_len", "10", "--output_len", "8", "--max_batch_size", "8",
                    "--max_seq_len", "512"])
    on, off = results["runs"]["on"], results["runs"]["off"]
    assert on["kv_hit_rate"] > 0.3 and off["kv_hit_rate"] == 0.0
    assert on["conversations"] == off["conversations"]
    assert all(len(history) == 100 + 3 * (10 + 8) for history in on["conversations"])
