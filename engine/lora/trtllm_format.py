"""TensorRT-LLM's LoRA arrays: the backend's ``lora_weights`` / ``lora_config`` inputs, which
TRT-LLM's examples/hf_lora_convert.py writes as model.lora_weights.npy / model.lora_config.npy.

- lora_config: int32 rows [module_id, layer_idx, adapter_size] (r);
- lora_weights: one row per config row, A (r, in_features) then B (out_features, r), flattened
  row-major (in*r + r*out values), zero-padded at the end to the longest row; alpha / r is already
  folded into B. Triton hands both with a leading batch dim: [1, rows, len] and [1, rows, 3].
"""
from __future__ import annotations

import numpy as np
import torch

from engine.config import ModelConfig
from engine.lora.host_adapter import LoraAdapter, LoraError, check_rank, module_shape
from engine.lora.peft_format import parse_peft_config, read_peft_modules

# TRT-LLM's LoraManager.LORA_MODULE_IDS, the ones a Llama-block model has. TRT-LLM's GatedMLP
# computes act(fc(x)) * gate(x) and its converter maps gate_proj -> mlp_h_to_4h (fc) and
# up_proj -> mlp_gate, hence 5 -> gate and 7 -> up. attn_qkv is one adapter on the fused
# projection: A (r, hidden), B (q + k + v, r).
MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5,
              "mlp_4h_to_h": 6, "mlp_gate": 7}
ID_MODULES = {0: ("q", "k", "v"), 1: ("q",), 2: ("k",), 3: ("v",), 4: ("o",), 5: ("gate",), 6: ("down",), 7: ("up",)}
_ID_NAMES = {i: name for name, i in MODULE_IDS.items()}
# A PEFT projection -> the rows it becomes (gate_up_proj: B's halves, sharing A).
HF_MODULE_IDS = {"q_proj": (1,), "k_proj": (2,), "v_proj": (3,), "o_proj": (4,), "gate_proj": (5,),
                 "down_proj": (6,), "up_proj": (7,), "qkv_proj": (0,), "gate_up_proj": (5, 7)}
# numpy has no bfloat16: TRT-LLM's converter writes it as raw 2-byte voids that np.load cannot
# give back as numbers, so only these two are written.
STORAGE_DTYPES = {"float16": np.float16, "float32": np.float32}


def adapter_from_trtllm(weights: np.ndarray, lora_config: np.ndarray, config: ModelConfig, max_rank: int,
                        source: str) -> LoraAdapter:
    """The adapter held by TRT-LLM's arrays, for a model of shape ``config``. ``weights`` may also
    be a CPU torch tensor (bfloat16 included). Each row is copied once (the inputs may be
    Triton's buffers); its a and b are views of that copy, in the stored dtype."""
    table = _config_rows(lora_config, source)
    values = _weight_rows(weights, len(table), source)
    adapter: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    row_of: dict[tuple[int, str], int] = {}
    for row, (module_id, layer, rank) in enumerate(table.tolist()):
        where = f"{source}: lora_config row {row}"
        if module_id not in ID_MODULES:
            allowed = ", ".join(f"{i} ({name})" for name, i in MODULE_IDS.items())
            raise LoraError(f"{where}: unknown module id {module_id}; allowed: {allowed}")
        if not 0 <= layer < config.num_layers:
            raise LoraError(f"{where}: layer index {layer} is out of range [0, {config.num_layers})")
        check_rank(rank, max_rank, f"module {_ID_NAMES[module_id]} in layer {layer}", where)
        if config.is_moe_layer(layer) and ID_MODULES[module_id][0] in ("gate", "up", "down"):
            raise LoraError(f"{where}: layer {layer} is a mixture-of-experts layer; LoRA on its MLP "
                            f"({_ID_NAMES[module_id]}) is not supported, only on attention (ids 0-4)")
        for module, a, b in _row_modules(values, row, module_id, rank, config, source):
            if (layer, module) in row_of:
                raise LoraError(f"{where}: module {module} of layer {layer} is already set by row "
                                f"{row_of[(layer, module)]}; each (module, layer) may appear once")
            row_of[(layer, module)] = row
            adapter[(layer, module)] = (a, b)
    return LoraAdapter(weights=adapter, source=source)


