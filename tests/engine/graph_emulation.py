"""CUDA graphs emulated on the CPU, for tests of the code around them (what a step fills into the
graphs' static inputs, which graph a step picks, padding rows, layer taps read after a replay).

``emulate_cuda_graphs(monkeypatch)`` makes engine/executor/cuda_graphs.py ``capture_forward`` run the
forward once into its outputs (the "capture") and return a graph whose ``replay`` reruns the forward
over the same static inputs and copies the result, and the tapped layers' streams, into those outputs;
pinned memory and CUDA events become no-ops; ``ModelRunner.capture_cuda_graphs`` builds the decode and
prefill graphs on the CPU as it would on CUDA (without the kernel choices), the decode graphs' head graphs
(LM head and greedy pick, replayed as "head") included. Replays are counted by the
forward's class and kind. What this does not check: the kernels' behaviour under a real capture (the
gpu-marked tests do).
"""
from __future__ import annotations

import collections

import torch

import engine.executor.cuda_graphs as cuda_graphs
import engine.executor.prefill_graphs as prefill_graphs
from engine.executor.overlap import resolve_placeholders
from engine.executor.runner import ModelRunner
from kernels.triton_attention import prefill_tokens_per_tile


class _Event:
    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Graph:
    """A "captured" forward: replay reruns it and copies into the static outputs (hidden, taps)."""

    def __init__(self, forward, hidden: torch.Tensor, taps, name: str, replays: collections.Counter):
        self.forward, self.hidden, self.taps, self.name, self.replays = forward, hidden, taps, name, replays
        self.captured = dict(taps._rows) if taps is not None else {}

    def replay(self) -> None:
        self.replays[self.name] += 1
        with torch.inference_mode():
            self.hidden.copy_(self.forward())
            for j, stream in self.captured.items():
                stream.copy_(self.taps._rows[j])


def emulate_cuda_graphs(monkeypatch) -> collections.Counter:
    """Patch the graph machinery for this test (monkeypatch undoes it); returns the replay counter,
    keyed "<forward class>-decode" / "<forward class>-prefill"."""
    replays: collections.Counter = collections.Counter()
    taps_of = {}  # the module whose forward a capture runs -> the runner's LayerTaps

    def capture_forward(model, args, sampled_tokens, pool):
        def forward():
            return model(resolve_placeholders(args[0], sampled_tokens), *args[1:])

        with torch.inference_mode():
            hidden = forward()
        kind = "decode" if args[3].is_decode_only else "prefill"
        return _Graph(forward, hidden, taps_of.get(id(model)), f"{type(model).__name__}-{kind}", replays), hidden

    def capture_head(head, hidden, pool):
        from kernels.sampling import greedy_tokens

        with torch.inference_mode():
            logits = head(hidden)
            greedy = greedy_tokens(logits)

        def forward_head():  # the head graph's two outputs rerun over the static hidden rows
            fresh = head(hidden)
            greedy.copy_(greedy_tokens(fresh))
            return fresh

        return _Graph(forward_head, logits, None, "head", replays), logits, greedy

    def capture_cuda_graphs(runner: ModelRunner) -> None:
        build, cfg = runner.build_config, runner.model_config
        taps_of[id(runner.model)] = runner.layer_taps
        runner.decode_graphs = cuda_graphs.DecodeGraphs(
            runner.graph_model, runner.kv_cache, tokens_per_block=runner.tokens_per_block, max_seq_len=build.max_seq_len,
            max_batch_size=build.max_batch_size, sampled_tokens=runner.sampled_tokens, taps=runner.layer_taps,
            head=runner.graph_head)
        runner.decode_graphs.capture()
        buckets = prefill_graphs.model_token_buckets(runner.model, build.max_num_tokens)
        if runner.prefill_graphs_enabled() and buckets:
            runner.prefill_graphs = prefill_graphs.PrefillGraphs(
                runner.graph_model, runner.kv_cache, tokens_per_block=runner.tokens_per_block,
                max_seq_len=build.max_seq_len, max_batch_size=build.max_batch_size,
                max_num_tokens=build.max_num_tokens, sampled_tokens=runner.sampled_tokens, buckets=buckets,
                taps=runner.layer_taps, tree_width=runner.tree_graph_width,
                tokens_per_tile=prefill_tokens_per_tile(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                                        runner.kv_cache.element_size(), runner.kv_cache.device))
            runner.prefill_graphs.capture()

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(cuda_graphs, "capture_forward", capture_forward)
    monkeypatch.setattr(cuda_graphs, "capture_head", capture_head)
    monkeypatch.setattr(prefill_graphs, "capture_forward", capture_forward)
    monkeypatch.setattr(ModelRunner, "capture_cuda_graphs", capture_cuda_graphs)
    return replays
