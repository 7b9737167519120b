"""Whisper's fused decode layer (engine/encoder_decoder/fused_decode.py): the fewer-launch decoder
layer gives the unfused layer's ids and transformers'.

CPU: the same requests through the executor unfused, then with the decoder prepared (q/k/v one
weight, LayerNorm/bias/GELU/residual folded into the products: kernels/norm_linear.py's torch
reference here), equal ids, and the fused layer served the decode steps. GPU (marked): a float32
engine's CUDA graphs, fused (also with L2 prefetches) against
TRITONLLM_ENCDEC_FUSED=0 (also with L2 prefetches) and transformers. CPU also: the L2 prefetch schedule of
both paths (engine/encoder_decoder/l2_prefetch_plan.py), recorded."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.encoder_decoder import fused_decode
from engine.encoder_decoder.cross_attention import CROSS_KERNEL_ENV
from engine.encoder_decoder.l2_prefetch_plan import PREFETCH_ENV, PREFETCH_KV_ENV
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from tests.executor.executor_testing import collect, final_tokens
from tiny_encdec import WHISPER_PROMPT, build_engine, generate_whisper, write_checkpoint


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper_fused")
    model = write_checkpoint("whisper", root / "checkpoint")
    build_engine(root)
    return model, str(root / "engine" / "decoder")


def _requests(features):
    out = OutputConfig(exclude_input_from_output=True)
    return [Request(WHISPER_PROMPT, 8, end_id=1, encoder_input_features=f, output=out) for f in features]


def _features():
    torch.manual_seed(3)
    return [torch.randn(100, 8), torch.randn(100, 8), torch.randn(60, 8)]


def test_fused_layer_ids_equal_unfused_and_transformers(whisper, monkeypatch):
    model, engine = whisper
    features = _features()
    with Executor(engine, ExecutorConfig(max_batch_size=4), device="cpu") as ex:
        # The L2 prefetch schedule (a no-op off Hopper GPUs, so recorded here) of the unfused decode steps, then of
        # the fused ones: 2 sub-layers ahead, and the cross pages
        schedule, events = _record_prefetch_schedule(ex.runner, monkeypatch)
        expected = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests(features))).values()]
        assert events and events == schedule * (len(events) // len(schedule))
        events.clear()
        decoder = ex.runner.model
        assert fused_decode.fusable(ex.runner.spec)
        fused_weights = fused_decode.prepare(decoder)
        attn = decoder.layers[0].self_attn
        assert fused_weights[0] is attn.qkv_weight and attn.k.weight.data_ptr() == attn.qkv_weight[
            attn.q.weight.shape[0]:].data_ptr()  # q/k/v are views of the fused weight
        assert attn.k.bias is None and not attn.qkv_bias[attn.q.weight.shape[0]:2 * attn.q.weight.shape[0]].any()
        steps = []
        step = fused_decode.layer_step
        monkeypatch.setattr(fused_decode, "layer_step", lambda layer, x, *a: steps.append(x.shape[0]) or step(layer, x, *a))
        got = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests(features))).values()]
    assert got == expected and steps
    assert len(events) == len(steps) // len(decoder.layers) * len(schedule)
    assert events == schedule * (len(events) // len(schedule))
    for f, tokens in zip(features[:2], got):
        assert tokens == [t for t in generate_whisper(model, f, 8) if t != 1]


def _record_prefetch_schedule(runner, monkeypatch):
    """A PrefetchPlan 2 sub-layers ahead, with the cross pages, on ``runner``'s decoder, its prefetcher recording what
    it is asked (each region table's first address; the pages by the K pool's address) beside the products the step
    runs (their weights' addresses: fused_decode's norm_linear, model.py's product and linear_activated). Returns
    (one decode step's expected events, the event list): at the step's start the first 2 sub-layers' weights;
    before sub-layer g (layer g // 3) the weights of sub-layer g + 2, and before each layer's self-attention that
    layer's cross pages; the sub-layer's two products; the join at the end."""
    from engine.encoder_decoder import model as model_module
    from engine.encoder_decoder.l2_prefetch_plan import KV_PREFETCH_SUBLAYER, PrefetchPlan, sublayer_tensors

    decoder, events = runner.model, []

    class Recorder:
        def issue(self, table):
            if table is not None:
                events.append(("prefetch", int(table[0, 0])))

        def issue_pages(self, k_pool, v_pool, tables, lengths):
            events.append(("pages", k_pool.data_ptr()))

        def join(self):
            events.append(("join", None))

    plan = PrefetchPlan(decoder, 2, kv=True)
    plan.prefetcher = Recorder()
    in_step = []  # (products are recorded from a decode step's start to its join: not the prompt steps')
    start, join = plan.start, plan.join
    plan.start, plan.join = (lambda: in_step.append(True) or start()), (lambda: join() or in_step.clear())
    monkeypatch.setattr(decoder, "l2_plan", plan, raising=False)
    for module, name in ((fused_decode, "norm_linear"), (model_module, "product"), (model_module, "linear_activated")):
        def recorded(x, weight, *args, product=getattr(module, name), **kwargs):
            if in_step:
                events.append(("product", weight.data_ptr()))
            return product(x, weight, *args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    groups = [tensors for layer in decoder.layers for tensors in sublayer_tensors(layer)]
    first = [tensors[0].data_ptr() for tensors in groups]
    schedule = [("prefetch", first[0]), ("prefetch", first[1])]
    for g, tensors in enumerate(groups):
        layer, sublayer = divmod(g, 3)
        schedule += [("prefetch", first[g + 2])] if g + 2 < len(groups) else []
        if sublayer == KV_PREFETCH_SUBLAYER:
            schedule.append(("pages", runner.cross_pool[layer, 0].data_ptr()))
        weights = [t for t in tensors if t.dim() == 2]  # (its products: [q | k | v] and o; q and o; up and down)
        schedule += [("product", w.data_ptr()) for w in weights]
    return schedule + [("join", None)], events


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_graphs_equal_unfused_on_gpu(whisper, monkeypatch):
    """Graph buckets 1, 2, 4 captured through the fused layer (the Triton kernels; float32 engines
    get IEEE dots) give the unfused graphs' ids and transformers'. (bfloat16: the kernels against
    their references, tests/kernels; ids of a tiny random model may part at near-ties.)"""
    model, engine = whisper
    features = _features()
    results = {}
    hopper = torch.cuda.get_device_capability()[0] >= 9
    # the fused layer with the cross decode kernel; again with L2 prefetches 2 sub-layers ahead (and the cross pages)
    # unfused without either, and with the prefetches
    for name, fused, prefetch in (("fused", "1", "0"), ("prefetch", "1", "2"), ("unfused", "0", "0"),
                                  ("unfused-prefetch", "0", "1")):
        monkeypatch.setenv(fused_decode.FUSED_ENV, fused)
        monkeypatch.setenv(CROSS_KERNEL_ENV, fused)
        monkeypatch.setenv(PREFETCH_ENV, prefetch)
        monkeypatch.setenv(PREFETCH_KV_ENV, "1" if prefetch != "0" else "0")
        with Executor(engine, ExecutorConfig(max_batch_size=4), device="cuda") as ex:
            assert getattr(ex.runner.model, "fused_decode", False) == (fused == "1")
            assert (getattr(ex.runner.model, "l2_plan", None) is not None) == (prefetch != "0" and hopper)
            assert sorted(ex.runner.decode_graphs.graphs) == [1, 2, 4]
            results[name] = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests(features))).values()]
    assert results["fused"] == results["unfused"] == results["prefetch"] == results["unfused-prefetch"]
    for f, tokens in zip(features[:2], results["fused"]):
        assert tokens == [t for t in generate_whisper(model, f, 8) if t != 1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="Triton's CPU interpreter (TRITON_INTERPRET=1) runs the fused products here")
def test_fused_products_with_row_stats_in_the_interpreter(whisper, monkeypatch):
    """The fused layer's products through kernels/norm_linear.py's kernel (Triton's interpreter on
    CPU tensors; attention stays the torch reference): each LayerNorm after the first reads the
    statistics its residual product emitted, and the ids equal the unfused layer's."""
    from kernels.norm_linear import norm_linear_triton

    model, engine = whisper
    features = _features()[:2]
    read = []

    def through_kernel(x, weight, bias, *, variant=None, row_stats=None, **options):
        read.append(row_stats is not None)
        return norm_linear_triton(x, weight, bias, variant="preload", row_stats=row_stats, **options)

    with Executor(engine, ExecutorConfig(max_batch_size=4), device="cpu") as ex:
        expected = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests(features))).values()]
        fused_decode.prepare(ex.runner.model)
        monkeypatch.setattr(fused_decode, "norm_linear", through_kernel)
        got = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests(features))).values()]
    assert got == expected
    # per layer: qkv (the previous layer's fc2 statistics; the first layer's norm reads its rows), o,
    # cross q (the o product's), cross o, fc1 (the cross o product's), fc2
    layers = len(ex.runner.model.layers)
    step = [False, False, True, False, True, False] + [True, False, True, False, True, False] * (layers - 1)
    assert read and read == step * (len(read) // len(step))
