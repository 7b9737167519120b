"""Llama 4 text (engine/models/llama4.py) against a tiny random Llama4ForCausalLM made by transformers:
4 layers, rope layers 0 and 2 attending within chunks of 8 positions with the q/k L2 norm, NoPE layers
1 and 3 global with temperature tuning (floor_scale 4, so it bites at these lengths), MoE on layers
1 and 3 (4 experts, top-1 sigmoid, a shared expert) and dense SwiGLU on 0 and 2. Logits of chunks
across chunk boundaries over shuffled pages equal transformers'; greedy ids through the executor
(prefix caching, chunked context) equal its generate.
"""
from __future__ import annotations

import pytest
import torch

from engine.executor.runner import ModelRunner
from engine_testing import (EXECUTOR_POOL, PagedSession, assert_cuda_steps_equal_transformers, hf_logits,
                            make_engine, random_tokens)
from tiny_llama4 import tiny_llama4, with_vision_tower


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    hf = tiny_llama4()
    return hf, make_engine(hf, tmp_path_factory.mktemp("llama4") / "engine", tokens_per_block=4)


def test_config_reads_the_layer_pattern(llama4):
    config = ModelRunner(llama4[1]).model_config
    assert config.layers_without_rope == [1, 3] and config.attention_chunk_size == 8 and config.qk_l2_norm
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (config.nope_floor_scale, config.nope_attn_scale) == (4.0, 0.1)


def test_chunks_across_chunk_boundaries_equal_transformers(llama4):
    """Two sequences in packed steps: a prompt in chunks of 11, 9, 1 and 6 tokens (crossing the
    8-position chunks mid-step) beside another's prompt and decode rows."""
    hf, engine_dir = llama4
    seqs = {0: random_tokens(27, 3), 1: random_tokens(18, 4)}
    session = PagedSession(ModelRunner(engine_dir), num_blocks=32)
    steps = [[(0, seqs[0][:11]), (1, seqs[1][:16])], [(0, seqs[0][11:20]), (1, seqs[1][16:17])],
             [(0, seqs[0][20:21]), (1, seqs[1][17:])], [(0, seqs[0][21:])]]
    outs = {0: [], 1: []}
    for step in steps:
        for (seq, _), logits in zip(step, session.step(step)):
            outs[seq].append(logits)
    for seq, tokens in seqs.items():
        assert (torch.cat(outs[seq]) - hf_logits(hf, tokens)).abs().max().item() <= 1e-4


def test_executor_greedy_ids_equal_transformers_generate(llama4):
    """Two requests sharing a 12-token prefix (the second reuses its cached blocks), prompts in chunks
    of 8 (chunked context), 10 new tokens each past the 16- and 24-position chunk boundaries."""
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    hf, engine_dir = llama4
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    shared = random_tokens(12, 31)
    prompts = [shared + random_tokens(3, 32), shared + random_tokens(5, 33)]
    config = ExecutorConfig(**EXECUTOR_POOL, enable_kv_cache_reuse=True, enable_chunked_context=True,
                            max_num_tokens=8)
    finals, ids = {}, []
    with Executor(engine_dir, config) as executor:
        for prompt in prompts:  # one after the other: the second finds the first's blocks
            ids += executor.enqueue_requests([Request(prompt, 10, output=OutputConfig(exclude_input_from_output=True))])
            while ids[-1] not in finals:
                for response in executor.await_responses(timeout=1.0):
                    assert response.error is None, response.error
                    if response.result.is_final:
                        finals[response.request_id] = response.result.output_token_ids[0]
        reused = executor.blocks.total_reused_blocks
    assert reused >= 3
    for prompt, request_id in zip(prompts, ids):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert finals[request_id] == expected.tolist()


