"""The embedded SmolLM2-135M quantized at build to INT4 (group 128): with AWQ's scales
(``--quantization int4_awq``) it still answers the capital question, and it agrees with the float
engine more often than round-to-nearest (``int4_wo``) does.

Agreement is teacher-forced: one prefill of a held-out text (not the calibration sample), the
share of positions whose greedy next token equals the float32 engine's, and the mean negative
log-likelihood of the text's own next tokens. Printed with ``-s``. The figures in
docs/features/quantization.md are the build's own searches, with INT8, FP8 and SmoothQuant beside them:
``TRITONLLM_QUANT_FIGURES=1 pytest -s tests/engine/test_smollm2_int4.py``. By default (CI) only the
two INT4 engines the assertions compare are built, and AWQ searches a coarser grid (``CI_GRIDS``).
(SmolLM2's weights were themselves 4-bit in the GGUF, Q4_1 with groups of 32, so these are real
weights but not pristine ones.)
"""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoTokenizer

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict
from engine.executor.runner import ForwardBatch, ModelRunner
from test_smollm2 import _chat_ids, _engine_greedy

HELD_OUT = (
    "The lighthouse keeper wrote in his log every evening, even when nothing happened. Most entries were "
    "short: the wind from the north-west, a fishing boat returning late, the lamp cleaned and trimmed. In "
    "the winter of the great storm, though, the entries grew longer. He described waves breaking over the "
    "rocks below the tower, the sound of the glass rattling in its frame, and a cargo ship that had lost "
    "its engine and drifted toward the reef until a tug reached it at dawn. Years later, historians used "
    "the log to date the storm precisely and to estimate the height of the waves. The keeper himself never "
    "thought his notes were important. When asked about them, he said only that a record kept every day "
    "is worth more than a memory kept for a lifetime, and that the sea does not care whether anyone is "
    "watching. The tower was automated in the spring after he retired, and the log books went to the "
    "county archive, where they are still read by students, sailors and the occasional novelist."
)


CALIBRATION_TOKENS = 128  # of the built-in text; the build's default is 512
# The AWQ searches' cost is the weights' fake quantization at every grid point (not the calibration
# tokens: 32 tokens build no faster than 128), ~2/3 of this module's time on CI's two cores. Half the
# grid points over the same ranges (scale exponents 0, 0.1, ..., 0.9; clip ratios 1, 0.9, ..., 0.6)
# halve it; AWQ still beats round to nearest by as much (agreement 79.2% vs 77.2% on the full grid,
# round to nearest 71.3%). Half again (scale exponents 0, 0.2, ..., 0.8; clip ratios 1, 0.8, 0.6): AWQ
# agrees on 80.2% (79.7% on the half grid, both measured on one thread on 2026-11-30), round to nearest 71.3%.
CI_GRIDS = {"SCALE_GRID": 5, "CLIP_GRID": 5, "CLIP_STEPS": 3}
FIGURES = bool(os.environ.get("TRITONLLM_QUANT_FIGURES"))


def _build(smollm2_hf, smollm2_gguf, out, quantization):
    model, tokenizer = smollm2_hf
    build = BuildConfig(dtype="float32", max_batch_size=2, max_input_len=512, max_seq_len=1024, max_num_tokens=1024,
                        tokens_per_block=16, quantization=quantization)
    get = getter_from_state_dict(model.state_dict(), smollm2_gguf)
    build_from_hf(model.config, get, tokenizer, str(out), build, source=smollm2_gguf, progress=False,
                  calibration_tokens=CALIBRATION_TOKENS)
    return str(out)


@pytest.fixture(scope="module")
def int4_engines(smollm2_hf, smollm2_gguf, tmp_path_factory) -> dict[str, str]:
    from engine.weight_only import awq

    schemes = ("int8_wo", "fp8", "int8_sq", "int4_wo", "int4_awq") if FIGURES else ("int4_wo", "int4_awq")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ({} if FIGURES else CI_GRIDS).items():
            assert hasattr(awq, name), name
            patch.setattr(awq, name, value)
        return {q: _build(smollm2_hf, smollm2_gguf, tmp_path_factory.mktemp(q), q) for q in schemes}


def teacher_forced_logits(engine_dir: str, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(engine_dir, device="cpu")
    runner.allocate_kv_cache(-(-len(ids) // runner.tokens_per_block) + 1)
    table = list(range(-(-len(ids) // runner.tokens_per_block)))
    n = len(ids)
    return runner.forward(ForwardBatch(ids, list(range(n)), [n], [n], [table], list(range(n)))).float()


# `make test-all`: AWQ's search, scales and packing run in make test on tiny models (test_awq_calibration.py,
# the weight-only engine tests); this is its quality on a real model (~40 CPU-s of calibration and builds).
@pytest.mark.extended
def test_int4_awq_beats_round_to_nearest_and_still_answers(int4_engines, smollm2_engine_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_engine_dir)
    ids = tokenizer(HELD_OUT)["input_ids"]
    reference = teacher_forced_logits(smollm2_engine_dir, ids)
    targets = torch.tensor(ids[1:])
    figures = {}
    for name, engine_dir in [("float32", smollm2_engine_dir)] + sorted(int4_engines.items()):
        logits = reference if name == "float32" else teacher_forced_logits(engine_dir, ids)
        agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        nll = torch.nn.functional.cross_entropy(logits[:-1], targets).item()
        figures[name] = (agreement, nll)
        print(f"{name}: greedy agreement with float32 {agreement:.1%}, NLL {nll:.3f} over {len(ids)} tokens")
    assert figures["int4_awq"][0] >= figures["int4_wo"][0], figures
    assert figures["int4_awq"][0] > 0.75, figures
    answer = tokenizer.decode(_engine_greedy(ModelRunner(int4_engines["int4_awq"]), _chat_ids(tokenizer), 8))
    assert "Paris" in answer, answer
