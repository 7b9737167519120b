"""engine/executor/decode_fusions.py: a model's optional decode fusions chosen at load by timing a
batch-1 decode graph at each setting (graphs and timer faked here: the GPU run is engine_bench's
``fusion_choice``). DeepSeek's offer: tests/engine/test_deepseek.py."""
from __future__ import annotations

import pytest
import torch

import engine.executor.decode_fusions as fusions


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.settings: list = []

    def decode_fusion_candidates(self, max_seq_len):
        return {"mla_decode": [None, (4, 32, 8), (8, 16, 4)]}

    def set_decode_fusion(self, name, setting):
        self.settings.append(setting)


@pytest.mark.parametrize("times,expected", [((2.0, 1.9, 1.95), (4, 32, 8)),
                                            ((2.0, 1.999, 1.995), None),  # within 1% of off: off
                                            ((2.0, 2.1, 1.5), (8, 16, 4))])
def test_fastest_setting_kept_when_one_percent_faster(monkeypatch, times, expected):
    captured = []

    class FakeGraphs:
        def __init__(self, model, *args, **kwargs):
            self.graphs = {1: len(captured)}  # the replay timer reads which capture this is
            captured.append(model.settings[-1])

        def capture(self):
            pass

        def run(self, *args):
            pass

    monkeypatch.setattr(fusions, "DecodeGraphs", FakeGraphs)
    monkeypatch.setattr(fusions, "replay_time_ms", lambda graph, replays: times[graph])
    model = _Model()
    report = fusions._time_settings(model, "mla_decode", model.decode_fusion_candidates(64)["mla_decode"],
                                    torch.zeros(1), tokens_per_block=4, max_seq_len=64, sampled_tokens=None, rounds=2)
    assert captured == model.decode_fusion_candidates(64)["mla_decode"]
    assert report["setting"] == expected and model.settings[-1] == expected and report["step_ms"] == list(times)


def test_a_setting_that_does_not_compile_is_skipped_not_fatal(monkeypatch):
    """Triton's OutOfResources (too much shared memory on another GPU) is an Exception, not a RuntimeError."""
    class OutOfResources(Exception):
        pass

    class FakeGraphs:
        def __init__(self, model, *args, **kwargs):
            self.setting, self.graphs = model.settings[-1], {1: 0 if model.settings[-1] is None else 1}

        def capture(self):
            if self.setting == (4, 32, 8):
                raise OutOfResources("out of resource: shared memory")

        def run(self, *args):
            pass

    monkeypatch.setattr(fusions, "DecodeGraphs", FakeGraphs)
    monkeypatch.setattr(fusions, "replay_time_ms", lambda graph, replays: (2.0, 1.5)[graph])
    model = _Model()
    report = fusions._time_settings(model, "mla_decode", model.decode_fusion_candidates(64)["mla_decode"],
                                    torch.zeros(1), tokens_per_block=4, max_seq_len=64, sampled_tokens=None, rounds=1)
    assert report["setting"] == (8, 16, 4) and "shared memory" in report["failed"]["(4, 32, 8)"]


def test_off_the_gpu_or_turned_off_nothing_is_timed(monkeypatch):
    model = _Model()
    assert fusions.choose_decode_fusions(model, torch.zeros(1), tokens_per_block=4, max_seq_len=64,
                                         sampled_tokens=None) == {}
    monkeypatch.setenv(fusions.DECODE_FUSIONS_ENV, "0")
    assert fusions.choose_decode_fusions(model, torch.zeros(1, device="meta"), tokens_per_block=4, max_seq_len=64,
                                         sampled_tokens=None) == {}
    assert model.settings == []
