"""Encoder-decoder engines (engine/encoder_decoder/): tiny random T5 v1.0, T5 v1.1 and BART made by
transformers, built by engine.build into encoder/ + decoder/, run by the executor with in-flight
batching: greedy ids and logits equal transformers' generate; the cross-KV pool makes requests wait
when full and is all free after cancels; bad encoder inputs get named errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine.build import main
from engine.config import EngineFormatError
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from tests.executor.executor_testing import assert_cancels_free_cross_pool, collect, final_tokens
from tiny_encdec import FAMILIES, INPUTS, build_engine, generate, write_checkpoint

MAX_ENCODER_LEN = 16


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, tmp_path_factory):
    """(family, transformers model, engine root): OUTPUT/encoder and OUTPUT/decoder."""
    root = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(request.param, root / "checkpoint")
    build_engine(root, "--max_seq_len", "48", "--max_encoder_input_len", str(MAX_ENCODER_LEN))
    return request.param, model, root / "engine"


@pytest.fixture(scope="module")
def executor(built):
    with Executor(str(built[2] / "decoder"), ExecutorConfig(max_batch_size=4)) as ex:
        yield ex


def test_layout(built):
    _, _, engine = built
    decoder = json.loads((engine / "decoder" / "config.json").read_text())
    encoder = json.loads((engine / "encoder" / "config.json").read_text())
    assert decoder["extra"]["stack"] == "decoder" and encoder["extra"]["stack"] == "encoder"
    assert decoder["extra"]["encoder_engine_dir"] == "../encoder"
    assert (engine / "decoder" / "tokenizer.json").is_file()


def test_greedy_ids_and_logits_equal_transformers(built, executor):
    """Three encoder inputs of different lengths and a request with a 3-token decoder prompt, in
    flight together (one of them streamed); the generation logits of one against transformers'."""
    family, model, _ = built
    start = model.config.decoder_start_token_id
    cases = [(ids, None) for ids in INPUTS] + [(INPUTS[0], [start, 30, 31])]
    output = OutputConfig(exclude_input_from_output=True, return_generation_logits=True)
    requests = [Request(input_token_ids=prompt or [], encoder_input_ids=ids, max_tokens=10, end_id=1,
                        streaming=index == 1, output=output) for index, (ids, prompt) in enumerate(cases)]
    responses = collect(executor, executor.enqueue_requests(requests))
    for (ids, prompt), request_id, request in zip(cases, responses, requests):
        expected, logits = generate(model, ids, 10, prompt)
        got = final_tokens(responses[request_id])
        assert got == expected[len(prompt or [start]):], (family, ids, prompt)
        if not request.streaming:
            ours = responses[request_id][-1].result.generation_logits[0]
            # On CUDA the float32 sums run in cuBLAS's and the Triton kernels' order, not the CPU's; T5
            # v1.1 scales no attention scores (and its random weights are large), so the same model on an
            # H200 lands 2.4e-4 from transformers' CPU logits: 1e-3 there, 1e-4 on the CPU. The ids above
            # stay exact on both.
            bound = 1e-3 if torch.cuda.is_available() else 1e-4  # the executor runs where CUDA is
            torch.testing.assert_close(ours.float(), logits[:len(ours)].float(), rtol=bound, atol=bound)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels: CUDA, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("kernel", ["split", "ahead", "tma", "old"])
def test_t5_encoder_kernels_in_the_executor_equal_transformers(built, monkeypatch, kernel):
    """T5's encoder attention through each dense kernel (kernels/t5_bias_attention.py; on the CPU in Triton's
    interpreter) inside the executor, whose tensors are inference tensors (torch.inference_mode: no version
    counters): three inputs of different lengths give transformers' greedy ids."""
    family, model, root = built
    if not family.startswith("t5"):
        pytest.skip("T5's relative position bias only")
    monkeypatch.setattr("engine.encoder_decoder.model.kernels_enabled", lambda x: True)  # the encoder's choice
    monkeypatch.setenv("TRITONLLM_T5_DENSE_KERNEL", kernel)
    requests = [Request(input_token_ids=[], encoder_input_ids=ids, max_tokens=6, end_id=1,
                        output=OutputConfig(exclude_input_from_output=True)) for ids in INPUTS]
    with Executor(str(root / "decoder"), ExecutorConfig(max_batch_size=4)) as ex:
        responses = collect(ex, ex.enqueue_requests(requests))
    start = model.config.decoder_start_token_id
    for ids, request_id in zip(INPUTS, responses):
        expected, _ = generate(model, ids, 6)
        assert final_tokens(responses[request_id]) == expected[len([start]):], (family, kernel, ids)


