"""The families on the Llama block beyond Llama itself (Qwen3, Phi-3/Phi-4, SmolLM3, yarn and
dynamic rope), builds whose limits come from the checkpoint, and the registry.

test_equivalence.py runs every family of engine_testing.FAMILIES (these included) against
transformers: a full prompt, 16 decode steps, a packed batch of 4 and a 3-chunk prefill. Here:
what only some families have (LongRoPE's long factors, checkpoints in sharded files), tensor
parallelism over gloo, and `python -m engine.build` with no length flag.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import engine.config
from engine.build import main
from engine.config import MAX_DEFAULT_SEQ_LEN, ConfigError, EngineConfig
from engine.executor.runner import ModelRunner
from engine.models import MODEL_FAMILIES, SUPPORTED_ARCHITECTURES, supported_models_markdown
from engine_testing import FAMILIES, PagedSession, assert_tp2_matches_tp1, hf_logits, make_engine, random_tokens, tiny_hf
from test_tensor_parallel import _reassemble

ROOT = Path(__file__).resolve().parents[2]
NEW_FAMILIES = ["qwen3", "phi3_longrope", "phi4_mini_partial_rotary", "smollm3_nope", "llama_yarn",
                "llama_dynamic_ntk"]


def _save(hf_model, path: Path, **kwargs) -> Path:
    hf_model.save_pretrained(path, **kwargs)
    return path


# ---- what only some families have -------------------------------------------------------------

def test_longrope_engine_past_the_original_length_uses_the_long_factors(tmp_path):
    """An engine built past original_max_position_embeddings rotates every position with the long
    factors, which is what transformers does for a sequence longer than that (it recomputes the
    whole cache with them when a sequence crosses it)."""
    config = transformers.Phi3Config(
        vocab_size=96, hidden_size=72, intermediate_size=86, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=32, pad_token_id=0,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    sequence = random_tokens(48, seed=3)
    expected = hf_logits(hf, sequence)  # 48 > 32 positions: transformers takes the long factors
    session = PagedSession(ModelRunner(make_engine(hf, tmp_path / "long", max_seq_len=256)), num_blocks=64)
    (prefill,) = session.step([(0, sequence[:40])])
    assert (prefill - expected[:40]).abs().max() <= 1e-4
    for pos in range(40, 48):
        (decode,) = session.step([(0, [sequence[pos]])])
        assert (decode - expected[pos:pos + 1]).abs().max() <= 1e-4


def test_sharded_phi3_checkpoint_with_fused_weights_builds_with_no_flags(tmp_path):
    """Phi-3's fused qkv_proj/gate_up_proj, spread over several safetensors files with an index."""
    hf = tiny_hf("phi4_mini_partial_rotary")
    checkpoint = _save(hf, tmp_path / "ckpt", max_shard_size="40KB")
    assert len(list(checkpoint.glob("*.safetensors"))) > 1 and (checkpoint / "model.safetensors.index.json").exists()
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine"), "--dtype", "float32"]) == 0
    prompt = random_tokens(30, seed=4)
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "engine"))).step([(0, prompt)])
    assert (logits - hf_logits(hf, prompt)).abs().max() <= 1e-4


def test_qwen3_engine_holds_the_head_norms_replicated(tmp_path):
    hf = tiny_hf("qwen3")
    ranks = [load_file(f"{make_engine(hf, tmp_path / 'tp2', tp_size=2)}/rank{r}.safetensors") for r in range(2)]
    checkpoint_norm = hf.model.layers[1].self_attn.k_norm.weight
    for rank in ranks:
        assert rank["layers.1.q_norm.weight"].shape == (14,)
        assert torch.equal(rank["layers.1.k_norm.weight"], checkpoint_norm)


@pytest.mark.parametrize("family", ["qwen3", "phi4_mini_partial_rotary", "smollm3_nope"])
def test_fp8_engine_of_a_new_family_stays_within_the_rounding_bound(family, tmp_path):
    """FP8 weights with q/k norms, reordered rotary dims and NoPE layers; weights at a trained scale,
    N(0, 0.02), and the 10% bound of test_fp8_engine.py (measured 4.7-8.6% here)."""
    from test_fp8_engine import all_logits, build

    hf = tiny_hf(family)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn_like(p))
    ids = [3, 17, 5, 9, 42, 8, 1, 77, 23, 64, 11, 90, 31, 7, 12, 56]
    reference = all_logits(build(hf, str(tmp_path / "fp32"), None), ids)
    quantized = all_logits(build(hf, str(tmp_path / "fp8"), "fp8"), ids)
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.10
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


