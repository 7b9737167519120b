"""Integer weight-only engines built from float checkpoints (--quantization int8_wo / int4_wo):
their logits equal the dequantized model's, tensor-parallel shards keep whole groups, and bad
schemes are refused naming the tensor and the rule.

The oracle is transformers' model with every decoder linear weight (and every expert) replaced by
its round-to-nearest quantize-dequantize (kernels.wna16.quantize/dequantize, the build's own
arithmetic applied per checkpoint module): the engine must compute exactly that model, so the
bound is float32 rounding (1e-4 on logits of magnitude ~1), not quantization error.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine.config import BuildConfig, ConfigError, EngineConfig
from engine.executor.runner import ModelRunner
from engine_testing import (GROUPABLE, VOCAB, PagedSession, assert_tp2_engines_match_tp1, make_engine, random_tokens,
                            tiny_hf)
from kernels.wna16 import dequantize, quantize, unpack_codes

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight", "qkv_proj.weight", "gate_up_proj.weight",
                   "experts.gate_up_proj", "experts.down_proj")


def dequantized_hf(hf, bits: int, group_size: int) -> torch.nn.Module:
    """A copy of ``hf`` whose decoder linears and experts hold their quantize-dequantize."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and name.endswith(LINEAR_SUFFIXES):
                group = p.shape[-1] if group_size == 0 else group_size
                p.copy_(dequantize(*quantize(p, bits, group, symmetric=bits == 8), bits))
    return model


def engine_logits(engine_dir: str, tokens: list[int]) -> torch.Tensor:
    session = PagedSession(ModelRunner(engine_dir, device="cpu"))
    prefill = session.step([(0, tokens[:-2])])[0]
    decode = [session.step([(0, [t])])[0] for t in tokens[-2:]]
    return torch.cat([prefill] + decode)


@torch.no_grad()
def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


CASES = [  # (model, quantization, group size, bits)
    ("llama_groupable", "int4_wo", 32, 4),
    ("llama_groupable", "int4_wo", 0, 4),
    ("llama_groupable", "int8_wo", None, 8),  # int8 default: per channel
    ("qwen2_qkv_bias", "int8_wo", 32, 8),
    ("phi4_mini_partial_rotary", "int4_wo", 0, 4),  # fused qkv in the checkpoint, partial-rotary row order
    ("qwen3_moe", "int4_wo", 0, 4),  # experts and a dense layer
    ("mixtral", "int8_wo", 0, 8),
]


@pytest.mark.parametrize("family,quantization,group_size,bits", CASES)
def test_engine_equals_the_dequantized_model(family, quantization, group_size, bits, tmp_path):
    hf = tiny_hf(family)
    engine_dir = make_engine(hf, tmp_path / "engine", quantization=quantization, group_size=group_size)
    tokens = random_tokens(12, seed=3)
    expected = reference_logits(dequantized_hf(hf, bits, group_size or 0), tokens)
    error = (engine_logits(engine_dir, tokens) - expected).abs().max().item()
    assert error < 1e-4, f"{family} {quantization}: max |logit error| {error:.3g} against the dequantized model"
    # ... and the quantization is real: the float model differs by far more than that bound.
    assert (reference_logits(hf, tokens) - expected).abs().max().item() > 1e-3


def test_stored_tensors_follow_the_format(tmp_path):
    hf = tiny_hf("llama_groupable")
    engine_dir = make_engine(hf, tmp_path / "engine", quantization="int4_wo", group_size=32)
    config, weights = EngineConfig.load(engine_dir), load_file(f"{engine_dir}/rank0.safetensors")
    assert (config.build.quantization, config.build.quant_group_size) == ("int4_wo", 32)
    qkv = weights["layers.0.qkv_proj.weight"]
    assert qkv.dtype == torch.uint8 and qkv.shape == (64 + 2 * 32, 32)  # two 4-bit codes a byte
    assert weights["layers.0.qkv_proj.weight_scale"].shape == (128, 2)
    assert weights["layers.0.down_proj.weight_zero"].dtype == torch.uint8
    assert weights["lm_head.weight"].dtype == torch.float32 and weights["embed_tokens.weight"].dtype == torch.float32
    # q_proj's rows quantized on their own give the fused tensor's first rows.
    codes, _, _ = quantize(hf.model.layers[0].self_attn.q_proj.weight.detach(), 4, 32, symmetric=False)
    assert torch.equal(unpack_codes(qkv[:64], 4), unpack_codes(codes, 4))


