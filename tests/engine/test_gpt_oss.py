"""gpt-oss beyond the shared family tests (test_equivalence.py runs the tiny "gpt_oss" config of
engine_testing: sinks, a window of 6 on alternate layers, yarn, biases, top-4 of 12 experts with a
clamped SwiGLU, against transformers through the paged cache): checkpoints with MXFP4 experts as
OpenAI ships them, built keeping the experts in MXFP4 (the default) or widening them, against
transformers and against each other; the kept engine's bytes are the checkpoint's, the widening's
exactness against transformers' own dequantization, malformed MXFP4 tensors and scale-group-cutting
splits refused by name, gpt-oss-20b's weight bytes either way, the config mapping, two gloo ranks,
and the harmony chat template carried into the engine directory.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.build import main
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.convert import CheckpointError, getter_from_state_dict, model_config_from_hf
from engine.executor.runner import ModelRunner
from engine.models import get_model_class
from engine.mxfp4 import dequantize_mxfp4, mxfp4_getter, mxfp4_keeping_getter, widen_mxfp4_checkpoint
from engine_testing import (PagedSession, VOCAB, assert_tp2_engines_match_tp1, assert_tp2_matches_tp1, hf_logits,
                            make_engine, random_tokens, tiny_hf)
from mxfp4_checkpoints import transformers_mxfp4_model, write_mxfp4_checkpoint

EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> str:
    return write_mxfp4_checkpoint(tiny_hf("gpt_oss"), tmp_path_factory.mktemp("mxfp4"))


def test_config_maps_every_gpt_oss_field(tmp_path):
    config = EngineConfig.load(make_engine(tiny_hf("gpt_oss"), tmp_path / "e")).model
    assert [config.layer_window(i) for i in range(config.num_layers)] == [6, None]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (12, 4, 32)
    assert config.swiglu_limit == 0.5 and config.qkv_bias and config.norm_topk_prob and config.head_dim == 16
    assert {k: config.rope_scaling[k] for k in ("rope_type", "factor", "truncate", "original_max_position_embeddings")} \
        == {"rope_type": "yarn", "factor": 4.0, "truncate": False, "original_max_position_embeddings": 64}
    assert config.rope_theta == 150000.0


def test_other_swiglu_alpha_is_refused():
    hf_config = tiny_hf("gpt_oss").config
    hf_config.swiglu_alpha = 1.5
    with pytest.raises(ConfigError, match="swiglu_alpha 1.5 is not supported; the experts' kernels use gpt-oss's 1.702"):
        model_config_from_hf(hf_config)


def _build(checkpoint, engine, *args) -> str:
    assert main(["--checkpoint", str(checkpoint), "--output", str(engine), *args]) == 0
    return str(engine)


def _session_logits(engine: str, sequence: list[int], *, device=None) -> torch.Tensor:
    """A prompt past the window (14 tokens), then decode steps: every position's logits, on CPU."""
    session = PagedSession(ModelRunner(engine, device=device) if device else ModelRunner(engine), num_blocks=16)
    if device == "cuda":
        session.runner.capture_cuda_graphs()
    steps = session.step([(0, sequence[:14])]) + [session.step([(0, [token])])[0] for token in sequence[14:]]
    return torch.cat(steps).cpu()


@pytest.mark.parametrize("experts,described", [("keep", "mxfp4 experts, kept"),
                                               ("widen", "mxfp4 experts, widened at build")])
