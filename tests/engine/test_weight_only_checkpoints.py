"""INT4/INT8 weight-only checkpoints as they ship (engine/weight_only/checkpoint_formats.py): AWQ
GEMM, GPTQ v1/v2 with and without act-order, compressed-tensors pack-/naive-quantized, written by
tests/engine/quantized_checkpoints.py from tiny random Llama and Qwen3-MoE models.

The reader's dequantized weights must equal the writers' references exactly: both compute
(code - zero) * scale in float32 from the stored float16/bfloat16 scales, which float32 holds exactly,
and |code - zero| < 256 times a 16-bit-mantissa scale is exact in float32's 24 bits -- so the only
rounding of the whole path is the scale's own, made once by the writer."""
from __future__ import annotations

import os
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.convert import CheckpointError, getter_from_safetensors_dir, getter_from_state_dict
from engine.weight_only.checkpoint_formats import (
    CheckpointWeightQuant, QuantizedLinearReader, checkpoint_weight_quant, unpack_int32)
from quantized_checkpoints import (
    VARIANTS, ct_compressor, ct_scheme, on_disk_state, pack_awq, pack_sequential, tiny_qwen3_moe, transformers_state,
    write_variant)

MODULES = {"llama": ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"),
           "moe": ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.experts.3.gate_proj",
                   "model.layers.0.mlp.experts.1.down_proj", "model.layers.1.mlp.up_proj")}
