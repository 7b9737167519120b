"""An FP8 KV cache on encoder-decoder engines (engine/encoder_decoder/runner.py): with kv_cache_dtype fp8
the cross-KV pool is E4M3 (scale 1) like the self pool, written once by ``encode_into`` and read by
the same FP8-aware paged kernels. Tiny random T5 v1.0, T5 v1.1, BART and Whisper made by transformers:
teacher-forced logits of the FP8 pools against the model-dtype pools within the bound the FP8
self-pool test uses (tests/engine/test_fp8_engine.py, 5% relative), greedy serving through the
executor with every cross block free after cancels, ``--kv_cache_dtype fp8`` at build (a --quantization encoder-decoder stacks do not take refused by name), the cross pool
alone in E4M3 (``cross_kv_cache_dtype fp8``: engine/encoder_decoder/cross_kv.py), FP8 refused by name on
a GPU without it, and Llama 3.2 Vision (its cross-attention reads the pool in the model dtype) refused
by name."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.build import main
from engine.encoder_decoder.cross_kv import cross_pool_dtype, require_fp8
from engine.encoder_decoder.model import Encoder
from engine.encoder_decoder.runner import EncDecRunner
from engine.encoder_decoder.whisper_alignment import cross_attention_weights
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from engine.executor.executor_config import ExecutorConfigError
from engine.executor.runner import ForwardBatch
from kernels.attention import KV_FP8_DTYPE
from tests.executor.executor_testing import assert_cancels_free_cross_pool, collect, final_tokens
from tiny_encdec import INPUTS, WHISPER_PROMPT, build_engine, feature_extractor, hf_model, tokenizer

FP8_RELATIVE_BOUND = 0.05  # tests/engine/test_fp8_engine.py's bound for an FP8 self pool


@pytest.fixture(scope="module", params=("t5_v1_0", "t5_v1_1", "bart", "whisper"))
def engine(request, tmp_path_factory):
    """(family, decoder directory) of a float32 engine built from the tiny checkpoint."""
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    write_trained_scale_checkpoint(request.param, root / "checkpoint")
    # Whisper: its own 50 encoder and 40 decoder positions
    limits = [] if request.param == "whisper" else ["--max_encoder_input_len", "16", "--max_seq_len", "48"]
    build_engine(root, *limits)
    return request.param, str(root / "engine" / "decoder")


def write_trained_scale_checkpoint(family: str, path: Path) -> None:
    """tiny_encdec's model with transformers' own initialization (the scale of trained checkpoints, as
    test_fp8_engine.py's Llama), not its wide N(0, 0.5) weights whose chaotic activations amplify any
    rounding (the T5s' unscaled scores most of all)."""
    model = hf_model(family)
    torch.manual_seed(0)
    model.load_state_dict(type(model)(model.config).state_dict())
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    if family == "whisper":
        feature_extractor().save_pretrained(path)


def encoder_input(family: str):
    return torch.randn(100, 8, generator=torch.Generator().manual_seed(0)) if family == "whisper" else INPUTS[2]


def teacher_forced_logits(runner: EncDecRunner, family: str, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, vocab) logits of a fixed decoder sequence over one encoder input, the self pool in ``kv_cache_dtype``
    (the cross pool too unless ``runner.cross_kv_cache_dtype`` says otherwise), and (Whisper, else empty)
    the cross-attention weights word timestamps read from the cross pool (whisper_alignment.py) of two heads."""
    source, T = encoder_input(family), runner.tokens_per_block
    ids = WHISPER_PROMPT + [5, 9, 30, 2, 44, 7] if family == "whisper" else [0, 30, 31, 12, 5, 9, 40, 3, 22, 7]
    n, length = len(ids), Encoder.output_length(len(source), runner.spec)
    self_blocks, cross_blocks = list(range(-(-n // T))), list(range(-(-length // T)))
    runner.num_cross_blocks = len(cross_blocks)
    runner.allocate_kv_cache(len(self_blocks), kv_cache_dtype)
    runner.encode_into([source], [cross_blocks])
    batch = ForwardBatch(ids, list(range(n)), [n], [n], [self_blocks], list(range(n)),
                         cross_lengths=[length], cross_block_tables=[cross_blocks])
    logits = runner.forward(batch, all_logits=True).float()
    if family != "whisper":
        return logits, torch.zeros(0)
    return logits, cross_attention_weights(runner.model, runner.cross_pool, cross_blocks, length, ids, [(0, 1), (1, 3)])


def check_fp8_logits(decoder_dir: str, family: str, device: str, model_dtype: torch.dtype) -> None:
    runner = EncDecRunner(decoder_dir, device=device)
    reference, weights = teacher_forced_logits(runner, family, "auto")
    assert runner.cross_pool.dtype == model_dtype
    quantized, fp8_weights = teacher_forced_logits(runner, family, "fp8")
    assert runner.cross_pool.dtype == KV_FP8_DTYPE and runner.kv_cache.dtype == KV_FP8_DTYPE
    runner.cross_kv_cache_dtype = "fp8"  # the cross pool alone in E4M3 (cross_kv.py)
    cross_only, cross_only_weights = teacher_forced_logits(runner, family, "auto")
    assert runner.cross_pool.dtype == KV_FP8_DTYPE and runner.kv_cache.dtype == model_dtype
    for ours, theirs in ((quantized, reference), (fp8_weights, weights), (cross_only, reference),
                         (cross_only_weights, weights)):
        error = ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()
        assert error < FP8_RELATIVE_BOUND, (family, error)


def test_fp8_pools_keep_teacher_forced_logits(engine):
    family, decoder = engine
    check_fp8_logits(decoder, family, "cpu", torch.float32)


def test_executor_fp8_cross_pool_serves_and_cancel_frees_it(engine):
    """Greedy requests through the executor with FP8 pools answer in full; two long streamed requests
    cancelled mid-decode give every cross block back."""
    family, decoder = engine
    if family != "bart":
        pytest.skip("one family exercises the executor")
    with Executor(decoder, ExecutorConfig(max_batch_size=4, kv_cache_dtype="fp8")) as ex:
        assert ex.runner.cross_pool.dtype == KV_FP8_DTYPE
        out = OutputConfig(exclude_input_from_output=True)
        ids = ex.enqueue_requests([Request([], 6, encoder_input_ids=i, output=out) for i in INPUTS])
        responses = collect(ex, ids)
        assert all(len(final_tokens(responses[i])) == 6 for i in ids)
        assert_cancels_free_cross_pool(ex, INPUTS[1])


def test_build_kv_cache_dtype_fp8_and_an_unsupported_quantization_refused(engine, tmp_path, capsys):
    family, decoder = engine
    if family != "t5_v1_0":
        pytest.skip("one family exercises the build")
    checkpoint = str(Path(decoder).parent.parent / "checkpoint")
    assert main(["--checkpoint", checkpoint, "--output", str(tmp_path / "e"), "--dtype", "float32",
                 "--kv_cache_dtype", "fp8", "--max_encoder_input_len", "16"]) == 0
    runner = EncDecRunner(str(tmp_path / "e" / "decoder"))
    runner.allocate_kv_cache(2)  # "auto": the build's choice
    assert runner.kv_cache.dtype == runner.cross_pool.dtype == KV_FP8_DTYPE
    # --quantization fp8 is taken (tests/engine/test_encoder_decoder_fp8_weights.py); fp8_block is not
    assert main(["--checkpoint", checkpoint, "--output", str(tmp_path / "q"), "--quantization", "fp8_block"]) == 2
    assert "--quantization fp8_block: not supported for T5ForConditionalGeneration" in capsys.readouterr().err


def test_mllama_refuses_an_fp8_kv_cache_by_name():
    from engine.encoder_decoder.mllama_runner import MllamaRunner

    runner = SimpleNamespace(build_config=SimpleNamespace(kv_cache_dtype=None), dtype=torch.bfloat16,
                             cross_kv_cache_dtype=None)
    assert MllamaRunner.kv_cache_torch_dtype(runner, "auto") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype fp8: not supported for MllamaForConditionalGeneration"):
        MllamaRunner.kv_cache_torch_dtype(runner, "fp8")
    runner.cross_kv_cache_dtype = "fp8"
    with pytest.raises(ValueError, match="^cross_kv_cache_dtype fp8: not supported for MllamaForConditionalGeneration"):
        MllamaRunner.kv_cache_torch_dtype(runner, "auto")


def test_fp8_refused_by_name_on_a_gpu_without_fp8(monkeypatch):
    """An sm_80 GPU (no E4M3 conversions): either switch refused by name; an H200 (sm_90) takes them."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"^cross_kv_cache_dtype fp8: this GPU \(sm_80\) has no FP8"):
        cross_pool_dtype("fp8", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype fp8: this GPU \(sm_80\) has no FP8"):
        require_fp8(cuda, "kv_cache_dtype fp8")
    assert cross_pool_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="cross_kv_cache_dtype 'int8' is not supported; allowed: auto, fp8"):
        cross_pool_dtype("int8", torch.bfloat16, cuda)
    with pytest.raises(ExecutorConfigError, match="cross_kv_cache_dtype value of 'int8' is not supported"):
        ExecutorConfig(cross_kv_cache_dtype="int8").validate()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cross_pool_dtype("fp8", torch.bfloat16, cuda) == KV_FP8_DTYPE


def test_fp8_cross_pool_alone_sizes_by_bytes_and_serves(engine):
    """cross_kv_cache_dtype fp8 with a float32 self pool: the cross pool holds 4x the blocks of the same
    byte share (E4M3 against float32), and greedy ids through the executor equal the float32 pools'."""
    family, decoder = engine
    if family != "t5_v1_1":
        pytest.skip("one family exercises the executor")
    out = OutputConfig(exclude_input_from_output=True)
    answers, cross_blocks = [], []
    for dtype in ("auto", "fp8"):
        config = ExecutorConfig(max_batch_size=4, cross_kv_cache_dtype=dtype, max_tokens_in_paged_kv_cache=512)
        with Executor(decoder, config) as ex:
            assert ex.runner.kv_cache.dtype == torch.float32
            cross_blocks.append(ex.runner.num_cross_blocks)
            ids = ex.enqueue_requests([Request([], 6, encoder_input_ids=i, output=out) for i in INPUTS])
            responses = collect(ex, ids)
            answers.append([final_tokens(responses[i]) for i in ids])
            if dtype == "fp8":
                assert ex.runner.cross_pool.dtype == KV_FP8_DTYPE
    assert cross_blocks[1] == 4 * cross_blocks[0]
    assert answers[1] == answers[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_pools_keep_teacher_forced_logits(engine):
    """The same on a GPU: the encoder's cross K/V cast once into the E4M3 pool, the decoder's
    cross-attention (and T5's biased self-attention kernel) reading it through the Triton kernels."""
    family, decoder = engine
    check_fp8_logits(decoder, family, "cuda", torch.float32)
