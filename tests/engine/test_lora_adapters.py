"""LoRA adapters on the host (engine/lora): PEFT directories written by real peft from tiny random
transformers models, TensorRT-LLM's lora_weights/lora_config arrays, the converter between them
(tools/hf_lora_convert.py) and every refusal. The reference delta of each projection is peft's
own ``get_delta_weight`` (scale included), so b @ a of ours must equal it."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from engine.convert import model_config_from_hf
from engine.lora.adapter import (MODULES, LoraAdapter, LoraError, adapter_from_trtllm, load_peft_adapter, module_shape,
                                 peft_to_trtllm, read_peft_config)

# peft's save_pretrained asks transformers a deprecated question; not ours to answer
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # Qwen3's default head_dim is 128: q is 512 wide on a 64-wide model
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),  # fused qkv_proj and gate_up_proj
}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Our module -> the unfused HF projection that holds it (fused ones: see peft_deltas)
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
            "down": "down_proj"}
TRTLLM_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}


def save_peft(path, family: str = "llama", **lora):
    """A tiny random model of ``family`` with a random LoRA (B not zero) saved to ``path``:
    (path, peft model, our ModelConfig)."""
    torch.manual_seed(0)
    config_class, model_class = FAMILIES[family]
    hf = model_class(config_class(**_SHAPE, pad_token_id=0))
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else ALL_TARGETS
    settings = {"r": 8, "lora_alpha": 16, "target_modules": targets, "init_lora_weights": False, **lora}
    model = get_peft_model(hf, LoraConfig(**settings))
    model.save_pretrained(str(path))
    return str(path), model, model_config_from_hf(hf.config)


def peft_deltas(model, config) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> peft's delta weight (out, in), fused projections cut into our modules."""
    deltas = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for block in (layer.self_attn, layer.mlp):
            for name, proj in block.named_children():
                if not hasattr(proj, "get_delta_weight") or "default" not in proj.lora_A:
                    continue
                delta = proj.get_delta_weight("default").detach()
                parts = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}.get(name)
                if parts is None:
                    deltas[(i, next(m for m, hf in HF_NAMES.items() if hf == name))] = delta
                else:
                    sizes = [module_shape(config, m)[1] for m in parts]
                    deltas.update({(i, m): d for m, d in zip(parts, delta.split(sizes))})
    return deltas


def assert_deltas_match(adapter: LoraAdapter, expected: dict, atol: float = 1e-5) -> None:
    assert set(adapter.weights) == set(expected)
    for key, (a, b) in adapter.weights.items():
        torch.testing.assert_close((b.float() @ a.float()), expected[key], atol=atol, rtol=1e-3, msg=str(key))


# ---- PEFT directories -------------------------------------------------------------------------

@pytest.mark.parametrize("family,rank", [("llama", 4), ("qwen3", 8), ("mistral", 16)])
def test_peft_adapter_equals_peft_deltas(tmp_path, family, rank):
    path, model, config = save_peft(tmp_path, family, r=rank, lora_alpha=2 * rank + 3)
    adapter = load_peft_adapter(path, config, max_rank=16)
    assert adapter.rank == rank and adapter.source == f"PEFT adapter {path}"
    assert len(adapter.weights) == config.num_layers * len(MODULES)
    for (layer, module), (a, b) in adapter.weights.items():
        in_features, out_features = module_shape(config, module)
        assert a.shape == (rank, in_features) and b.shape == (out_features, rank)
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())
    assert_deltas_match(adapter, peft_deltas(model, config))


def test_rslora_and_rank_alpha_patterns(tmp_path):
    patterns = dict(use_rslora=True, rank_pattern={"layers.1.self_attn.q_proj": 4, "down_proj": 16},
                    alpha_pattern={"v_proj": 3, r"layers\.0\.mlp\.up_proj": 40})
    path, model, config = save_peft(tmp_path, r=8, lora_alpha=16, **patterns)
    adapter = load_peft_adapter(path, config, max_rank=16)
    ranks = {key: a.shape[0] for key, (a, _) in adapter.weights.items()}
    assert ranks[(1, "q")] == 4 and ranks[(0, "q")] == 8 and ranks[(0, "down")] == ranks[(1, "down")] == 16
    assert adapter.rank == 16
    assert_deltas_match(adapter, peft_deltas(model, config))


