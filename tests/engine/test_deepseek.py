"""DeepSeek-V3 and V2 (engine/models/deepseek.py) against tiny random checkpoints made by transformers:

- V3: q-lora, yarn with mscale, sigmoid group-limited routing with e_score_correction_bias,
  norm_topk_prob, routed_scaling_factor 2.5, one shared expert, layer 0 dense (first_k_dense_replace);
- V2-Lite shape: no q-lora, softmax greedy top-k without renormalisation, two shared experts;

logits of prefill chunks over paged, shuffled blocks and of decode rows equal transformers'; greedy
ids through the executor (prefix caching on, prompts sharing a prefix, chunked context) equal its
generate; the routing equals transformers' routers; a block-FP8 checkpoint (weight_scale_inv as
DeepSeek ships it) gives the logits of its dequantized weights within activation rounding.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, EngineConfig
from engine.convert import getter_from_state_dict, model_config_from_hf, rank_weights
from engine.executor.runner import ForwardBatch, ModelRunner, keep_or_cast, load_rank_weights
from engine_testing import (EXECUTOR_POOL, PagedSession, assert_cuda_steps_equal_transformers,
                            assert_tp2_engines_match_tp1, hf_logits, make_engine, random_tokens)
from kernels.moe_grouped_routing import route_grouped
from test_fp8_block_checkpoints import save_block_checkpoint
from test_fp8_checkpoints import build_cli
from test_fp8_engine import all_logits

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
               kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
               max_position_embeddings=256, rms_norm_eps=1e-5)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
         "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}


def tiny_deepseek(version: str, seed: int = 0, **changes) -> torch.nn.Module:
    """Weights N(0, 0.1) (norms around 1), e_score_correction_bias N(0, 0.1): random routing biases."""
    if version == "v3":
        config = transformers.DeepseekV3Config(**{**_COMMON, **changes}, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
                                               n_group=4, topk_group=2, num_mtp_layers=0, rope_parameters=_YARN)
        model_class = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**{**_COMMON, **changes}, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                               norm_topk_prob=False, routed_scaling_factor=1.0)
        model_class = transformers.DeepseekV2ForCausalLM
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module", params=["v3", "v2"])
def deepseek(request, tmp_path_factory):
    """(transformers model, engine directory of pages of 4 tokens)."""
    hf = tiny_deepseek(request.param)
    return hf, make_engine(hf, tmp_path_factory.mktemp(f"deepseek_{request.param}") / "engine", tokens_per_block=4)


@pytest.mark.parametrize("expanded_min_tokens", [None, 4])
def test_chunks_and_decode_rows_equal_transformers(deepseek, expanded_min_tokens):
    """Two sequences: prompts in chunks (one over a cached prefix of 11), then decode rows beside a
    chunk, all in shared packed steps over shuffled pages of the latent pool; all absorbed, or with
    chunks of >= 4 new tokens in the expanded form (kernels/mla_expanded.py) beside absorbed rows."""
    hf, engine_dir = deepseek
    runner = ModelRunner(engine_dir)
    for layer in runner.model.layers:
        layer.attn.expanded_min_tokens = expanded_min_tokens
    seqs = {0: random_tokens(19, 3), 1: random_tokens(9, 4)}
    session = PagedSession(runner, num_blocks=32)
    a0, b0 = session.step([(0, seqs[0][:11]), (1, seqs[1][:7])])
    a1, b1 = session.step([(0, seqs[0][11:18]), (1, seqs[1][7:8])])
    a2, b2 = session.step([(0, seqs[0][18:]), (1, seqs[1][8:])])
    for seq, parts in ((0, (a0, a1, a2)), (1, (b0, b1, b2))):
        assert (torch.cat(parts) - hf_logits(hf, seqs[seq])).abs().max().item() <= 1e-4
    # One latent row per token per layer: (layers, 1, blocks, tokens, 1, kv_lora_rank + rope).
    assert runner.kv_cache.shape == (2, 1, 32, 4, 1, 32 + 8)


def test_fp8_latent_pool(deepseek):
    """kv_cache_dtype fp8: the latent rows stored as E4M3 (unscaled); logits near transformers'."""
    hf, engine_dir = deepseek
    runner = ModelRunner(engine_dir)
    runner.allocate_kv_cache(16, "fp8")
    prompt = random_tokens(13, 5)
    n = len(prompt)
    logits = runner.forward(ForwardBatch(prompt, list(range(n)), [n], [n], [list(range(4))], list(range(n))))
    reference = hf_logits(hf, prompt)
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert ((logits - reference).norm() / reference.norm()).item() < 0.1


