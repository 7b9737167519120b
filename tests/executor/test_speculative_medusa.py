"""Medusa heads (engine/executor/speculative/medusa.py) in FasterDecoding's medusa_lm_head format,
made here on random weights: they load, draft a medusa_choices tree, and greedy ids through tree
verification equal transformers' greedy decoding. Heads that do not fit the target are refused by name.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.executor.runner import ModelRunner
from engine.executor.speculative.medusa import MedusaConfigError, MedusaProposer, load_medusa_heads, propose_tree
from engine.executor.speculative.tree import shape_from_choices
from engine.executor.speculative.tree_step import TreeDecoder

HIDDEN, VOCAB, NEW_TOKENS = 64, 128, 12
CHOICES = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [2, 0], [0, 0, 1], [0, 1, 0], [1, 1]]


class ResBlock(torch.nn.Module):
    """FasterDecoding's: x + SiLU(linear(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_lm_head(num_heads: int, num_layers: int, hidden: int = HIDDEN, vocab: int = VOCAB) -> torch.nn.ModuleList:
    torch.manual_seed(1)
    heads = torch.nn.ModuleList(torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                                                    torch.nn.Linear(hidden, vocab, bias=False))
                                for _ in range(num_heads))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return heads


def save_heads(directory, heads: torch.nn.ModuleList, num_layers: int, fmt: str = "safetensors") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": len(heads), "medusa_num_layers": num_layers,
                                                       "base_model_name_or_path": "tiny"}))
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, directory / "medusa_lm_head.pt")
    return str(directory)


@pytest.fixture(scope="module")
def decoder(tiny_engine) -> TreeDecoder:
    return TreeDecoder(ModelRunner(tiny_engine), num_blocks=64)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_heads_load_as_published(tmp_path, fmt):
    reference = medusa_lm_head(3, 2)
    heads = load_medusa_heads(save_heads(tmp_path / fmt, reference, 2, fmt), hidden_size=HIDDEN, vocab_size=VOCAB)
    hidden = torch.randn(HIDDEN)
    with torch.no_grad():
        want = torch.stack([head(hidden) for head in reference])
    torch.testing.assert_close(heads(hidden), want, rtol=1e-5, atol=1e-5)


def test_medusa_greedy_ids_equal_transformers(tmp_path, decoder, tiny_hf):
    heads = load_medusa_heads(save_heads(tmp_path / "heads", medusa_lm_head(3, 1), 1), hidden_size=HIDDEN,
                              vocab_size=VOCAB)
    prompt = [5, 17, 99, 3, 42, 8, 61]
    want = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
    got, stats = decoder.generate(prompt, NEW_TOKENS, MedusaProposer(heads, CHOICES))
    assert got == want.tolist()
    assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks
    assert stats.tree_sizes and all(size <= len(CHOICES) for size in stats.tree_sizes)
    assert all(0 <= a <= 3 for a in stats.accepted)


def test_tree_from_head_ranks():
    shape = shape_from_choices([[0], [1], [0, 0], [0, 1]])  # nodes: root, (0), (1), (0,0), (0,1)
    logits = torch.tensor([[0.0, 5, 3, 1], [9, 0, 0, 8]])  # head 0 ranks 1, 2, 3, 0; head 1 ranks 0, 3, ...
    assert propose_tree(logits, shape, 2) == ([-1, -1, 0, 0], [1, 2, 0, 3])


def test_heads_that_do_not_fit_are_refused(tmp_path):
    path = save_heads(tmp_path / "narrow", medusa_lm_head(2, 1, hidden=32), 1)
    with pytest.raises(MedusaConfigError, match="the target has vocab_size 128 and hidden_size 64"):
        load_medusa_heads(path, hidden_size=HIDDEN, vocab_size=VOCAB)
    path = save_heads(tmp_path / "vocab", medusa_lm_head(2, 1, vocab=100), 1)
    with pytest.raises(MedusaConfigError, match="target has vocab_size 128"):
        load_medusa_heads(path, hidden_size=HIDDEN, vocab_size=VOCAB)
    heads = load_medusa_heads(save_heads(tmp_path / "two", medusa_lm_head(2, 1), 1), hidden_size=HIDDEN,
                              vocab_size=VOCAB)
    with pytest.raises(MedusaConfigError, match="medusa_choices: paths 3 deep need as many heads; the checkpoint has 2"):
        MedusaProposer(heads, CHOICES)
    with pytest.raises(MedusaConfigError, match="has no config.json"):
        load_medusa_heads(str(tmp_path), hidden_size=HIDDEN, vocab_size=VOCAB)
