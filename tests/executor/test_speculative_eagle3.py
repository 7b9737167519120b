"""EAGLE-3 heads (engine/executor/speculative/eagle3.py) in the published checkpoint layout, made here
on random weights: they load, draft a tree from the target's low/mid/high layer streams, and
greedy ids through tree verification (TreeDecoder) equal transformers' greedy decoding."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.executor.runner import ModelRunner
from engine.executor.speculative.eagle3 import Eagle3ConfigError, Eagle3TreeProposer, load_eagle3
from engine.executor.speculative.tree_step import TreeDecoder

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 128, 32


def save_eagle3(directory, hidden: int = HIDDEN, seed: int = 0, layers: list[int] | None = None) -> str:
    """Random weights under the EAGLE-3 authors' key names; draft vocab = every 4th target id (d2t)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    heads, kv, head_dim, inter = 4, 2, 16, 128
    state = {"fc.weight": r(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
             "midlayer.hidden_norm.weight": torch.ones(hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
             "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
             "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
             "midlayer.self_attn.k_proj.weight": r(kv * head_dim, 2 * hidden),
             "midlayer.self_attn.v_proj.weight": r(kv * head_dim, 2 * hidden),
             "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
             "midlayer.mlp.gate_proj.weight": r(inter, hidden), "midlayer.mlp.up_proj.weight": r(inter, hidden),
             "midlayer.mlp.down_proj.weight": r(hidden, inter), "lm_head.weight": r(DRAFT_VOCAB, HIDDEN),
             "d2t": torch.arange(DRAFT_VOCAB) * 3,  # draft id i -> target id 4i
             "t2d": torch.arange(VOCAB) % 4 == 0}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "num_hidden_layers": 1,
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}} if layers else {})}))
    save_file(state, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def runner(tiny_engine) -> ModelRunner:
    return ModelRunner(tiny_engine)


def test_greedy_ids_through_eagle3_trees_equal_transformers(tmp_path, runner, tiny_hf):
    head, layers = load_eagle3(save_eagle3(tmp_path / "eagle3"), hidden_size=HIDDEN, vocab_size=VOCAB,
                               num_layers=len(runner.model.layers))
    assert layers == [1, 0, 0]  # the default [1, L/2 - 1, L - 4] clamped to the 2-layer target
    proposer = Eagle3TreeProposer(runner, head, layers, choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    decoder = TreeDecoder(runner, num_blocks=64)
    try:
        for prompt in ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3],):
            want = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
            proposer._previous = None  # a new sequence
            got, stats = decoder.generate(prompt, 12, proposer)
            assert got == want
            assert stats.tree_sizes and set(stats.tree_sizes) <= {5, 4, 2, 1}
            assert all(t % 4 == 0 for t in proposer._previous[2][1:])  # drafts are d2t-mapped target ids
        assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks
    finally:
        proposer.close()


class OracleHead:
    """The loaded head, but ranking the true next token first: deep paths get accepted, so the
    proposer's bookkeeping of accepted rows (and their target features) is exercised."""

    def __init__(self, head, full: list[int]):
        self.head, self.full = head, full

    def features(self, *streams):
        return self.head.features(*streams)

    def forward(self, embeds, g, positions):
        h, ranked = self.head.forward(embeds, g, positions)
        true = self.full[len(positions) + 1]  # row r embeds x_{r+1} and guesses x_{r+2}
        return h, torch.cat([torch.tensor([true]), ranked[ranked != true]])


def test_accepted_paths_keep_the_targets_features_in_order(tmp_path, runner, tiny_hf):
    """With drafts accepted several deep, the features the proposer keeps for every computed token
    equal fc([h0; h0; h0]) of transformers' stream after layer 0 over the same tokens."""
    head, layers = load_eagle3(save_eagle3(tmp_path / "eagle3", layers=[0, 0, 0]), hidden_size=HIDDEN,
                               vocab_size=VOCAB, num_layers=len(runner.model.layers))
    prompt = [5, 9, 13, 2, 7]
    full = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0].tolist()
    proposer = Eagle3TreeProposer(runner, OracleHead(head, full + [0] * 8), layers,
                                  choices=[[0], [1], [0, 0], [0, 0, 0]])
    try:
        got, stats = TreeDecoder(runner, num_blocks=64).generate(prompt, 16, proposer)  # (the runner's pool)
    finally:
        proposer.close()
    assert got == full[len(prompt):len(prompt) + 16]
    assert max(stats.accepted) == 3 and stats.steps < 8
    with torch.no_grad():
        stream = tiny_hf(torch.tensor([full[:len(proposer._g)]]), output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(proposer._g, head.features(stream, stream, stream), rtol=1e-4, atol=1e-4)


def test_checkpoints_that_do_not_fit_are_refused_by_name(tmp_path):
    path = save_eagle3(tmp_path / "wide", hidden=32)
    with pytest.raises(Eagle3ConfigError, match="hidden_size 32 does not match the target's 64"):
        load_eagle3(path, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2)
    with pytest.raises(Eagle3ConfigError, match="expected config.json and model.safetensors"):
        load_eagle3(str(tmp_path), hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=2)