def test_subsets_of_modules_and_layers(tmp_path):
    path, model, config = save_peft(tmp_path, target_modules=["q_proj", "down_proj"], layers_to_transform=[1])
    adapter = load_peft_adapter(path, config, max_rank=8)
    assert set(adapter.weights) == {(1, "q"), (1, "down")}
    assert_deltas_match(adapter, peft_deltas(model, config))


def test_fused_phi3_projections_become_slices_sharing_a(tmp_path):
    path, model, config = save_peft(tmp_path, "phi3", r=4)
    adapter = load_peft_adapter(path, config, max_rank=8)
    assert len(adapter.weights) == config.num_layers * len(MODULES)
    q, k, v = (adapter.weights[(0, m)] for m in "qkv")
    assert q[0] is k[0] is v[0]
    assert adapter.weights[(1, "gate")][0] is adapter.weights[(1, "up")][0]
    assert_deltas_match(adapter, peft_deltas(model, config))
    # TRT-LLM's layout keeps qkv_proj as one attn_qkv row and splits gate_up_proj into gate and up
    weights, table = peft_to_trtllm(path, "float32")
    assert table[0, :, 0].tolist() == [0, 4, 5, 7, 6] * 2
    assert_deltas_match(adapter_from_trtllm(weights, table, config, 8, "phi3"), peft_deltas(model, config))


def test_bin_weights_are_read_when_there_is_no_safetensors(tmp_path):
    path, model, config = save_peft(tmp_path, r=4)
    torch.save(load_file(os.path.join(path, "adapter_model.safetensors")), os.path.join(path, "adapter_model.bin"))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    assert_deltas_match(load_peft_adapter(path, config, max_rank=4), peft_deltas(model, config))


# ---- TensorRT-LLM's arrays --------------------------------------------------------------------

def test_peft_to_trtllm_layout_and_round_trip(tmp_path):
    path, model, config = save_peft(tmp_path, r=4, rank_pattern={"o_proj": 8})
    weights, table = peft_to_trtllm(path)
    assert weights.dtype == np.float16 and table.dtype == np.int32
    assert table.shape == (1, 14, 3) and weights.shape[:2] == (1, 14)
    hidden, inter, kv = 64, 128, 2 * 16
    ids = [TRTLLM_IDS[name] for name in ALL_TARGETS]  # rows by layer, then q, k, v, o, gate, up, down
    assert table[0].tolist() == [[i, layer, 8 if i == 4 else 4] for layer in range(2) for i in ids]
    lengths = {1: 4 * (hidden + hidden), 2: 4 * (hidden + kv), 3: 4 * (hidden + kv), 4: 8 * (hidden + hidden),
               5: 4 * (hidden + inter), 6: 4 * (inter + hidden), 7: 4 * (hidden + inter)}
    assert weights.shape[2] == max(lengths.values())
    safetensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    for row, (module_id, layer, rank) in enumerate(table[0].tolist()):
        name = next(hf for hf, i in TRTLLM_IDS.items() if i == module_id)
        peft_a = safetensors[f"base_model.model.model.layers.{layer}.self_attn.{name}.lora_A.weight"
                             if module_id <= 4 else f"base_model.model.model.layers.{layer}.mlp.{name}.lora_A.weight"]
        np.testing.assert_array_equal(weights[0, row, :peft_a.numel()], peft_a.flatten().half().numpy())
        assert not weights[0, row, lengths[module_id]:].any()  # zero padding after A then B
        assert weights[0, row, lengths[module_id] - 1] != 0
    deltas = peft_deltas(model, config)
    assert_deltas_match(adapter_from_trtllm(weights, table, config, 8, "lora_task_id 3"), deltas, atol=2e-3)
    # 2-D inputs (no Triton batch dim) and float32 storage
    weights32, table32 = peft_to_trtllm(path, "float32")
    adapter = adapter_from_trtllm(weights32[0], table32[0], config, 8, "lora_task_id 3")
    assert adapter.weights[(0, "q")][0].dtype == torch.float32 and adapter.source == "lora_task_id 3"
    assert_deltas_match(adapter, deltas)


