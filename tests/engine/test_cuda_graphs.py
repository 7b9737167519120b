"""Decode and mixed-step CUDA graphs, and config-only (random-weight) engines.

CPU: a config-only engine directory loads with random weights and runs; capture_cuda_graphs and
warmup are no-ops there. GPU: after capture, decode steps replayed from the graphs give the
logits of the same steps run eagerly, for batch sizes that fill a bucket exactly and ones that
leave padding rows, with contexts that cross KV block boundaries mid-run; and the capture and
warm-up leave the cached K/V of earlier steps intact. The graph and the eager run may split the
attention over the keys differently (the graph is captured for max_seq_len), so they agree to
bf16 rounding, not bit for bit: relative error under 2e-2 and the same greedy token on >= 95%
of rows (random weights give near-ties). Steps with prompt tokens (prefill chunks, alone or with
decode rows) replayed from their token bucket's graph give the logits of the eager run.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.config import BuildConfig, EngineConfig, ModelConfig
from engine.executor.runner import ForwardBatch, ModelRunner

TINY = dict(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8,
            num_kv_heads=2, head_dim=32, intermediate_size=512, max_position_embeddings=512)


# The configurable decoder's LayerNorm forms (engine/models/decoder.py), in TINY's shape: BLOOM (ALiBi, biases,
# embedding norm, sequential residual) and Falcon-7B (multi-query, rotary, one norm for parallel attention and MLP).
_LAYERNORM = dict(norm_kind="layernorm", norm_bias=True, mlp_gated=False)
TINY_DECODERS = {
    "bloom": dict(TINY, architecture="BloomForCausalLM", num_kv_heads=8, positions="alibi", alibi_slopes="bloom",
                  hidden_act="gelu_pytorch_tanh", qkv_bias=True, attention_out_bias=True, mlp_bias=True,
                  embedding_norm=True, tie_word_embeddings=True, **_LAYERNORM),
    "falcon": dict(TINY, architecture="FalconForCausalLM", num_kv_heads=1, hidden_act="gelu", residual="parallel",
                   tie_word_embeddings=True, **_LAYERNORM),
}


def config_only_engine(tmp_path, dtype: str, max_batch_size: int = 24, quantization: str | None = None,
                       model: dict = TINY, max_num_tokens: int = 1024) -> str:
    build = BuildConfig(dtype=dtype, max_batch_size=max_batch_size, max_input_len=128, max_seq_len=256,
                        max_num_tokens=max_num_tokens, tokens_per_block=16, quantization=quantization)
    EngineConfig(model=ModelConfig(**model), build=build, extra={"random_weights_seed": 3}).validate().save(str(tmp_path))
    return str(tmp_path)


def test_config_only_engine_runs_with_random_weights_on_cpu(tmp_path):
    runner = ModelRunner(config_only_engine(tmp_path, "float32"), device="cpu")
    runner.allocate_kv_cache(8)
    runner.capture_cuda_graphs()  # CPU: no-op
    runner.warmup()
    assert runner.decode_graphs is None
    norms = [p for n, p in runner.model.named_parameters() if "norm" in n]
    assert norms and all(torch.all(p == 1) for p in norms)
    logits = runner.forward(ForwardBatch([1, 2, 3], [0, 1, 2], [3], [3], [[1]], [2]))
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all() and logits.std() > 0


def prefill_then_decode_batches(num_seqs: int, prompt_lens: list[int], steps: int, page: int):
    """Block tables (shuffled blocks), a prefill batch, and a generator of decode batches."""
    rng = random.Random(num_seqs)
    blocks = list(range(1, 400))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-(n + steps) // page))] for n in prompt_lens]
    tokens = [[rng.randrange(1000) for _ in range(n)] for n in prompt_lens]
    prefill = ForwardBatch(
        [t for seq in tokens for t in seq], [p for n in prompt_lens for p in range(n)], list(prompt_lens),
        list(prompt_lens), [t[: -(-n // page)] for t, n in zip(tables, prompt_lens)],
        [end - 1 for end in itertools.accumulate(prompt_lens)],
    )

    def decode(step: int) -> ForwardBatch:
        positions = [n + step for n in prompt_lens]
        return ForwardBatch([rng.randrange(1000) for _ in prompt_lens], positions, [1] * num_seqs,
                            [p + 1 for p in positions], [t[: p // page + 1] for t, p in zip(tables, positions)],
                            list(range(num_seqs)))

    return prefill, decode


def captured_runner(tmp_path, dtype: str, device: str, num_seqs: int, steps: int, **engine_limits):
    """(runner, decode): a ModelRunner over config_only_engine(tmp_path, dtype, **engine_limits) with a 400-block
    pool, num_seqs prompts of odd lengths (some cross a block soon) prefilled eagerly BEFORE its CUDA graphs are
    captured (their K/V must survive capture and warm-up), and prefill_then_decode_batches' decode batches."""
    runner = ModelRunner(config_only_engine(tmp_path, dtype, **engine_limits), device=device)
    runner.allocate_kv_cache(400)
    prompt_lens = [13 + 7 * i % 29 for i in range(num_seqs)]
    prefill, decode = prefill_then_decode_batches(num_seqs, prompt_lens, steps=steps, page=16)
    runner.forward(prefill)
    runner.capture_cuda_graphs()
    return runner, decode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("num_seqs", [1, 3, 8, 9, 24])