def peft_to_trtllm(path: str, dtype: str = "float16") -> tuple[np.ndarray, np.ndarray]:
    """TRT-LLM's two arrays for the PEFT adapter in ``path``: weights [1, rows, max_len] in
    ``dtype`` and config [1, rows, 3] int32, one row per projection (rows by layer, then
    q, k, v, o, gate, up, down). Sizes come from the tensors, so no ModelConfig is needed; the
    engine checks them, and max_lora_rank, when it loads the arrays."""
    if dtype not in STORAGE_DTYPES:
        raise LoraError(f"storage dtype {dtype!r} is not supported; allowed: {', '.join(STORAGE_DTYPES)} "
                        "(numpy has no bfloat16; the engine casts the adapter to its own dtype)")
    rows, table = [], []
    for m in read_peft_modules(path, parse_peft_config(path)):
        module_ids = HF_MODULE_IDS[m.name]
        if m.b.shape[0] % len(module_ids):
            raise LoraError(f"tensor {m.key.replace('.lora_A.', '.lora_B.')} has {m.b.shape[0]} rows; "
                            f"{m.name} needs an even number (gate and up halves)")
        for module_id, b in zip(module_ids, m.b.chunk(len(module_ids))):
            rows.append(torch.cat([m.a.flatten(), b.flatten()]))
            table.append([module_id, m.layer, m.a.shape[0]])
    weights = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        weights[i, :len(r)] = r
    stored = weights.numpy().astype(STORAGE_DTYPES[dtype])
    if not np.isfinite(stored).all():
        raise LoraError(f"PEFT adapter {path}: values overflow {dtype} (largest |value| "
                        f"{weights.abs().max().item():.4g}); use float32")
    return stored[None], np.asarray(table, dtype=np.int32)[None]


def _config_rows(lora_config, source: str) -> np.ndarray:
    """lora_config as (rows, 3) int64, the Triton batch dim dropped."""
    table = np.asarray(lora_config)
    if table.ndim == 3 and table.shape[0] == 1:
        table = table[0]
    if table.ndim != 2 or table.shape[1] != 3 or table.shape[0] == 0:
        raise LoraError(f"{source}: lora_config must have shape [rows, 3] or [1, rows, 3] with rows >= 1, "
                        f"got {list(np.shape(lora_config))}")
    if table.dtype.kind not in "iu":
        raise LoraError(f"{source}: lora_config must hold integers (int32), got {table.dtype}")
    return table.astype(np.int64)


def _weight_rows(weights, num_rows: int, source: str) -> torch.Tensor | np.ndarray:
    """lora_weights as (rows, len), the Triton batch dim dropped; not copied yet."""
    shape = list(weights.shape)
    if weights.ndim == 3 and shape[0] == 1:
        weights = weights[0]
    if weights.ndim != 2:
        raise LoraError(f"{source}: lora_weights must have shape [rows, len] or [1, rows, len], got {shape}")
    floating = weights.is_floating_point() if isinstance(weights, torch.Tensor) else weights.dtype.kind == "f"
    if not floating:
        raise LoraError(f"{source}: lora_weights must hold floats (float16, bfloat16 or float32), got {weights.dtype}")
    if weights.shape[0] != num_rows:
        raise LoraError(f"{source}: lora_weights has {weights.shape[0]} rows but lora_config has {num_rows}; "
                        "they must match row for row")
    return weights


def _row_modules(values, row: int, module_id: int, rank: int, config: ModelConfig, source: str):
    """(module, a, b) of one row: one entry, or q/k/v sharing a for attn_qkv."""
    modules = ID_MODULES[module_id]
    in_features = module_shape(config, modules[0])[0]
    out_sizes = [module_shape(config, m)[1] for m in modules]
    needed = rank * (in_features + sum(out_sizes))
    where = f"{source}: lora_weights row {row}"
    if values.shape[1] < needed:
        raise LoraError(f"{where} has {values.shape[1]} values; module {_ID_NAMES[module_id]} of rank {rank} needs "
                        f"{needed} (in {in_features} * r + r * out {sum(out_sizes)})")
    data = values[row, :needed]
    data = data.clone() if isinstance(data, torch.Tensor) else torch.from_numpy(np.array(data))
    if data.dtype == torch.float64:  # no kernel wants it: keep float64 input as float32
        data = data.float()
    if not torch.isfinite(data).all():
        raise LoraError(f"{where} holds non-finite values (inf or nan)")
    a = data[:rank * in_features].view(rank, in_features)
    b = data[rank * in_features:].view(sum(out_sizes), rank)
    return [(m, a, part) for m, part in zip(modules, b.split(out_sizes))]