def test_fp8_phi3_checkpoint_keeps_its_values_through_unfusing_reordering_and_tp(tmp_path):
    """A compressed-tensors FP8 Phi-4-mini-like checkpoint (fused qkv_proj and gate_up_proj, partial
    rotary): every rank's FP8 weights times their scales equal, exactly, what a float32 build of the
    dequantized model holds, so the E4M3 values and per-row scales followed the split into q/k/v,
    the q/k dim reorder and the tp split without being rounded again."""
    from kernels.fp8 import FP8_DTYPE
    from test_fp8_checkpoints import SOURCE_PEAK

    hf = tiny_hf("phi4_mini_partial_rotary")
    tensors, dequantized = {}, {}
    for name, param in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            scale = param.abs().amax(dim=1, keepdim=True) / SOURCE_PEAK
            tensors[name], tensors[module + ".weight_scale"] = (param / scale).to(FP8_DTYPE), scale
            dequantized[name] = tensors[name].float() * scale
        else:
            tensors[name] = dequantized[name] = param.detach().clone()
    hf.load_state_dict(dequantized)
    reference = make_engine(hf, tmp_path / "dequantized", tp_size=2)
    hf.config.quantization_config = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
    checkpoint = tmp_path / "ckpt"
    hf.config.save_pretrained(checkpoint)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(checkpoint / "model.safetensors"))
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "fp8"), "--dtype", "float32",
                 "--tp_size", "2"]) == 0
    for rank in range(2):
        fp8 = load_file(f"{tmp_path / 'fp8'}/rank{rank}.safetensors")
        full = load_file(f"{reference}/rank{rank}.safetensors")
        quantized = [name for name, weight in fp8.items() if weight.dtype == FP8_DTYPE]
        assert len(quantized) == 4 * 3  # qkv, o, gate_up, down of 3 layers
        for name in quantized:
            assert torch.equal(fp8[name].float() * fp8[name + "_scale"][:, None], full[name]), (rank, name)


# ---- tensor parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_tp2_shards_reassemble_exactly_to_tp1(family, tmp_path):
    hf = tiny_hf(family)
    tp1 = load_file(f"{make_engine(hf, tmp_path / 'tp1')}/rank0.safetensors")
    tp2_dir = make_engine(hf, tmp_path / "tp2", tp_size=2)
    ranks = [load_file(f"{tp2_dir}/rank{r}.safetensors") for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(tp1)
    for name, full in tp1.items():
        assert torch.equal(_reassemble(name, [rank[name] for rank in ranks], EngineConfig.load(tp2_dir)), full), name


def test_two_gloo_ranks_compute_tp1_logits(tmp_path):
    """With the configurable decoder's parallel-residual and ALiBi forms (test_decoder_families.py
    TP_FAMILIES) in the same job of the shared gloo ranks (gloo_ranks.py)."""
    from decoder_testing import tiny_decoder
    from test_decoder_families import TP_FAMILIES

    models = {family: tiny_hf(family) for family in NEW_FAMILIES}
    models.update({family: tiny_decoder(family) for family in TP_FAMILIES})
    assert_tp2_matches_tp1(models, tmp_path)


# ---- builds whose limits come from the checkpoint --------------------------------------------

def _limits(engine_dir: Path) -> tuple[int, int, int]:
    build = json.loads((engine_dir / "config.json").read_text())["build"]
    return build["max_seq_len"], build["max_input_len"], build["max_num_tokens"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_build_with_no_flags(family, tmp_path):
    """`--checkpoint --output` alone: max_seq_len = max_input_len = the model's positions."""
    hf = tiny_hf(family)
    checkpoint = _save(hf, tmp_path / "ckpt")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine")]) == 0
    positions = EngineConfig.load(str(tmp_path / "engine")).model.max_position_embeddings
    # 8 sequences of max_seq_len cap max_num_tokens below 8192 for these tiny models.
    assert _limits(tmp_path / "engine") == (positions, positions, min(8192, 8 * positions))
    ModelRunner(str(tmp_path / "engine"))  # loads: every tensor present, of the right shape


def test_gpt2_builds_with_no_flags(tmp_path):
    """The case users hit first: GPT-2's 1024 learned positions under a 2048 default. In this process
    (engine.build's `main`, what `python -m engine.build` runs): a subprocess cost ~5 s of imports, and
    the module entry point itself is test_build_and_errors.py's test_module_entry_point_shows_progress."""
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=1024)
    checkpoint = _save(transformers.GPT2LMHeadModel(config), tmp_path / "gpt2")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine")]) == 0
    assert _limits(tmp_path / "engine") == (1024, 1024, 8192)


def test_a_512_position_model_gets_512_everywhere(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=512))
    assert main(["--checkpoint", str(_save(hf, tmp_path / "ckpt")), "--output", str(tmp_path / "e")]) == 0
    assert _limits(tmp_path / "e") == (512, 512, 4096)
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "f"), "--max_input_len", "100",
                 "--max_batch_size", "64"]) == 0
    assert _limits(tmp_path / "f") == (512, 100, 8192)


