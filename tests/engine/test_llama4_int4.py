"""Llama 4 text with integer weight-only linears and experts (engine/models/llama4.py): ``--quantization int4_wo``
engines of the tiny Llama4ForCausalLM of test_llama4_fp8 (round to nearest at build), and compressed-tensors W4A16
``pack-quantized`` checkpoints written by the compressed-tensors library in the scheme RedHatAI ships Scout's in
(4-bit symmetric groups; llm-compressor's Llama 4 W4A16 recipe ignores lm_head, the routers, the attention and
the vision tower), with one Linear per expert (what llm-compressor saves) or the experts left stacked and
unquantized (a Parameter, not Linears), and as a Llama4ForConditionalGeneration. On CPU (the kernels' plain-torch
references: the experts dequantized once through kernels/fused_moe.py).

Groups of 32 columns here, not Scout's 128: the tiny model's dense MLP is 192 wide (96 a rank at --tp_size 2).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import BuildConfig, ConfigError, EngineConfig
from engine.models.llama4 import Llama4ForCausalLM
from engine_testing import assert_same_engine_tensors, cuda_graph_steps_logits
from kernels.wna16 import dequantize, unpack_codes
from quantized_checkpoints import ct_compressor, ct_scheme, round_to_nearest, save_compressed_tensors
from test_fp8_engine import all_logits, build
from test_llama4_fp8 import IDS, build_cli, on_disk_experts
from tiny_llama4 import (CONDITIONAL_GENERATION_IGNORE, decompressed_logits, llama4_of_trained_scale,
                         with_vision_tower)

GROUP = 32
INTEGER_NAMES = ("layers.1.moe.gate_up_proj", "layers.1.moe.down_proj", "layers.1.moe.shared_gate_up_proj.weight",
                 "layers.1.moe.shared_down_proj.weight", "layers.1.qkv_proj.weight", "layers.1.o_proj.weight",
                 "layers.0.gate_up_proj.weight", "layers.0.down_proj.weight")


def dequantized_engine(engine_dir: str, out_dir: str, bits: int = 4) -> str:
    """A float32 engine holding ``engine_dir``'s integer weights dequantized (every ``<name>`` with a
    ``<name>_zero``: (code - zero) x scale per group), its quantization cleared."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = load_file(os.path.join(engine_dir, "rank0.safetensors"))
    for name in [n for n in tensors if n + "_zero" in tensors]:
        tensors[name] = dequantize(tensors[name], tensors.pop(name + "_scale"), tensors.pop(name + "_zero"), bits)
    save_file(tensors, os.path.join(out_dir, "rank0.safetensors"), metadata={"format": "pt"})
    config = EngineConfig.load(engine_dir)
    config.build = dataclasses.replace(config.build, quantization=None, quant_group_size=None)
    config.save(out_dir)
    return out_dir