def test_conditional_generation_checkpoint_builds_its_text_model(llama4, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (a one-layer vision tower beside the same text model,
    saved as ``language_model.model.*``) builds the text model alone: transformers' text logits."""
    from engine.build import build_engine
    from engine.config import BuildConfig

    text = llama4[0]
    model = with_vision_tower(text)
    model.save_pretrained(tmp_path / "ckpt")
    build_engine(str(tmp_path / "ckpt"), str(tmp_path / "engine"),
                 BuildConfig(dtype="float32", max_batch_size=2, max_seq_len=64, max_input_len=64, max_num_tokens=64,
                             tokens_per_block=4), progress=False)
    prompt = random_tokens(20, 7)
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "engine")), num_blocks=16).step([(0, prompt)])
    assert (logits - hf_logits(text, prompt)).abs().max().item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_equals_transformers(llama4):
    """fp32 on CUDA (IEEE dots in the Triton kernels, so routing matches fp32 transformers): a prompt,
    decode steps replayed from CUDA graphs (the chunked-attention kernel, the NoPE layers' paged attention and the experts inside them), then a packed mixed step."""
    hf, engine_dir = llama4
    assert_cuda_steps_equal_transformers(hf, engine_dir)


# The experts' GEMV pair at every decode count, as a load-time choice may mark it (few programs: the interpreter's time)
GEMV_MARKS = {count: ((64, 128, 8, 2), (64, 128, 8, 2)) for count in (1, 2, 4, 8)}