DESCRIBED = {
    "awq_gemm_asym": "awq int4 group 64 asymmetric",
    "gptq_v1_sym": "gptq int4 group 32 symmetric",
    "gptq_v1_asym_desc_act": "gptq int4 group 32 asymmetric, act-order",
    "gptq_int8_asym_per_channel": "gptq int8 per channel asymmetric",
    "ct_w4a16_g128_sym": "compressed-tensors int4 group 128 symmetric",
    "ct_w4a16_g32_asym_actorder": "compressed-tensors int4 group 32 asymmetric, act-order",
    "ct_w8a16_channel_asym": "compressed-tensors int8 per channel asymmetric",
}
CT_LIBRARY_VARIANTS = [v for v in VARIANTS if v.startswith("ct_") and "actorder" not in v]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(variant, family) -> (directory, Written), each written once per module."""
    written = {}

    def get(variant: str, family: str = "llama"):
        if (variant, family) not in written:
            path = str(tmp_path_factory.mktemp(f"{variant}_{family}"))
            written[variant, family] = path, write_variant(path, variant, family)
        return written[variant, family]

    return get


def reader_of(path: str) -> QuantizedLinearReader:
    quant = checkpoint_weight_quant(transformers.AutoConfig.from_pretrained(path))
    return QuantizedLinearReader(getter_from_safetensors_dir(path), quant)


# ---- the formats' bit layouts, from their definitions ----------------------------------------

def test_awq_nibble_order():
    """AutoAWQ packs columns [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7: values c at column c
    give the nibbles 0, 2, 4, 6, 1, 3, 5, 7 from the lowest up."""
    word = pack_awq(torch.arange(8)[None])
    assert word.item() == 0x75316420
    get = getter_from_state_dict({"m.qweight": word.repeat(32, 1), "m.qzeros": word,
                                  "m.scales": torch.ones(1, 8, dtype=torch.float16)}, "literal")
    codes = QuantizedLinearReader(get, CheckpointWeightQuant("awq", 4, 32, False, False)).read("m").codes
    assert codes[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("bits, values, word", [(4, range(1, 9), 0x87654321), (8, [1, 2, 3, 0xF4], -0xBFCFDFF)])
def test_gptq_sequential_packing(bits, values, word):
    """GPTQ packs along K from the lowest bits: value j of each word at bits * j."""
    packed = pack_sequential(torch.tensor([list(values)]), bits)
    assert packed.item() == (word if word < 2 ** 31 else word - 2 ** 32)
    assert unpack_int32(packed, bits, 1, len(values)).tolist() == [list(values)]


def test_compressed_tensors_packing_offsets_signed_codes():
    """compressed-tensors stores signed code q as q + 2**(bits-1) from the lowest bits, which is the
    engine's unsigned code."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    packed = pack_to_int32(torch.arange(-8, 0, dtype=torch.int8)[None], 4)
    assert packed.item() == 0x76543210
    assert unpack_int32(packed, 4, 1, 8).tolist() == [list(range(8))]


# ---- every layout read back exactly -----------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "moe"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dequantized_weights_equal_the_reference(checkpoint, variant, family):
    path, written = checkpoint(variant, family)
    reader = reader_of(path)
    get = reader.dequantized_getter()
    for name, reference in written.reference.items():
        assert torch.equal(get(name), reference), name
    assert all(reader.is_quantized(m) for m in written.expected)
    assert not reader.is_quantized("lm_head") and not reader.is_quantized("model.layers.0.mlp.gate")


@pytest.mark.parametrize("family", ["llama", "moe"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_read_gives_codes_scale_zero_and_g_idx(checkpoint, variant, family):
    path, written = checkpoint(variant, family)
    reader = reader_of(path)
    for module in MODULES[family]:
        got, want = reader.read(module), written.expected[module]
        assert got.codes.dtype == torch.uint8 and got.zero.dtype == torch.uint8 and got.scale.dtype == torch.float32
        assert torch.equal(got.codes, want.codes) and torch.equal(got.zero, want.zero), module
        assert torch.equal(got.scale, want.scale), module
        if want.g_idx is None:
            assert got.g_idx is None, module
        else:
            assert got.g_idx.dtype == torch.int32 and torch.equal(got.g_idx, want.g_idx), module


def test_transformers_state_restacks_experts():
    model = tiny_qwen3_moe()
    state = transformers_state(on_disk_state(model))
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())


def test_asymmetric_checkpoints_hold_a_zero_of_0(checkpoint):
    """Row 0 of every layer is non-negative, so its zero is 0: GPTQ v1 stores 2**bits - 1 for it."""
    _, written = checkpoint("gptq_v1_asym")
    assert all((q.zero[0] == 0).all() for q in written.expected.values())


@pytest.mark.parametrize("variant", list(DESCRIBED))
def test_config_scheme(checkpoint, variant):
    path, _ = checkpoint(variant)
    quant = checkpoint_weight_quant(transformers.AutoConfig.from_pretrained(path))
    assert quant.describe() == DESCRIBED[variant]
    if variant.startswith("ct_"):
        assert quant.ignores("lm_head") and quant.ignores("model.layers.0.mlp.gate")
        assert not quant.ignores("model.layers.0.mlp.gate_proj")


@pytest.mark.parametrize("family", ["llama", "moe"])
@pytest.mark.parametrize("variant", CT_LIBRARY_VARIANTS)
def test_compressed_tensors_decompressor_agrees(checkpoint, variant, family):
    """The library's own decompress of each module's tensors (in bfloat16, the scale's dtype: its
    exact float32 product rounded once) equals our dequantized weight rounded to bfloat16."""
    path, written = checkpoint(variant, family)
    _, kwargs = VARIANTS[variant]
    scheme = ct_scheme(kwargs.get("bits", 4), kwargs.get("group_size", 128), kwargs.get("symmetric", True))
    compressor = ct_compressor(kwargs.get("fmt", "pack-quantized"))
    tensors, reader = load_file(os.path.join(path, "model.safetensors")), reader_of(path)
    for module in written.expected:
        state = {n: tensors[f"{module}.{n}"] for n in compressor.compression_param_names(scheme)}
        theirs = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(reader.read(module).dequantize().to(theirs.dtype), theirs), module


def test_compressed_tensors_model_decompression_agrees(checkpoint):
    """The whole-model path transformers takes (ModelCompressor on a model with the config applied)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    path, written = checkpoint("ct_w4a16_g128_asym")
    config = transformers.AutoConfig.from_pretrained(path)
    qconfig = QuantizationConfig.model_validate(config.quantization_config)
    model = transformers.LlamaForCausalLM(config)
    apply_quantization_config(model, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    compressor.decompress_model(model)
    state, get = model.state_dict(), reader_of(path).dequantized_getter()
    for module in written.expected:
        theirs = state[module + ".weight"]
        assert torch.equal(get(module + ".weight").to(theirs.dtype), theirs), module


# ---- configs: what is refused, and what is not ours -------------------------------------------

def _config(quant):
    return types.SimpleNamespace(quantization_config=quant) if quant is not None else types.SimpleNamespace()


def _ct(weights=None, fmt="pack-quantized", **group):
    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True, **(weights or {})}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **group}}}


FP8_GROUP = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}


@pytest.mark.parametrize("quant", [None, {"quant_method": "gguf"}, {"quant_method": "fp8"},
                                   _ct({"type": "float", "num_bits": 8, "strategy": "channel"}, "float-quantized"),
                                   # W8A8 INT8 (an int8_sq engine, engine/fp8_checkpoint.py)
                                   _ct({"num_bits": 8, "strategy": "channel"}, "int-quantized", input_activations={
                                       "type": "int", "num_bits": 8, "strategy": "token", "dynamic": True})])
def test_not_integer_weight_only_is_none(quant):
    assert checkpoint_weight_quant(_config(quant)) is None


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, "version 'marlin'"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 100, "version": "GEMM"}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down": {"bits": 8}}}, "dynamic"),
    (_ct({"num_bits": 2}), "num_bits 2"),
    (_ct({"group_size": 48}), "group_size 48"),
    (_ct({"strategy": "tensor"}), "strategy 'tensor'"),
    (_ct({"strategy": "block", "block_structure": [128, 128]}), "strategy 'block'"),
    (_ct(fmt="marlin-24"), "format 'marlin-24'"),
    (_ct(fmt="dense"), "format 'dense'"),
    (_ct({"num_bits": 8, "strategy": "channel"}, "int-quantized",  # static activations: not int8_sq's scheme
         input_activations={"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}), "input_activations"),
    (_ct({"type": "float", "num_bits": 4, "group_size": 16}, "nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    ({**_ct(), "config_groups": {"a": _ct()["config_groups"]["group_0"],
                                 "b": _ct({"num_bits": 8, "strategy": "channel"})["config_groups"]["group_0"]}},
     "different schemes"),
    ({**_ct(), "config_groups": {"a": _ct()["config_groups"]["group_0"], "b": FP8_GROUP}}, "type 'float'"),
    ({**_ct(), "transform_config": {"config_groups": {"u": {}}}}, "transform_config"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'.*AWQ.*GPTQ.*compressed-tensors"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
])
def test_unsupported_config_is_refused_by_name(quant, field):
    with pytest.raises(ConfigError, match=field):
        checkpoint_weight_quant(_config(quant))


@pytest.mark.parametrize("quant, described", [
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM", "zero_point": False},
     "awq int4 group 128 symmetric"),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": True, "format": "gptq_v2"},
     "gptq int8 per channel symmetric, act-order"),
    (_ct({"num_bits": 8, "strategy": "channel", "actorder": "weight"}, "naive-quantized"),
     "compressed-tensors int8 per channel symmetric"),
])
def test_config_variants(quant, described):
    assert checkpoint_weight_quant(_config(quant)).describe() == described


def test_awq_and_gptq_exclusions_become_patterns():
    awq = checkpoint_weight_quant(_config({"quant_method": "awq", "bits": 4, "group_size": 128,
                                           "modules_to_not_convert": ["visual", "mlp.gate."]}))
    assert awq.ignores("model.visual.blocks.0.attn") and not awq.ignores("model.layers.0.mlp.gate_proj")
    gptq = checkpoint_weight_quant(_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                            "dynamic": {"-:.*mlp\\.gate$": {}}}))
    assert gptq.ignores("model.layers.0.mlp.gate") and not gptq.ignores("model.layers.0.mlp.gate_proj")


# ---- checkpoints that do not match their config -----------------------------------------------

def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


M = "model.layers.0.self_attn.q_proj"
BAD_CHECKPOINTS = {
    "awq missing qzeros": ("awq_gemm_asym", _drop(M + ".qzeros"), f"{M}.qzeros is missing"),
    "awq missing scales": ("awq_gemm_asym", _drop(M + ".scales"), f"{M}.scales is missing"),
    "awq scales rows": ("awq_gemm_asym", _set(M + ".scales", lambda s: s[:1]), f"{M}.scales has shape \\(1, 128\\)"),
    "awq packed width": ("awq_gemm_asym", _set(M + ".qweight", lambda w: w[:, :8]), f"{M}.qweight has shape"),
    "awq K not a multiple of G": ("awq_gemm_asym", _set(M + ".qweight", lambda w: w[:96]), "96 input columns"),
    "gptq missing qzeros": ("gptq_v1_sym", _drop(M + ".qzeros"), f"{M}.qzeros is missing"),
    "gptq missing scales": ("gptq_v1_sym", _drop(M + ".scales"), f"{M}.scales is missing"),
    "gptq missing g_idx": ("gptq_v1_sym_desc_act", _drop(M + ".g_idx"), f"{M}.g_idx is missing"),
    "gptq scales rows": ("gptq_v1_sym", _set(M + ".scales", lambda s: s[:2]), f"{M}.scales has shape \\(2, 128\\)"),
    "gptq qzeros width": ("gptq_v1_asym", _set(M + ".qzeros", lambda z: z[:, :4]), f"{M}.qzeros has shape"),
    "gptq K not a multiple of G": ("gptq_v1_sym", _set(M + ".qweight", lambda w: w[:3]), "24 input columns"),
    "gptq g_idx out of range": ("gptq_v1_asym_desc_act", _set(M + ".g_idx", lambda g: g + 1), f"{M}.g_idx holds group"),
    "gptq g_idx length": ("gptq_v1_asym_desc_act", _set(M + ".g_idx", lambda g: g[:64]), f"{M}.g_idx has shape"),
    "ct missing weight_scale": ("ct_w4a16_g128_sym", _drop(M + ".weight_scale"), f"{M}.weight_scale is missing"),
    "ct missing zero point": ("ct_w4a16_g128_asym", _drop(M + ".weight_zero_point"), f"{M}.weight_zero_point is missing"),
    "ct scale groups": ("ct_w4a16_g128_sym", _set(M + ".weight_scale", lambda s: s.repeat(1, 2)), f"{M}.weight_scale has shape"),
    "ct packed width": ("ct_w4a16_g128_sym", _set(M + ".weight_packed", lambda w: w[:, :8]), f"{M}.weight_packed has shape"),
    "ct zero point rows": ("ct_w4a16_g128_asym", _set(M + ".weight_zero_point", lambda z: z[:4]), f"{M}.weight_zero_point has"),
    "ct g_idx out of range": ("ct_w4a16_g32_asym_actorder", _set(M + ".weight_g_idx", lambda g: g - 1),
                              f"{M}.weight_g_idx holds group"),
    "ct naive codes out of range": ("ct_naive_w4a16_g64_asym", _set(M + ".weight", lambda w: w * 0 + 9),
                                    f"{M}.weight must hold int8 codes in \\[-8, 8\\)"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_names_the_tensor(checkpoint, tmp_path, case):
    variant, mutate, message = BAD_CHECKPOINTS[case]
    path, _ = checkpoint(variant)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mutate(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    quant = checkpoint_weight_quant(transformers.AutoConfig.from_pretrained(path))
    reader = QuantizedLinearReader(getter_from_safetensors_dir(str(tmp_path)), quant)
    with pytest.raises(CheckpointError, match=message):
        reader.dequantized_getter()(M + ".weight")