def test_mxfp4_checkpoint_equals_transformers(mxfp4_checkpoint, tmp_path, experts, described):
    """`python -m engine.build` of a checkpoint with MXFP4 experts (float32 engine), its experts kept
    as MXFP4 or widened, against transformers loading the same directory with
    Mxfp4Config(dequantize=True): a prompt past the window, then decode steps through pages of 4,
    within 1e-4."""
    engine = _build(mxfp4_checkpoint, tmp_path / "engine", "--dtype", "float32", "--tokens_per_block", "4",
                    "--mxfp4_experts", experts)
    config = EngineConfig.load(engine)
    assert config.extra["source_quantization"] == described
    assert config.model.expert_quantization == ("mxfp4" if experts == "keep" else None)
    sequence = random_tokens(24, seed=5)
    expected = hf_logits(transformers_mxfp4_model(mxfp4_checkpoint), sequence)
    assert (_session_logits(engine, sequence) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_kept_mxfp4_experts_equal_the_widened_build(mxfp4_checkpoint, tmp_path, dtype, tolerance):
    """The same weights either way (the kept experts widen exactly to what the widening build
    stores), so the same logits up to the CPU GEMMs' accumulation, which may differ with the
    operands' alignment (the widened experts are read from the rank file, the kept ones widened at
    load): float32 within 1e-5, bf16 (logits O(1), ulp 2^-8) within 2e-2."""
    sequence = random_tokens(20, seed=8)
    engine = _build(mxfp4_checkpoint, tmp_path / "kept", "--dtype", dtype)
    model = ModelRunner(engine).model
    widened_engine = _build(mxfp4_checkpoint, tmp_path / "widened", "--dtype", dtype, "--mxfp4_experts", "widen")
    widened_model = ModelRunner(widened_engine).model
    for kept_layer, widened_layer in zip(model.layers, widened_model.layers):
        assert torch.equal(kept_layer.moe.experts[0].dense, widened_layer.moe.gate_up_proj)
        assert torch.equal(kept_layer.moe.experts[1].dense, widened_layer.moe.down_proj)
    kept, widened = _session_logits(engine, sequence), _session_logits(widened_engine, sequence)
    assert (kept - widened).abs().max().item() <= tolerance


def test_kept_engine_holds_the_checkpoint_bytes(mxfp4_checkpoint, tmp_path):
    """The engine's codes and exponents are the checkpoint's bytes, the rows de-interleaved into
    [gate | up] (a copy, no re-encoding), beside the model-dtype biases."""
    weights = load_file(f"{_build(mxfp4_checkpoint, tmp_path / 'engine', '--dtype', 'bfloat16')}/rank0.safetensors")
    checkpoint = load_file(f"{mxfp4_checkpoint}/model.safetensors")
    for i in range(2):
        experts = f"model.layers.{i}.mlp.experts."
        codes = checkpoint[experts + "gate_up_proj_blocks"].flatten(-2)  # (E, 2I, H/2), gate and up alternating
        scales = checkpoint[experts + "gate_up_proj_scales"]
        assert torch.equal(weights[f"layers.{i}.moe.gate_up_proj"], torch.cat([codes[:, 0::2], codes[:, 1::2]], 1))
        assert torch.equal(weights[f"layers.{i}.moe.gate_up_proj_scale"], torch.cat([scales[:, 0::2], scales[:, 1::2]], 1))
        assert torch.equal(weights[f"layers.{i}.moe.down_proj"], checkpoint[experts + "down_proj_blocks"].flatten(-2))
        assert torch.equal(weights[f"layers.{i}.moe.down_proj_scale"], checkpoint[experts + "down_proj_scales"])
        assert weights[f"layers.{i}.moe.down_proj"].dtype == torch.uint8
        assert weights[f"layers.{i}.moe.gate_up_bias"].dtype == torch.bfloat16


def test_kept_mxfp4_experts_on_two_gloo_ranks(tmp_path):
    """Experts of width 64 split over two ranks (32 a rank: one scale group each): rank r holds
    down's bytes [16r, 16r + 16) and exponent r of every row; TP 2 gives TP 1's logits."""
    hf_config = tiny_hf("gpt_oss").config
    hf_config.intermediate_size = 64
    torch.manual_seed(3)
    hf = transformers.GptOssForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    checkpoint = write_mxfp4_checkpoint(hf, tmp_path / "ckpt")
    fp32 = ("--dtype", "float32")
    engines = {"kept": (_build(checkpoint, tmp_path / "tp1", *fp32),
                        _build(checkpoint, tmp_path / "tp2", *fp32, "--tp_size", "2"))}
    rank1 = load_file(f"{engines['kept'][1]}/rank1.safetensors")
    down = load_file(f"{checkpoint}/model.safetensors")["model.layers.0.mlp.experts.down_proj_blocks"].flatten(-2)
    assert torch.equal(rank1["layers.0.moe.down_proj"], down[:, :, 16:])
    assert_tp2_engines_match_tp1(engines, tmp_path)


def test_a_split_that_cuts_a_scale_group_is_refused(mxfp4_checkpoint, tmp_path, capsys):
    """Experts of width 32 at TP 2 would leave 16 values of a 32-value group on each rank: kept
    MXFP4 is refused naming the numbers and the way out; widened, the same split builds."""
    assert main(["--checkpoint", mxfp4_checkpoint, "--output", str(tmp_path / "e"), "--tp_size", "2"]) == 2
    assert ("error: MXFP4 experts kept: tp_size 2 splits the experts' width (moe_intermediate_size 32) into slices "
            "of 16, which cuts a scale group of 32 values" in capsys.readouterr().err)
    assert main(["--checkpoint", mxfp4_checkpoint, "--output", str(tmp_path / "e"), "--tp_size", "2",
                 "--mxfp4_experts", "widen"]) == 0


def test_gpt_oss_20b_weight_bytes_kept_and_widened():
    """gpt-oss-20b's shape in bf16 (meta device, no memory): ~13.8 GB with its experts in MXFP4
    (4.25 bits a weight), ~41.8 GB widened."""
    shape = dict(architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
                 num_kv_heads=8, head_dim=64, intermediate_size=2880, max_position_embeddings=131072, qkv_bias=True,
                 num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880, swiglu_limit=7.0)
    sizes = {}
    for quantization in (None, "mxfp4"):
        config = ModelConfig(**shape, expert_quantization=quantization).validate()
        model = get_model_class(config.architecture)(config, dtype=torch.bfloat16, device="meta")
        sizes[quantization] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    expert_values = 24 * 32 * 3 * 2880 * 2880
    assert sizes[None] - sizes["mxfp4"] == expert_values * 2 - expert_values * 17 // 32  # 16 bits -> 4.25
    assert 13.5e9 < sizes["mxfp4"] < 14e9 and 41.5e9 < sizes[None] < 42e9


def test_bf16_engine_holds_transformers_dequantized_experts_exactly(mxfp4_checkpoint, tmp_path):
    """A bf16 build's widened experts equal, bit for bit, what transformers' bf16 dequantization
    holds (transposed to (E, out, in), gate and up de-interleaved into [gate | up] rows)."""
    engine = str(tmp_path / "engine")
    assert main(["--checkpoint", mxfp4_checkpoint, "--output", engine, "--dtype", "bfloat16",
                 "--mxfp4_experts", "widen"]) == 0
    weights = load_file(f"{engine}/rank0.safetensors")
    reference = transformers_mxfp4_model(mxfp4_checkpoint, torch.bfloat16).model.layers
    for i, layer in enumerate(reference):
        gate_up = layer.mlp.experts.gate_up_proj.transpose(1, 2)  # (E, 2I, H), gate and up alternating
        assert torch.equal(weights[f"layers.{i}.moe.gate_up_proj"], torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
        assert torch.equal(weights[f"layers.{i}.moe.down_proj"], layer.mlp.experts.down_proj.transpose(1, 2))


def test_widening_equals_transformers_for_every_byte_and_exponent():
    """Every byte (both nibbles, signed zeros included) under every exponent whose values stay below
    2^128 (0, the subnormal 2^-127, to 252), against transformers' convert_moe_packed_tensors."""
    exponents = torch.arange(253, dtype=torch.uint8)
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(253, 1, 1)  # (253 rows, 16 groups, 16)
    scales = exponents[:, None].expand(253, 16).contiguous()
    widened = dequantize_mxfp4(blocks[None], scales[None])
    expected = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.bfloat16)
    assert torch.equal(widened.transpose(1, 2), expected)
    assert widened[0, 0].float().abs().min() == 0 and widened[0, 0].float().abs().max() == 6 * 2.0**-127


def _malformed(blocks=None, scales=None):
    good_blocks, good_scales = torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.full((2, 4, 1), 120, dtype=torch.uint8)
    return {EXPERTS + "_blocks": good_blocks if blocks is None else blocks,
            EXPERTS + "_scales": good_scales if scales is None else scales}


@pytest.mark.parametrize("tensors,message", [
    (_malformed(blocks=torch.zeros(2, 4, 1, 16, dtype=torch.int8)), "_blocks and _scales must be uint8"),
    (_malformed(blocks=torch.zeros(2, 4, 1, 8, dtype=torch.uint8)), r"_blocks \(2, 4, 1, 8\) must be _scales' shape "
                                                                    r"\(2, 4, 1\) plus a last dim of 16 bytes"),
    (_malformed(scales=torch.full((2, 4, 2), 120, dtype=torch.uint8)), "must be _scales' shape"),
    (_malformed(scales=torch.full((2, 4, 1), 255, dtype=torch.uint8)), "_scales holds 255, which is NaN"),
    (_malformed(blocks=torch.full((2, 4, 1, 16), 0x77, dtype=torch.uint8),
                scales=torch.full((2, 4, 1), 254, dtype=torch.uint8)), "a value reaches 2\\^128"),
    ({EXPERTS + "_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8)}, f"lacks the tensor '{EXPERTS}_scales'"),
], ids=["dtype", "block-width", "group-count", "nan-exponent", "overflow", "no-scales"])
def test_malformed_mxfp4_tensors_are_refused_by_name(tensors, message):
    get = mxfp4_getter(getter_from_state_dict(tensors, "ckpt"))
    with pytest.raises(CheckpointError, match=message) as raised:
        get(EXPERTS)
    assert EXPERTS in str(raised.value)
    if "_scales" in "".join(tensors) and message != "a value reaches 2\\^128":  # the same checks keeping them
        with pytest.raises(CheckpointError, match=message):
            mxfp4_keeping_getter(getter_from_state_dict(tensors, "ckpt"))(EXPERTS + "_blocks")


def test_exponents_the_kernels_do_not_take_are_refused_when_kept():
    tensors = _malformed(scales=torch.full((2, 4, 1), 241, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=f"MXFP4 tensor {EXPERTS}: _scales up to 241; MXFP4 experts are kept "
                                              "with exponents up to 240 .*: build with --mxfp4_experts widen"):
        mxfp4_keeping_getter(getter_from_state_dict(tensors, "ckpt"))(EXPERTS + "_scales")


def test_a_corrupt_mxfp4_checkpoint_fails_the_build_naming_the_tensor(mxfp4_checkpoint, tmp_path, capsys):
    import shutil

    broken = shutil.copytree(mxfp4_checkpoint, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][0, 0, 0] = 255
    save_file(tensors, str(broken / "model.safetensors"))
    assert main(["--checkpoint", str(broken), "--output", str(tmp_path / "e")]) == 2
    assert ("error: MXFP4 tensor model.layers.1.mlp.experts.down_proj: _scales holds 255"
            in capsys.readouterr().err)
    assert not (tmp_path / "e" / "config.json").exists()


def test_mxfp4_is_refused_for_other_families():
    with pytest.raises(ConfigError, match="MXFP4 checkpoints are supported for GptOssForCausalLM, not LlamaForCausalLM"):
        widen_mxfp4_checkpoint(transformers.LlamaConfig(), getter_from_state_dict({}, "ckpt"), "LlamaForCausalLM")


def test_two_gloo_ranks_compute_tp1_logits(tmp_path):
    """Each rank holds half the heads (and their sinks) and half of every expert's width; only
    rank 0 adds the experts' down biases, so the all-reduce counts them once."""
    assert_tp2_matches_tp1({"gpt_oss": tiny_hf("gpt_oss")}, tmp_path)


def test_attention_adapters_equal_their_merge(tmp_path):
    """A LoRA adapter on q/k/v/o (served by default: `make serve` turns LoRA on) equals its merge
    into the weights; the experts take none, as on the other mixture-of-experts families."""
    from engine.executor import Executor, ExecutorConfig, LoraRequest
    from test_lora_merged import POOL, greedy, merged, write_adapter

    hf = tiny_hf("gpt_oss")
    weights = write_adapter(hf, tmp_path / "attn", rank=4, alpha=8, seed=3, modules=("q", "k", "v", "o"))
    prompts = [random_tokens(6 + 3 * i, seed=40 + i) for i in range(2)]
    with Executor(make_engine(merged(hf, weights, 2.0), tmp_path / "merged"), ExecutorConfig(**POOL)) as executor:
        wanted = greedy(executor, [(p, None) for p in prompts])
    with Executor(make_engine(hf, tmp_path / "base"), ExecutorConfig(enable_lora=True, max_loras=2, **POOL)) as executor:
        adapter = LoraRequest(task_id=1, path=str(tmp_path / "attn"))
        got = greedy(executor, [(p, adapter) for p in prompts] + [(p, None) for p in prompts])
    assert got[:2] == wanted and got[2:] != wanted  # adapter rows as merged; base rows in the same steps differ


HARMONY_LIKE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_engine_directory_carries_the_checkpoint_chat_template(tmp_path):
    """gpt-oss ships its harmony template as chat_template.jinja: the build copies it with the
    tokenizer, and the OpenAI frontend renders chat prompts with it from the engine directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from openai_frontend.chat_template import PromptBuilder

    checkpoint = tmp_path / "ckpt"
    tiny_hf("gpt_oss").save_pretrained(checkpoint)
    words = ["<|start|>", "<|end|>", "<|message|>", "<|return|>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|return|>").save_pretrained(checkpoint)
    (checkpoint / "chat_template.jinja").write_text(HARMONY_LIKE)
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine")]) == 0
    assert (tmp_path / "engine" / "chat_template.jinja").read_text() == HARMONY_LIKE
    text = PromptBuilder(str(tmp_path / "engine")).render_chat([{"role": "user", "content": "w5 w6"}])
    assert text == "<|start|>user<|message|>w5 w6<|end|><|start|>assistant"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-3), ("bfloat16", 0.15)])
def test_kept_mxfp4_engine_on_cuda(mxfp4_checkpoint, tmp_path, dtype, tolerance):
    """The MXFP4 kernels in an engine on CUDA (a 14-token prefill through the grouped GEMM, decode
    steps replayed from CUDA graphs with the routing inside the FMA kernel's launch, then a packed
    step of 41 tokens), against the widened engine (the same weights; equal to transformers within
    1e-4 on CPU, test_mxfp4_checkpoint_equals_transformers): float32 on CPU within 1e-3 as the
    model-dtype engine on CUDA is to transformers; bf16 on CUDA within bf16's roundings. (transformers
    itself on a CUDA machine dequantizes MXFP4 to bf16 whatever dtype is asked.)"""
    sequence, other = random_tokens(20, seed=6), random_tokens(40, seed=9)
    engine = _build(mxfp4_checkpoint, tmp_path / "kept", "--dtype", dtype)
    widened = _build(mxfp4_checkpoint, tmp_path / "widened", "--dtype", dtype, "--mxfp4_experts", "widen")
    reference_device = None if dtype == "float32" else "cuda"
    expected = _session_logits(widened, sequence, device=reference_device)
    assert (_session_logits(engine, sequence, device="cuda") - expected).abs().max().item() <= tolerance
    outs = []
    for path, device in ((engine, "cuda"), (widened, reference_device)):
        session = PagedSession(ModelRunner(path, device=device) if device else ModelRunner(path), num_blocks=32)
        session.step([(0, sequence[:3])])
        outs.append(session.step([(1, other), (0, sequence[3:4])])[0].cpu())
    assert (outs[0] - outs[1]).abs().max().item() <= tolerance


def test_random_weight_engines_hold_valid_mxfp4_experts():
    """Benchmark engines (config only, weights made at load): MXFP4 experts of random codes and
    scales 2^-7, widening to weights of std ~0.02, so a forward is finite."""
    from engine.executor.random_weights import materialize_random_weights
    from kernels.fused_moe_mxfp4 import dequantize_mxfp4_experts

    config = ModelConfig.from_dict({**model_config_from_hf(tiny_hf("gpt_oss").config).to_dict(),
                                    "expert_quantization": "mxfp4"}).validate()
    model = materialize_random_weights(get_model_class(config.architecture)(config, device="meta"),
                                       torch.device("cpu"), seed=0)
    experts = model.layers[0].moe
    assert (experts.gate_up_proj_scale == 120).all() and (experts.down_proj_scale == 120).all()
    widened = dequantize_mxfp4_experts(experts.gate_up_proj, experts.gate_up_proj_scale, torch.float32)
    assert 0.018 < widened.std().item() < 0.028 and widened.abs().max().item() <= 6 * 2**-7
