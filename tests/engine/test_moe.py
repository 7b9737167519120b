"""Mixture-of-experts families beyond the shared equivalence tests: building from checkpoint
directories as they are on disk (one tensor per expert), idle experts, refusals, and the engine
on CUDA (Triton routing, alignment and grouped GEMMs inside the decode graphs).
"""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.executor.runner import ModelRunner
from engine_testing import (EXECUTOR_POOL, PagedSession, assert_cuda_steps_equal_transformers,
                            assert_directory_build_equals, hf_logits, make_engine, random_tokens, tiny_hf)
from kernels.fused_moe import route_tokens_ref

MOE_FAMILIES = ["mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_build_from_a_checkpoint_directory(family, tmp_path):
    """save_pretrained writes one tensor per expert (Mixtral's w1/w2/w3, Qwen3-MoE's gate/up/down_proj);
    `python -m engine.build --checkpoint --output` stacks them into the same engine the in-memory
    (stacked) layout gives, and its logits equal transformers'."""
    hf = tiny_hf(family)
    engine_dir = assert_directory_build_equals(hf, make_engine(hf, tmp_path / "memory"), tmp_path)
    prompt = random_tokens(19, seed=3)
    (logits,) = PagedSession(ModelRunner(engine_dir), num_blocks=32).step([(0, prompt)])
    assert (logits - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_batch_where_some_experts_get_no_token(family, tmp_path):
    """A packed step of two decode tokens and a 2-token chunk routes 8 (token, expert) pairs over
    8 or 10 experts: the routing recorded at every sparse layer leaves experts idle, and the logits
    still equal transformers'."""
    hf = tiny_hf(family)
    runner = ModelRunner(make_engine(hf, tmp_path / "engine"))
    routed: list[set[int]] = []  # per sparse layer and step: the experts that got a token

    def record_experts(module, args, router_logits):
        routed.append(set(route_tokens_ref(router_logits, 2, True)[1].flatten().tolist()))

    for layer in runner.model.layers:
        if layer.moe is not None:
            layer.moe.router.register_forward_hook(record_experts)
    seqs = {0: random_tokens(9, 1), 1: random_tokens(6, 2), 2: random_tokens(11, 3)}
    session = PagedSession(runner, num_blocks=32)
    session.step([(0, seqs[0][:8]), (1, seqs[1][:5]), (2, seqs[2][:9])])
    routed.clear()
    outs = session.step([(0, seqs[0][8:]), (1, seqs[1][5:]), (2, seqs[2][9:])])
    num_experts = runner.model_config.num_experts
    assert routed and all(len(experts) < num_experts for experts in routed), routed
    expected = [hf_logits(hf, seqs[0])[8:], hf_logits(hf, seqs[1])[5:], hf_logits(hf, seqs[2])[9:]]
    for actual, wanted in zip(outs, expected):
        assert (actual - wanted).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe"])  # (Mixtral's layer takes the same path: its GPU test below)
def test_norm_in_the_router_launch_equals_the_unfused_layer(family, tmp_path, monkeypatch):
    """TRITONLLM_MOE_NORM_ROUTER=1 (engine/models/moe.py forward_normed: the post-attention norm, the router
    product and the routing in kernels/moe_router.py's launch, the experts for the chosen ids) on the CPU, the
    CUDA-only dispatch forced so that its kernels' references run: a 1-token decode step takes it at every sparse
    layer, and its logits equal the unfused layer's (=0); the prompt's 17 tokens (more than the launch's 16) keep
    the unfused layer."""
    from engine.models import moe

    runner = ModelRunner(make_engine(tiny_hf(family), tmp_path / "engine"))
    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    normed_calls = []
    forward_normed = moe.SparseMoeBlock.forward_normed
    monkeypatch.setattr(moe.SparseMoeBlock, "forward_normed",
                        lambda self, *args: normed_calls.append(1) or forward_normed(self, *args))
    prompt = random_tokens(18, seed=4)
    steps = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(moe.NORM_ROUTER_ENV, setting)
        session = PagedSession(runner, num_blocks=16)
        steps[setting] = [session.step([(0, prompt[:17])])[0], session.step([(0, prompt[17:])])[0]]
    sparse_layers = sum(layer.moe is not None for layer in runner.model.layers)
    assert len(normed_calls) == sparse_layers > 0
    for unfused, fused in zip(steps["0"], steps["1"]):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_executor_greedy_equals_transformers_generate(family, tmp_path):
    """Three prompts in flight at once through the in-flight-batching executor (their prefills and
    decodes share MoE steps): each one's greedy tokens equal transformers' generate."""
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    hf = tiny_hf(family)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = [random_tokens(5, 11), random_tokens(12, 12), random_tokens(1, 13)]
    engine_dir = make_engine(hf, tmp_path / "engine", tokens_per_block=4)
    with Executor(engine_dir, ExecutorConfig(**EXECUTOR_POOL)) as executor:
        ids = executor.enqueue_requests([Request(p, 12, output=OutputConfig(exclude_input_from_output=True))
                                         for p in prompts])
        finals = {}
        while len(finals) < len(ids):
            for response in executor.await_responses(timeout=1.0):
                assert response.error is None, response.error
                if response.result.is_final:
                    finals[response.request_id] = response.result.output_token_ids[0]
    for prompt, request_id in zip(prompts, ids):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert finals[request_id] == expected.tolist()


def test_qwen3_moe_dense_layers_follow_mlp_only_layers(tmp_path):
    runner = ModelRunner(make_engine(tiny_hf("qwen3_moe"), tmp_path / "engine"))
    assert [layer.moe is not None for layer in runner.model.layers] == [True, False, True]
    config = runner.model_config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (10, 2, 22)
    assert config.norm_topk_prob is False and config.qk_norm


def test_tp_size_must_divide_the_expert_width(tmp_path):
    hf = tiny_hf("qwen3_moe")  # moe_intermediate_size 22
    hf.config.moe_intermediate_size = 21
    with pytest.raises(ConfigError, match=r"tp_size 2 does not divide moe_intermediate_size \(21\)"):
        from engine.config import check_tp_divides
        from engine.convert import model_config_from_hf

        check_tp_divides(model_config_from_hf(hf.config), 2)


@pytest.mark.parametrize("changes,message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be <= num_experts \(8\)"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    (dict(mlp_only_layers=[2]), r"mlp_only_layers must hold layer indices in \[0, 2\)"),
    (dict(architecture="LlamaForCausalLM"), "LlamaForCausalLM has no experts; num_experts must be 0"),
])
def test_expert_fields_are_validated(changes, message):
    fields = dict(architecture="MixtralForCausalLM", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=36, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=36)
    ModelConfig(**fields).validate()
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**fields, **changes}).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", MOE_FAMILIES + ["gpt_oss"])
def test_engine_on_cuda_equals_transformers(family, tmp_path):
    """fp32 on CUDA (IEEE dots in every Triton kernel, so routing matches fp32 transformers): a
    prompt, then decode steps replayed from CUDA graphs, then a packed mixed step. gpt-oss adds the
    sinks in the prefill and decode attention kernels and the experts' biases and clamp."""
    hf = tiny_hf(family)
    assert_cuda_steps_equal_transformers(hf, make_engine(hf, tmp_path / "engine"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", MOE_FAMILIES + ["gpt_oss"])
def test_engine_with_one_launch_decode_experts_equals_transformers(family, tmp_path, monkeypatch):
    """TRITONLLM_MOE_DECODE=fused (kernels/moe_decode.py): the decode steps' MoE layers (one token, in
    the captured graphs) run the one-launch kernel, the 40-token prompt the grouped path; every row as
    test_engine_on_cuda_equals_transformers."""
    from kernels.moe_decode import MOE_DECODE_ENV

    monkeypatch.setenv(MOE_DECODE_ENV, "fused")
    hf = tiny_hf(family)
    assert_cuda_steps_equal_transformers(hf, make_engine(hf, tmp_path / "engine"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_with_the_norm_in_the_router_launch_equals_transformers(family, tmp_path, monkeypatch):
    """TRITONLLM_MOE_NORM_ROUTER=1 (engine/models/moe.py forward_normed): the decode steps' sparse layers (one
    token, in the captured graphs) run the post-attention norm and the routing in kernels/moe_router.py's launch
    and the experts for its ids; every row as test_engine_on_cuda_equals_transformers."""
    from engine.models.moe import NORM_ROUTER_ENV

    monkeypatch.setenv(NORM_ROUTER_ENV, "1")
    hf = tiny_hf(family)
    assert_cuda_steps_equal_transformers(hf, make_engine(hf, tmp_path / "engine"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_on_cuda_in_bf16_is_close_to_transformers(family, tmp_path):
    """bf16 on CUDA against fp32 transformers. A token whose k-th and (k+1)-th router scores lie
    within bf16 rounding may take another expert (a discrete change), so the bound is per row and
    nine rows in ten must meet it: 0.15, the bf16 tolerance of the dense families
    (test_equivalence.TOLERANCES); a wrong expert layout or routing misses it on every row."""
    hf = tiny_hf(family)
    runner = ModelRunner(make_engine(hf, tmp_path / "engine", dtype="bfloat16"), device="cuda")
    session = PagedSession(runner, num_blocks=64)
    runner.capture_cuda_graphs()
    sequence = random_tokens(30 + 10, seed=6)
    expected = hf_logits(hf, sequence)
    rows = list(session.step([(0, sequence[:30])])[0].cpu().float())
    for pos in range(30, 40):
        rows.append(session.step([(0, [sequence[pos]])])[0][0].cpu().float())
    errors = [(row - want).abs().max().item() for row, want in zip(rows, expected)]
    assert sum(error <= 0.15 for error in errors) >= 0.9 * len(errors), errors


def test_sparse_layers_follow_qwen3_moe_rule():
    """A layer is sparse unless it is in mlp_only_layers or (index + 1) is not a multiple of
    decoder_sparse_step, as transformers' Qwen3MoeDecoderLayer decides."""
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=96, hidden_size=64, num_layers=6,
                         num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=40, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2,
                         mlp_only_layers=[3]).validate()
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not ModelConfig(**{**config.to_dict(), "architecture": "LlamaForCausalLM", "num_experts": 0}).is_moe_layer(1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_kernel_warm_up_runs_every_variant(family, tmp_path):
    """ModelRunner.warmup calls warm_up_kernels on CUDA; here the same calls run the reference."""
    runner = ModelRunner(make_engine(tiny_hf(family), tmp_path / "engine"))
    runner.model.warm_up_kernels()