def test_tp2_equals_tp1_with_groups_split_along_input_columns(tmp_path):
    """int4 group 32 at tp 2: o_proj and down_proj split their groups across ranks (64/2 and 128/2
    columns: 1 and 2 groups a rank); two gloo ranks give tp 1's logits."""
    hf = tiny_hf("llama_groupable")
    tp1 = make_engine(hf, tmp_path / "tp1", quantization="int4_wo", group_size=32)
    tp2 = make_engine(hf, tmp_path / "tp2", quantization="int4_wo", group_size=32, tp_size=2)
    ranks = [load_file(f"{tp2}/rank{r}.safetensors") for r in range(2)]
    full = load_file(f"{tp1}/rank0.safetensors")
    for suffix in ("weight", "weight_scale", "weight_zero"):  # row-parallel: split along K and along the groups
        name = f"layers.1.down_proj.{suffix}"
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), full[name]), name
    assert_tp2_engines_match_tp1({"int4": (tp1, tp2)}, tmp_path)


def test_group_size_must_divide_every_layer(tmp_path):
    hf = tiny_hf("qwen3")  # hidden 72: no 64-column groups
    with pytest.raises(ConfigError, match=r"layers\.0\.qkv_proj\.weight: 72 input columns .* groups of 64"):
        make_engine(hf, tmp_path / "bad", quantization="int4_wo", group_size=64)


def test_groups_must_not_straddle_tensor_parallel_ranks(tmp_path):
    hf = tiny_hf("llama_groupable")  # o_proj: 64 columns, 32 a rank: a group of 64 would straddle the ranks
    with pytest.raises(ConfigError, match=r"o_proj\.weight: 32 input columns .* groups of 64"):
        make_engine(hf, tmp_path / "bad", quantization="int4_wo", group_size=64, tp_size=2)


@pytest.mark.parametrize("quantization,group_size,message", [
    ("int4_wo", 48, r"unsupported quant_group_size 48; supported: 32, 64, 128, 256 or 0"),
    ("fp8", 128, r"quant_group_size applies to int8_wo, int4_wo, int4_awq, not to quantization fp8"),
])
def test_bad_schemes_are_refused_by_name(quantization, group_size, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        make_engine(tiny_hf("llama_groupable"), tmp_path / "bad", quantization=quantization, group_size=group_size)


def test_families_without_integer_linears_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"quantization int4_wo is not supported for GPT2LMHeadModel; it is for "
                                          r"LlamaForCausalLM"):
        make_engine(tiny_hf("gpt2"), tmp_path / "bad", quantization="int4_wo")


def test_random_weight_engines_hold_valid_codes(tmp_path):
    """Benchmark engines (config only, weights made at load) get codes, mid-range zeros and
    scales giving weights of std ~0.02, so a forward is finite."""
    from engine.executor.random_weights import materialize_random_weights
    from engine.models.layers import prepare_weights
    from engine.models.llama import LlamaForCausalLM
    from engine.convert import model_config_from_hf

    cfg = model_config_from_hf(tiny_hf("llama_groupable").config)
    scheme = BuildConfig(quantization="int4_wo", quant_group_size=32).weight_only
    model = materialize_random_weights(LlamaForCausalLM(cfg, device="meta", quantization=scheme),
                                       torch.device("cpu"), seed=0)
    prepare_weights(model)
    dense = model.layers[0].gate_up_proj.wna16.dense
    assert 0.015 < dense.std().item() < 0.025 and dense.abs().max().item() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the W4A16 kernels need a CUDA device")
@pytest.mark.parametrize("family,quantization,group_size", [("llama_groupable", "int4_wo", 32),
                                                            ("llama_groupable", "int8_wo", None),
                                                            ("qwen3_moe", "int4_wo", 0)])
def test_cuda_engine_with_graphs_matches_the_cpu_reference(family, quantization, group_size, tmp_path):
    """The kernels' layout (made at load), the decode tilings timed at load and the decode CUDA
    graphs give the CPU reference's logits (the dequantized model) within bf16 rounding."""
    hf = tiny_hf(family)
    engine_dir = make_engine(hf, tmp_path / "engine", dtype="bfloat16", max_seq_len=128, quantization=quantization,
                             group_size=group_size)
    tokens = random_tokens(14, seed=5)
    expected = engine_logits(engine_dir, tokens)  # CPU: the dequantized weights in bf16
    runner = ModelRunner(engine_dir, device="cuda")
    session = PagedSession(runner)
    runner.capture_cuda_graphs()
    runner.warmup()
    assert runner.decode_graphs is not None
    got = torch.cat([session.step([(0, tokens[:-2])])[0]] + [session.step([(0, [t])])[0] for t in tokens[-2:]])
    error = ((got.float().cpu() - expected.float()).norm() / expected.float().norm()).item()
    assert error < 2e-2, f"{family} {quantization}: relative error {error:.2e} against the CPU reference"


