"""The persistent cache of load-time kernel choices (kernels/choice_cache.py).

CPU: a second lookup of a key hits and returns the stored value (tuples and int keys intact) without
timing; editing a covered source file or today's candidate list, or a stored value that is not among
today's candidates, re-times; "off" never reads or writes; an unwritable location prints one stderr
line and times as without a cache; ranks writing one family at once leave a whole file with every
entry. The real choose_skinny_weights / choose_fp8_skinny_variants code runs on CPU weights with only
the timing (a CUDA graph) replaced. GPU: a second load of the same engine hits every choice and makes
the same choices.
"""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from kernels import choice_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path / "choices"))
    monkeypatch.setattr(choice_cache, "_disabled_reason", [])
    return tmp_path / "choices"


class Timer:
    """A timing function that counts its calls and returns ``value``."""

    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


VALUE = {"variant": (64, 128, 4, 4, 2), "us": {1: 3.5, 8: float("inf")}, "best": [1, (2, 3)], "won": False}


def test_second_lookup_hits_and_returns_the_stored_value(cache, tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("A = 1\n")
    timer = Timer(VALUE)
    with choice_cache.counting() as counts:
        first = choice_cache.choice("skinny", ((4096, 4096), "torch.bfloat16"), "cpu", timer, sources=(str(source),))
        second = choice_cache.choice("skinny", ((4096, 4096), "torch.bfloat16"), "cpu", timer, sources=(str(source),))
        other = choice_cache.choice("skinny", ((1024, 4096), "torch.bfloat16"), "cpu", timer, sources=(str(source),))
    assert first == (VALUE, False) and second == (VALUE, True) and other == (VALUE, False)
    assert timer.calls == 2
    assert {k: v for k, v in counts.items() if k != "seconds"} == {"hits": 1, "lookups": 3,
                                                                   "families": {"skinny": [1, 3]}}
    assert set(counts["seconds"]) == {"skinny"}  # (the two misses' timings)
    stored = json.loads((cache / "skinny.json").read_text())
    assert len(stored) == 2 and not [p for p in os.listdir(cache) if p.endswith(".tmp")]


def test_misses_add_their_timing_seconds_and_hits_nothing(cache):
    """counting()'s "seconds": each family's wall time in its timing functions (what a cold load spends there), the
    load line's slowest families."""
    import time

    def slow():
        time.sleep(0.05)
        return VALUE

    with choice_cache.counting() as counts:
        for key in ("a", "b", "a"):  # two misses, one hit
            choice_cache.choice("wide", key, "cpu", slow)
        choice_cache.choice("skinny", "a", "cpu", Timer(VALUE))
    assert 0.1 <= counts["seconds"]["wide"] < 1.0 and counts["seconds"]["skinny"] < 0.05
    assert choice_cache.slowest_families(counts) == f"wide {counts['seconds']['wide']:.1f} s"
    assert choice_cache.slowest_families({"seconds": {"a": 0.01, "b": 2.5, "c": 7.25}}) == "c 7.2 s, b 2.5 s"


def test_a_family_file_is_parsed_once_until_another_process_replaces_it(cache, monkeypatch):
    """Lookups parse the family file once, not once each (it keeps every digest's entries); a write of
    another process (its own temp file renamed over this one) is read at the next lookup."""
    parses = []
    read = choice_cache._read
    monkeypatch.setattr(choice_cache, "_read", lambda path: parses.append(path) or read(path))
    for _ in range(3):
        assert choice_cache.choice("skinny", "a", "cpu", Timer(VALUE))[0] == VALUE
    assert len(parses) == 2  # the write's re-read (under its lock), then one parse of the new file for two lookups
    stored = json.loads((cache / "skinny.json").read_text())
    ((key, entry),) = stored.items()
    stored[key.replace("'a'", "'b'")] = entry  # as another rank's write: a new file renamed into place
    (cache / "next.tmp").write_text(json.dumps(stored))
    os.replace(cache / "next.tmp", cache / "skinny.json")
    assert choice_cache.choice("skinny", "b", "cpu", Timer(None)) == (VALUE, True)


def test_source_edit_candidates_and_invalid_values_re_time(cache, tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("A = 1\n")
    timer = Timer(VALUE)

    def lookup(candidates=((64, 128, 4, 4, 2),), valid=lambda v: True):
        return choice_cache.choice("wide", (4096, 1), "cpu", timer, sources=(str(source),), candidates=candidates,
                                   valid=valid)[1]

    assert not lookup() and lookup()
    source.write_text("A = 2\n")  # the kernel edited: its stored choices no longer apply
    assert not lookup() and lookup()
    assert not lookup(candidates=((64, 64, 4, 4),)) and lookup(candidates=((64, 64, 4, 4),))
    assert not lookup(valid=lambda v: False)  # not among today's candidates: ignored, timed again
    assert timer.calls == 4


@pytest.mark.parametrize("value", ["off", "OFF", "0"])
def test_off_never_reads_or_writes(tmp_path, monkeypatch, value):
    monkeypatch.setenv(choice_cache.CACHE_ENV, value)
    monkeypatch.chdir(tmp_path)
    timer = Timer(VALUE)
    assert [choice_cache.choice("pdl", (1,), "cpu", timer)[1] for _ in range(2)] == [False, False]
    assert timer.calls == 2 and choice_cache.cache_dir() is None and not os.listdir(tmp_path)


def test_unwritable_location_disables_with_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(choice_cache.CACHE_ENV, str(blocker / "choices"))  # under a file: cannot be made
    monkeypatch.setattr(choice_cache, "_disabled_reason", [])
    timer = Timer(VALUE)
    results = [choice_cache.choice("fp8_skinny", (i,), "cpu", timer) for i in range(3)]
    assert results == [(VALUE, False)] * 3 and timer.calls == 3
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "kernel choice cache disabled" in lines[0] and choice_cache.CACHE_ENV in lines[0]


def _write_keys(rank: int) -> None:
    for i in range(15):
        choice_cache.choice("wna16", (rank, i), "cpu", lambda: {"variant": {1: (rank, i)}})


def test_ranks_writing_at_once_keep_every_entry(cache):
    processes = [multiprocessing.get_context("fork").Process(target=_write_keys, args=(rank,)) for rank in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    assert [p.exitcode for p in processes] == [0] * 4
    stored = json.loads((cache / "wna16.json").read_text())
    assert len(stored) == 60
    assert choice_cache.choice("wna16", (3, 14), "cpu", Timer(None)) == ({"variant": {1: (3, 14)}}, True)


def test_choose_skinny_weights_reads_the_cache(cache, monkeypatch):
    """The real choose_skinny_weights on CPU weights, its CUDA-graph timing replaced: the second load
    takes the stored choice (marked on the weight, "cached" in its report) without timing."""
    import kernels.linear as linear

    timed = []

    def fake_time_shape(shape, dtype, device, rows, gated=False, activation=None):
        timed.append(shape)
        return {"cublas_us": {m: 10.0 for m in rows}, "best_variant": linear.SKINNY_VARIANTS[0],
                "best_us": {m: 5.0 for m in rows}, "variant": linear.SKINNY_VARIANTS[0]}

    monkeypatch.setattr(linear, "use_triton", lambda t: True)
    monkeypatch.setattr(linear, "_time_shape", fake_time_shape)
    weights = [torch.zeros(48, 32, dtype=torch.bfloat16), torch.zeros(32, 48, dtype=torch.bfloat16)]
    first = linear.choose_skinny_weights(weights)
    for w in weights:
        delattr(w, linear._SKINNY_ATTR)
    second = linear.choose_skinny_weights(weights)
    assert len(timed) == 2 and all(r.get("cached") for r in second.values())
    assert {s: r["variant"] for s, r in second.items()} == {s: r["variant"] for s, r in first.items()}
    assert all(getattr(w, linear._SKINNY_ATTR) == linear.SKINNY_VARIANTS[0] for w in weights)


def test_fp8_choice_not_among_todays_candidates_is_ignored(cache, monkeypatch):
    import kernels.fp8 as fp8

    picks = iter([(1, 2, 3, 4), fp8.FP8_SKINNY_DEFAULT])  # the first: no candidate of today's list
    monkeypatch.setattr(fp8, "_fastest_fp8_variant", lambda weight, gated, rows: next(picks))
    weight = torch.zeros(64, 128)
    assert fp8.choose_fp8_skinny_variants([weight]) == {(64, 128): (1, 2, 3, 4)}
    assert fp8.choose_fp8_skinny_variants([weight]) == {(64, 128): fp8.FP8_SKINNY_DEFAULT}  # re-timed
    assert fp8.choose_fp8_skinny_variants([weight]) == {(64, 128): fp8.FP8_SKINNY_DEFAULT}  # now stored
    assert weight._fp8_skinny_variant == fp8.FP8_SKINNY_DEFAULT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the load-time choices time on a CUDA device")
def test_second_load_hits_every_choice_and_chooses_the_same(tmp_path, cache):
    from engine.executor.runner import ModelRunner

    from tests.engine.test_cuda_graphs import config_only_engine

    (tmp_path / "engine").mkdir()
    engine = config_only_engine(tmp_path / "engine", "bfloat16", max_batch_size=8)
    loads = []
    for _ in range(2):
        runner = ModelRunner(engine, device="cuda")
        runner.allocate_kv_cache(64)
        runner.capture_cuda_graphs()
        chosen = {key: choice_cache.without_timings(report) for key, report in runner.gemm_choices.items()}
        loads.append((runner.choice_cache_counts, chosen, runner.launch_choice["pdl"]))
        runner.release_cuda_graphs()
        del runner
    (first, choices1, pdl1), (second, choices2, pdl2) = loads
    assert first["lookups"] > 0 and first["hits"] == 0
    assert second["hits"] == second["lookups"] == first["lookups"], second
    assert choices1 == choices2 and pdl1 == pdl2



def test_default_location_follows_tritonllm_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(choice_cache.CACHE_ENV, raising=False)
    monkeypatch.setattr(choice_cache, "_disabled_reason", [])
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    assert choice_cache.cache_dir() == str(tmp_path / "kernel_choices")
    monkeypatch.delenv("TRITONLLM_CACHE")
    assert choice_cache.cache_dir() == os.path.expanduser("~/.cache/tritonllm/kernel_choices")


def test_two_loads_at_once_count_their_own_lookups(cache):
    """counting() is per thread: two executors loading at once in one process (disaggregated serving) each
    report their own "(cached: h of n)", not each other's lookups too."""
    import threading

    barrier, seen = threading.Barrier(2), {}

    def load(name: str, keys: list[str]) -> None:
        with choice_cache.counting() as counts:
            barrier.wait()  # both blocks open before either looks anything up
            for key in keys:
                choice_cache.choice(name, key, "cpu", Timer(VALUE))
            barrier.wait()
        seen[name] = counts

    loads = [threading.Thread(target=load, args=("first", ["a", "a"])),
             threading.Thread(target=load, args=("second", ["b", "c", "d"]))]
    for thread in loads:
        thread.start()
    for thread in loads:
        thread.join()
    assert {k: v for k, v in seen["first"].items() if k != "seconds"} == {"hits": 1, "lookups": 2,
                                                                          "families": {"first": [1, 2]}}
    assert {k: v for k, v in seen["second"].items() if k != "seconds"} == {"hits": 0, "lookups": 3,
                                                                           "families": {"second": [0, 3]}}
    assert set(seen["first"]["seconds"]) == {"first"} and set(seen["second"]["seconds"]) == {"second"}
