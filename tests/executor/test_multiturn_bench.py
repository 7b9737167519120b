"""benchmarks/engine/multiturn_bench.py on CPU (tiny shape, float32): with the prefix cache on, later turns
take the shared system prompt and their own history from the cache (a KV hit rate above zero, none
with it off), and every conversation's tokens are exactly those of the run without reuse. With the
device pool half the working set, the host tier brings evicted histories back (blocks onboarded,
a higher hit rate than reuse alone) without changing a token."""
from benchmarks.engine.multiturn_bench import main


def test_prefix_reuse_keeps_every_answer_and_hits_the_cache():
    results = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--conversations", "4", "--turns",
                    "3", "--system_len", "100", "--user_len", "10", "--output_len", "8", "--max_batch_size", "8",
                    "--max_seq_len", "512"])
    on, off = results["runs"]["on"], results["runs"]["off"]
    assert on["kv_hit_rate"] > 0.3 and off["kv_hit_rate"] == 0.0
    assert on["conversations"] == off["conversations"]
    assert all(len(history) == 100 + 3 * (10 + 8) for history in on["conversations"])
    assert on["onboarded_blocks"] == on["offloaded_blocks"] == 0


def test_host_tier_with_a_working_set_twice_the_device_pool():
    results = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--conversations", "6", "--turns",
                    "3", "--system_len", "64", "--user_len", "40", "--output_len", "8", "--max_batch_size", "8",
                    "--max_seq_len", "512", "--reuse", "off,on,host", "--working_set_over_gpu_pool", "2"])
    assert results["working_set_tokens"] == 64 + 6 * 3 * (40 + 8)
    assert results["gpu_pool_tokens"] == -(-results["working_set_tokens"] // 2)
    off, on, host = results["runs"]["off"], results["runs"]["on"], results["runs"]["host"]
    assert host["gpu_pool_blocks"] == on["gpu_pool_blocks"] == -(-results["gpu_pool_tokens"] // 32)
    assert host["conversations"] == on["conversations"] == off["conversations"]
    assert host["onboarded_blocks"] > 0 and host["offloaded_blocks"] >= host["onboarded_blocks"]
    assert host["kv_hit_rate"] > on["kv_hit_rate"]
    assert host["counter_hit_rate"] > 0 and host["host_tier_blocks"] > 0


def test_varied_answer_lengths_are_the_same_draws_for_every_setting():
    results = main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--conversations", "4", "--turns",
                    "3", "--system_len", "40", "--user_len", "6", "--output_len", "8", "--max_batch_size", "8",
                    "--max_seq_len", "512", "--vary_output_len"])
    on, off = results["runs"]["on"], results["runs"]["off"]
    assert on["conversations"] == off["conversations"]
    lengths = {len(history) for history in on["conversations"]}
    assert len(lengths) > 1  # not all equal: the answers varied
    assert all(40 + 3 * (6 + 4) <= n <= 40 + 3 * (6 + 12) for n in lengths)