def test_lora_adapters_on_integer_base_weights(tmp_path):
    """An adapter served on an INT4 engine equals the dequantized model with the adapter merged in
    (greedy ids, mixed adapter and base rows in one batch): the adapters read the layer's input in
    the model dtype, beside the integer product."""
    from engine.executor import Executor, ExecutorConfig, LoraRequest
    from test_lora_merged import POOL, greedy, merged, write_adapter

    hf = tiny_hf("llama_groupable")
    weights = write_adapter(hf, tmp_path / "adapter", rank=8, alpha=16, seed=1)
    dequantized = dequantized_hf(hf, 4, 32)
    expected_base = make_engine(dequantized, tmp_path / "base")
    expected_adapter = make_engine(merged(dequantized, weights, 2.0), tmp_path / "merged")
    prompts = [random_tokens(6 + 3 * i, seed=40 + i) for i in range(2)]
    wanted = {}
    for key, engine_dir in (("base", expected_base), ("adapter", expected_adapter)):
        with Executor(engine_dir, ExecutorConfig(**POOL), device="cpu") as executor:
            wanted[key] = greedy(executor, [(p, None) for p in prompts])
    assert wanted["adapter"] != wanted["base"]
    quantized = make_engine(hf, tmp_path / "int4", quantization="int4_wo", group_size=32)
    adapter = LoraRequest(task_id=1, path=str(tmp_path / "adapter"))
    with Executor(quantized, ExecutorConfig(enable_lora=True, max_loras=1, max_lora_rank=8, **POOL),
                  device="cpu") as executor:
        got = greedy(executor, [(p, lora) for p in prompts for lora in (adapter, None)])
    assert got == [wanted[key][i] for i in range(len(prompts)) for key in ("adapter", "base")]


def test_int4_awq_refuses_an_unsupported_family_before_calibrating(tmp_path, monkeypatch):
    import engine.weight_only.awq as awq

    monkeypatch.setattr(awq, "awq_transform", lambda *a, **k: pytest.fail("calibrated a family it then refuses"))
    with pytest.raises(ConfigError, match=r"quantization int4_awq is not supported for GPT2LMHeadModel"):
        make_engine(tiny_hf("gpt2"), tmp_path / "bad", quantization="int4_awq", group_size=32)


class _ByteTokenizer:
    """Bytes as ids within a tiny vocabulary: enough text for AWQ to calibrate a random model."""

    def __call__(self, text: str, **_kwargs) -> dict:
        return {"input_ids": [1] + [2 + b % (VOCAB - 2) for b in text.encode()]}

    def save_pretrained(self, _path) -> None:
        pass


def test_int4_awq_builds_a_moe_checkpoint_directory(tmp_path, monkeypatch):
    """A Qwen3-MoE directory on disk (one tensor per expert) calibrates through transformers' own
    loading (stacked experts), gets AWQ on attention and round-to-nearest experts, and runs."""
    import engine.build as build_module
    from engine.build import build_engine

    config = transformers.Qwen3MoeConfig(**GROUPABLE, head_dim=16, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1])
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    load_hf_dir = build_module.load_hf_dir
    monkeypatch.setattr(build_module, "load_hf_dir", lambda path: (*load_hf_dir(path)[:2], _ByteTokenizer()))
    build = BuildConfig(dtype="float32", max_batch_size=2, max_seq_len=64, quantization="int4_awq",
                        quant_group_size=32)
    build_engine(str(tmp_path / "ckpt"), str(tmp_path / "engine"), build, progress=False, calibration_tokens=64)
    weights = load_file(f"{tmp_path}/engine/rank0.safetensors")
    assert weights["layers.0.moe.gate_up_proj"].dtype == torch.uint8 and "layers.0.moe.down_proj_zero" in weights
    logits = engine_logits(str(tmp_path / "engine"), random_tokens(8, seed=1))
    assert torch.isfinite(logits).all() and logits.std() > 0