def relative_rms(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def int4_engine(tmp_path_factory):
    """(engine dir of --quantization int4_wo with groups of 32, the unquantized engine dir) of the same model."""
    root = tmp_path_factory.mktemp("llama4_int4")
    hf = llama4_of_trained_scale()
    return (build(hf, str(root / "int4"), "int4_wo", quant_group_size=GROUP), build(hf, str(root / "float"), None))


def test_linears_experts_and_shared_expert_are_int4_and_the_router_and_head_stay(int4_engine):
    """Layer 1 (MoE): experts (4, 2 x 128, 128 / 2 bytes) / (4, 128, 64) with a scale and zero per row and group
    of 32, the shared expert and attention integer Linears; layer 0's dense MLP integer; router, norms, embedding
    and lm_head float32 without scales."""
    tensors = load_file(f"{int4_engine[0]}/rank0.safetensors")
    build_config = EngineConfig.load(int4_engine[0]).build
    assert (build_config.quantization, build_config.quant_group_size) == ("int4_wo", GROUP)
    shapes = {"layers.1.moe.gate_up_proj": (4, 256, 128), "layers.1.moe.down_proj": (4, 128, 128),
              "layers.1.moe.shared_gate_up_proj.weight": (256, 128), "layers.1.moe.shared_down_proj.weight": (128, 128),
              "layers.1.qkv_proj.weight": (256, 128), "layers.1.o_proj.weight": (128, 128),
              "layers.0.gate_up_proj.weight": (384, 128), "layers.0.down_proj.weight": (128, 192)}
    for name, (*rows, columns) in shapes.items():
        assert tensors[name].dtype == torch.uint8 and list(tensors[name].shape) == rows + [columns // 2], name
        for suffix, dtype in (("_scale", torch.float32), ("_zero", torch.uint8)):
            assert tensors[name + suffix].dtype == dtype and list(tensors[name + suffix].shape) == rows + [columns // GROUP]
    for name in ("layers.1.moe.router.weight", "layers.1.input_norm.weight", "embed_tokens.weight", "lm_head.weight"):
        assert tensors[name].dtype == torch.float32 and name + "_zero" not in tensors, name


def test_int4_logits_are_the_dequantized_weights_and_near_the_float_model(int4_engine, tmp_path):
    """Weight-only: the engine multiplies exactly its codes dequantized, so a float32 engine of those weights gives
    its logits (measured: bit for bit, model seeds 0-2; bound 1e-5 relative, for the order of accumulation).
    Against the unquantized model the 4-bit rounding of every decoder weight (N(0, 0.02), asymmetric groups of 32:
    ~8% of a weight's spread each) shows: measured 19.0-20.0% relative RMS over model seeds 0-2, argmax
    agreement 0.75-0.83 (routing flips included; FP8's were 6.8-8.1%); bounds 30% and 0.6."""
    quantized = all_logits(int4_engine[0], IDS)
    reference = all_logits(dequantized_engine(int4_engine[0], str(tmp_path / "dequantized")), IDS)
    assert relative_rms(quantized, reference) < 1e-5
    unquantized = all_logits(int4_engine[1], IDS)
    assert relative_rms(quantized, unquantized) < 0.30
    assert (quantized.argmax(-1) == unquantized.argmax(-1)).float().mean().item() >= 0.6


def test_int8_wo_logits_are_the_dequantized_weights_and_near_the_float_model(int4_engine, tmp_path):
    """int8_wo (symmetric, per output channel) through the same experts' path: its dequantized float32 engine's
    logits (bit for bit here), and within 3% of the unquantized model's (measured 1.4%, model seed 0)."""
    engine_dir = build(llama4_of_trained_scale(), str(tmp_path / "int8"), "int8_wo")
    assert load_file(f"{engine_dir}/rank0.safetensors")["layers.1.moe.gate_up_proj_zero"].shape == (4, 256, 1)
    quantized = all_logits(engine_dir, IDS)
    reference = all_logits(dequantized_engine(engine_dir, str(tmp_path / "dequantized"), bits=8), IDS)
    assert relative_rms(quantized, reference) < 1e-5
    assert relative_rms(quantized, all_logits(int4_engine[1], IDS)) < 0.03


def test_random_weight_engines_hold_valid_integer_experts():
    """Benchmark engines (engine_bench --model llama4_scout --quantization int4_wo: config only, weights made at
    load): experts, shared expert and attention get codes, mid-range zeros and scales giving weights of std ~0.02;
    the router keeps the model dtype; the experts' warm-up and a forward through them run."""
    from engine.convert import model_config_from_hf
    from engine.executor.random_weights import materialize_random_weights
    from engine.models.layers import prepare_weights

    cfg = model_config_from_hf(llama4_of_trained_scale().config)
    scheme = BuildConfig(quantization="int4_wo", quant_group_size=GROUP).weight_only
    model = materialize_random_weights(Llama4ForCausalLM(cfg, device="meta", quantization=scheme),
                                       torch.device("cpu"), seed=0)
    prepare_weights(model)
    moe = model.layers[1].moe
    for dense in (moe.experts[0].dense, moe.experts[1].dense, moe.shared_gate_up_proj.wna16.dense,
                  model.layers[1].qkv_proj.wna16.dense):
        assert 0.015 < dense.std().item() < 0.025
    assert moe.router.weight.dtype == torch.float32 and moe.gemv_experts() is None  # no kernel layout on CPU
    model.warm_up_kernels(64)
    rows = 0.1 * torch.randn(6, 128)
    ids = torch.tensor([[0], [1], [2], [3], [1], [1]], dtype=torch.int32)
    expected = torch.stack([torch.nn.functional.silu(g) * u @ moe.experts[1].dense[e].T for e, (g, u) in
                            ((int(e), (moe.experts[0].dense[e] @ r).chunk(2)) for e, r in zip(ids[:, 0], rows))])
    torch.testing.assert_close(moe.routed_experts(rows, ids), expected, rtol=1e-5, atol=1e-6)


# ---- compressed-tensors W4A16 checkpoints ---------------------------------------------------------

def write_compressed_tensors_w4a16(path: str, model: torch.nn.Module, *, decoder: str = "model.layers.",
                                   ignore: tuple[str, ...] = ("lm_head", "re:.*router"),
                                   unquantized: tuple[str, ...] = (), stacked_experts: bool = False):
    """A compressed-tensors ``pack-quantized`` W4A16 checkpoint of ``model`` (4-bit symmetric, groups of 32, bf16
    scales), packed by the library's PackedQuantizationCompressor from our round-to-nearest codes: every Linear of
    the decoder (names under ``decoder``) but the routers and the modules whose names hold one of ``unquantized``
    (added to ``ignore``). The experts as one Linear per expert, or (``stacked_experts``) as transformers holds
    them, stacked and unquantized. Returns (the tensors written, {module: (codes uint8, scale float32)}, the
    float32 weights the checkpoint stands for)."""
    scheme = ct_scheme(4, GROUP, True)
    state = ({n: t.detach().float().clone() for n, t in model.state_dict().items()} if stacked_experts
             else on_disk_experts(model))
    tensors, expected, reference = {}, {}, dict(state)
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not (name.startswith(decoder) and name.endswith("proj.weight") and "router" not in name
                and not any(part in name for part in unquantized)):
            tensors[name] = tensor
            continue
        codes, scale, zero = round_to_nearest(tensor, 4, torch.arange(tensor.shape[1]) // GROUP, True, torch.bfloat16)
        reference[name] = (codes.float() - zero.float().repeat_interleave(GROUP, 1)) * scale.float().repeat_interleave(GROUP, 1)
        compressed = ct_compressor("pack-quantized")().compress({"weight": reference[name], "weight_scale": scale}, scheme)
        tensors.update({f"{module}.{key}": value for key, value in compressed.items()})
        expected[module] = (codes, scale.float())
    save_compressed_tensors(path, model, tensors, scheme, "pack-quantized",
                            list(ignore) + [f"re:.*{part}.*" for part in unquantized])
    return tensors, expected, reference


@pytest.fixture(scope="module")
def w4a16_checkpoint(tmp_path_factory):
    """(checkpoint dir, expected codes and scales, engine dir built from it with no quantization flag): every
    decoder Linear W4A16 per expert, the routers and lm_head ignored."""
    root = tmp_path_factory.mktemp("llama4_w4a16")
    _, expected, _ = write_compressed_tensors_w4a16(str(root / "ckpt"), llama4_of_trained_scale(seed=1))
    assert build_cli(str(root / "ckpt"), str(root / "engine")) == 0
    return str(root / "ckpt"), expected, str(root / "engine")


def stacked(expected: dict, ff: str, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one projection of every expert of the MoE layer under ``ff``, stacked (E, N, ...)."""
    return tuple(torch.stack([expected[f"{ff}experts.{e}.{part}_proj"][i] for e in range(4)]) for i in (0, 1))


def assert_carried(engine: dict, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """The engine tensor ``name`` holds exactly ``codes`` (unpacked) with ``scale`` and symmetric zeros (8)."""
    assert torch.equal(unpack_codes(engine[name], 4), codes), name
    assert torch.equal(engine[name + "_scale"], scale), name
    assert bool((engine[name + "_zero"] == 8).all()), name


def test_w4a16_checkpoint_codes_and_scales_reach_the_engine_exactly(w4a16_checkpoint):
    """No flag given: the checkpoint's scheme builds an ``int4_wo`` engine (groups of 32) whose experts are the
    checkpoint's per-expert codes stacked (gate rows above up rows), their scales beside them; the shared expert,
    attention and dense MLP likewise; the router the checkpoint's float32."""
    _, expected, engine_dir = w4a16_checkpoint
    build_config = EngineConfig.load(engine_dir).build
    assert (build_config.quantization, build_config.quant_group_size) == ("int4_wo", GROUP)
    engine = load_file(f"{engine_dir}/rank0.safetensors")
    ff = "model.layers.1.feed_forward."
    (gate, gate_scale), (up, up_scale) = stacked(expected, ff, "gate"), stacked(expected, ff, "up")
    assert_carried(engine, "layers.1.moe.gate_up_proj", torch.cat([gate, up], 1), torch.cat([gate_scale, up_scale], 1))
    assert_carried(engine, "layers.1.moe.down_proj", *stacked(expected, ff, "down"))
    shared = [expected[f"{ff}shared_expert.{p}_proj"] for p in ("gate", "up")]
    assert_carried(engine, "layers.1.moe.shared_gate_up_proj.weight", torch.cat([shared[0][0], shared[1][0]]),
                   torch.cat([shared[0][1], shared[1][1]]))
    assert_carried(engine, "layers.1.o_proj.weight", *expected["model.layers.1.self_attn.o_proj"])
    assert_carried(engine, "layers.0.down_proj.weight", *expected["model.layers.0.feed_forward.down_proj"])
    assert engine["layers.1.moe.router.weight"].dtype == torch.float32


def test_w4a16_checkpoint_logits_are_transformers_decompressed_model(w4a16_checkpoint):
    """transformers loads the checkpoint through its compressed-tensors quantizer, decompressed: the same
    weights, but rounded to bfloat16 (the scales' dtype; checked: its o_proj equals our (code - zero) x scale in
    bfloat16 exactly), so the same logits up to that rounding (measured 0.31-0.35% relative over model seeds
    0-2; bound 1%) and every argmax the same."""
    checkpoint, _, engine_dir = w4a16_checkpoint
    reference = decompressed_logits(checkpoint, IDS)
    engine = all_logits(engine_dir, IDS)
    assert relative_rms(engine, reference) < 0.01
    assert torch.equal(engine.argmax(-1), reference.argmax(-1))


def test_w4a16_checkpoint_splits_exactly_over_two_ranks(w4a16_checkpoint, tmp_path):
    """--tp_size 2: each rank holds its half of every expert's rows (gate_r | up_r) with their scales, and of
    down's columns with their groups (64 columns, 2 groups a rank); o_proj's columns likewise."""
    _, _, engine_dir = w4a16_checkpoint
    assert build_cli(w4a16_checkpoint[0], str(tmp_path / "tp2"), "--tp_size", "2") == 0
    whole = load_file(f"{engine_dir}/rank0.safetensors")
    rows = [torch.cat([torch.arange(64) + 64 * rank, torch.arange(64) + 128 + 64 * rank]) for rank in range(2)]
    for rank in range(2):
        part = load_file(f"{tmp_path}/tp2/rank{rank}.safetensors")
        for suffix in ("", "_scale", "_zero"):
            name = "layers.1.moe.gate_up_proj" + suffix
            assert torch.equal(part[name], whole[name][:, rows[rank]]), name
            name = "layers.1.moe.down_proj" + suffix
            columns = 32 if suffix == "" else 2  # bytes (two codes each) or groups a rank
            assert torch.equal(part[name], whole[name][..., columns * rank:columns * (rank + 1)]), name
            name = "layers.1.o_proj.weight" + suffix
            assert torch.equal(part[name], whole[name][:, columns * rank:columns * (rank + 1)]), name


def test_scouts_recipe_keeps_the_attention_it_ignores_in_the_model_dtype(tmp_path, capsys):
    """llm-compressor's Llama 4 W4A16 recipe (RedHatAI's Scout) leaves the attention unquantized: the engine
    holds q/k/v and o_proj in --dtype as the checkpoint has them (said on stderr; recorded in the build config;
    at --tp_size 2 split like float Linears, each rank's tensors the shapes its model declares), everything else
    with the checkpoint's codes, so its logits are transformers' decompressed model's up to that model's bf16
    weights (measured 0.060-0.063% over model seeds 0-2, every argmax the same; bound 1%)."""
    _, expected, reference = write_compressed_tensors_w4a16(str(tmp_path / "ckpt"), llama4_of_trained_scale(seed=2),
                                                            unquantized=("self_attn",))
    assert build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine")) == 0
    assert "8 linear weights the checkpoint leaves unquantized keep --dtype float32" in capsys.readouterr().err
    build_config = EngineConfig.load(str(tmp_path / "engine")).build
    attention = [f"layers.{i}.{p}.weight" for i in range(4) for p in ("qkv_proj", "o_proj")]
    assert build_config.quant_float_linears == attention
    engine = load_file(f"{tmp_path}/engine/rank0.safetensors")
    assert torch.equal(engine["layers.1.o_proj.weight"], reference["model.layers.1.self_attn.o_proj.weight"])
    assert engine["layers.1.qkv_proj.weight"].dtype == torch.float32 and "layers.1.qkv_proj.weight_zero" not in engine
    assert_carried(engine, "layers.1.moe.down_proj", *stacked(expected, "model.layers.1.feed_forward.", "down"))
    got = all_logits(str(tmp_path / "engine"), IDS)
    assert relative_rms(got, decompressed_logits(str(tmp_path / "ckpt"), IDS)) < 0.01
    assert build_cli(str(tmp_path / "ckpt"), str(tmp_path / "tp2"), "--tp_size", "2") == 0  # each rank its columns
    tp2 = EngineConfig.load(str(tmp_path / "tp2"))
    rank_model = Llama4ForCausalLM(tp2.model, tp_size=2, device="meta", quantization=tp2.build.weight_only)
    declared = {name: tuple(tensor.shape) for name, tensor in rank_model.state_dict().items()}  # float Linears too
    for rank in range(2):
        part = load_file(f"{tmp_path}/tp2/rank{rank}.safetensors")
        assert {name: tuple(tensor.shape) for name, tensor in part.items()} == declared
        columns = slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(part["layers.1.o_proj.weight"], engine["layers.1.o_proj.weight"][:, columns])
        assert part["layers.1.qkv_proj.weight"].shape == (128, 128) and "layers.1.o_proj.weight_zero" not in part


def test_stacked_unquantized_experts_are_quantized_at_build(tmp_path, capsys):
    """A checkpoint whose experts stayed a stacked Parameter (compressed-tensors quantizes Linears only; the
    other Linears W4A16): the engine's expert blocks are quantized at build, round to nearest in the checkpoint's
    groups (said on stderr), exactly as int4_wo quantizes float experts, while the shared expert keeps the
    checkpoint's codes. The logits are transformers' decompressed model's within the experts' 4-bit rounding
    (measured 5.1-5.9% over model seeds 0-2, argmax agreement 0.875-0.92; bound 12%)."""
    from kernels.wna16 import quantize

    _, expected, reference = write_compressed_tensors_w4a16(str(tmp_path / "ckpt"), llama4_of_trained_scale(seed=2),
                                                            stacked_experts=True)
    assert build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine")) == 0
    assert "layers.1.moe.gate_up_proj is not quantized (or only in part) in the checkpoint" in capsys.readouterr().err
    engine = load_file(f"{tmp_path}/engine/rank0.safetensors")
    ff = "model.layers.1.feed_forward."
    shared = [expected[f"{ff}shared_expert.{p}_proj"] for p in ("gate", "up")]
    assert_carried(engine, "layers.1.moe.shared_gate_up_proj.weight", torch.cat([shared[0][0], shared[1][0]]),
                   torch.cat([shared[0][1], shared[1][1]]))
    down = reference[ff + "experts.down_proj"].transpose(1, 2)  # (E, I, H) -> the engine's (E, H, I)
    codes, scale, zero = quantize(down, 4, GROUP, symmetric=False)
    for suffix, tensor in (("", codes), ("_scale", scale), ("_zero", zero)):
        assert torch.equal(engine["layers.1.moe.down_proj" + suffix], tensor), suffix
    got = all_logits(str(tmp_path / "engine"), IDS)
    if transformers_release() < (5, 24):
        pytest.skip("transformers 5.17 (the GPU machine's) cannot decompress a checkpoint whose stacked experts "
                    "stayed unquantized (compressed-tensors' dequantize meets an empty packed weight); the engine "
                    "side above ran, the logits' reference needs transformers >= 5.24 (make test)")
    assert relative_rms(got, decompressed_logits(str(tmp_path / "ckpt"), IDS)) < 0.12


def transformers_release() -> tuple[int, int]:
    """The installed transformers' (major, minor)."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def test_conditional_generation_w4a16_checkpoint_builds_the_same_text_engine(w4a16_checkpoint, tmp_path):
    """Scout as RedHatAI ships it: a Llama4ForConditionalGeneration (a one-layer vision tower and projector
    beside the same text model) whose decoder Linears under ``language_model.model.layers.`` are W4A16 per
    expert, the vision parts ignored. It builds the text model alone, an engine identical tensor for tensor to the
    text-only checkpoint's."""
    model = with_vision_tower(llama4_of_trained_scale(seed=1))
    write_compressed_tensors_w4a16(str(tmp_path / "ckpt"), model, decoder="language_model.model.layers.",
                                   ignore=CONDITIONAL_GENERATION_IGNORE)
    assert build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine")) == 0
    assert_same_engine_tensors(str(tmp_path / "engine"), w4a16_checkpoint[2])


def test_bad_combinations_are_refused_by_name(w4a16_checkpoint, tmp_path, capsys):
    """The W4A16 checkpoint with --quantization fp8 or another --group_size would be rounded again; SmoothQuant
    and AWQ calibration are not Llama 4's; the model class names what it takes."""
    from engine.convert import model_config_from_hf

    checkpoint = w4a16_checkpoint[0]
    assert build_cli(checkpoint, str(tmp_path / "a"), "--quantization", "fp8") == 2
    assert "--quantization fp8 would round them again: leave --quantization out" in capsys.readouterr().err
    assert build_cli(checkpoint, str(tmp_path / "b"), "--quantization", "int4_wo", "--group_size", "64") == 2
    assert "--group_size 64 cannot change that: leave --group_size out" in capsys.readouterr().err
    hf = llama4_of_trained_scale()
    hf.save_pretrained(tmp_path / "float")
    assert build_cli(str(tmp_path / "float"), str(tmp_path / "c"), "--quantization", "int8_sq") == 2
    assert "quantization int8_sq is not supported for Llama4ForCausalLM" in capsys.readouterr().err
    assert build_cli(str(tmp_path / "float"), str(tmp_path / "d"), "--quantization", "int4_awq",
                     "--group_size", "32") == 2
    assert "int4_awq calibration is not built for Llama4ForCausalLM; use --quantization int4_wo" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"quantization 'int8_sq' is not supported for Llama4ForCausalLM; allowed: "
                                          r"fp8, fp8_block .*, an integer weight-only scheme"):
        Llama4ForCausalLM(model_config_from_hf(hf.config), device="meta", quantization="int8_sq")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int4_engine_on_cuda_with_decode_graphs(int4_engine, tmp_path):
    """bf16 int4_wo engine on CUDA (kernels/fused_moe_wna16.py's grouped kernels on the input-scaled rows, or the
    GEMV pair where the load-time choice marked it, inside the decode graphs; chunked attention; a packed mixed
    step) against the float32 int4 engine on CPU: within the bf16 bound of the FP8 engines' test (12%)."""
    engine_dir = build(llama4_of_trained_scale(), str(tmp_path / "engine"), "int4_wo", quant_group_size=GROUP,
                       dtype="bfloat16")
    reference = all_logits(int4_engine[0], IDS + [7])
    got, packed_prompt = cuda_graph_steps_logits(engine_dir, IDS, prompt=12)
    assert relative_rms(got, reference) < 0.12
    assert relative_rms(packed_prompt, reference[:9]) < 0.12
