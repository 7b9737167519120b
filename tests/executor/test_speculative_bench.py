"""benchmarks/speculative/speculative_bench.py on CPU (tiny shape, float32), bf16 and fp8 labels: the verify step
is timed against a plain step at every (batch, k); the client-draft loop (the BLS's: one verify step
per call, a of k drafts right) emits exactly plain decoding's ids at every acceptance, with the
acceptance it was built for; the n-gram executor's ids are plain decoding's too; the projections
and goals are filled, the tables printed with commit, device and date, and --report renders the JSON."""
import json

from benchmarks.speculative.speculative_bench import curve_at, main

ARGS = ["--tiny", "--dtypes", "bf16,fp8", "--context", "96", "--output-len", "12", "--batches", "1,4", "--ks", "1,4",
        "--loop-ks", "4,2", "--ngram-prompts", "2", "--warmup", "2", "--repeat", "3"]


def test_tiny_run_measures_every_section_and_keeps_plain_ids(tmp_path, capsys):
    out = tmp_path / "speculative.json"
    results = main(ARGS + ["--out", str(out)])
    printed = capsys.readouterr().out
    assert set(results["dtypes"]) == {"bf16", "fp8"}
    for label, entry in results["dtypes"].items():
        assert "error" not in entry, entry.get("error")
        # Section 1: a verify row per (batch, k) against its batch's plain step.
        rows = {(r["batch"], r["k"]): r for r in entry["verify_rows"]}
        assert set(rows) == {(b, k) for b in (1, 4) for k in (1, 4)}
        for (batch, k), r in rows.items():
            assert r["tokens"] == batch * (k + 1) and r["path"] == "eager (CPU)"
            assert r["step_ms"] > 0 and r["plain_step_ms"] > 0 and r["ratio"] == r["step_ms"] / r["plain_step_ms"]
        # Section 2: every (k, a) loop gives plain decoding's ids, one verify step per call.
        ext = entry["external"]
        assert ext["plain"]["decode_tok_s"] > 0 and ext["plain"]["repeat_identical"]
        # The reference (one-token calls) is plain decoding's ids on the CPU, where steps round alike.
        assert ext["reference_ids"] == ext["plain_ids"] and len(ext["plain_ids"]) == 12
        assert ext["one_token_calls"]["ids_equal_plain"] and ext["one_token_calls"]["first_difference_from_plain"] is None
        loops = {(r["k"], r["accepted_drafts"]): r for r in ext["loops"]}
        assert set(loops) == {(4, a) for a in range(5)} | {(2, a) for a in range(3)}
        for (k, a), r in loops.items():
            assert r["ids_equal_plain"] and r["ids_equal_reference"] and r["output_ids"] == ext["plain_ids"]
            assert not r["mismatches"] and not r["stopped_early"]
            assert r["tokens"] == 12 and r["tok_s"] > 0 and r["speedup"] == r["tok_s"] / ext["plain"]["decode_tok_s"]
            # Each call emits its accepted drafts and one token of the target's own, and no more.
            assert r["accepted_draft_tokens"] == r["tokens"] - r["calls"]
            assert r["steps"] == r["calls"] and r["step_ms_median"] > 0
            # a + 1 tokens a call until the last calls, which have fewer tokens left to draft for.
            assert r["calls"] >= -(-12 // (a + 1)) and r["calls"] <= -(-12 // (a + 1)) + 2
        assert loops[(4, 0)]["accepted_draft_tokens"] == 0
        assert loops[(4, 4)]["measured_acceptance_length"] > loops[(4, 1)]["measured_acceptance_length"]
        # Section 3: the n-gram executor against plain decoding of the same prompts.
        ngram, plain = entry["ngram"], entry["ngram_plain"]
        assert ngram["ids_equal_plain"] and ngram["prompts"] == plain["prompts"] == 2
        assert ngram["generated_tokens"] == plain["generated_tokens"] == 24
        assert ngram["mean_acceptance_length"] >= 1.0 and ngram["decode_tok_s"] > 0 and plain["drafted_steps"] == 0
        projected = {r["set"]: r for r in entry["projections"]}
        assert set(projected) == {"summarisation", "code_edit"}
        for r in projected.values():
            assert r["verify_cost_speedup"] > 0
            assert r["ngram_speedup"] is None or r["ngram_speedup"] > 0  # needs a drafted step in the n-gram run
        assert {"verify_k4_batch1_ratio", "verify_k4_batch1_met", "speedup_at_3", "speedup_at_3_met"} <= set(entry["goals"])
        assert set(entry["goals"]["speedup_at_3"]) == {"k4", "k2"}
    assert "Commit " in printed and ", cpu, " in printed and "PROJECTED" in printed
    assert json.loads(out.read_text())["dtypes"]["fp8"]["external"]["loops"]
    md = tmp_path / "results.md"
    again = main(["--report", str(out), "--markdown", str(md)])
    assert again["dtypes"].keys() == results["dtypes"].keys() and "| fp8 | 4 | 2 |" in md.read_text()


def test_curve_interpolates_between_measured_acceptance_lengths():
    loops = [{"k": 4, "measured_acceptance_length": 1.0, "speedup": 0.5},
             {"k": 4, "measured_acceptance_length": 3.0, "speedup": 1.5},
             {"k": 2, "measured_acceptance_length": 2.0, "speedup": 9.0}]
    assert curve_at(loops, 4, 2.0) == 1.0
    assert curve_at(loops, 4, 3.5) is None


def test_a_loop_whose_reference_is_wrong_records_it_and_goes_on_from_its_own_tokens():
    """What a verify step rounding a near-tie the other way looks like (the GPU, random weights):
    the loop notes the call, remakes its reference from its own tokens and still emits the
    target's ids."""
    from benchmarks.speculative.speculative_bench import draft_loop, one_token_calls, parse_args, start_executor

    args = parse_args(["--tiny", "--context", "40", "--output-len", "20", "--batches", "1", "--ks", "4",
                       "--loop-ks", "4"])
    executor, _ = start_executor(args, "bf16")
    try:
        prompt = list(range(3, 43))
        truth, _ = one_token_calls(executor, prompt, 20)
        bad = list(truth)
        bad[7] = (bad[7] + 5) % 512  # a "right" draft the target will not take
        row = draft_loop(executor, prompt, bad, 4, 2, 512)
        assert row["mismatches"] == [7] and not row["stopped_early"]
        assert row["output_ids"] == truth and row["tokens"] == 20
    finally:
        executor.shutdown()