def test_adapter_from_trtllm_copies_its_inputs_and_takes_bfloat16_tensors(tmp_path):
    path, model, config = save_peft(tmp_path, r=4)
    weights, table = peft_to_trtllm(path, "float32")
    adapter = adapter_from_trtllm(weights, table, config, 4, "t")
    before = adapter.weights[(0, "q")][1].clone()
    weights[:] = 0  # Triton reuses its input buffers after the request
    assert torch.equal(adapter.weights[(0, "q")][1], before)
    weights, _ = peft_to_trtllm(path, "float32")
    bf16 = adapter_from_trtllm(torch.from_numpy(weights).bfloat16(), torch.from_numpy(table), config, 4, "t")
    assert bf16.weights[(1, "down")][0].dtype == torch.bfloat16
    assert_deltas_match(bf16, peft_deltas(model, config), atol=2e-2)


def test_attn_qkv_row_expands_to_q_k_v_sharing_a():
    config = model_config_from_hf(transformers.LlamaConfig(**_SHAPE))
    rank, q_size, kv_size = 3, 64, 32
    torch.manual_seed(1)
    a, b = torch.randn(rank, 64), torch.randn(q_size + 2 * kv_size, rank)
    row = torch.cat([a.flatten(), b.flatten(), torch.zeros(5)]).numpy()  # padded a little
    adapter = adapter_from_trtllm(row[None, None], np.array([[[0, 1, rank]]], np.int32), config, 4, "qkv")
    assert set(adapter.weights) == {(1, "q"), (1, "k"), (1, "v")}
    (qa, qb), (ka, kb), (va, vb) = (adapter.weights[(1, m)] for m in "qkv")
    assert qa is ka is va and torch.equal(qa, a)
    for got, want in zip((qb, kb, vb), b.split([q_size, kv_size, kv_size])):
        assert torch.equal(got, want)
    assert adapter.rank == rank and adapter.nbytes == (a.numel() + b.numel()) * 4


def test_cli_writes_the_two_npy_files(tmp_path, capsys):
    """tools/hf_lora_convert.py's main in this process (two interpreters cost ~3 s of imports each; the
    script as a command is what tests/integration/conftest.py's lora_adapters runs, exit status checked)."""
    path, _, _ = save_peft(tmp_path / "peft", r=4)
    out = tmp_path / "out"
    spec = importlib.util.spec_from_file_location("hf_lora_convert_under_test",
                                                  os.path.join(ROOT, "tools", "hf_lora_convert.py"))
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    assert convert.main(["-i", path, "-o", str(out), "--storage-type", "float32", "--verbose"]) == 0
    printed = capsys.readouterr().out
    assert "mlp_gate" in printed and "wrote 14 rows" in printed
    weights, table = peft_to_trtllm(path, "float32")
    np.testing.assert_array_equal(np.load(out / "model.lora_weights.npy"), weights)
    np.testing.assert_array_equal(np.load(out / "model.lora_config.npy"), table)
    assert convert.main(["-i", path, "-o", str(out), "--storage-type", "bfloat16"]) == 2
    assert "numpy has no bfloat16" in capsys.readouterr().err


# ---- refusals ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved llama adapter (r 8) to copy and break: (path, ModelConfig)."""
    path, _, config = save_peft(tmp_path_factory.mktemp("lora") / "base", r=8)
    return path, config


def broken_copy(saved, tmp_path, config_edit: dict | None = None, tensors_edit=None) -> str:
    path = str(tmp_path / "adapter")
    shutil.copytree(saved[0], path)
    if config_edit:
        with open(os.path.join(path, "adapter_config.json")) as f:
            data = json.load(f)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({**data, **config_edit}, f)
    if tensors_edit:
        file = os.path.join(path, "adapter_model.safetensors")
        tensors = load_file(file)
        tensors_edit(tensors)
        save_file(tensors, file)
    return path


LAYER0 = "base_model.model.model.layers.0"


