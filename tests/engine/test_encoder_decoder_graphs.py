"""Decode steps of encoder-decoder engines over static buffers (engine/encoder_decoder/decode_graphs.py).

CPU: T5's batched decode attention with its relative bias equals the per-sequence reference; the
static-buffer step run eagerly (tables, slots, cross rows, rows left from a larger step) gives the
packed eager step's ids; bucket bookkeeping. GPU (marked): captured graphs give the eager ids,
and both transformers'."""
from __future__ import annotations

import pytest
import torch

from engine.encoder_decoder.decode_graphs import EncDecDecodeGraphs, fill_cross_rows
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from kernels.attention_metadata import AttentionMetadata
from kernels.relative_position_bias import decode_attention_bias, paged_attention_bias_ref
from tests.executor.executor_testing import collect, final_tokens
from tiny_encdec import INPUTS, build_engine, generate, write_checkpoint


def test_decode_attention_bias_equals_reference():
    """Rows of contexts 1..37 over shuffled blocks, tables wider than needed (stale columns)."""
    torch.manual_seed(0)
    heads, dim, page, blocks = 4, 8, 4, 48
    k_cache, v_cache = torch.randn(2, blocks, page, heads, dim).unbind(0)
    contexts = [1, 5, 16, 37]
    width = 12  # wider than any row needs
    tables = torch.randperm(blocks)[:len(contexts) * width].view(len(contexts), width).int()
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=tables,
                             cu_seqlens_q=torch.arange(len(contexts) + 1, dtype=torch.int32),
                             context_lens=torch.tensor(contexts, dtype=torch.int32), max_seqlen_q=1,
                             max_context_len=max(contexts), is_decode_only=True)
    q, table = torch.randn(len(contexts), heads, dim), torch.randn(32, heads)
    got = decode_attention_bias(q, k_cache, v_cache, meta, 0.7, table, 20)
    expected = paged_attention_bias_ref(q, k_cache, v_cache, meta, 0.7, table, 20)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fill_cross_rows_pads_the_bucket():
    tables, lengths = torch.full((4, 3), 9, dtype=torch.int32).numpy(), torch.zeros(4, dtype=torch.int32).numpy()
    fill_cross_rows(tables, lengths, [[5, 6], [7]], [8, 3], bucket=4)
    assert lengths.tolist() == [8, 3, 1, 1]
    assert tables[:, 0].tolist() == [5, 7, 0, 0] and tables[0, 1] == 6


