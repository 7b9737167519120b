"""Load-time choice of a model's optional decode-step fusions, by timing the step itself.

Some fusions remove launches but make the kernel that takes the work in longer or serial (DeepSeek's
MLA decode layer in one launch, kernels/mla_decode_fused.py, where three launches spread the keys
over many programs): whether the step gains is the GPU's to say, and a kernel timed alone misses the
launch and dependency latency the fusion removes. So a model that offers fusions
(``decode_fusion_candidates(max_seq_len)``: {name: [None (off), setting, ...]},
``set_decode_fusion(name, setting)``, optionally ``decode_fusion_context``: the keys a timed step's
sequence holds, default 1) gets, for each, a batch-1 decode graph captured at every setting and
replayed in turns (as the PDL choice, engine/executor/cuda_graphs.py); a setting other than off is
kept when it is at least 1% faster than off. Runs
before the engine's graphs are captured (they keep the setting they were captured with), after the
PDL choice (timed in the launch mode the graphs will have), through kernels/choice_cache.py (family
"decode_fusion"; the key covers the model's parameters, the pool and every kernel source).
$TRITONLLM_DECODE_FUSIONS=0 leaves every fusion off.
"""
from __future__ import annotations

import glob
import hashlib
import os

import torch

import kernels
from engine.executor.cuda_graphs import DecodeGraphs
from kernels import choice_cache
from kernels.linear import replay_time_ms

DECODE_FUSIONS_ENV = "TRITONLLM_DECODE_FUSIONS"  # "0": every fusion off


def choose_decode_fusions(model: torch.nn.Module, kv_cache: torch.Tensor, *, tokens_per_block: int, max_seq_len: int,
                          sampled_tokens: torch.Tensor, rounds: int = 3) -> dict:
    """{fusion: report} for each fusion ``model`` offers (module docstring): the setting kept
    ("setting"; None: off) and each setting's step time ("step_ms", in candidate order), which the
    model is left set to. Empty off CUDA, for models without fusions, or with the variable at 0."""
    offered = getattr(model, "decode_fusion_candidates", lambda max_seq_len: {})(max_seq_len)
    if not offered or kv_cache.device.type != "cuda" or os.environ.get(DECODE_FUSIONS_ENV, "1") == "0":
        return {}
    shapes = hashlib.sha256(repr([type(model).__name__] + [(name, tuple(p.shape), str(p.dtype))
                                                           for name, p in model.named_parameters()]).encode())
    sources = tuple(glob.glob(os.path.join(os.path.dirname(kernels.__file__), "*.py"))) + (__file__,)
    reports = {}
    for name, settings in offered.items():
        def timed(name=name, settings=settings):
            return _time_settings(model, name, settings, kv_cache, tokens_per_block=tokens_per_block,
                                  max_seq_len=max_seq_len, sampled_tokens=sampled_tokens, rounds=rounds)

        reports[name] = choice_cache.timed_report(
            "decode_fusion", (name, shapes.hexdigest()[:32], tuple(kv_cache.shape), str(kv_cache.dtype),
                              tokens_per_block, max_seq_len, rounds, getattr(model, "decode_fusion_context", 1)),
            kv_cache.device, timed,
            sources=sources, candidates=repr(settings),
            valid=lambda r, settings=settings: _setting(r.get("setting")) in settings)
        model.set_decode_fusion(name, _setting(reports[name]["setting"]))
    return reports


def _setting(value):
    """A setting as the model's candidates hold it (the cache stores tuples as lists)."""
    return tuple(value) if isinstance(value, list) else value


def _time_settings(model, name: str, settings: list, kv_cache: torch.Tensor, *, tokens_per_block: int,
                   max_seq_len: int, sampled_tokens: torch.Tensor, rounds: int) -> dict:
    graphs, failed = [], {}
    context_len = max(1, min(max_seq_len, getattr(model, "decode_fusion_context", 1)))
    blocks = list(range(-(-context_len // tokens_per_block)))  # (the pool's first blocks; their rows unread after)
    for setting in settings:
        model.set_decode_fusion(name, setting)
        try:
            graph = DecodeGraphs(model, kv_cache, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                                 max_batch_size=1, buckets=[1], sampled_tokens=sampled_tokens)
            graph.capture()
            graph.run([0], [context_len - 1], [context_len], [blocks])
        except Exception as error:  # a fused setting this GPU or driver cannot compile or capture: not a candidate
            if setting is None:  # (Triton's OutOfResources / CompilationError are no RuntimeErrors)
                raise
            failed[repr(setting)] = str(error).splitlines()[0][:200]
            graph = None
        graphs.append(graph)
    times = [[] for _ in settings]
    for _ in range(rounds):
        for index, graph in enumerate(graphs):
            if graph is not None:
                times[index].append(replay_time_ms(graph.graphs[1], replays=10))
    best = [min(values) if values else float("inf") for values in times]
    fastest = min(range(1, len(settings)), key=best.__getitem__, default=0)
    chosen = settings[fastest] if fastest and best[fastest] < 0.99 * best[0] else None
    model.set_decode_fusion(name, chosen)
    del graphs
    report = {"setting": chosen, "settings": list(settings), "step_ms": best}
    return {**report, "failed": failed} if failed else report