@pytest.mark.parametrize("edit,match", [
    ({"use_dora": True}, "DoRA adapters are not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"bias": "all"}, r"bias 'all' is not supported.*allowed: 'none'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "includes embed_tokens"),
    ({"target_modules": ["lm_head"]}, "includes lm_head"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"r": 128}, "rank 128 of adapter_config.json field r .* exceeds max_lora_rank 64"),
    ({"rank_pattern": {"q_proj": 65}}, r"rank 65 of adapter_config.json rank_pattern\['q_proj'\].* exceeds"),
    ({"alpha_pattern": {"q_proj": "big"}}, r"alpha_pattern\['q_proj'\] must be a positive number, got 'big'"),
    ({"lora_alpha": 0}, "lora_alpha must be a positive number, got 0"),
])
def test_refused_configs(saved, tmp_path, edit, match):
    path = broken_copy(saved, tmp_path, config_edit=edit)
    with pytest.raises(LoraError, match=match):
        read_peft_config(path, max_rank=64)
    with pytest.raises(LoraError, match=match):
        load_peft_adapter(path, saved[1], max_rank=64)


def _put(key: str, shape: tuple[int, ...]):
    """An edit that adds tensor ``key``, or replaces it with one of another shape."""
    return lambda tensors: tensors.update({key: torch.randn(shape)})


@pytest.mark.parametrize("edit,match", [
    (_put("base_model.model.model.embed_tokens.lora_embedding_A", (8, 128)), "lora_embedding_"),
    (_put("base_model.model.lm_head.lora_A.weight", (8, 64)), "lm_head"),
    (_put(f"{LAYER0}.self_attn.q_proj.lora_B.bias", (64,)), "LoRA bias tensors are not supported"),
    (_put(f"{LAYER0}.self_attn.rotary.lora_A.weight", (8, 64)), r"module 'rotary' is not supported; allowed: q_proj"),
    (_put(f"{LAYER0}.mlp.experts.0.w1.lora_A.weight", (8, 64)), r"mlp.experts.0.w1.lora_A.weight in .* is not"),
    (_put(f"{LAYER0}.self_attn.k_proj.lora_B.weight", (48, 8)),
     r"k_proj.lora_B.weight has shape \(48, 8\), expected \(32, 8\)"),
    (_put(f"{LAYER0}.mlp.down_proj.lora_A.weight", (8, 64)),
     r"down_proj.lora_A.weight has shape \(8, 64\), expected \(8, 128\)"),
    (_put(f"{LAYER0}.self_attn.q_proj.lora_A.weight", (4, 64)), r"shape \(4, 64\), expected \(8, \?\)"),
    (_put("base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight", (8, 64)), "no lora_B.weight"),
    (lambda t: t.update({f"{LAYER0}.self_attn.v_proj.lora_A.weight": torch.full((8, 64), float("nan"))}),
     "v_proj.lora_A.weight .* non-finite"),
    (lambda t: t.clear() or t.update({"unrelated": torch.zeros(1)}), "unrelated .* is not a lora_A/lora_B weight"),
    (lambda t: t.clear(), "adapter_model.safetensors holds no LoRA tensors"),
    (_put("model.layers.0.self_attn.o_proj.lora_A.weight", (8, 64)), "are both lora_A of layer 0 o_proj"),
])
def test_refused_tensors(saved, tmp_path, edit, match):
    path = broken_copy(saved, tmp_path, tensors_edit=edit)
    with pytest.raises(LoraError, match=match):
        load_peft_adapter(path, saved[1], max_rank=64)


def test_refused_paths_and_layers(saved, tmp_path):
    config = saved[1]
    with pytest.raises(LoraError, match=f"directory {tmp_path}/nowhere does not exist"):
        load_peft_adapter(str(tmp_path / "nowhere"), config, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="empty/adapter_config.json does not exist"):
        load_peft_adapter(str(tmp_path / "empty"), config, 64)
    path = broken_copy(saved, tmp_path)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoraError, match=r"no adapter weights: neither adapter_model.safetensors nor adapter_model.bin"):
        load_peft_adapter(path, config, 64)
    with pytest.raises(LoraError, match=r"layer 1 is out of range \[0, 1\)"):
        load_peft_adapter(saved[0], replace(config, num_layers=1), 64)
    with pytest.raises(LoraError, match=r"rank 8 of adapter_config.json field r in .* exceeds max_lora_rank 4"):
        load_peft_adapter(saved[0], config, 4)


