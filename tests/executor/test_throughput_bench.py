"""benchmarks/engine/throughput_bench.py on CPU (tiny shape): a TensorRT-LLM shape (128/128) and one it publishes
no figure for (512/16) through the executor print trtllm-bench's fields and the table against TensorRT-LLM's
figure (or n/a), with numbers that add up;
the steady-state check tells a run of many waves from one of two; request counts and batch bounds; the graph-alone
figure's split report."""
import json
from types import SimpleNamespace

import pytest

from benchmarks.engine import throughput_bench as tb
from benchmarks.engine.throughput_bench import (TRT_LLM_H100_FP8_TOK_S, batch_bounds, main, markdown, parse_args,
                                                parse_shapes, request_count, steady_state, trt_llm_column)


def test_two_tiny_shapes_print_the_fields_and_the_table(tmp_path, capsys):
    """The second shape was 2048/128 until 2026-11-30 (TensorRT-LLM's too): its rows were ~2/3 of the
    test's 15 CPU-s (256 decode steps over 2k-token contexts each), 512/16 takes ~1/10 of that."""
    out, md = tmp_path / "throughput.json", tmp_path / "throughput.md"
    results = main(["--tiny", "--shapes", "128/128,512/16", "--dtype", "both", "--max-requests", "4",
                    "--max-batch-size", "2", "--out", str(out), "--markdown", str(md)])
    printed = capsys.readouterr().out
    rows = results["rows"]
    assert [(r["isl"], r["osl"], r["dtype"]) for r in rows] == [(128, 128, "fp8"), (512, 16, "fp8"),
                                                                (128, 128, "bf16"), (512, 16, "bf16")]
    for row in rows:
        assert "error" not in row, row
        assert row["requests"] == 4 and row["count_reason"] == "capped by --max-requests 4"
        assert row["output_tokens"] == 4 * row["osl"] and row["output_tokens_min"] == row["output_tokens_max"] == row["osl"]
        assert row["input_tokens"] == 4 * row["isl"]
        assert row["output_tok_s"] == pytest.approx(row["request_tok_s"] * row["osl"])
        assert row["total_tok_s"] == pytest.approx(row["request_tok_s"] * (row["isl"] + row["osl"]))
        assert min(row["per_user_output_tok_s"], row["per_user_speed_tok_s"], row["seconds"]) > 0
        for name in ("ttft_ms", "tpot_ms"):
            stats = row[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] and stats["avg"] > 0
        # A request's latency is its TTFT plus OSL - 1 token gaps: the averages agree.
        assert row["latency_ms_avg"] == pytest.approx(row["ttft_ms"]["avg"] + (row["osl"] - 1) * row["tpot_ms"]["avg"],
                                                      rel=0.05)
        steady = row["steady"]
        assert steady["plateau_batch"] == 2 and steady["max_batch"] == 2 and steady["cap"] == 2
        # Two waves of two: the second runs with nothing queued (a drain), so the run is not all plateau.
        # How long each part took moves with the machine's load (one wave 3x slower than the other was
        # seen among 15 test workers), so the shares' sizes are checked on a made-up history below.
        assert steady["drain_share"] > 0 and steady["steady_share"] < 1
        assert steady["steady_share"] + steady["ramp_share"] + steady["drain_share"] <= 1.0 + 1e-6
        time = row["time"]
        assert time["context_steps"] >= 2 and time["decode_steps"] > 0 and time["prefill_tok_s"] > 0
        assert time["context_tokens"] == 4 * row["isl"]
        # Step latencies against the wall clock of the requests: most of it. Against the span from the first
        # step's start to the last one's end: within it (a step's latency starts where the step before it
        # ended, so none is counted twice). (<= 1.01 of the requests' wall clock until 2026-11-30: the step
        # that times the last token ends after it, by as long as its thread is kept from the CPU there, which
        # a loaded machine can make a few percent of these sub-second runs.)
        assert 0.5 < time["context_share"] + time["decode_share"]
        assert time["context_seconds"] + time["decode_seconds"] <= time["steps_span_seconds"] + 1e-3
        assert time["bucket"] == 2 and "bucket_graph_ms" not in time  # no CUDA graph on the CPU
    for field in ("Request Throughput (req/sec)", "Total Output Throughput (tokens/sec)", "Per User Output Speed",
                  "TTFT avg / p50 / p90 / p99 (ms)", "TPOT avg / p50 / p90 / p99 (ms)", "Steady state: no",
                  "Where the time went: context steps"):
        assert field in printed
    table = md.read_text()
    fp8_row = next(line for line in table.splitlines() if line.startswith("| 128/128 | fp8 | 4 |"))
    ratio = rows[0]["output_tok_s"] / TRT_LLM_H100_FP8_TOK_S[(128, 128)]
    assert "| 28,312 |" in fp8_row and f"| {ratio:.2f} |" in fp8_row
    assert "| TensorRT-LLM 1.0 (H100 FP8) |" in table  # (the CPU compares with the H100's column)
    # On an H200 the same rows compare with TensorRT-LLM's H200 column, and the header says so.
    h200_table = markdown({**results, "gpu": "NVIDIA H200"})
    h200_row = next(line for line in h200_table.splitlines() if line.startswith("| 128/128 | fp8 | 4 |"))
    assert "| TensorRT-LLM 1.0 (H200 FP8) |" in h200_table and "| 27,911 |" in h200_row
    assert f"| {rows[0]['output_tok_s'] / 27911:.2f} |" in h200_row
    bf16_row = next(line for line in table.splitlines() if line.startswith("| 128/128 | bf16 | 4 |"))
    assert "| n/a | n/a |" in bf16_row  # none is published for bf16
    unpublished = next(line for line in table.splitlines() if line.startswith("| 512/16 | fp8 | 4 |"))
    assert "| n/a | n/a |" in unpublished
    assert f"Commit {results['commit']}, cpu, " in table and table.strip() in printed
    # A run cut short is rendered again from its JSON.
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    main(["--report", str(out)])
    assert table.strip() in capsys.readouterr().out