def test_missing_decoder_prompt_is_decoder_start(built, executor):
    _, model, _ = built
    request = Request(input_token_ids=[], encoder_input_ids=INPUTS[1], max_tokens=3)
    [responses] = collect(executor, [executor.enqueue_request(request)]).values()
    assert final_tokens(responses)[0] == model.config.decoder_start_token_id


def test_bad_encoder_inputs_are_named(executor):
    cases = {
        "encoder_input_ids: an encoder-decoder engine needs": Request(input_token_ids=[0], max_tokens=2),
        "exceed the engine's max_encoder_input_len (16)": Request([], 2, encoder_input_ids=[5] * 17),
        "outside the vocabulary (0..63)": Request([], 2, encoder_input_ids=[5, 64]),
        "decoder_input_ids: token ids [99]": Request([0, 99], 2, encoder_input_ids=[5]),
    }
    ids = executor.enqueue_requests(list(cases.values()))
    responses = collect(executor, ids)
    for (text, _), request_id in zip(cases.items(), ids):
        assert text in responses[request_id][-1].error
    # the engine keeps serving
    [ok] = collect(executor, [executor.enqueue_request(Request([], 2, encoder_input_ids=INPUTS[1]))]).values()
    assert ok[-1].error is None


def test_small_cross_pool_queues_requests_and_cancel_frees_it(built):
    """A cross pool of one longest input: requests wait for their encoder run and still equal
    transformers; cancelled mid-decode, every cross block is back in the pool."""
    family, model, engine = built
    if family != "t5_v1_1":
        pytest.skip("one family exercises the pool")
    config = ExecutorConfig(max_batch_size=4, max_tokens_in_paged_kv_cache=192, cross_kv_cache_fraction=0.01)
    with Executor(str(engine / "decoder"), config) as ex:
        assert ex.encoder_stage.num_blocks == MAX_ENCODER_LEN // 4
        # the stats show the cross pool before any iteration (tritonllm_cross_kv_cache_block_metrics
        # reads its max and free from the engine process's first publish, not after a first request)
        start = ex.get_latest_iteration_stats()
        assert start.iter == 0 and start.cross_kv_cache_stats.max_num_blocks == ex.encoder_stage.num_blocks
        assert start.cross_kv_cache_stats.free_num_blocks == ex.encoder_stage.num_blocks
        out = OutputConfig(exclude_input_from_output=True)
        ids = ex.enqueue_requests([Request([], 6, end_id=1, encoder_input_ids=i, output=out) for i in INPUTS])
        responses = collect(ex, ids)
        for encoder_ids, request_id in zip(INPUTS, ids):
            expected, _ = generate(model, encoder_ids, 6)
            assert final_tokens(responses[request_id]) == expected[1:]
        assert_cancels_free_cross_pool(ex, INPUTS[1])


def test_decoder_only_engine_refuses_encoder_input():
    from engine.encoder_decoder.encoder_stage import encoder_input_error

    assert "decoder-only" in encoder_input_error(Request([1, 2], 2, encoder_input_ids=[3]), None)
    assert encoder_input_error(Request([1, 2], 2), None) is None


def test_build_refusals_and_missing_encoder(built, tmp_path, capsys):
    _, _, engine = built
    checkpoint = engine.parent / "checkpoint"
    assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--pp_size", "2"]) == 2
    assert "pp_size 2: " in capsys.readouterr().err  # (tensor parallelism: tests/distributed/test_encdec_tp.py)
    with pytest.raises(EngineFormatError, match="encoder engine directory"):
        Executor(str(engine / "decoder"), ExecutorConfig(encoder_engine_dir=str(tmp_path)))


# ---- Whisper: log-mel features through the conv front-end ---------------------------------------

