"""Tensor parallelism of encoder-decoder engines (T5, BART, Whisper): real processes, gloo on CPU, no server.

Tiny random checkpoints (tests/tiny_encdec.py) built at tp_size 2, each served by a two-rank job
(``encdec_tp_driver.py``: an Executor on make_runner's LeaderRunner, and the real worker's main), give
transformers' greedy ids and generation logits (text families; Whisper's ids), as TP 1 does
(tests/engine/test_encoder_decoder.py). `make test` runs T5 v1.1, which reaches the code every family
shares: split heads (encoder self-attention, decoder self- and cross-attention; T5's position table too),
split MLP widths (its gated one), each rank's cross pool of its heads, the all-reduces after each block,
the vocabulary-split LM head, the encoder pass mirrored on every rank. BART (biases: added once after the
all-reduce; post-norms; final_logits_bias split with the head) and Whisper (its features broadcast to the
workers, FeatureShapes; the replicated conv front-end) are `extended` (~2 s each).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encdec_tp_driver import FAMILIES, MAX_TOKENS, requests, run_rank
from free_ports import free_port
from tp_testing import rank_env, stop

DRIVER = str(Path(__file__).with_name("encdec_tp_driver.py"))


def _build(root: Path, tp_size: int) -> str:
    from engine.build import main

    out = root / f"tp{tp_size}"
    assert main(["--checkpoint", str(root / "checkpoint"), "--output", str(out), "--dtype", "float32",
                 "--tokens_per_block", "4", "--max_batch_size", "4", "--max_seq_len", "32",
                 "--tp_size", str(tp_size)]) == 0
    return str(out / "decoder")


def _forked_rank(rank: int, env: dict, args: tuple) -> None:
    """A rank forked from this process (its imports done: a fresh interpreter costs seconds of them)."""
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    code = 1
    try:
        code = run_rank(rank, *args)
    finally:
        os._exit(code)  # (not pytest's exit handlers)


@pytest.fixture(scope="module", params=[pytest.param(family, marks=[] if family == "t5_v1_1" else pytest.mark.extended)
                                        for family in FAMILIES])
def run(request, tmp_path_factory) -> tuple:
    """(family, transformers model, the TP 2 job's result). Both ranks are forked from this process where
    torch runs one thread here (`make test`: tests/conftest.py gives each xdist worker cores // workers),
    since a fresh interpreter costs seconds of imports on CI's cores; otherwise, and always with CUDA (which
    does not survive a fork), fresh interpreters: a fork after multi-threaded torch work can hang in the
    child's first parallel op (seen here at -n 0: a worker rank stuck in a matmul)."""
    from tiny_encdec import write_checkpoint

    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = write_checkpoint(family, root / "checkpoint")
    engine = _build(root, 2)
    out = str(root / "tp2.json")
    port = free_port()
    # a lost rank fails the job in a minute, not the default 15 (CUDA keeps them: its kernels compile at load)
    quick_faults = {} if torch.cuda.is_available() else {"TRITONLLM_DIST_STARTUP_TIMEOUT_S": "60",
                                                         "TRITONLLM_DIST_TIMEOUT_S": "60"}
    if torch.cuda.is_available() or torch.get_num_threads() > 1:
        command = [sys.executable, DRIVER, "--families", family, "--engine_dirs", engine, "--ports", str(port),
                   "--out", out]
        ranks = [subprocess.Popen(command + ["--rank", str(rank)], env=rank_env(rank, 2, port, **quick_faults),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        try:
            for rank in ranks:
                log, _ = rank.communicate(timeout=300)
                assert rank.returncode == 0, log
        finally:
            stop(ranks)
    else:
        fork = multiprocessing.get_context("fork")
        ranks = [fork.Process(target=_forked_rank, args=(rank, rank_env(rank, 2, port, **quick_faults),
                                                         ([family], [engine], [port], out)))
                 for rank in (0, 1)]
        for rank in ranks:
            rank.start()
        try:
            for rank in ranks:
                rank.join(timeout=120)
                assert rank.exitcode == 0, f"rank exit code {rank.exitcode}"
        finally:
            for rank in ranks:
                if rank.is_alive():
                    rank.kill()
    return family, model, json.loads(Path(out).read_text())[family]


def test_tp2_greedy_ids_and_logits_equal_transformers(run):
    from tiny_encdec import generate, generate_whisper

    family, model, tp2 = run
    for index, (prompt, source) in enumerate(requests(family)):
        if family == "whisper":
            assert tp2["tokens"][index] == [t for t in generate_whisper(model, source, MAX_TOKENS, prompt) if t != 1]
            continue
        expected, logits = generate(model, source, MAX_TOKENS)
        assert tp2["tokens"][index] == expected[1:], (family, index)
        ours = torch.tensor(tp2["logits"][index])
        bound = 1e-3 if torch.cuda.is_available() else 1e-4  # (CUDA's float32 sums: test_encoder_decoder.py says)
        torch.testing.assert_close(ours, logits[:len(ours)].float(), rtol=bound, atol=bound)


def test_tp_size_that_does_not_divide_the_heads_is_named(tmp_path, capsys):
    from engine.build import main
    from tiny_encdec import write_checkpoint

    write_checkpoint("t5_v1_1", tmp_path / "checkpoint")  # (the module already imported its transformers model)
    assert main(["--checkpoint", str(tmp_path / "checkpoint"), "--output", str(tmp_path / "engine"),
                 "--dtype", "float32", "--tp_size", "3"]) == 2
    assert "tp_size 3 does not divide encoder_heads (4)" in capsys.readouterr().err
    assert not (tmp_path / "engine" / "decoder" / "config.json").exists()


def test_shards_split_one_dimension_and_pad_the_vocabulary():
    """engine/encoder_decoder/build.py shard: a rank's block of the one dimension its module splits (o's columns),
    whole tensors left whole, and the LM head's rows zero-padded on the last rank where tp does not divide
    the vocabulary (BART's 50,265 over 2 ranks: 25,133 rows each)."""
    from engine.encoder_decoder.build import shard

    whole = torch.arange(15.0).view(5, 3)
    assert torch.equal(shard(whole, torch.Size((5, 3)), 1), whole)
    assert torch.equal(shard(whole.t(), torch.Size((3, 3)), 0), whole.t()[:, :3])
    assert torch.equal(shard(whole, torch.Size((3, 3)), 0), whole[:3])
    assert torch.equal(shard(whole, torch.Size((3, 3)), 1), torch.cat([whole[3:], torch.zeros(1, 3)]))
