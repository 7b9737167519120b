"""`tensorrt_llm` inputs of an encoder-decoder engine (serving/requests.py): input_ids are the
encoder's, decoder_input_ids the decoder prompt (preprocessing's [[pad_id]] is none), named errors
for a wrong encoder_output_lengths or encoder features; the fill keys reach the ExecutorConfig."""
import numpy as np
import pytest

from engine.executor.executor import ExecutorConfig
from serving.executor_config import executor_settings, to_executor_config
from serving.requests import convert_request, to_executor_request


def i32(*rows):
    return np.array(rows, dtype=np.int32)


def convert(**tensors):
    base = {"input_ids": i32([5, 6, 7, 1], [8, 1, 0, 0]), "input_lengths": i32([4], [2]),
            "request_output_len": i32([4], [4]), "pad_id": i32([0], [0])}
    base.update(tensors)
    return convert_request(base, decoupled=True, encoder_decoder=True, max_input_len=16)


def test_input_ids_feed_the_encoder_and_pad_is_no_decoder_prompt():
    first, second = convert(decoder_input_ids=i32([0], [0]), decoder_input_lengths=i32([1], [1]))
    assert first.encoder_input_ids == [5, 6, 7, 1] and second.encoder_input_ids == [8, 1]
    assert first.input_token_ids == second.input_token_ids == []
    request = to_executor_request(first)
    assert request.encoder_input_ids == [5, 6, 7, 1] and request.input_token_ids == []


def test_decoder_prompt_trimmed_by_its_lengths():
    first, second = convert(decoder_input_ids=i32([0, 30, 31], [0, 40, 0]), decoder_input_lengths=i32([3], [2]),
                            encoder_output_lengths=i32([4], [2]))
    assert first.input_token_ids == [0, 30, 31] and second.input_token_ids == [0, 40]


@pytest.mark.parametrize("tensors, message", [
    ({"encoder_output_lengths": i32([3], [2])}, "encoder_output_lengths is 3 but the encoder input holds 4"),
    ({"encoder_input_features": np.ones((2, 4), np.float16)}, "encoder_input_features has shape"),
    ({"input_ids": i32([5] * 17, [5] * 17), "input_lengths": i32([17], [17])}, "max_input_len 16"),
])
def test_bad_encoder_inputs_are_named(tensors, message):
    with pytest.raises(ValueError, match=message):
        convert(**tensors)


def test_whisper_features_with_their_lengths():
    """The whisper_bls tensors: features (B, frames, mels) trimmed by input_lengths, no input_ids,
    encoder_output_lengths frames / 2, the prompt in decoder_input_ids."""
    features = np.arange(2 * 6 * 3, dtype=np.float16).reshape(2, 6, 3)
    tensors = {"encoder_input_features": features, "input_lengths": i32([6], [5]),
               "encoder_output_lengths": i32([3], [2]), "decoder_input_ids": i32([17, 18], [17, 18]),
               "request_output_len": i32([4], [4])}
    first, second = convert_request(tensors, decoupled=True, encoder_decoder=True)
    assert first.encoder_input_features.shape == (6, 3) and second.encoder_input_features.shape == (5, 3)
    assert first.encoder_input_ids is None and first.input_token_ids == [17, 18]
    assert to_executor_request(second).encoder_input_features.dtype == np.float32
    tensors["encoder_output_lengths"] = i32([3], [4])
    with pytest.raises(ValueError, match="encoder_output_lengths is 4 but the encoder input holds 5 frames"):
        convert_request(tensors, decoupled=True, encoder_decoder=True)


def test_decoder_only_engines_still_refuse_a_decoder_prompt():
    tensors = {"input_ids": i32([5, 6]), "request_output_len": i32([4]), "decoder_input_ids": i32([0, 3])}
    with pytest.raises(ValueError, match="^decoder_input_ids: encoder-decoder models are not supported"):
        convert_request(tensors, decoupled=True)


def test_fill_keys_reach_the_executor_config():
    params = {"encoder_model_path": "/engines/t5/encoder", "cross_kv_cache_fraction": "0.5"}
    config, ignored = to_executor_config(ExecutorConfig, executor_settings(params, {}))
    assert config.encoder_engine_dir == "/engines/t5/encoder" and config.cross_kv_cache_fraction == 0.5
    assert not ignored
