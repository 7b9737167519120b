"""Writers of INT4/INT8 weight-only checkpoints as AWQ, GPTQ and compressed-tensors ship them, from
a tiny random Hugging Face model (a Llama, and a Qwen3-MoE whose experts are quantized too).

Each writer rounds every linear layer to nearest (its own rounding, below), packs the codes from
the format's definition -- written here independently of engine/weight_only/checkpoint_formats.py;
compressed-tensors through the compressed-tensors library's own compressors -- saves config.json
and model.safetensors, and returns a ``Written``: the float32 state dict the checkpoint stands for
(each quantized weight dequantized from its stored codes and scales) and each module's expected
codes, scale, zero and g_idx in the engine's scheme (unsigned codes and zeros, float32 scales).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
import transformers
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word <- column order[i]


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen3_moe(seed: int = 0) -> torch.nn.Module:
    """4 experts of width 128 in layer 0, a dense MLP in layer 1."""
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                         max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def on_disk_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's float tensors under their checkpoint names: transformers 5 stacks experts in memory
    (gate_up_proj (E, 2I, H), down_proj (E, H, I)); checkpoints hold one Linear per expert."""
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, width = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :width].clone()
                state[f"{prefix}{e}.up_proj.weight"] = tensor[e, width:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                state[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            state[name] = tensor
    return state


def transformers_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``on_disk_state``: per-expert tensors stacked again, to load a reference
    (``Written.reference``, in checkpoint names) into a transformers 5 model."""
    stacked, experts = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            stacked[name] = tensor
        else:
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        stacked[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)])
        stacked[prefix + "down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
    return stacked


def quantized_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Modules a quantizer converts: every decoder linear (lm_head, embeddings and the router stay)."""
    return [n.removesuffix(".weight") for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]


@dataclass
class Expected:
    """One module in the engine's scheme (see kernels/wna16.py)."""

    codes: torch.Tensor  # uint8 (N, K)
    scale: torch.Tensor  # float32 (N, groups)
    zero: torch.Tensor  # uint8 (N, groups)
    g_idx: torch.Tensor | None  # int32 (K,) for act-order, else None


@dataclass
class Written:
    reference: dict[str, torch.Tensor]  # float32: quantized weights dequantized, the rest as saved
    expected: dict[str, Expected] = field(default_factory=dict)


def round_to_nearest(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype):
    """(codes, scale in scale_dtype, zero) of a float weight (N, K), group of column k = g_idx[k].
    Row 0 is made non-negative first, so asymmetric groups there get a zero of 0."""
    weight = weight.clone()
    weight[0] = weight[0].abs()
    top, groups = 2 ** bits - 1, int(g_idx.max()) + 1
    scale, zero = torch.empty(weight.shape[0], groups), torch.empty(weight.shape[0], groups)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        if symmetric:
            scale[:, g] = cols.abs().amax(dim=1) / (2 ** (bits - 1) - 1)
            zero[:, g] = 2 ** (bits - 1)
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale[:, g] = (high - low) / top
            zero[:, g] = (-low / scale[:, g]).round()
    scale = scale.clamp(min=1e-8).to(scale_dtype)
    codes = (weight / scale.float()[:, g_idx] + zero[:, g_idx]).round().clamp(0, top)
    return codes.to(torch.uint8), scale, zero.to(torch.uint8)


_INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _quantize_all(state, bits, group_size, symmetric, scale_dtype, act_order=False, seed=0):
    """module -> Expected for every quantized module, and the reference state dict."""
    written = Written(reference=dict(state))
    generator = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    for module in quantized_modules(state):
        weight = state[module + ".weight"]
        k = weight.shape[1]
        group = group_size or k
        g_idx = torch.arange(k) // group
        if act_order:  # GPTQ's act-order: column perm[j] is the j-th quantized, in group j // G
            # The order comes from the layer input's statistics (its Hessian's diagonal), so modules
            # that read the same input (q/k/v, gate/up) get the same one, as GPTQ gives them.
            shared_input = module.rsplit(".", 1)[0] + "." + _INPUT_OF.get(module.rsplit(".", 1)[1], module)
            if shared_input not in orders:
                orders[shared_input] = torch.randperm(k, generator=generator)
            perm = orders[shared_input]
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // group
        codes, scale, zero = round_to_nearest(weight, bits, g_idx, symmetric, scale_dtype)
        written.expected[module] = Expected(codes, scale.float(), zero, g_idx.to(torch.int32) if act_order else None)
        written.reference[module + ".weight"] = (codes.float() - zero.float()[:, g_idx]) * scale.float()[:, g_idx]
    return written


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit unsigned words -> the same bits as int32."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_sequential(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) -> int32 (R, C*bits/32): value j of each run of 32/bits at bits*j (GPTQ, compressed-tensors)."""
    per_word = 32 // bits
    runs = values.long().reshape(values.shape[0], -1, per_word)
    return _int32(sum(runs[..., j] << (bits * j) for j in range(per_word)))


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(R, C) 4-bit -> int32 (R, C/8): nibble i of word c holds column 8c + AWQ_PACK_ORDER[i]."""
    runs = values.long().reshape(values.shape[0], -1, 8)
    return _int32(sum(runs[..., AWQ_PACK_ORDER[i]] << (4 * i) for i in range(8)))


def _save(path: str, model: torch.nn.Module, tensors: dict, quantization_config: dict | None) -> None:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    config = model.config.to_dict()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_awq(path: str, model: torch.nn.Module, group_size: int = 64) -> Written:
    """AutoAWQ GEMM, 4-bit with zero points: qweight (K, N/8), qzeros (K/G, N/8), scales fp16 (K/G, N)."""
    state = on_disk_state(model)
    written = _quantize_all(state, 4, group_size, False, torch.float16)
    tensors = {n: t for n, t in state.items() if n.removesuffix(".weight") not in written.expected}
    for module, q in written.expected.items():
        tensors[module + ".qweight"] = pack_awq(q.codes.T)
        tensors[module + ".qzeros"] = pack_awq(q.zero.T)
        tensors[module + ".scales"] = q.scale.T.to(torch.float16)
    _save(path, model, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                 "version": "gemm", "modules_to_not_convert": None})
    return written


def write_gptq(path: str, model: torch.nn.Module, *, bits: int = 4, group_size: int = 32, sym: bool = True,
               desc_act: bool = False, checkpoint_format: str = "gptq") -> Written:
    """GPTQ: qweight (K*bits/32, N) packed along K, qzeros (K/G, N*bits/32) along N -- v1 ("gptq")
    stores zero - 1 (masked to its bits), v2 the zero --, scales fp16 (K/G, N), g_idx (K,)."""
    state = on_disk_state(model)
    written = _quantize_all(state, bits, group_size, sym, torch.float16, act_order=desc_act, seed=bits)
    tensors = {n: t for n, t in state.items() if n.removesuffix(".weight") not in written.expected}
    for module, q in written.expected.items():
        k = q.codes.shape[1]
        stored_zero = (q.zero.long() - 1) % 2 ** bits if checkpoint_format == "gptq" else q.zero
        tensors[module + ".qweight"] = pack_sequential(q.codes, bits).T
        tensors[module + ".qzeros"] = pack_sequential(stored_zero.T, bits)
        tensors[module + ".scales"] = q.scale.T.to(torch.float16)
        g_idx = q.g_idx if q.g_idx is not None else torch.arange(k) // (group_size or k)
        tensors[module + ".g_idx"] = g_idx.to(torch.int32)
    _save(path, model, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1,
                                 "desc_act": desc_act, "sym": sym, "true_sequential": True, "damp_percent": 0.01,
                                 "static_groups": False, "checkpoint_format": checkpoint_format})
    return written


def ct_scheme(bits: int, group_size: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if group_size else "channel",
                            group_size=group_size or None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_compressor(fmt: str):
    from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor

    return PackedQuantizationCompressor if fmt == "pack-quantized" else NaiveQuantizationCompressor


def save_compressed_tensors(path: str, model: torch.nn.Module, tensors: dict, scheme, fmt: str,
                            ignore: list[str]) -> None:
    """A compressed-tensors checkpoint of ``tensors`` (the quantized modules' already compressed) and ``model``'s
    config: one config group ``scheme`` in format ``fmt``, status compressed, the modules ``ignore`` names left out
    (the library writes its quantization_config into config.json)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=ignore)
    _save(path, model, tensors, None)
    ModelCompressor(quantization_config=config).update_config(path)


def write_compressed_tensors(path: str, model: torch.nn.Module, *, bits: int = 4, group_size: int = 128,
                             symmetric: bool = True, fmt: str = "pack-quantized", actorder: bool = False) -> Written:
    """compressed-tensors, packed by the library's compressor from the dequantized weight and our
    scale / zero point (its rounding then gives back exactly our codes). Scales bfloat16.

    ``actorder``: the layout llm-compressor wrote for ``actorder: group`` (``weight_g_idx`` (K,)); the
    library dropped that mode, so these layers are packed with its ``pack_to_int32`` directly."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    state = on_disk_state(model)
    written = _quantize_all(state, bits, group_size, symmetric, torch.bfloat16, act_order=actorder, seed=7)
    tensors = {n: t for n, t in state.items() if n.removesuffix(".weight") not in written.expected}
    scheme, offset = ct_scheme(bits, group_size, symmetric), 2 ** (bits - 1)
    for module, q in written.expected.items():
        scale = q.scale.to(torch.bfloat16)
        signed_zero = (q.zero.int() - offset).to(torch.int8)
        if actorder:
            compressed = {"weight_packed": pack_to_int32((q.codes.int() - offset).to(torch.int8), bits),
                          "weight_scale": scale, "weight_shape": torch.tensor(q.codes.shape), "weight_g_idx": q.g_idx}
            if not symmetric:
                compressed["weight_zero_point"] = pack_to_int32(signed_zero, bits, packed_dim=0)
        else:
            module_state = {"weight": written.reference[module + ".weight"], "weight_scale": scale}
            if not symmetric:
                module_state["weight_zero_point"] = signed_zero
            compressed = ct_compressor(fmt).compress(module_state, scheme)
        tensors.update({f"{module}.{name}": t for name, t in compressed.items()})
    save_compressed_tensors(path, model, tensors, scheme, fmt, ["lm_head", "re:.*mlp\\.gate$"])
    if actorder:  # the library no longer accepts the value: set it the way older versions wrote it
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        saved["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(saved, f, indent=2)
    return written


# name -> (writer, kwargs): every checkpoint layout the tests cover
VARIANTS = {
    "awq_gemm_asym": (write_awq, {}),
    "gptq_v1_sym": (write_gptq, {}),
    "gptq_v1_asym": (write_gptq, {"sym": False}),
    "gptq_v1_sym_desc_act": (write_gptq, {"desc_act": True}),
    "gptq_v1_asym_desc_act": (write_gptq, {"sym": False, "desc_act": True}),
    "gptq_v2_asym": (write_gptq, {"sym": False, "checkpoint_format": "gptq_v2"}),
    "gptq_int8_asym_per_channel": (write_gptq, {"bits": 8, "group_size": 0, "sym": False}),
    "gptq_int8_sym_desc_act": (write_gptq, {"bits": 8, "group_size": 64, "desc_act": True}),
    "ct_w4a16_g128_sym": (write_compressed_tensors, {}),
    "ct_w4a16_g128_asym": (write_compressed_tensors, {"symmetric": False}),
    "ct_w4a16_g32_asym_actorder": (write_compressed_tensors, {"group_size": 32, "symmetric": False, "actorder": True}),
    "ct_w8a16_channel_sym": (write_compressed_tensors, {"bits": 8, "group_size": 0}),
    "ct_w8a16_channel_asym": (write_compressed_tensors, {"bits": 8, "group_size": 0, "symmetric": False}),
    "ct_naive_w8a16_channel": (write_compressed_tensors, {"bits": 8, "group_size": 0, "fmt": "naive-quantized"}),
    "ct_naive_w4a16_g64_asym": (write_compressed_tensors, {"group_size": 64, "symmetric": False,
                                                           "fmt": "naive-quantized"}),
}


def write_variant(path: str, variant: str, family: str = "llama") -> Written:
    writer, kwargs = VARIANTS[variant]
    return writer(path, tiny_llama() if family == "llama" else tiny_qwen3_moe(), **kwargs)
