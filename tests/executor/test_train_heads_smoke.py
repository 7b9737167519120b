"""benchmarks/speculative/train_heads.py in small: its Medusa and ReDrafter trainers fit random
states of a 64-wide model, lower their loss, and save checkpoints that the executor's loaders read
(FasterDecoding's medusa_lm_head, Apple's recurrent drafter). The SmolLM2 run itself is a benchmark
(minutes on the CPU), not part of make test."""
from __future__ import annotations

import torch

from benchmarks.speculative.train_heads import Vocab, examples, train_medusa, train_redrafter
from engine.executor.speculative.medusa import load_medusa_heads
from engine.executor.speculative.redrafter import load_drafter

HIDDEN, VOCAB = 64, 128


def test_trainers_fit_and_save_loadable_heads(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny products: 2 threads spin for seconds on a loaded 2-core machine
    try:
        _fit_and_load(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _fit_and_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    # sequences whose token after next is a function of the state: something to learn
    seqs = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (40,), generator=g).tolist()
        seqs.append((ids, 9, embed[torch.tensor(ids[12:40])] + 0.1 * torch.randn(28, HIDDEN, generator=g)))
    h, y = examples(seqs, 3)
    assert h.shape == (112, HIDDEN) and y.shape == (112, 4) and int(y[-1, 3]) == -1  # 28 positions a sequence
    vocab = Vocab(y, h, embed, VOCAB)
    ids, targets = vocab.batch(y)
    assert torch.equal(ids[targets[y >= 0]], y[y >= 0])
    fit = train_medusa(h, y, embed, vocab, 2, 3, tmp_path / "medusa")
    assert fit["losses"][-1] < fit["losses"][0]
    heads = load_medusa_heads(str(tmp_path / "medusa"), hidden_size=HIDDEN, vocab_size=VOCAB)
    assert heads(h[0]).shape == (2, VOCAB)
    fit = train_redrafter(h, y, embed, embed, vocab, 3, 3, tmp_path / "redrafter")
    assert fit["losses"][-1] < fit["losses"][0]
    drafter, settings = load_drafter(str(tmp_path / "redrafter"), hidden_size=HIDDEN, vocab_size=VOCAB)
    beams = drafter.beam_search(h[0], 5, torch.nn.Embedding.from_pretrained(embed), 2, 3)
    assert beams.shape == (2, 4) and settings == {}
