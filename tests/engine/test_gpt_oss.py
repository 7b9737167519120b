"""gpt-oss beyond the shared family tests (test_equivalence.py runs the tiny "gpt_oss" config of
engine_testing: sinks, a window of 6 on alternate layers, yarn, biases, top-4 of 12 experts with a
clamped SwiGLU, against transformers through the paged cache): checkpoints with MXFP4 experts as
OpenAI ships them, the widening's exactness against transformers' own dequantization, malformed
MXFP4 tensors refused by name, the config mapping, two gloo ranks, and the harmony chat template
carried into the engine directory.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.build import main
from engine.config import ConfigError, EngineConfig
from engine.convert import CheckpointError, getter_from_state_dict, model_config_from_hf
from engine.executor.runner import ModelRunner
from engine.mxfp4 import dequantize_mxfp4, mxfp4_getter, widen_mxfp4_checkpoint
from engine_testing import PagedSession, VOCAB, assert_tp2_matches_tp1, hf_logits, make_engine, random_tokens, tiny_hf
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


def test_mxfp4_checkpoint_equals_transformers(mxfp4_checkpoint, tmp_path):
    """`python -m engine.build` of a checkpoint with MXFP4 experts (float32 engine) against transformers
    loading the same directory with Mxfp4Config(dequantize=True): a prompt past the window, then
    decode steps through pages of 4, within 1e-4."""
    engine = str(tmp_path / "engine")
    assert main(["--checkpoint", mxfp4_checkpoint, "--output", engine, "--dtype", "float32",
                 "--tokens_per_block", "4"]) == 0
    assert EngineConfig.load(engine).extra["source_quantization"] == "mxfp4 experts, widened at build"
    sequence = random_tokens(24, seed=5)
    expected = hf_logits(transformers_mxfp4_model(mxfp4_checkpoint), sequence)
    session = PagedSession(ModelRunner(engine), num_blocks=16)
    (prefill,) = session.step([(0, sequence[:14])])
    assert (prefill - expected[:14]).abs().max().item() <= 1e-4
    for pos in range(14, 24):
        (decode,) = session.step([(0, [sequence[pos]])])
        assert (decode - expected[pos:pos + 1]).abs().max().item() <= 1e-4


def test_bf16_engine_holds_transformers_dequantized_experts_exactly(mxfp4_checkpoint, tmp_path):
    """A bf16 build's experts equal, bit for bit, what transformers' bf16 dequantization holds
    (transposed to (E, out, in), gate and up de-interleaved into [gate | up] rows)."""
    engine = str(tmp_path / "engine")
    assert main(["--checkpoint", mxfp4_checkpoint, "--output", engine, "--dtype", "bfloat16"]) == 0
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
def test_engine_on_cuda_equals_transformers(tmp_path):
    """fp32 on CUDA (IEEE dots in every Triton kernel, so routing matches fp32 transformers): the
    sinks in the prefill and decode attention kernels, the experts' biases and clamp in the fused-MoE
    kernels, decode steps replayed from CUDA graphs, then a packed mixed step."""
    hf = tiny_hf("gpt_oss")
    runner = ModelRunner(make_engine(hf, tmp_path / "engine"), device="cuda")
    session = PagedSession(runner, num_blocks=64)
    runner.capture_cuda_graphs()
    sequence = random_tokens(11 + 8, seed=4)
    expected = hf_logits(hf, sequence)
    (prefill,) = session.step([(0, sequence[:11])])
    assert (prefill.cpu() - expected[:11]).abs().max().item() <= 1e-3
    for pos in range(11, 19):
        (decode,) = session.step([(0, [sequence[pos]])])
        assert (decode.cpu() - expected[pos:pos + 1]).abs().max().item() <= 1e-3
    other = random_tokens(40, seed=5)
    outs = session.step([(1, other), (0, [7])])
    assert (outs[0].cpu() - hf_logits(hf, other)).abs().max().item() <= 1e-3
    assert (outs[1].cpu() - hf_logits(hf, sequence + [7])[-1:]).abs().max().item() <= 1e-3
