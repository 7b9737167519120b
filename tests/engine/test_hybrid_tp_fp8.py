"""Hybrid Mamba-2 models split over tensor-parallel ranks, and with FP8 weights.

- TP 2 on two gloo ranks = TP 1: test_tensor_parallel.py's test_hybrid_tp2_over_gloo_equals_tp1 (it
  shares that file's gloo pair; pytest-xdist's loadfile keeps one pair per file's worker).
- What cannot split is refused by name at build.
- ``--quantization fp8``: in_proj/out_proj and the attention and MLP projections hold E4M3 weights
  with per-channel scales, the conv, A_log, D, dt_bias and norms stay; logits of a model of trained
  scale stay within the repo's FP8 bound of the float32 engine's (test_fp8_engine.py: 10% relative
  RMS, >= 90% argmax agreement), the same tokens fed to both (teacher-forced decodes).
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from engine.build import build_from_hf
from engine.config import BuildConfig, ConfigError, mamba_tp_error
from engine.convert import getter_from_state_dict
from engine.executor.runner import ModelRunner

from hybrid_testing import VOCAB, tiny_hybrid
from hybrid_tp_ranks import hybrid_steps

FP8_FAMILIES = ("nemotron_h", "bamba")


def _build(model, out_dir: str, *, tp_size: int = 1, quantization: str | None = None, dtype: str = "float32") -> str:
    build = BuildConfig(dtype=dtype, max_batch_size=4, max_input_len=64, max_seq_len=64, max_num_tokens=128,
                        tokens_per_block=16, tp_size=tp_size, quantization=quantization)
    build_from_hf(model.config, getter_from_state_dict(model.state_dict(), "t"), None, str(out_dir), build,
                  progress=False)
    return str(out_dir)


def test_splits_that_cannot_be_made_are_refused_by_name(tmp_path):
    assert mamba_tp_error(128, 8, 16) is None and mamba_tp_error(8, 1, 4) is None and mamba_tp_error(8, 4, 2) is None
    assert "n_groups 3" in mamba_tp_error(6, 3, 2)
    with pytest.raises(ConfigError, match=r"tp_size 3 does not divide the Mamba-2 heads \(num_heads 4\)"):
        _build(tiny_hybrid("nemotron_h"), tmp_path / "tp3", tp_size=3)
    with pytest.raises(ConfigError, match=r"Mamba2ForCausalLM without attention layers .* tp_size 2"):
        _build(tiny_hybrid("mamba2"), tmp_path / "mamba2", tp_size=2)
    with pytest.raises(ConfigError, match="quantization int8_wo is not supported for NemotronHForCausalLM"):
        _build(tiny_hybrid("nemotron_h"), tmp_path / "int8", quantization="int8_wo")
    with pytest.raises(ConfigError, match="quantization fp8 is not supported for JambaForCausalLM"):
        _build(tiny_hybrid("jamba"), tmp_path / "jamba", quantization="fp8")
    moe = tiny_hybrid("nemotron_h_moe")
    with pytest.raises(ConfigError, match="NemotronHForCausalLM: quantization 'fp8' is not supported for its relu2 "
                                          "routed experts"):
        _build(moe, tmp_path / "nemotron_h_moe", quantization="fp8")
    moe.config.moe_latent_size = 16
    with pytest.raises(ConfigError, match="NemotronHForCausalLM with moe_latent_size 16"):
        _build(moe, tmp_path / "latent")


def _trained_scale(family: str) -> torch.nn.Module:
    """The tiny hybrid with its non-norm weights at N(0, 0.02), the scale of trained checkpoints
    (at tiny_hybrid's 0.1 the activations are chaotic and amplify any rounding: ~9% measured)."""
    model = tiny_hybrid(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not ("norm" in name and name.endswith("weight")):
                p.mul_(0.2)
    return model


@pytest.fixture(scope="module")
def fp8_engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_fp8")
    out = {}
    for family in FP8_FAMILIES:
        model = _trained_scale(family)
        out[family] = (model, _build(model, root / f"{family}-fp32"), _build(model, root / f"{family}-fp8",
                                                                             quantization="fp8"))
    return out


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_hybrid_within_the_rounding_bound_of_float32(fp8_engines, family):
    from kernels.fp8 import FP8_DTYPE

    _, fp32_dir, fp8_dir = fp8_engines[family]
    with safe_open(f"{fp8_dir}/rank0.safetensors", "pt") as f:
        names = set(f.keys())
        quantized = {n[:-len(".weight_scale")] for n in names if n.endswith(".weight_scale")}
        for name in quantized:
            assert f.get_tensor(name + ".weight").dtype == FP8_DTYPE, name
        kept = [n for n in names if n.endswith(("conv_weight", "A_log", ".D", "dt_bias", "norm.weight"))]
        assert kept and all(f.get_tensor(n).dtype == torch.float32 for n in kept)
    kinds = {name.rsplit(".", 1)[-1] for name in quantized}
    assert {"in_proj", "out_proj", "qkv_proj", "o_proj", "up_proj", "down_proj"} == kinds
    reference, greedy = hybrid_steps(ModelRunner(fp32_dir), VOCAB)
    runner = ModelRunner(fp8_dir)
    mixer = next(b.mixer for b in runner.model.blocks if b.kind == "mamba")
    # in_proj's 196 rows (4 heads) padded to 208 for cuBLASLt's FP8 product (mamba2.pad_fp8_rows)
    assert mixer.in_pad == 12 and mixer.in_proj.weight.shape[0] == 208
    logits, _ = hybrid_steps(runner, VOCAB, feed=greedy)  # the same tokens as float32's
    relative_rms = ((logits - reference).norm() / reference.norm()).item()
    assert relative_rms < 0.10, relative_rms  # measured 1.4% (Nemotron-H), 1.4% (Bamba)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9  # measured 1.0, 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_cuda_fp8_hybrid_with_decode_graphs(fp8_engines, family, tmp_path):
    """bf16 FP8 engine on CUDA (cuBLASLt / skinny W8A8 products, Triton SSD and conv kernels, decode
    steps replayed from CUDA graphs) against the float32 engine on CPU: the bound above with bf16's
    own rounding (12%, as test_fp8_moe.py)."""
    model, fp32_dir, _ = fp8_engines[family]
    reference, greedy = hybrid_steps(ModelRunner(fp32_dir), VOCAB)
    engine_dir = _build(model, tmp_path / "bf16-fp8", quantization="fp8", dtype="bfloat16")
    logits, _ = hybrid_steps(ModelRunner(engine_dir, device="cuda"), VOCAB, feed=greedy, graphs=True)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.12


def test_nemotron_h_moe_routes_in_float32_in_a_bfloat16_engine(tmp_path):
    """Nemotron-H's router (gate.weight, e_score_correction_bias) stays float32 in a bf16 engine, as
    transformers keeps it and DeepSeek's is kept (engine/config.py keeps_float32): the engine loads,
    its routing reads float32, and its logits stay within the bf16 bound of the float32 reference."""
    model = tiny_hybrid("nemotron_h_moe")
    runner = ModelRunner(_build(model, tmp_path / "bf16", dtype="bfloat16"))
    state = runner.model.state_dict()
    assert {state[n].dtype for n in state if n.endswith(("experts.router.weight", "experts.score_bias"))} == {torch.float32}
    assert state["blocks.1.mixer.experts.gate_up_proj"].dtype == torch.bfloat16
    from engine.executor.runner import ForwardBatch

    runner.allocate_state_cache(1)
    runner.allocate_kv_cache(4)
    prompt = list(range(1, 31))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    got = runner.forward(ForwardBatch(prompt, list(range(30)), [30], [30], [[0, 1]], list(range(30)), state_slots=[0]))
    assert (got.float() - expected).abs().max().item() <= 0.15