@pytest.fixture(scope="module", params=["t5_v1_1", "bart"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, root / "checkpoint")
    build_engine(root, "--max_seq_len", "48", "--max_encoder_input_len", "16")
    return model, str(root / "engine" / "decoder")


def _requests():
    out = OutputConfig(exclude_input_from_output=True)
    # three encoder inputs of 8, 4 and 15 tokens, one with a 3-token decoder prompt: 4 rows, then fewer
    return [Request([], 12, end_id=1, encoder_input_ids=ids, output=out) for ids in INPUTS] + \
        [Request([0, 30, 31], 5, encoder_input_ids=INPUTS[1], output=out)]


def test_static_buffer_steps_equal_packed_steps(engine):
    """The same requests through the packed eager step, then through EncDecDecodeGraphs' buffers
    run eagerly (CPU has no capture): equal ids, and the buffers served every decode step."""
    model, decoder = engine
    with Executor(decoder, ExecutorConfig(max_batch_size=4)) as ex:
        expected = collect(ex, ex.enqueue_requests(_requests()))
        runner = ex.runner
        graphs = EncDecDecodeGraphs(runner.model, runner.kv_cache, runner.cross_pool,
                                    tokens_per_block=runner.tokens_per_block, max_seq_len=48, max_encoder_len=16,
                                    max_batch_size=4, sampled_tokens=runner.sampled_tokens)
        assert graphs.buckets == [1, 2, 4] and graphs.max_cross_blocks == 4 and graphs.bucket_for(3) == 4
        served = []
        run = graphs.run
        graphs.run = lambda *args: served.append(len(args[0])) or run(*args)
        runner.decode_graphs = graphs
        got = collect(ex, ex.enqueue_requests(_requests()))
    assert [final_tokens(r) for r in got.values()] == [final_tokens(r) for r in expected.values()]
    assert max(served) == 4 and min(served) < 4  # rows of later, smaller steps left stale rows behind
    assert final_tokens(got[next(iter(got))]) == [t for t in generate(model, INPUTS[0], 12)[0][1:] if t != 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_ids_equal_eager_and_transformers(engine, monkeypatch):
    """float32 engines on the GPU: decode steps replayed from graphs give the eager steps' ids
    (TRITONLLM_ENCDEC_GRAPHS=0) and transformers' greedy ids."""
    model, decoder = engine
    results = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("TRITONLLM_ENCDEC_GRAPHS", graphs)
        with Executor(decoder, ExecutorConfig(max_batch_size=4), device="cuda") as ex:
            assert (ex.runner.decode_graphs is not None) == (graphs == "1")
            if graphs == "1":
                assert sorted(ex.runner.decode_graphs.graphs) == [1, 2, 4]
            responses = collect(ex, ex.enqueue_requests(_requests()))
            results[graphs] = [final_tokens(r) for r in responses.values()]
    assert results["1"] == results["0"]
    for ids, tokens in zip(INPUTS, results["1"]):
        assert tokens == [t for t in generate(model, ids, 12)[0][1:] if t != 1]


def _counting_cross_kernel(monkeypatch) -> list[int]:
    """engine/encoder_decoder/cross_attention.py's decode kernel entry, wrapped: the rows of each call."""
    from engine.encoder_decoder import cross_attention

    calls, kernel = [], cross_attention.cross_attention_decode
    monkeypatch.setattr(cross_attention, "cross_attention_decode",
                        lambda q, *args: calls.append(q.shape[0]) or kernel(q, *args))
    return calls


def test_decode_steps_take_the_cross_decode_kernel_unless_switched_off(engine, monkeypatch):
    """Decode-only steps' cross-attention goes through kernels/cross_attention_decode.py (on CPU its
    reference), the prompt steps (a 3-token decoder prompt) and $TRITONLLM_ENCDEC_CROSS_KERNEL=0's steps
    through the paged kernel; the ids do not change."""
    from engine.encoder_decoder.cross_attention import CROSS_KERNEL_ENV

    model, decoder = engine
    results, calls = {}, _counting_cross_kernel(monkeypatch)
    for switch in ("1", "0"):
        monkeypatch.setenv(CROSS_KERNEL_ENV, switch)
        calls.clear()
        with Executor(decoder, ExecutorConfig(max_batch_size=4)) as ex:
            results[switch] = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests())).values()]
        layers = len(ex.runner.model.layers)
        assert (len(calls) > 0) == (switch == "1") and len(calls) % layers == 0, (switch, len(calls))
    assert results["1"] == results["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_with_the_cross_decode_kernel_equal_the_paged_kernel(engine, monkeypatch):
    """float32 engines on the GPU, decode graphs captured with the cross decode kernel (its Triton launch,
    captured in each bucket) and with $TRITONLLM_ENCDEC_CROSS_KERNEL=0: the same ids, transformers'."""
    from engine.encoder_decoder.cross_attention import CROSS_KERNEL_ENV

    model, decoder = engine
    results, calls = {}, _counting_cross_kernel(monkeypatch)
    for switch in ("1", "0"):
        monkeypatch.setenv(CROSS_KERNEL_ENV, switch)
        calls.clear()
        with Executor(decoder, ExecutorConfig(max_batch_size=4), device="cuda") as ex:
            assert sorted(ex.runner.decode_graphs.graphs) == [1, 2, 4]
            results[switch] = [final_tokens(r) for r in collect(ex, ex.enqueue_requests(_requests())).values()]
        assert (4 in calls) == (switch == "1"), switch  # the bucket of 4 rows captured through it
    assert results["1"] == results["0"]
    for ids, tokens in zip(INPUTS, results["1"]):
        assert tokens == [t for t in generate(model, ids, 12)[0][1:] if t != 1]