def test_graph_decode_matches_eager_decode(tmp_path, num_seqs):
    runner, decode = captured_runner(tmp_path, "bfloat16", "cuda", num_seqs, steps=6)
    runner.warmup()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.bucket_for(num_seqs) >= num_seqs
    for step in range(6):
        batch = decode(step)
        graphed = runner.forward(batch)
        runner.decode_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.decode_graphs = graphs
        err = ((graphed - eager).norm() / eager.norm()).item()
        assert err < 2e-2, f"step {step}: relative error {err:.2e}"
        same = (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item()
        assert same >= 0.95, f"step {step}: only {same:.0%} of greedy tokens agree"


@pytest.mark.parametrize("repeat", [1, 15])  # 3 rows: the Python loop; 45 rows: the numpy path
def test_fill_decode_inputs_packs_ragged_tables_slots_and_padding(repeat):
    """The graphs' host-side packing (no GPU needed, so it runs in CI): slots, tables, padding rows."""
    import numpy as np

    from engine.executor.cuda_graphs import fill_decode_inputs

    page, bs = 16, 3 * repeat
    bucket = bs + 5
    i64 = np.full((3, bucket), 99, dtype=np.int64)
    ctx = np.full(bucket, 99, dtype=np.int32)
    tables = np.full((bucket, 6), 77, dtype=np.int32)
    block_tables = [[5], [9, 3], [4, 8, 2, 7]] * repeat
    positions = [0, 16, 63] * repeat  # first slot of a block, first of the second block, last of the fourth
    fill_decode_inputs(i64, ctx, tables, [11, 12, 13] * repeat, positions, [1, 17, 64] * repeat, block_tables,
                       page, bucket)
    assert i64[0, :bs].tolist() == [11, 12, 13] * repeat and i64[1, :bs].tolist() == positions
    assert i64[2].tolist() == [5 * 16 + 0, 3 * 16 + 0, 7 * 16 + 15] * repeat + [-1] * 5
    assert ctx.tolist() == [1, 17, 64] * repeat + [1] * 5
    for row in range(bs):
        table = block_tables[row]
        assert tables[row, :len(table)].tolist() == table
    assert tables[bs:, 0].tolist() == [0] * 5  # padding rows read block 0




@pytest.mark.parametrize("one_copy", [True, False])
def test_emulated_decode_graphs_read_each_step_and_give_the_eager_logits(tmp_path, monkeypatch, one_copy):
    """CUDA graphs emulated on the CPU (graph_emulation.py: a replay reruns the forward over the graphs' device
    buffers): each decode step's ids, positions, slots, context lengths and tables reach those buffers, in one
    staged copy (or one copy each with $TRITONLLM_DECODE_ONE_COPY=0), padding rows up to the bucket included,
    and the replayed steps give the eager steps' logits; 9 rows in bucket 16, then 3 in bucket 4 over them."""
    from graph_emulation import emulate_cuda_graphs

    from engine.executor.cuda_graphs import DECODE_ONE_COPY_ENV

    monkeypatch.setenv(DECODE_ONE_COPY_ENV, "1" if one_copy else "0")
    emulate_cuda_graphs(monkeypatch)  # (buckets to 16 rows, 128 tokens: each bucket's "capture" runs the forward)
    runner, decode = captured_runner(tmp_path, "float32", "cpu", 9, steps=4, max_batch_size=16, max_num_tokens=128)
    graphs = runner.decode_graphs
    assert graphs.separate_copies is not one_copy
    for step in range(4):
        batch = decode(step)
        if step >= 2:  # the first 3 rows only: a smaller bucket over the buffers the wider steps left
            batch = ForwardBatch(batch.token_ids[:3], batch.positions[:3], [1] * 3, batch.context_lens[:3],
                                 batch.block_tables[:3], [0, 1, 2])
        bs = len(batch.token_ids)
        bucket = graphs.bucket_for(bs)
        replays = graphs.replays[bucket]
        graphed = runner.forward(batch)
        assert graphs.replays[bucket] == replays + 1
        ids, positions, slots = graphs.dev_i64[:, :bucket].tolist()
        assert ids[:bs] == batch.token_ids and positions[:bs] == batch.positions
        assert slots == [table[p // 16] * 16 + p % 16 for table, p in zip(batch.block_tables, batch.positions)] + \
            [-1] * (bucket - bs)
        assert graphs.dev_ctx[:bucket].tolist() == batch.context_lens + [1] * (bucket - bs)
        for row, table in enumerate(batch.block_tables):
            assert graphs.dev_tables[row, :len(table)].tolist() == table
        assert graphs.dev_tables[bs:bucket, 0].tolist() == [0] * (bucket - bs)
        runner.decode_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.decode_graphs = graphs
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_emulated_head_graphs_give_the_eager_logits_and_greedy_ids(tmp_path, monkeypatch, num_seqs):
    """The decode graphs' head graphs (the LM head and greedy pick replayed after a step of up to 8 rows,
    cuda_graphs.py) on the CPU emulation: forward(graph_logits=True) gives the eager step's logits and greedy_of
    their argmax, from the head graph (its replay counted) in buckets 1 and 4; at 9 rows (bucket 16, no head graph)
    and without graph_logits the head stays eager and greedy_of says None. Also with the switch off (no head graphs)."""
    from graph_emulation import emulate_cuda_graphs

    from engine.executor.cuda_graphs import HEAD_GRAPH_MAX_ROWS

    replays = emulate_cuda_graphs(monkeypatch)
    runner, decode = captured_runner(tmp_path, "float32", "cpu", num_seqs, steps=3, max_batch_size=16,
                                     max_num_tokens=128)
    graphs = runner.decode_graphs
    assert sorted(graphs.head_graphs) == [b for b in graphs.buckets if b <= HEAD_GRAPH_MAX_ROWS] == [1, 2, 4, 8]
    in_head = graphs.bucket_for(num_seqs) <= HEAD_GRAPH_MAX_ROWS
    for step in range(3):
        batch = decode(step)
        heads = replays["head"]
        graphed = runner.forward(batch, graph_logits=True)
        greedy = runner.greedy_of(graphed)
        assert replays["head"] == heads + in_head and (greedy is not None) == in_head
        assert runner.greedy_of(graphed.clone()) is None  # only the very logits of the head graph
        runner.decode_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.decode_graphs = graphs
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
        if in_head:
            assert greedy.tolist() == eager.argmax(-1).tolist()
        plain = runner.forward(batch)  # without graph_logits: the step's own logits, picked by the caller
        assert runner.greedy_of(plain) is None and replays["head"] == heads + in_head
        torch.testing.assert_close(plain, eager, rtol=1e-5, atol=1e-5)
    graphs.use_head_graphs = False  # the bench's A/B switch: the head launched eagerly again
    assert runner.forward(decode(0), graph_logits=True) is not None and runner.graph_greedy is None


def test_head_graphs_switched_off_by_the_environment(tmp_path, monkeypatch):
    from graph_emulation import emulate_cuda_graphs

    from engine.executor.cuda_graphs import DECODE_HEAD_GRAPH_ENV

    monkeypatch.setenv(DECODE_HEAD_GRAPH_ENV, "0")
    emulate_cuda_graphs(monkeypatch)
    runner = ModelRunner(config_only_engine(tmp_path, "float32", max_batch_size=4, max_num_tokens=64), device="cpu")
    runner.allocate_kv_cache(64)
    runner.capture_cuda_graphs()
    assert runner.decode_graphs.head_graphs == {} and runner.decode_graphs.head is None


def test_executor_serves_the_same_tokens_with_and_without_head_graphs(tmp_path, monkeypatch):
    """An executor over emulated decode graphs (graph_emulation.py) serves the same tokens with the head graphs
    (its greedy rows take the head graph's ids, a seeded draw its logits) as with $TRITONLLM_DECODE_HEAD_GRAPH=0:
    three greedy requests (decode steps of 1-3 rows: buckets 1, 2, 4), a seeded draw beside them, and a request
    with a repetition penalty (the synchronous path: it keeps the eager head)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "executor"))
    from executor_testing import collect, final_tokens
    from graph_emulation import emulate_cuda_graphs

    from engine.executor.cuda_graphs import DECODE_HEAD_GRAPH_ENV
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request, SamplingConfig

    engine_dir = config_only_engine(tmp_path, "float32", max_batch_size=8, max_num_tokens=128)
    exclude = OutputConfig(exclude_input_from_output=True)
    prompts = [[3, 17, 5, 99, 42], [8, 1, 44], [7, 7, 2, 9, 30, 31, 4]]

    def served(head: str) -> tuple[list[list[int]], int]:
        monkeypatch.setenv(DECODE_HEAD_GRAPH_ENV, head)
        replays = emulate_cuda_graphs(monkeypatch)
        greedy = [Request(p, 6 + i, output=exclude) for i, p in enumerate(prompts)]
        drawn = Request(prompts[0], 6, sampling=SamplingConfig(temperature=0.8, seed=11), output=exclude)
        with Executor(engine_dir, ExecutorConfig(device="cpu")) as ex:
            ids = ex.enqueue_requests(greedy + [drawn])
            responses = collect(ex, ids)
            tokens = [final_tokens(responses[i]) for i in ids]
            [penalized] = ex.enqueue_requests([Request(prompts[1], 5, output=exclude,
                                                       sampling=SamplingConfig(repetition_penalty=1.3))])
            tokens.append(final_tokens(collect(ex, [penalized])[penalized]))
        return tokens, replays["head"]

    with_head, head_replays = served("1")
    without, none = served("0")
    assert with_head == without and head_replays > 0 and none == 0
    assert [len(t) for t in with_head] == [6, 7, 8, 6, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_head_graph_logits_and_greedy_ids_match_the_eager_head(tmp_path, num_seqs):
    """On CUDA: a decode step's head graph (LM head + greedy pick captured after the step's graph) gives the
    logits of the eager LM head over the same hidden rows and their argmax, step after step (1 row in bucket 1,
    3 rows in bucket 4)."""
    from kernels.sampling import greedy_tokens

    # (max_batch_size 4: buckets 1, 2, 4 only, so the capture stays short; a 24-row engine's took > 22 s on the H200)
    runner, decode = captured_runner(tmp_path, "bfloat16", "cuda", num_seqs, steps=4, max_batch_size=4)
    graphs = runner.decode_graphs
    assert graphs.bucket_for(num_seqs) in graphs.head_graphs
    for step in range(4):
        logits = runner.forward(decode(step), graph_logits=True)
        greedy = runner.greedy_of(logits)
        assert greedy is not None
        # (over the bucket's rows, as the graph: the same product shape, so the same kernel and rounding)
        eager = runner.model.compute_logits(graphs.hidden[graphs.bucket_for(num_seqs)])[:num_seqs]
        torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
        assert greedy.tolist() == greedy_tokens(eager).tolist() == eager.argmax(-1).tolist()


# A 16-wide-head Llama as small as the draft engine "small_limits" of test_speculative_draft_model.py.
SMALL = dict(TINY, vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
             max_position_embeddings=64)


@pytest.mark.parametrize("tokens_per_block,max_seq_len,max_num_tokens", [(8, 32, 8), (4, 16, 3), (8, 64, 1024)])
def test_warmup_batch_stays_within_the_engine_limits(tmp_path, tokens_per_block, max_seq_len, max_num_tokens):
    """The warm-up's mixed batch (run at CUDA engine load, here through the torch references) keeps every
    position below max_seq_len (the rotary table's rows: past them the Triton rotary kernel read out of
    bounds, an illegal memory access on an H200 for a draft of max_seq_len 32), at most max_num_tokens
    tokens, a prompt chunk of >= 2 tokens, and block tables that cover each row's context in the pool."""
    from engine.executor.cuda_graphs import run_warmup_batch

    build = BuildConfig(dtype="float32", max_batch_size=2, max_input_len=max_seq_len, max_seq_len=max_seq_len,
                        max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block)
    EngineConfig(model=ModelConfig(**SMALL), build=build, extra={"random_weights_seed": 3}).validate().save(str(tmp_path))
    runner = ModelRunner(str(tmp_path), device="cpu")
    runner.allocate_kv_cache(4)
    seen = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, positions, kv_cache, meta, **kw: (seen.append((positions, meta)),
                                                                        forward(ids, positions, kv_cache, meta, **kw))[1]
    run_warmup_batch(runner.model, runner.kv_cache, tokens_per_block, max_seq_len=max_seq_len,
                     max_num_tokens=max_num_tokens)
    (positions, meta), = seen
    q_lens = meta.cu_seqlens_q.diff().tolist()
    assert int(positions.max()) < max_seq_len and len(positions) <= max_num_tokens and q_lens[0] >= 2
    assert meta.block_tables.shape[1] * tokens_per_block >= max(meta.context_lens.tolist()) == meta.max_context_len
    assert 0 <= int(meta.block_tables.min()) and int(meta.block_tables.max()) < runner.num_kv_blocks


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_wide_row_weights_are_the_plain_and_gated_products(tmp_path, quantization):
    """What choose_kernels times for 17-128 rows (kernels/wide_rows.py): every projection linear() /
    fp8_linear() multiplies (qkv, o_proj, down_proj, lm_head when it is a Linear), and each layer's fused
    gate_up_proj as gated only; their dtypes are the engine's."""
    from engine.models.layers import Linear, wide_row_weights

    build = BuildConfig(dtype="float32", max_batch_size=2, max_input_len=32, max_seq_len=32, max_num_tokens=64,
                        tokens_per_block=8, quantization=quantization)
    EngineConfig(model=ModelConfig(**SMALL), build=build, extra={"random_weights_seed": 3}).validate().save(str(tmp_path))
    model = ModelRunner(str(tmp_path), device="cpu").model
    plain, gated = wide_row_weights(model)
    gate_ups = [layer.gate_up_proj.weight for layer in model.layers]
    assert [id(w) for w in gated] == [id(w) for w in gate_ups]
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
    assert {id(w) for w in plain} == {id(w) for w in linears} - {id(w) for w in gate_ups}
    if quantization:
        assert {w.dtype for w in gated} == {torch.float8_e4m3fn}


def test_warmup_batch_shape_fits_every_limit():
    from engine.executor.cuda_graphs import warmup_batch_shape

    assert warmup_batch_shape(2048, 8192) == (5, 37, 8)  # large engines keep the batch they always warmed up with
    assert warmup_batch_shape(1, 8) is None and warmup_batch_shape(32, 2) is None  # no mixed batch fits
    for max_seq_len, max_num_tokens in itertools.product(range(2, 50), range(3, 50)):
        prefix, chunk, decode_position = warmup_batch_shape(max_seq_len, max_num_tokens)
        assert prefix >= 0 and chunk >= 2 and chunk + 1 <= max_num_tokens
        assert prefix + chunk <= max_seq_len and decode_position < max_seq_len

def prompt_chunk_batches(num_seqs: int, page: int):
    """Three steps over shuffled blocks: the first half of every prompt; the rest of the
    even-numbered prompts; the rest of the odd-numbered ones beside one decode token of each
    even-numbered sequence (a mixed batch)."""
    rng = random.Random(num_seqs)
    blocks = list(range(1, 400))
    rng.shuffle(blocks)
    prompt_lens = [5 + 11 * i % 60 for i in range(num_seqs)]
    tables = [[blocks.pop() for _ in range(-(-(n + 1) // page))] for n in prompt_lens]
    tokens = [[rng.randrange(1000) for _ in range(n)] for n in prompt_lens]
    half = [-(-n // 2) for n in prompt_lens]

    def batch(rows):  # rows: (seq, first position, end position)
        ids, positions, lens, contexts, tabs, logits = [], [], [], [], [], []
        for seq, start, end in rows:
            ids += (tokens[seq] + [rng.randrange(1000)])[start:end]
            positions += range(start, end)
            lens.append(end - start)
            contexts.append(end)
            tabs.append(tables[seq][: -(-end // page)])
            logits.append(len(ids) - 1)
        return ForwardBatch(ids, positions, lens, contexts, tabs, logits)

    even, odd = range(0, num_seqs, 2), range(1, num_seqs, 2)
    return [batch([(i, 0, half[i]) for i in range(num_seqs)]),
            batch([(i, half[i], prompt_lens[i]) for i in even]),
            batch([(i, half[i], prompt_lens[i]) for i in odd] + [(i, prompt_lens[i], prompt_lens[i] + 1) for i in even])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, None), ("fp8", None), ("fp8", "fp8")])
@pytest.mark.parametrize("num_seqs", [1, 5, 24])
def test_graph_mixed_steps_match_eager(tmp_path, num_seqs, quantization, kv_cache_dtype):
    runner = ModelRunner(config_only_engine(tmp_path, "bfloat16", quantization=quantization), device="cuda")
    runner.allocate_kv_cache(400, kv_cache_dtype)
    runner.capture_cuda_graphs()
    runner.warmup()
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.buckets[-1] == 1024
    for step, batch in enumerate(prompt_chunk_batches(num_seqs, page=16)):
        if len(batch.token_ids) == len(batch.seq_lens_q):
            continue  # one sequence, one token each: a decode-only step
        assert graphs.try_run(batch) is not None  # a bucket holds it
        graphed = runner.forward(batch)
        runner.prefill_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.prefill_graphs = graphs
        assert graphed.shape == eager.shape == (len(batch.logits_indices), 1000)
        err = ((graphed - eager).norm() / eager.norm()).item()
        # FP8 weights: a step's GEMMs take another path graphed (the bucket's padded row count goes
        # to cuBLASLt with fast accumulation) than eagerly (few rows: the skinny Triton kernel), so
        # the same W8A8 scheme accumulates in another order; 3e-2 seen on this tiny random model.
        assert err < (5e-2 if quantization else 2e-2), f"step {step}: relative error {err:.2e}"
        same = (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item()
        assert same >= 0.95, f"step {step}: only {same:.0%} of greedy tokens agree"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", sorted(TINY_DECODERS))
def test_decoder_family_graphs_match_eager(tmp_path, family):
    """The LayerNorm families through both kinds of graph: decode steps (the fused LayerNorm with its
    residual adds, the activated up projection, ALiBi's new K/V written inside the attention kernel)
    and steps with prompt chunks, each equal to the same step run eagerly."""
    runner = ModelRunner(config_only_engine(tmp_path, "bfloat16", model=TINY_DECODERS[family]), device="cuda")
    runner.allocate_kv_cache(400)
    runner.capture_cuda_graphs()
    runner.warmup()
    assert runner.decode_graphs is not None and runner.prefill_graphs is not None
    steps = [batch for batch in prompt_chunk_batches(5, page=16) if len(batch.token_ids) != len(batch.seq_lens_q)]
    prompt_lens = [13 + 7 * i % 29 for i in range(5)]
    prefill, decode = prefill_then_decode_batches(5, prompt_lens, steps=3, page=16)
    for batch in steps + [prefill] + [decode(step) for step in range(3)]:
        graphed = runner.forward(batch)
        decode_graphs, prefill_graphs = runner.decode_graphs, runner.prefill_graphs
        runner.decode_graphs = runner.prefill_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.decode_graphs, runner.prefill_graphs = decode_graphs, prefill_graphs
        err = ((graphed - eager).norm() / eager.norm()).item()
        assert err < 2e-2, f"{family}: relative error {err:.2e}"
        assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.95


def tree_steps(num_seqs: int, page: int, nodes: int):
    """A prompt step for ``num_seqs`` sequences, then a tree step: each verifying a random tree of
    ``nodes`` nodes under its root (tree_batch.py's packing: rotary positions by depth, logits at
    every node), beside one plain decode row."""
    from engine.executor.tree_batch import chunk_parents, tree_positions

    rng = random.Random(nodes)
    lens = [7 + 9 * i % 40 for i in range(num_seqs)]
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(num_seqs + 1)]
    prompt = ForwardBatch([rng.randrange(1000) for _ in range(sum(lens) + 5)], [p for n in lens + [5] for p in range(n)],
                          lens + [5], lens + [5], [t[:-(-n // page)] for t, n in zip(tables, lens + [5])],
                          [sum(lens[:i + 1]) - 1 for i in range(num_seqs)] + [sum(lens) + 4])
    ids, positions, q_lens, contexts, tabs, trees = [], [], [], [], [], []
    for i, n in enumerate(lens):
        parents = chunk_parents(nodes + 1, [rng.randrange(-1, j) for j in range(nodes)])
        ids += [rng.randrange(1000) for _ in range(nodes + 1)]
        positions += tree_positions(n, parents)
        q_lens.append(nodes + 1)
        contexts.append(n + nodes + 1)
        tabs.append(tables[i][:-(-(n + nodes + 1) // page)])
        trees.append(parents)
    ids.append(rng.randrange(1000))  # the decode row: position 5 of the last sequence
    positions.append(5)
    q_lens.append(1)
    contexts.append(6)
    tabs.append(tables[num_seqs][:1])
    trees.append(None)
    step = ForwardBatch(ids, positions, q_lens, contexts, tabs, list(range(len(ids))))
    step.tree_parents = trees
    return prompt, step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_tree_graph_steps_and_layer_taps_match_eager(tmp_path, quantization):
    """Tree verify steps replay their own graphs (runner.tree_graph_width; prefill_graphs.py) with
    the ancestor mask: logits equal the same step run eagerly, and the layers tapped inside the
    replay (engine/executor/layer_taps.py; FP8 layers hand on ScaledProducts) equal the eager taps."""
    runner = ModelRunner(config_only_engine(tmp_path, "bfloat16", quantization=quantization), device="cuda")
    runner.tree_graph_width = 9
    taps = runner.tap_layers([0, 1, 1])
    runner.allocate_kv_cache(400)
    runner.capture_cuda_graphs()
    runner.warmup()
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.tree_buckets and graphs.tree_graphs
    prompt, step = tree_steps(5, page=16, nodes=8)
    runner.forward(prompt)
    assert graphs.try_run(step) is not None  # a tree graph holds it
    graphed = runner.forward(step)
    graphed_taps = [t.clone() for t in taps.streams]
    runner.prefill_graphs = None  # the same step eagerly (rewrites the same K/V slots)
    eager = runner.forward(step)
    runner.prefill_graphs = graphs
    err = ((graphed - eager).norm() / eager.norm()).item()
    assert err < (5e-2 if quantization else 2e-2), f"relative error {err:.2e}"
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.95
    for got, want in zip(graphed_taps, taps.streams):
        assert got.shape == want.shape == (len(step.token_ids), 256)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2



def test_emulated_prefill_graphs_give_the_eager_logits_and_tree_inputs(tmp_path, monkeypatch):
    """Steps with prompt tokens through the prefill graphs emulated on the CPU (graph_emulation.py: a replay
    reruns the forward over the graphs' device buffers), across buckets (each bucket's inputs a region of one
    staging buffer, the table rows shared: prefill_graphs.py _allocate_buffers): prompt chunks and a mixed step
    give the logits of the same steps run eagerly; a tree verify step's device inputs (slots, rotary positions,
    sequence rows, tables, ancestor mask and its bits) are the eager step's. (Its logits are compared on the GPU,
    test_tree_graph_steps_and_layer_taps_match_eager: the graph's int8 mask is the Triton kernel's, and the torch
    reference negates a mask with ``~``, right for the eager bool mask only.)"""
    from graph_emulation import emulate_cuda_graphs

    from kernels.attention_metadata import pack_tree_mask

    replays = emulate_cuda_graphs(monkeypatch)  # (token buckets to 256: each bucket's "capture" runs the forward)
    runner = ModelRunner(config_only_engine(tmp_path, "float32", max_batch_size=8, max_num_tokens=256), device="cpu")
    runner.tree_graph_width = 9
    runner.allocate_kv_cache(400)
    runner.capture_cuda_graphs()
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.tree_graphs and 9 in graphs.buckets
    base = graphs.dev_staging.data_ptr()  # each bucket's ids, positions and slots start 16-byte aligned (odd ones too)
    assert all((inputs.dev_i64[row].data_ptr() - base) % 16 == 0
               for inputs in graphs.inputs.values() for row in range(3))
    prompt, tree_step = tree_steps(5, page=16, nodes=8)
    steps = [b for b in prompt_chunk_batches(5, page=16) if len(b.token_ids) != len(b.seq_lens_q)] + [prompt]
    assert len({graphs.bucket_for(len(b.token_ids)) for b in steps}) >= 3
    for step, batch in enumerate(steps + [tree_step]):
        before = replays["LlamaForCausalLM-prefill"]
        graphed = runner.forward(batch)
        assert replays["LlamaForCausalLM-prefill"] == before + 1, f"step {step} did not replay a graph"
        runner.prefill_graphs = None  # the same step eagerly (rewrites the same K/V slots)
        eager = runner.forward(batch)
        runner.prefill_graphs = graphs
        if batch is not tree_step:
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    n, seqs = len(tree_step.token_ids), len(tree_step.seq_lens_q)
    inputs = graphs.inputs[graphs.bucket_for(n)]
    _, positions, meta = runner.attention_inputs(tree_step)
    assert inputs.dev_i64[1, :n].tolist() == positions.tolist()
    assert inputs.dev_i64[2].tolist() == meta.slot_mapping.tolist() + [-1] * (len(inputs.dev_i64[2]) - n)
    assert inputs.dev_seq[0, :seqs + 2].tolist() == meta.cu_seqlens_q.tolist() + [n]
    assert inputs.dev_seq[1, :seqs].tolist() == meta.context_lens.tolist()
    for row, table in enumerate(tree_step.block_tables):
        assert graphs.dev_tables[row, :len(table)].tolist() == table
    width = meta.tree_mask.shape[1]
    assert torch.equal(inputs.dev_tree[:n, :width].bool(), meta.tree_mask)
    assert torch.equal(inputs.dev_tree_bits[:n, :meta.tree_bits.shape[1]], pack_tree_mask(meta.tree_mask))


def test_prefill_tile_map_and_token_buckets():
    """The mixed-step graphs' host side (no GPU needed): every query tile of every sequence once,
    in order, the rest empty; buckets end at max_num_tokens, at most an eighth apart from 256 on."""
    import numpy as np

    from engine.executor.prefill_graphs import model_token_buckets, tile_map, token_buckets, tree_step_buckets

    tile_seq, tile_m = tile_map([1, 5, 21, 0, 43], tokens_per_tile=21, length=10)
    assert tile_seq.tolist() == [0, 1, 2, 4, 4, 4, -1, -1, -1, -1]
    assert tile_m.tolist()[:6] == [0, 0, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="do not fit"):
        tile_map([64, 64], tokens_per_tile=16, length=7)
    buckets = token_buckets(8192)
    assert buckets[:8] == [16, 32, 64, 128, 192, 256, 288, 320] and buckets[-1] == 8192
    assert buckets == sorted(set(buckets)) and all(b / a <= 1.125 for a, b in zip(buckets[5:], buckets[6:]))
    assert token_buckets(100) == [16, 32, 64, 100] and np.all(np.diff(token_buckets(3000)) > 0)
    # a model's cap (DeepSeek: below the expanded form's threshold, 171 new tokens for V2-Lite / V3)
    capped = type("Capped", (), {"prefill_graph_max_tokens": 170})()
    assert model_token_buckets(capped, 8192) == [16, 32, 64, 128] and model_token_buckets(object(), 100) == buckets[:3] + [100]
    # a tree method's rows of W tokens: W, 2W, 3W, 4W exact below the largest bucket (a 64-node tree at batch 1 is 65
    # tokens, not a 128-token bucket), nothing added without trees
    assert tree_step_buckets(buckets, 65)[:9] == [16, 32, 64, 65, 128, 130, 192, 195, 256]
    assert 260 in tree_step_buckets(buckets, 65) and tree_step_buckets(buckets, 0) == buckets
    assert tree_step_buckets([16, 32, 64, 100], 33) == [16, 32, 33, 64, 66, 99, 100]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen3_q_k_norms_in_the_decode_attention_kernel_equal_transformers(tmp_path, monkeypatch):
    """$TRITONLLM_QK_NORM_IN_ATTENTION=1 (engine/models/llama.py): Qwen3's per-head q/k norms inside the decode
    attention kernel (kernels/triton_attention.py qk_norm; 16-wide heads, so that kernel rotates and appends),
    decode steps replayed from graphs and a packed mixed step (its own norm launch): every row as transformers'."""
    from engine.models.llama import QK_NORM_IN_ATTENTION_ENV
    from engine_testing import assert_cuda_steps_equal_transformers, make_engine, tiny_hf

    monkeypatch.setenv(QK_NORM_IN_ATTENTION_ENV, "1")
    hf = tiny_hf("qwen3_aligned")
    assert_cuda_steps_equal_transformers(hf, make_engine(hf, tmp_path / "engine"))


def test_qwen3_q_k_norms_passed_to_the_attention_equal_their_own_launch_on_cpu(tmp_path, monkeypatch):
    """The wiring of $TRITONLLM_QK_NORM_IN_ATTENTION=1 on the CPU, the CUDA-only choice forced: a decode step's
    layers hand the raw q and k with the norms to kernels/rope_attention.py (whose CPU path applies them itself),
    and its logits equal those of the norms' own pass (=0)."""
    from engine.models import llama
    from engine_testing import PagedSession, make_engine, random_tokens, tiny_hf

    runner = ModelRunner(make_engine(tiny_hf("qwen3_aligned"), tmp_path / "engine"))
    monkeypatch.setattr(llama, "use_triton", lambda t: True)
    folded = []
    rope_paged_attention = llama.rope_paged_attention
    monkeypatch.setattr(llama, "rope_paged_attention", lambda *args, qk_norm=None, **kwargs: folded.append(
        qk_norm is not None) or rope_paged_attention(*args, qk_norm=qk_norm, **kwargs))
    prompt = random_tokens(12, seed=9)
    steps = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(llama.QK_NORM_IN_ATTENTION_ENV, setting)
        session = PagedSession(runner, num_blocks=16)
        steps[setting] = [session.step([(0, prompt[:11])])[0], session.step([(0, prompt[11:])])[0]]
    layers = len(runner.model.layers)
    assert folded == [False] * 3 * layers + [True] * layers  # (only the decode step with the setting on)
    for own_launch, in_attention in zip(steps["0"], steps["1"]):
        torch.testing.assert_close(in_attention, own_launch, rtol=1e-5, atol=1e-5)