@pytest.fixture(scope="module")
def arrays(saved):
    """TRT-LLM arrays of the saved adapter, 2-D: (weights (14, len) float16, config (14, 3) int32)."""
    weights, table = peft_to_trtllm(saved[0])
    return weights[0], table[0]


def _with_row(table, row: int, values: list[int]):
    table = table.copy()
    table[row] = values
    return table


@pytest.mark.parametrize("change,match", [
    (lambda w, t: (w, t[:, :2]), r"lora_config must have shape \[rows, 3\] or \[1, rows, 3\].*got \[14, 2\]"),
    (lambda w, t: (w, t.astype(np.float32)), "lora_config must hold integers"),
    (lambda w, t: (w[:13], t), "lora_weights has 13 rows but lora_config has 14"),
    (lambda w, t: (w[None, None], t), r"lora_weights must have shape \[rows, len\].*got \[1, 1, 14"),
    (lambda w, t: (w.astype(np.int32), t), "lora_weights must hold floats"),
    (lambda w, t: (w, _with_row(t, 2, [9, 0, 8])), r"row 2: unknown module id 9; allowed: 0 \(attn_qkv\), 1 \(attn_q\)"),
    (lambda w, t: (w, _with_row(t, 2, [2, 2, 8])), r"row 2: layer index 2 is out of range \[0, 2\)"),
    (lambda w, t: (w, _with_row(t, 2, [2, -1, 8])), r"row 2: layer index -1 is out of range"),
    (lambda w, t: (w, _with_row(t, 2, [2, 0, 0])), "row 2: rank 0 of module attn_k in layer 0 must be at least 1"),
    (lambda w, t: (w, _with_row(t, 1, [1, 0, 8])), "row 1: module q of layer 0 is already set by row 0"),
    (lambda w, t: (w, _with_row(t, 1, [0, 0, 8])), "row 1: module q of layer 0 is already set by row 0"),
    (lambda w, t: (w[:, :1000], t), r"lora_weights row 0 has 1000 values; module attn_q of rank 8 needs 1024"),
    (lambda w, t: (np.where(np.arange(w.shape[1]) == 3, np.float16(np.inf), w), t), "row 0 holds non-finite"),
])
def test_refused_trtllm_arrays(saved, arrays, change, match):
    weights, table = change(*arrays)
    with pytest.raises(LoraError, match=match):
        adapter_from_trtllm(weights, table, saved[1], 64, "lora_task_id 7")


def test_trtllm_rank_above_max_names_module_layer_and_limit(saved, arrays):
    weights, table = arrays
    table = _with_row(table, 12, [7, 3, 128])  # up_proj is TRT-LLM's mlp_gate
    with pytest.raises(LoraError, match="lora_task_id 7: lora_config row 12: rank 128 of module mlp_gate in layer 3 exceeds max_lora_rank 64"):
        adapter_from_trtllm(weights, table, replace(saved[1], num_layers=4), 64, "lora_task_id 7")


def test_trtllm_mlp_rows_on_moe_layers_are_refused(arrays):
    config = model_config_from_hf(transformers.MixtralConfig(**_SHAPE, num_local_experts=4, num_experts_per_tok=2))
    weights, table = arrays
    attention = np.isin(table[:, 0], [1, 2, 3, 4])
    assert len(adapter_from_trtllm(weights[attention], table[attention], config, 64, "t").weights) == 8
    with pytest.raises(LoraError, match="row 4: layer 0 is a mixture-of-experts layer; LoRA on its MLP"):
        adapter_from_trtllm(weights, table, config, 64, "t")


def test_storage_dtypes(saved):
    with pytest.raises(LoraError, match=r"storage dtype 'bfloat16' is not supported; allowed: float16, float32"):
        peft_to_trtllm(saved[0], "bfloat16")