def test_many_waves_reach_a_steady_state(tmp_path):
    results = main(["--tiny", "--shapes", "16/4:40", "--dtype", "bf16", "--max-batch-size", "2",
                    "--out", str(tmp_path / "t.json")])
    (row,) = results["rows"]
    assert row["requests"] == 40 and row["output_tokens"] == 160 and row["count_reason"] == "given in --shapes"
    assert row["steady"]["plateau_batch"] == 2 and row["steady"]["reached"], row["steady"]


def history(batches_and_queues, step_ms=10.0):
    return [SimpleNamespace(num_context_requests=0, num_gen_requests=batch, num_queued_requests=queued,
                            iter_latency_ms=step_ms) for batch, queued in batches_and_queues]


def test_steady_state_shares_of_ramp_plateau_and_drain():
    # 10 steps ramping up, 80 at the plateau of 100 with requests queued, 10 draining.
    steps = [(10 * (i + 1), 500) for i in range(9)] + [(100, 400)] * 80 + [(100 - 10 * i, 0) for i in range(10)]
    steady = steady_state(history(steps), wall_seconds=1.0, cap=128)
    assert steady["plateau_batch"] == 100 and steady["max_batch"] == 100
    assert steady["ramp_share"] == pytest.approx(0.09) and steady["steady_share"] == pytest.approx(0.80)
    assert steady["drain_share"] == pytest.approx(0.10) and steady["cap_share"] == 0.0
    # Every request admitted at once (no queue): no steady state at all.
    assert steady_state(history([(50, 0)] * 20), 0.2, cap=50)["steady_share"] == 0.0


def test_request_counts_and_batch_bounds():
    assert parse_shapes("all")[0] == (128, 128, None) and len(parse_shapes("")) == 10
    assert parse_shapes("128/128, 5000/500:64") == [(128, 128, None), (5000, 500, 64)]
    with pytest.raises(SystemExit):
        parse_shapes("128x128")
    # 2048/128: each step's 8,192 tokens feed decodes and prefill, so ~481 sequences run at once.
    bounds = batch_bounds(2048, 128, 1024, kv_tokens=2 << 20, tokens_per_block=32, max_num_tokens=8192)
    assert bounds["expected_batch"] == 481 and bounds["bound"] == "prefill budget"
    bounds = batch_bounds(20000, 2000, 1024, kv_tokens=1 << 20, tokens_per_block=32, max_num_tokens=8192)
    assert bounds["expected_batch"] == 47 and bounds["bound"] == "KV pool"
    args = parse_args(["--num-requests-scale", "0.1"])
    assert request_count(128, 128, None, args, 1024, None, None) == (3000, "TensorRT-LLM's count x 0.1")
    args = parse_args(["--waves", "4", "--max-requests", "10000"])
    assert request_count(2048, 128, None, args, 481, None, None)[0] == 1924
    args = parse_args([])
    count, why = request_count(2048, 128, None, args, 481, prior=2762.0, seconds_cap=60)
    assert count == 1294 and why.startswith("capped to ~60 s")


def test_tensorrt_llm_column_follows_the_gpu():
    """TensorRT-LLM 1.0 published an H100 and an H200 column (none for 1000/2000 on the H200): a run compares with its
    own GPU's, and with the H100's on anything that is not an H200."""
    assert trt_llm_column("NVIDIA H200")[0] == "H200" and trt_llm_column("NVIDIA H100 80GB HBM3")[0] == "H100"
    h200 = trt_llm_column("NVIDIA H200")[1]
    assert h200[(20000, 2000)] == 1804 and h200[(128, 128)] == 27911 and (1000, 2000) not in h200
    assert trt_llm_column("cpu") == ("H100", TRT_LLM_H100_FP8_TOK_S)


def test_the_graph_alone_figure_says_how_its_attention_split_its_keys():
    """Issue 51: a decode graph captured without its kernel's residency kept one split and no plan (50 ms where 41
    was due); the "where the time went" line now says which way the timed replay split."""
    import torch

    def graphs(plan, splits):  # DecodeGraphs' two fields it reads (a DecodeGraphs needs CUDA)
        return SimpleNamespace(metas={96: SimpleNamespace(decode_split_plan=plan)},
                               host_splits=torch.tensor([splits], dtype=torch.int32))

    planned = tb.graph_splits_text(graphs((8, 528, 132), 2), 96)
    assert planned == "2 splits a replay (528 programs at once on 132 SMs)"
    assert tb.graph_splits_text(graphs(None, 16), 96) == "no split plan: the splits its capture chose"
    time = {"context_share": 0.4, "context_steps": 675, "decode_share": 0.6, "decode_steps": 5556, "bucket": 96,
            "bucket_batch_mean": 91.0, "bucket_step_ms_mean": 41.2, "bucket_graph_ms": 40.8,
            "bucket_graph_context": 21000, "bucket_graph_splits": planned}
    assert tb.time_text(time).endswith("vs graph 40.80 ms (alone, context 21000; 2 splits a replay (528 programs at "
                                       "once on 132 SMs))")
    del time["bucket_graph_splits"]  # a JSON from before the field
    assert tb.time_text(time).endswith("vs graph 40.80 ms (alone, context 21000)")