def test_huge_contexts_are_capped_unless_asked_for(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=131072))
    checkpoint = _save(hf, tmp_path / "ckpt")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e")]) == 0
    assert _limits(tmp_path / "e") == (MAX_DEFAULT_SEQ_LEN, MAX_DEFAULT_SEQ_LEN, MAX_DEFAULT_SEQ_LEN)
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "f"), "--max_seq_len", "65536"]) == 0
    assert _limits(tmp_path / "f") == (65536, 65536, 65536)


def test_yarn_extends_the_positions_a_build_may_use(tmp_path, capsys):
    """Qwen3's yarn recipe keeps max_position_embeddings at the pretrained length: the engine may
    use factor x original positions, and matches transformers past max_position_embeddings."""
    hf = tiny_hf("llama_yarn")
    hf.config.max_position_embeddings = 128  # factor 4 x original 64 = 256 positions
    checkpoint = _save(hf, tmp_path / "ckpt")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--dtype", "float32"]) == 0
    assert _limits(tmp_path / "e")[:2] == (256, 256)
    prompt = random_tokens(200, seed=9)
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "e"))).step([(0, prompt)])
    assert (logits - hf_logits(hf, prompt)).abs().max() <= 1e-4
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "f"), "--max_seq_len", "300"]) == 2
    assert ("max_seq_len (300) exceeds the model's yarn factor x original_max_position_embeddings (256)"
            in capsys.readouterr().err)


def test_a_sliding_window_does_not_bound_the_default(tmp_path):
    """The engine applies the window (kernels/attention.py), so sequences may outgrow it: the
    default comes from the positions alone, and the window is recorded for the attention."""
    hf = tiny_hf("mistral")
    hf.config.sliding_window = 64
    checkpoint = _save(hf, tmp_path / "ckpt")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--max_seq_len", "128"]) == 0
    assert _limits(tmp_path / "e")[:2] == (128, 128)
    assert EngineConfig.load(str(tmp_path / "e")).model.sliding_window == 64


@pytest.mark.parametrize("flags,message", [
    (["--max_seq_len", "4096"], "max_seq_len (4096) exceeds the model's max_position_embeddings (256); "
                                "allowed: max_seq_len <= 256, or leave it out to use 256"),
    (["--max_input_len", "300"], "max_input_len (300) must be <= max_seq_len (256, from the model)"),
    (["--max_input_len", "200", "--max_seq_len", "100"], "max_input_len (200) must be <= max_seq_len (100)"),
])
def test_a_flag_that_contradicts_the_model_names_both_numbers(flags, message, tmp_path, capsys):
    checkpoint = _save(tiny_hf("gpt2"), tmp_path / "ckpt")
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "e" / "config.json").exists()


def test_bad_rotary_layouts_are_named():
    base = dict(architecture="Phi3ForCausalLM", vocab_size=96, hidden_size=72, num_layers=2, num_heads=6,
                num_kv_heads=2, head_dim=12, intermediate_size=86)
    with pytest.raises(ConfigError, match=r"layers_without_rope \[5\] are not layer indices; allowed: 0..1"):
        engine.config.ModelConfig(**base, layers_without_rope=[5]).validate()
    with pytest.raises(ConfigError, match="rope_scaling short_factor has 3 values; the rotary dims \\(6\\) need 3"
                                          "|rope_scaling long_factor has 2 values; the rotary dims \\(6\\) need 3"):
        engine.config.ModelConfig(**base, partial_rotary_factor=0.5, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 2,
            "original_max_position_embeddings": 64, "max_position_embeddings": 256}).validate()


# ---- the registry ---------------------------------------------------------------------------

def test_registry_config_and_test_families_agree():
    from decoder_testing import DECODER_FAMILIES
    from hybrid_testing import HYBRIDS
    from test_deepseek import tiny_deepseek
    from tiny_llama4 import tiny_llama4
    from test_sliding_window import FAMILIES as WINDOWED_FAMILIES  # Gemma's equivalence tests live there

    assert set(SUPPORTED_ARCHITECTURES) == set(engine.config.SUPPORTED_ARCHITECTURES)
    tested = {type(tiny_hf(family)).__name__ for family in FAMILIES}  # every family is tested
    tested |= {type(make()).__name__ for make in WINDOWED_FAMILIES.values()}
    tested |= {type(make()).__name__ for make in DECODER_FAMILIES.values()}  # test_decoder_families.py
    tested |= {"BaichuanForCausalLM", "QWenLMHeadModel"}  # remote code: test_decoder_families.py writes them
    tested |= {model_class.__name__ for model_class, _ in HYBRIDS.values()}  # test_hybrid_models.py
    tested |= {type(tiny_deepseek(version)).__name__ for version in ("v3", "v2")}  # test_deepseek.py
    tested |= {type(tiny_llama4()).__name__}  # test_llama4.py
    assert {family.architecture for family in MODEL_FAMILIES} <= tested


def test_readme_lists_the_registry():
    assert supported_models_markdown() in (ROOT / "README.md").read_text()