@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(transformers model, executor) of the tiny Whisper (100-frame windows of 8 mel bins)."""
    from tiny_encdec import write_checkpoint as write

    root = tmp_path_factory.mktemp("whisper")
    model = write("whisper", root / "checkpoint")
    build_engine(root)
    assert (root / "engine" / "decoder" / "preprocessor_config.json").is_file()
    with Executor(str(root / "engine" / "decoder"), ExecutorConfig(max_batch_size=4)) as ex:
        yield model, ex


def test_whisper_greedy_ids_equal_transformers(whisper):
    """Two full windows and a shorter one (60 frames, the anchor's zero_pad; transformers refuses
    it, so only its answer is checked) in flight together, after the prompt
    <|startoftranscript|><|en|><|transcribe|><|notimestamps|>."""
    from tiny_encdec import WHISPER_PROMPT, generate_whisper

    model, ex = whisper
    torch.manual_seed(1)
    features = [torch.randn(100, 8), torch.randn(100, 8), torch.randn(60, 8)]
    out = OutputConfig(exclude_input_from_output=True)
    ids = ex.enqueue_requests([Request(WHISPER_PROMPT, 8, end_id=1, encoder_input_features=f, output=out,
                                       streaming=i == 1) for i, f in enumerate(features)])
    responses = collect(ex, ids)
    assert responses[ids[2]][-1].error is None and final_tokens(responses[ids[2]])
    for f, request_id in zip(features[:2], ids):
        expected = generate_whisper(model, f, 8)
        assert final_tokens(responses[request_id]) == [t for t in expected if t != 1]


def test_whisper_token_timestamps_equal_transformers(whisper):
    """OutputConfig.return_token_timestamps: each output token's time (the alignment heads' cross
    attention, re-run over the final tokens, then DTW) = transformers' _extract_token_timestamps on
    its generate's own cross-attentions (generate(return_token_timestamps=True)'s computation; its
    long-form bookkeeping is left out because the tiny vocabulary's words double as timestamp
    tokens); alignment heads: the default, every head of the last half of the layers. One request
    stops on max_tokens (the last token never fed back), one on the end id."""
    from transformers import GenerationMixin

    from engine.encoder_decoder.whisper_alignment import default_alignment_heads
    from tiny_encdec import WHISPER_PROMPT

    model, ex = whisper
    torch.manual_seed(0)
    features = [torch.randn(100, 8), torch.randn(100, 8)]
    torch.manual_seed(1)
    features[1] = torch.randn(100, 8)  # (its greedy ids end on the end id after 3 tokens)
    out = OutputConfig(exclude_input_from_output=True, return_token_timestamps=True)
    ids = ex.enqueue_requests([Request(WHISPER_PROMPT, 8, end_id=1, encoder_input_features=f, output=out)
                               for f in features])
    responses = collect(ex, ids)
    for f, request_id in zip(features, ids):
        result = responses[request_id][-1].result
        model.set_attn_implementation("eager")  # (sdpa returns no attention weights)
        try:
            hf = GenerationMixin.generate(model, input_features=f.t()[None], decoder_input_ids=torch.tensor([WHISPER_PROMPT]),
                                          max_new_tokens=8, do_sample=False, eos_token_id=1, output_attentions=True,
                                          return_dict_in_generate=True, forced_decoder_ids=None, suppress_tokens=None,
                                          begin_suppress_tokens=None)
        finally:
            model.set_attn_implementation("sdpa")
        expected = model._extract_token_timestamps(hf, default_alignment_heads(2, 4), num_input_ids=len(WHISPER_PROMPT))
        generated = hf.sequences[0, len(WHISPER_PROMPT):].tolist()
        assert result.output_token_ids[0] == [t for t in generated if t != 1]
        assert result.token_timestamps[0] == pytest.approx(expected[0, len(WHISPER_PROMPT):][:len(generated)].tolist()
                                                           [:len(result.output_token_ids[0])], abs=1e-6)
    assert len(responses[ids[1]][-1].result.output_token_ids[0]) < 8 and any(responses[ids[0]][-1].result
                                                                              .token_timestamps[0])


def test_whisper_bad_features_are_named(whisper):
    _, ex = whisper
    cases = {"encoder_input_features: shape (100, 7)": Request([17], 2, encoder_input_features=torch.zeros(100, 7)),
             "201 frames exceed the encoder's 100": Request([17], 2, encoder_input_features=torch.zeros(201, 8)),
             "needs log-mel features": Request([17], 2, encoder_input_ids=[3, 4])}
    ids = ex.enqueue_requests(list(cases.values()))
    responses = collect(ex, ids)
    for text, request_id in zip(cases, ids):
        assert text in responses[request_id][-1].error


def test_preempted_requests_keep_their_cross_kv(built):
    """max_utilization over a self-attention pool of 12 blocks: three 30-token answers do not fit
    side by side, so sequences are preempted and recomputed; their cross K/V stays, and every
    answer still equals transformers'."""
    family, model, engine = built
    if family != "t5_v1_1":
        pytest.skip("one family exercises preemption")
    config = ExecutorConfig(max_batch_size=4, max_tokens_in_paged_kv_cache=48,
                            batch_scheduler_policy="max_utilization")
    with Executor(str(engine / "decoder"), config) as ex:
        out = OutputConfig(exclude_input_from_output=True)
        ids = ex.enqueue_requests([Request([], 30, encoder_input_ids=i, output=out) for i in INPUTS])
        responses = collect(ex, ids)
        assert ex.scheduler.num_preemptions > 0
        for encoder_ids, request_id in zip(INPUTS, ids):
            assert final_tokens(responses[request_id]) == generate(model, encoder_ids, 30, eos=None)[0][1:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_ids_equal_transformers(built):
    """The same engines on a GPU (Triton paged attention for self- and cross-attention; T5's biased
    self-attention through its torch reference), float32: ids equal transformers' on the CPU."""
    _, model, engine = built
    with Executor(str(engine / "decoder"), ExecutorConfig(max_batch_size=4), device="cuda") as ex:
        out = OutputConfig(exclude_input_from_output=True)
        ids = ex.enqueue_requests([Request([], 10, end_id=1, encoder_input_ids=i, output=out) for i in INPUTS])
        responses = collect(ex, ids)
    for encoder_ids, request_id in zip(INPUTS, ids):
        assert final_tokens(responses[request_id]) == generate(model, encoder_ids, 10)[0][1:]


def test_whisper_timestamps_long_form_equal_transformers(whisper):
    """A prompt without <|notimestamps|> decodes under Whisper's timestamp rules
    (engine/encoder_decoder/whisper_timestamps.py), and serving/whisper_long_form.py's windows over
    2.5 s of audio (1-s windows), each decoded by the executor, give the segments (times and ids)
    of transformers' WhisperForConditionalGeneration.generate(return_timestamps=True), whose
    sequential long-form loop seeks by the predicted timestamps."""
    import numpy as np

    from serving.whisper_long_form import LongForm
    from tiny_encdec import TIMESTAMP_BEGIN, feature_extractor

    model, ex = whisper
    extractor, out = feature_extractor(), OutputConfig(exclude_input_from_output=True)
    for seed in (0, 3):
        samples = np.random.default_rng(seed).uniform(-0.5, 0.5, 40000).astype(np.float32)
        clip = LongForm.of(extractor, samples, zero_pad=False, timestamp_begin=TIMESTAMP_BEGIN)
        while (window := clip.next_window()) is not None:
            [request_id] = ex.enqueue_requests([Request([17, 18, 19], 8, end_id=1, output=out,
                                                        encoder_input_features=torch.tensor(window.features))])
            clip.finish(window, final_tokens(collect(ex, [request_id])[request_id]))
        features = extractor(samples, sampling_rate=16000, return_tensors="pt", padding="longest",
                             truncation=False).input_features
        result = model.generate(features, return_timestamps=True, return_segments=True, language="en",
                                task="transcribe", max_new_tokens=8)
        expected = [(round(float(s["start"]), 3), round(float(s["end"]), 3),
                     [t for t in s["tokens"].tolist() if t < TIMESTAMP_BEGIN]) for s in result["segments"][0]]
        assert [(s.start, s.end, s.ids) for s in clip.segments] == expected, seed
        assert len(expected) > 3  # timestamp pairs closed segments inside windows
