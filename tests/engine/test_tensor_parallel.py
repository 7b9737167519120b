"""Tensor-parallel shards: they reassemble exactly, and two gloo ranks compute tp 1's logits (decoder
families, and the hybrid Mamba-2 models with a decode after a chunked prompt)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ConfigError, EngineConfig
from engine.executor.runner import ModelRunner
from engine_testing import assert_tp2_matches_tp1, make_engine, tiny_hf

TP_FAMILIES = ["llama", "llama3_rope_scaling", "mistral", "qwen2_qkv_bias", "gpt2", "mixtral", "qwen3_moe"]  # 2 kv heads
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", "fc_out.weight")  # split along input columns
VOCAB_OR_COLUMN = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "fc_in.weight", "fc_in.bias")


def _reassemble(name: str, shards: list[torch.Tensor], config: EngineConfig) -> torch.Tensor:
    """Undo the tp split of one tensor, from the layout rules in docs/INTERFACES.md."""
    model = config.model
    if name.endswith("moe.down_proj"):  # (E, H, I_r): every expert sliced along its width
        return torch.cat(shards, dim=2)
    if name.endswith("moe.gate_up_proj"):  # (E, 2 * I_r, H), each shard [gate_r | up_r] per expert
        parts = [s.chunk(2, dim=1) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts], dim=1) for i in range(2)], dim=1)
    if name.endswith(ROW_PARALLEL):
        return torch.cat(shards, dim=1)
    if name.endswith(VOCAB_OR_COLUMN):
        return torch.cat(shards, dim=0)
    if "qkv_proj" in name:  # each shard is [q_r | k_r | v_r]
        tp = len(shards)
        q, kv = model.num_heads * model.head_dim // tp, model.num_kv_heads * model.head_dim // tp
        parts = [s.split([q, kv, kv]) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    if "gate_up_proj" in name:  # each shard is [gate_r | up_r]
        parts = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(2)])
    assert all(torch.equal(s, shards[0]) for s in shards), f"{name} should be replicated"
    return shards[0]


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_shards_reassemble_exactly_to_tp1(family, tmp_path):
    hf = tiny_hf(family)
    tp1 = load_file(f"{make_engine(hf, tmp_path / 'tp1')}/rank0.safetensors")
    tp2_dir = make_engine(hf, tmp_path / "tp2", tp_size=2)
    config = EngineConfig.load(tp2_dir)
    ranks = [load_file(f"{tp2_dir}/rank{r}.safetensors") for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(tp1)
    for name, full in tp1.items():
        shards = [rank[name] for rank in ranks]
        assert torch.equal(_reassemble(name, shards, config), full), name


def test_tp_size_must_divide_heads(tmp_path):
    hf = tiny_hf("smollm2_tied")  # 3 heads, 1 kv head
    with pytest.raises(ConfigError, match=r"tp_size 2 does not divide num_heads \(3\)"):
        make_engine(hf, tmp_path / "bad", tp_size=2)


def test_tp2_engine_needs_a_process_group(tmp_path):
    engine_dir = make_engine(tiny_hf("llama"), tmp_path / "tp2", tp_size=2)
    with pytest.raises(ValueError, match="tp_group is required"):
        ModelRunner(engine_dir, rank=0)
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        ModelRunner(engine_dir, rank=2)


def test_two_gloo_ranks_compute_tp1_logits(tmp_path):
    # GQA, qkv bias, row-parallel bias + learned positions, experts sliced across ranks
    families = ("llama", "qwen2_qkv_bias", "gpt2", "mixtral", "qwen3_moe")
    assert_tp2_matches_tp1({family: tiny_hf(family) for family in families}, tmp_path)


def _one_group_bamba() -> torch.nn.Module:
    """Bamba with a single B/C group (as state-spaces' Mamba-2 and Codestral): at tp 2 both ranks
    replicate it, and the gated norm's group spans both ranks."""
    from hybrid_testing import HYBRIDS

    model_class, make_config = HYBRIDS["bamba"]
    config = make_config()
    config.mamba_n_groups = 1
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    return model


def test_hybrid_tp2_over_gloo_equals_tp1(tmp_path):
    """Hybrid Mamba-2 models (engine/ssm/mamba_shard.py) at TP 2 give TP 1's logits (1e-5) and greedy
    ids on both ranks, over a prompt prefilled in two chunks beside a second prompt, decodes of both,
    and a step mixing a decode with a fresh prompt (hybrid_tp_ranks.py): Nemotron-H with 2 B/C groups
    (each rank holds one), Bamba with 1 (both ranks hold it; the gated norm's one group spans the
    ranks, its mean square summed across them), Granite 4.0 and Nemotron-H MoE (every expert's width
    and the shared MLP's split, their partial sums meeting in one all-reduce)."""
    from gloo_ranks import shared_pair
    from hybrid_testing import VOCAB, tiny_hybrid
    from hybrid_tp_ranks import hybrid_steps, tp_hybrid_steps

    models = {"nemotron_h": tiny_hybrid("nemotron_h"), "bamba_one_group": _one_group_bamba(),
              "granite_moe": tiny_hybrid("granite_moe"), "nemotron_h_moe": tiny_hybrid("nemotron_h_moe")}
    engines = {name: (make_engine(m, tmp_path / f"{name}-1"), make_engine(m, tmp_path / f"{name}-2", tp_size=2))
               for name, m in models.items()}
    expected = {name: hybrid_steps(ModelRunner(tp1), VOCAB) for name, (tp1, _) in engines.items()}
    ranks = shared_pair().run(tp_hybrid_steps, {name: tp2 for name, (_, tp2) in engines.items()}, VOCAB)
    for name, (logits, greedy) in expected.items():
        for rank in range(2):
            got_logits, got_greedy = ranks[rank][name]
            error = (got_logits - logits).abs().max().item()
            assert error <= 1e-5, f"{name} rank {rank}: max abs error {error:.3g} vs tp 1"
            assert got_greedy == greedy, name