def test_executor_greedy_ids_equal_transformers_generate(deepseek):
    """Three requests in flight, two sharing an 8-token prefix (the second reuses its cached blocks),
    prompts of 14 tokens in chunks of 6 (chunked context): each one's greedy ids equal generate's."""
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    hf, engine_dir = deepseek
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    shared = random_tokens(8, 21)
    prompts = [shared + random_tokens(6, 22), random_tokens(5, 23), shared + random_tokens(3, 24)]
    config = ExecutorConfig(**EXECUTOR_POOL, enable_kv_cache_reuse=True, enable_chunked_context=True,
                            max_num_tokens=8)
    finals = {}
    with Executor(engine_dir, config) as executor:
        first = executor.enqueue_requests([Request(prompts[0], 8, output=OutputConfig(exclude_input_from_output=True))])
        while not finals:
            for response in executor.await_responses(timeout=1.0):
                assert response.error is None, response.error
                if response.result.is_final:
                    finals[response.request_id] = response.result.output_token_ids[0]
        ids = first + executor.enqueue_requests([Request(p, 8, output=OutputConfig(exclude_input_from_output=True))
                                                 for p in prompts[1:]])
        while len(finals) < len(ids):
            for response in executor.await_responses(timeout=1.0):
                assert response.error is None, response.error
                if response.result.is_final:
                    finals[response.request_id] = response.result.output_token_ids[0]
        reused = executor.blocks.total_reused_blocks
    assert reused >= 2  # the third prompt's two full blocks of the shared prefix
    for prompt, request_id in zip(prompts, ids):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert finals[request_id] == expected.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_equals_transformers(deepseek):
    """fp32 on CUDA (IEEE dots in the Triton kernels, so routing matches fp32 transformers): a prompt,
    decode steps replayed from CUDA graphs (the latent write, the split latent-attention kernel, the routing and the experts inside them), then a packed mixed step."""
    hf, engine_dir = deepseek
    assert_cuda_steps_equal_transformers(hf, engine_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_graphs_on_cuda_equal_transformers(deepseek):
    """Steps of up to prefill_graph_max_tokens (31: the tiny shape expands from 32 new tokens) replay
    the prefill graphs: an 11-token prompt, then two sequences' short chunks in one step (an MTP verify
    step's shape, padded to the 16-token bucket: the padding rows' attention reads no sequence); logits
    within 1e-3 of transformers. A 40-token prompt stays eager (expanded)."""
    hf, engine_dir = deepseek
    runner = ModelRunner(engine_dir, device="cuda")
    session = PagedSession(runner, num_blocks=64)
    runner.capture_cuda_graphs()
    graphs = runner.prefill_graphs
    assert runner.model.prefill_graph_max_tokens == 31 and graphs.buckets == [16]
    replays, try_run = [], graphs.try_run

    def counted(*args, **kwargs):
        hidden = try_run(*args, **kwargs)
        replays.append(hidden is not None)
        return hidden

    graphs.try_run = counted
    a, b, c = random_tokens(15, seed=6), random_tokens(9, seed=7), random_tokens(40, seed=8)
    (first,) = session.step([(0, a[:11])])
    assert (first.cpu() - hf_logits(hf, a[:11])).abs().max().item() <= 1e-3
    tail, other = session.step([(0, a[11:]), (1, b[:5])])
    assert (tail.cpu() - hf_logits(hf, a)[11:]).abs().max().item() <= 1e-3
    assert (other.cpu() - hf_logits(hf, b[:5])).abs().max().item() <= 1e-3
    (long,) = session.step([(2, c)])
    assert (long.cpu() - hf_logits(hf, c)).abs().max().item() <= 1e-3
    assert replays[:2] == [True, True] and not replays[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lookahead_trees_on_cuda_give_the_greedy_ids(deepseek, device="cuda"):
    """Lookahead (3, 3, 3) on CUDA: its verify steps are token trees, attended by the MLA Triton kernel
    with the tree mask (kernels/mla_attention.py); greedy ids equal transformers' generate, some drafts
    kept (repetitive prompts). On the CPU, /tmp/notes/mlatree.md's ad hoc run forced the kernel under
    TRITON_INTERPRET=1 (14 tree calls, ids equal)."""
    from engine.executor.executor import Executor, ExecutorConfig, SpeculativeConfig
    from engine.executor.request import OutputConfig, Request

    hf, engine_dir = deepseek
    spec = SpeculativeConfig(mode="lookahead", lookahead_window_size=3, lookahead_ngram_size=3,
                             lookahead_verification_set_size=3)
    prompts = [[5, 17, 42, 8] * 4, [33, 9] * 6 + [4]]
    out = OutputConfig(exclude_input_from_output=True)
    finals = {}
    with Executor(engine_dir, ExecutorConfig(**EXECUTOR_POOL, speculative=spec), device=device) as executor:
        ids = executor.enqueue_requests([Request(p, 12, output=out) for p in prompts])
        while len(finals) < len(ids):
            for response in executor.await_responses(timeout=1.0):
                if response.result is not None and response.result.is_final:
                    finals[response.request_id] = response.result.output_token_ids[0]
    for prompt, request_id in zip(prompts, ids):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert finals[request_id] == expected.tolist()


def test_expert_parallel_ranks_give_the_single_rank_logits(deepseek, tmp_path):
    """moe_ep_size 2 over two gloo ranks (heads split, four whole experts a rank, each rank running
    the assignments routed to its own) gives the tp 1 engine's logits within 1e-5 on both ranks; a
    moe_ep_size that is not 1 or tp_size is refused by name."""
    hf, engine_dir = deepseek
    ep2 = make_engine(hf, tmp_path / "ep2", tokens_per_block=4, tp_size=2, moe_ep_size=2)
    config = EngineConfig.load(ep2).model
    assert config.moe_ep_size == 2
    shapes = {k: v.shape for k, v in load_rank_weights(ep2, 1, torch.device("cpu")).items() if ".moe." in k}
    assert shapes["layers.1.moe.gate_up_proj"] == (4, 2 * 32, 64) and shapes["layers.1.moe.router.weight"] == (8, 64)
    assert_tp2_engines_match_tp1({"deepseek_ep2": (engine_dir, ep2)}, tmp_path)
    with pytest.raises(ConfigError, match=r"moe_ep_size \(2\) must be 1 or tp_size \(1\)"):
        make_engine(hf, tmp_path / "bad", moe_ep_size=2)


@pytest.mark.parametrize("version", ["v3", "v2_group_limited"])
def test_routing_equals_transformers_routers(version):
    """route_grouped against transformers' DeepseekV3TopkRouter (sigmoid, bias, groups by their two
    best, renormalised, x2.5) and DeepseekV2TopkRouter (softmax, group_limited_greedy), as sets of
    (expert, weight) per token."""
    torch.manual_seed(5)
    if version == "v3":
        config = transformers.DeepseekV3Config(**_COMMON, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(8))
        kwargs = dict(method="noaux_tc", n_group=4, topk_group=2, score_bias=router.e_score_correction_bias,
                      renormalize=True, scaling=2.5)
    else:
        config = transformers.DeepseekV2Config(**_COMMON, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                               routed_scaling_factor=1.5)
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
        kwargs = dict(method="group_limited_greedy", n_group=4, topk_group=2, renormalize=False, scaling=1.5)
    router.weight.data.normal_()
    x = torch.randn(33, 64)
    _, hf_weights, hf_ids = router(x)
    weights, ids = route_grouped(x @ router.weight.T, 2, **kwargs)
    order, hf_order = ids.long().argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6)


def test_routing_weights_stay_float32_in_a_bf16_engine():
    """As transformers keeps gate.weight and e_score_correction_bias in float32 (in bf16 a near tie can
    pick another expert): a bf16 engine's converter writes them float32, the loader keeps them, the
    model declares them so; the experts are bf16."""
    hf = tiny_deepseek("v3")
    cfg = model_config_from_hf(hf.config)
    weights = rank_weights(getter_from_state_dict(hf.state_dict(), "tiny"), cfg, 0, 1, torch.bfloat16)
    for name in ("layers.1.moe.router.weight", "layers.1.moe.score_bias"):
        assert weights[name].dtype == keep_or_cast(name, weights[name], torch.bfloat16).dtype == torch.float32
    assert weights["layers.1.moe.gate_up_proj"].dtype == torch.bfloat16
    from engine.models.deepseek import DeepseekForCausalLM

    model = DeepseekForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    assert model.layers[1].moe.router.weight.dtype == model.layers[1].moe.score_bias.dtype == torch.float32


def test_block_fp8_checkpoint_gives_its_dequantized_logits(tmp_path):
    """Every projection and expert of the tiny V3 saved as E4M3 codes with weight_scale_inv (DeepSeek's
    layout; routers, norms, embeddings and lm_head unquantized), with an MTP layer as V3 ships one
    (layer 2: a copy of layer 1's codes and scales, eh_proj unquantized), builds an fp8_block engine
    without a flag whose logits are transformers' on the dequantized weights within the activation
    rounding, and whose MTP layer holds the checkpoint's codes and scales."""
    # MLP and expert widths of 128: fused gate/up rows then span whole 128-row blocks.
    model = tiny_deepseek("v3", intermediate_size=128, moe_intermediate_size=128)
    save_block_checkpoint(str(tmp_path / "ckpt"), model, ["lm_head"])
    add_mtp_layer_copying_layer_1(str(tmp_path / "ckpt"))
    built = build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine"))
    assert built.build.quantization == "fp8_block" and built.model.num_nextn_predict_layers == 1
    weights = load_rank_weights(str(tmp_path / "engine"), 0, torch.device("cpu"))
    for name in ("attn.q_a_proj.weight", "attn.q_a_proj.weight_scale", "moe.gate_up_proj", "moe.down_proj_scale"):
        mtp, layer = weights[f"mtp.layer.{name}"], weights[f"layers.1.{name}"]  # the MTP layer's codes carried too
        assert mtp.dtype == layer.dtype and torch.equal(mtp.view(torch.uint8), layer.view(torch.uint8))
    assert weights["mtp.eh_proj.weight"].dtype == torch.float32  # (DeepSeek ships eh_proj unquantized)
    ids = random_tokens(24, 9)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    engine = all_logits(str(tmp_path / "engine"), ids)
    # 0.089 measured; with the activations' 1 x 128 quantization stubbed out the same engine is within
    # 2e-5 of the reference (the codes and scales are carried exactly): the rest is activation rounding,
    # over more chained projections than a Llama block has (q_a, q_b, kv_a, o, shared and routed experts).
    assert ((engine - reference).norm() / reference.norm()).item() < 0.12


def add_mtp_layer_copying_layer_1(checkpoint: str) -> None:
    """Give a saved tiny V3 (2 layers) an MTP layer as DeepSeek-V3 ships one: model.layers.2.* holding
    layer 1's tensors as they are on disk (block-FP8 codes and scales included), enorm, hnorm,
    eh_proj and shared_head.norm; config.json's num_nextn_predict_layers 1."""
    path = os.path.join(checkpoint, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors["model.layers.2." + name[len("model.layers.1."):]] = tensors[name].clone()
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.2.{name}.weight"] = torch.ones(hidden)
    tensors["model.layers.2.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden)
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(checkpoint, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_shared_experts_appended_to_the_routed_ones_give_the_same_layer(quantization):
    """DeepseekExperts.init_buffers: the shared SwiGLU cut into S experts of the routed width (block-FP8
    scales too: I = 128, one scale block a run) and chosen with weight 1 gives the layer's output of
    the separate shared Linears, at decode sizes (the path that reads them)."""
    from engine.models.deepseek import DeepseekExperts
    from kernels.fp8_block import quantize_blocks

    hf = tiny_deepseek("v2", hidden_size=128, moe_intermediate_size=128)
    cfg = model_config_from_hf(hf.config)
    experts = DeepseekExperts(cfg, tp_size=1, tp_group=None, dtype=torch.float32, device="cpu",
                              quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    for name, p in experts.named_parameters():
        values = torch.randn(p.shape, generator=gen) * 0.1
        if p.dtype == torch.float8_e4m3fn:
            scale = dict(experts.named_parameters())[name.removesuffix(".weight") + ".weight_scale"
                                                     if name.endswith(".weight") else name + "_scale"]
            codes, block_scales = quantize_blocks(values)
            p.data.copy_(codes)
            scale.data.copy_(block_scales)
        elif not name.endswith("scale"):
            p.data.copy_(values)
    x = torch.randn(3, 128, generator=gen)
    apart = experts(x)
    experts.init_buffers()
    assert experts.with_shared is not None and experts.with_shared[0].shape[0] == cfg.num_experts + 2
    assert experts.gate_up_proj.data_ptr() == experts.with_shared[0].data_ptr()  # a view, not a copy
    together = experts(x)
    assert (together - apart).abs().max().item() < 1e-5 * apart.abs().max().item()  # (measured ~1e-7 relative)


def run_interpreted(*versions: str) -> list[list[str]]:
    """deepseek_interpreted.py in a subprocess: its "ok" lines, split."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("deepseek_interpreted.py")
    run = subprocess.run([sys.executable, str(script), *versions], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert [line[1] for line in lines] == list(versions), run.stdout + run.stderr[-3000:]
    return lines


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (~20 s)")
def test_cuda_path_in_the_interpreter_equals_transformers():
    """deepseek_interpreted.py: the engines' CUDA code path (Triton kernels in the interpreter) on CPU. V3 on
    pages of 4 (decode steps through the general MLA kernel: kernels/mla_decode.py's tiles do not fit), V2 on
    pages of 32 (through kernels/mla_decode.py, its launches counted)."""
    lines = run_interpreted("v3", "v2:32")
    assert all(float(line[2]) <= 1e-4 and int(line[3]) >= int(line[4]) > 0 for line in lines), lines
    assert lines[0][5] == "0" and int(lines[1][5]) > 0, lines


def test_unsupported_settings_are_refused_by_name():
    config = tiny_deepseek("v2").config
    config.topk_method = "random"
    with pytest.raises(ConfigError, match="unsupported topk_method 'random'; supported: greedy"):
        model_config_from_hf(config)
    with pytest.raises(ConfigError, match="quantization 'fp8' is not supported for DeepseekV2ForCausalLM"):
        from engine.models.deepseek import DeepseekForCausalLM

        config.topk_method = "greedy"
        DeepseekForCausalLM(model_config_from_hf(config), device="meta", quantization="fp8")