@pytest.mark.parametrize("shared_rows", [False, True])
def test_one_launch_routing_with_the_norm_equals_the_unfused_moe_block(llama4, shared_rows, monkeypatch):
    """Llama4Experts.forward_normed (kernels/llama4_router.py: the post-attention residual add and norm, the router,
    top-1, sigmoid and input scaling in one launch, as decode steps on CUDA run it; the shared expert as expert 4, a
    second row of the experts' GEMV pair that reads its Linears' weights where they lie, nothing copied) against the
    norm, then the router Linear, topk, sigmoid and scaling in torch and the shared expert's Linears, on the tiny
    model's first MoE layer. GPU, or TRITON_INTERPRET=1 on CPU (the experts' GEMV pair in the interpreter)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)")
    from kernels.rmsnorm import rms_norm_ref

    from kernels.moe_gemv import mark_gemv

    from engine.models.llama4 import STACK_SHARED_ENV

    monkeypatch.setenv(STACK_SHARED_ENV, "1" if shared_rows else "0")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = ModelRunner(llama4[1], device=device).model.layers[1]
    moe, norm_weight = layer.moe, layer.post_attn_norm.weight
    monkeypatch.setattr("engine.models.llama4.use_triton", lambda tensor: True)  # (the interpreter's CPU tensors)
    mark_gemv(moe.gate_up_proj, GEMV_MARKS)
    gen = torch.Generator().manual_seed(9)
    x, residual = (torch.randn(3, norm_weight.shape[0], generator=gen).to(device) for _ in range(2))
    assert moe.gate_up_proj.shape[0] == moe.down_proj.shape[0] == 4  # (no stacked copy)
    assert moe.shared_slot == (4 if shared_rows else None)
    assert moe.shares_expert_rows(3) == moe.shares_expert_rows(4) == shared_rows
    assert not moe.shares_expert_rows(5)  # (10 rows: past the GEMV pair's counts)
    with torch.inference_mode():
        got, got_residual = moe.forward_normed(x, residual, norm_weight, layer.eps)
        if shared_rows:
            assert got.shape == (3, 2, x.shape[1])  # [routed, shared] unsummed: the next norm sums them
            got = got.sum(dim=1)
        h, want_residual = rms_norm_ref(x, norm_weight, layer.eps, residual)
        top, ids = moe.router(h).topk(1, dim=-1)
        want = moe._plus_shared(moe.routed_experts(h * torch.sigmoid(top), ids.to(torch.int32)), h)
    assert torch.equal(got_residual, want_residual)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert len(set(ids.flatten().tolist())) > 1  # (the tokens go to different experts)


@pytest.mark.parametrize("shared_rows", [False, True])
def test_cuda_decode_path_in_the_interpreter_equals_transformers(llama4, shared_rows, monkeypatch):
    """The code decode steps run on CUDA, on CPU through Triton's interpreter (TRITON_INTERPRET=1; on a GPU
    test_engine_on_cuda_equals_transformers covers it): the Llama 4 modules' kernel dispatch told it is on CUDA, so
    each layer's attention is the one decode kernel (kernels/llama4_attention.py), each MoE layer's post-attention
    norm and routing the one launch (kernels/llama4_router.py), the experts the GEMV pair (marked as a load-time
    choice may), with the shared expert as its expert 4 (its own weights read in place), and the unsummed [routed,
    shared] rows go to the next norm. A prompt, then decode steps across the chunk boundaries at
    16 and 24: transformers' float32 logits within 1e-4."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 only (the GPU runs this path in test_engine_on_cuda_equals_transformers)")
    import engine.models.llama4 as llama4_model
    import kernels.chunked_attention
    import kernels.llama4_attention
    import kernels.moe_gemv
    import kernels.rope_attention

    calls = {"one-kernel attention": 0, "routing launch": 0, "shared expert rows": 0}

    def counted(name, function, counts=lambda kwargs: True):
        def call(*args, **kwargs):
            calls[name] += counts(kwargs)
            return function(*args, **kwargs)
        return call

    for module in (llama4_model, kernels.rope_attention, kernels.chunked_attention):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(kernels.llama4_attention, "paged_attention_triton",
                        counted("one-kernel attention", kernels.llama4_attention.paged_attention_triton,
                                lambda kwargs: kwargs.get("new_kv") is not None))
    monkeypatch.setattr(llama4_model, "route_top1_triton",
                        counted("routing launch", llama4_model.route_top1_triton))
    monkeypatch.setattr(llama4_model, "moe_gemv_triton",
                        counted("shared expert rows", llama4_model.moe_gemv_triton,
                                lambda kwargs: kwargs.get("shared_expert") is not None))
    monkeypatch.setenv(llama4_model.STACK_SHARED_ENV, "1" if shared_rows else "0")
    hf, engine_dir = llama4
    runner = ModelRunner(engine_dir)
    slots = [layer.moe.shared_slot for layer in runner.model.layers if layer.moe is not None]
    assert slots == ([4, 4] if shared_rows else [None, None])
    for layer in runner.model.layers:
        if layer.moe is not None:
            kernels.moe_gemv.mark_gemv(layer.moe.gate_up_proj, GEMV_MARKS)
    session = PagedSession(runner, num_blocks=64)
    sequence = random_tokens(27, 4)
    expected = hf_logits(hf, sequence)
    (prefill,) = session.step([(0, sequence[:10])])
    assert (prefill - expected[:10]).abs().max().item() <= 1e-4
    for pos in range(10, 27):
        (decode,) = session.step([(0, [sequence[pos]])])
        assert (decode - expected[pos:pos + 1]).abs().max().item() <= 1e-4, pos
    # (the 10-token prompt routes in the launch too, its 20 rows past the GEMV pair's counts: no shared rows)
    assert calls == {"one-kernel attention": 4 * 17, "routing launch": 2 * 18,
                     "shared expert rows": 2 * 17 if shared_rows else 0}


def test_one_launch_routing_switch(llama4, monkeypatch):
    """$TRITONLLM_LLAMA4_ONE_LAUNCH_ROUTING=0 keeps every batch on the unfused routing (an A/B switch); the launch
    is for top-1 batches of at most 16 tokens on CUDA only."""
    from engine.models.llama4 import ONE_LAUNCH_ROUTING_ENV

    moe = ModelRunner(llama4[1]).model.layers[1].moe
    assert not moe.routes_in_one_launch(1)  # (CPU)
    monkeypatch.setattr("engine.models.llama4.use_triton", lambda tensor: True)
    assert moe.routes_in_one_launch(1) and moe.routes_in_one_launch(16) and not moe.routes_in_one_launch(17)
    monkeypatch.setenv(ONE_LAUNCH_ROUTING_ENV, "0")
    assert not moe.routes_in_one_launch(1)
