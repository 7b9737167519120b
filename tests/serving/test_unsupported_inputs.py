"""Inputs of features this backend does not have: refused when really used, accepted when absent,
empty or neutral, and never in the way of a plain request through the ensemble or the BLS.
(Guided decoding and draft tokens are supported: tests/serving/test_guided_inputs.py, test_speculative_serving.py.)"""
import importlib.util
import os
import re
import sys
import types

import numpy as np
import pytest

from serving.bls import (LLM_INPUTS_FROM_PREPROCESSING, LLM_INPUTS_FROM_REQUEST, PREPROCESSING_INPUTS,
                         validate, with_batch_dim)
from serving.mrope import MROPE_INPUTS
from serving.requests import (DRAFT_INPUTS, GUIDED_INPUTS, IGNORED_INPUTS, LOOKAHEAD_INPUTS, LORA_INPUTS,
                              PROMPT_TABLE_INPUTS, UNSUPPORTED_INPUTS, conversion_error_message, convert_request)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def i32(*rows):
    return np.array(rows, dtype=np.int32)


def f32(*rows):
    return np.array(rows, dtype=np.float32)


def text(*rows):
    return np.array([[value.encode()] for value in rows], dtype=object)


def minimal(**extra):
    tensors = {"input_ids": i32([5, 6, 7]), "request_output_len": i32([4])}
    tensors.update(extra)
    return tensors


# ----------------------------------------------------------------------------- tensorrt_llm

# input -> (its value in a request that really uses the feature, other inputs that request sends)
USED = {
    "decoder_input_ids": (i32([1, 2, 3]), {}),
    "decoder_input_lengths": (i32([3]), {}),
    "encoder_input_features": (np.ones((1, 4, 8), np.float16), {}),
    "encoder_output_lengths": (i32([4]), {}),
    "cross_attention_mask": (np.ones((1, 3, 4), np.bool_), {}),
    "skip_cross_attn_blocks": (np.array([[False]]), {}),
    "runtime_top_p_decay": (f32([0.9]), {"runtime_top_p": f32([0.8])}),
    "runtime_top_p_min": (f32([0.9]), {"runtime_top_p": f32([0.5])}),
    "runtime_top_p_reset_ids": (i32([13]), {"runtime_top_p_decay": f32([0.9])}),
    "beam_search_diversity_rate": (f32([0.5]), {"beam_width": i32([2])}),
}


def test_every_unsupported_input_has_a_case_and_every_declared_input_a_rule():
    assert set(USED) == set(UNSUPPORTED_INPUTS)
    config = open(os.path.join(ROOT, "all_models/tensorrt_llm/config.pbtxt")).read()
    declared = set(re.findall(r'name: "(\w+)"', config.split("output [")[0])) - {"tensorrt_llm"}
    read = {"input_ids", "input_lengths", "request_output_len", "num_return_sequences", "end_id",
            "pad_id", "stop_words_list", "bad_words_list", "embedding_bias", "beam_width",
            "temperature", "runtime_top_k", "runtime_top_p", "len_penalty", "early_stopping",
            "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty", "seed",
            "return_log_probs", "return_context_logits", "return_generation_logits",
            "return_perf_metrics", "exclude_input_in_output", "stop", "streaming", "num_top_log_probs",
            "return_token_timestamps",
            "context_phase_params", *GUIDED_INPUTS, *LORA_INPUTS, *DRAFT_INPUTS, *PROMPT_TABLE_INPUTS,
            *MROPE_INPUTS, *LOOKAHEAD_INPUTS}
    assert declared == read | set(UNSUPPORTED_INPUTS) | set(IGNORED_INPUTS)
    assert not set(UNSUPPORTED_INPUTS) & set(IGNORED_INPUTS)


@pytest.mark.parametrize("name", list(USED))
def test_a_used_unsupported_input_is_refused_by_name(name):
    value, context = USED[name]
    with pytest.raises(ValueError) as raised:
        convert_request(minimal(**context, **{name: value}), decoupled=True)
    message = str(raised.value)
    named, _, rest = message.partition(": ")
    assert name in named.split(", ")
    assert "not supported by this backend; " in rest
    assert name in conversion_error_message("7", raised.value)


def test_error_text_names_what_is_wrong_and_what_is_allowed():
    with pytest.raises(ValueError) as raised:
        convert_request(minimal(runtime_top_p_decay=f32([0.9]), runtime_top_p=f32([0.8])), decoupled=False)
    assert str(raised.value) == (
        "runtime_top_p_decay: top-p decay is not supported by this backend; send runtime_top_p_decay 1.0, "
        "runtime_top_p_min no larger than runtime_top_p and runtime_top_p_reset_ids -1, or leave them out")


# input -> values that must pass: empty tensors, the "off" values clients and the pipeline send
NEUTRAL = {
    "lora_task_id": [np.zeros((1, 0), np.uint64)],
    "lora_weights": [np.zeros((1, 0, 16), np.float16)],
    "lora_config": [np.zeros((1, 0, 3), np.int32)],
    "prompt_embedding_table": [np.zeros((1, 0, 8), np.float16)],
    "prompt_table_extra_ids": [np.zeros((1, 3), np.uint64), np.zeros((1, 0), np.uint64)],
    "prompt_vocab_size": [i32([0])],
    "guided_decoding_guide_type": [text(""), np.zeros((1, 0), object)],
    "guided_decoding_guide": [text("")],
    "draft_input_ids": [np.zeros((1, 0), np.int32)],
    "draft_logits": [np.zeros((1, 0, 16), np.float32)],
    "draft_acceptance_threshold": [np.zeros((1, 0), np.float32)],
    "lookahead_window_size": [np.zeros((1, 0), np.int32)],
    "decoder_input_ids": [i32([0]), np.zeros((1, 0), np.int32)],  # preprocessing's [[pad_id]]
    "decoder_input_lengths": [i32([1]), i32([0])],
    "encoder_input_features": [np.zeros((1, 0, 8), np.float16)],
    "encoder_output_lengths": [i32([0])],
    "cross_attention_mask": [np.zeros((1, 0, 4), np.bool_)],
    "skip_cross_attn_blocks": [np.array([[True]])],
    "mrope_rotary_cos_sin": [np.zeros((1, 0), np.float32)],
    "mrope_position_deltas": [np.array([[0]], np.int64)],
    "context_phase_params": [np.zeros((1, 0), np.uint8)],
    "runtime_top_p_decay": [f32([1.0])],
    "runtime_top_p_min": [f32([1e-6]), f32([0.0])],
    "runtime_top_p_reset_ids": [i32([-1]), i32([13])],  # 13 with no decay: nothing to reset
    "beam_search_diversity_rate": [f32([0.0]), f32([0.7])],  # 0.7 with beam_width 1: no beams
}


@pytest.mark.parametrize("name,value", [(name, value) for name, values in NEUTRAL.items()
                                        for value in values])
def test_empty_or_neutral_values_are_accepted(name, value):
    [spec] = convert_request(minimal(**{name: value}), decoupled=False)
    assert spec.input_token_ids == [5, 6, 7]


def test_neutral_values_together_and_in_context():
    tensors = minimal(**{name: values[0] for name, values in NEUTRAL.items()})
    assert len(convert_request(tensors, decoupled=False)) == 1
    # a top-p floor at or below the request's top-p never moves it
    assert convert_request(minimal(runtime_top_p=f32([0.9]), runtime_top_p_min=f32([0.9])),
                           decoupled=False)
    # decoder ids padded in a batch: decoder_input_lengths says each item has one token
    batch = {"input_ids": i32([1, 2], [3, 0]), "input_lengths": i32([2], [1]),
             "request_output_len": i32([2], [2]), "decoder_input_ids": i32([0, 0], [0, 0]),
             "decoder_input_lengths": i32([1], [1]), "beam_width": i32([1], [1]),
             "beam_search_diversity_rate": f32([0.5], [0.0])}
    assert len(convert_request(batch, decoupled=False)) == 2
    batch["decoder_input_lengths"] = i32([1], [2])
    with pytest.raises(ValueError, match=r"^decoder_input_ids, decoder_input_lengths: encoder-decoder"):
        convert_request(batch, decoupled=False)


def test_kv_cache_retention_hints_are_accepted_and_ignored():
    hints = {"retention_token_range_starts": i32([0]), "retention_token_range_ends": i32([-1]),
             "retention_token_range_priorities": i32([80]),
             "retention_token_range_durations_ms": i32([-1]), "retention_decode_priority": i32([50]),
             "retention_decode_duration_ms": i32([1000])}
    assert set(hints) == set(IGNORED_INPUTS)
    [spec] = convert_request(minimal(**hints), decoupled=False)
    [plain] = convert_request(minimal(), decoupled=False)
    assert spec == plain


# ----------------------------------------------------------------------------- ensemble and BLS


class _Tensor:
    def __init__(self, array):
        self.array = array

    def as_numpy(self):
        return self.array


@pytest.fixture
def preprocess(monkeypatch, smollm2_tokenizer):
    """The real preprocessing model's `_preprocess` (tokenizer from the test fixture), given a
    dict of its inputs, without Triton."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.get_input_tensor_by_name = lambda request, name: (
        _Tensor(request[name]) if name in request else None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    spec = importlib.util.spec_from_file_location(
        "preprocessing_model_under_test", os.path.join(ROOT, "all_models/preprocessing/1/model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from serving.tokenization import first_token_id

    model = module.TritonPythonModel.__new__(module.TritonPythonModel)
    model.tokenizer, model.add_special_tokens = smollm2_tokenizer, True
    model.end_id = first_token_id(smollm2_tokenizer, smollm2_tokenizer.eos_token)
    model.pad_id = first_token_id(smollm2_tokenizer, smollm2_tokenizer.pad_token)
    model.vocab_size = smollm2_tokenizer.vocab_size
    return model._preprocess


def _ensemble_step_maps():
    """(preprocessing input <- ensemble input, tensorrt_llm input <- tensor) of all_models/ensemble."""
    config = open(os.path.join(ROOT, "all_models/ensemble/config.pbtxt")).read()
    steps = {}
    for block in config.split("model_name: ")[1:]:
        name = block.split()[0].strip('"')
        steps[name] = dict(re.findall(r'input_map\s*{\s*key:\s*"(\w+)"\s*value:\s*"(\w+)"\s*}', block))
    return steps["preprocessing"], steps["tensorrt_llm"]


def ensemble_llm_tensors(preprocess, client):
    """What tensorrt_llm receives from the ensemble for the client's inputs."""
    pre_map, llm_map = _ensemble_step_maps()
    pre_out = preprocess({key: client[value] for key, value in pre_map.items() if value in client})
    out_map = {"_REQUEST_INPUT_LEN": "REQUEST_INPUT_LEN", "_INPUT_ID": "INPUT_ID",
               "_REQUEST_DECODER_INPUT_LEN": "REQUEST_DECODER_INPUT_LEN",
               "_DECODER_INPUT_ID": "DECODER_INPUT_ID", "_REQUEST_OUTPUT_LEN": "REQUEST_OUTPUT_LEN",
               "_STOP_WORDS_IDS": "STOP_WORDS_IDS", "_BAD_WORDS_IDS": "BAD_WORDS_IDS",
               "_EMBEDDING_BIAS": "EMBEDDING_BIAS", "_PREPROCESSOR_END_ID": "OUT_END_ID",
               "_PREPROCESSOR_PAD_ID": "OUT_PAD_ID",
               "_OUT_PROMPT_TABLE_EXTRA_IDS": "OUT_PROMPT_TABLE_EXTRA_IDS"}
    tensors = {}
    for key, value in llm_map.items():
        if value.startswith("_"):
            if out_map[value] in pre_out:
                tensors[key] = pre_out[out_map[value]]
        elif value in client:
            tensors[key] = client[value]
    return tensors


# what NVIDIA's end_to_end_grpc_client sends by default (plus a stop word)
E2E_CLIENT = {"text_input": text("What is the capital of France?"), "max_tokens": i32([8]),
              "stream": np.array([[False]]), "beam_width": i32([1]), "temperature": f32([1.0]),
              "exclude_input_in_output": np.array([[False]]), "stop_words": text("Paris")}


@pytest.mark.parametrize("extra", [
    {},
    {"decoder_text_input": text("")},  # an empty decoder prompt
    {"prompt_table_extra_id": np.array([[7]], np.uint64)},  # no prompt-table tokens in the prompt
    {"pad_id": i32([5]), "end_id": i32([2]), "top_p": f32([0.9]), "num_return_sequences": i32([1])},
    {"guided_decoding_guide_type": text(""), "guided_decoding_guide": text("")},
])
def test_plain_ensemble_requests_pass(preprocess, extra):
    tensors = ensemble_llm_tensors(preprocess, {**E2E_CLIENT, **extra})
    assert "decoder_input_ids" in tensors and "decoder_input_lengths" in tensors
    [spec] = convert_request(tensors, decoupled=True)
    assert spec.max_tokens == 8 and spec.stop_words


def test_plain_ensemble_batch_passes(preprocess):
    client = {"text_input": text("Hi", "What is the capital of France?"), "max_tokens": i32([4], [8])}
    tensors = ensemble_llm_tensors(preprocess, client)
    assert tensors["decoder_input_ids"].shape == (2, 1)
    assert [len(s.input_token_ids) for s in convert_request(tensors, decoupled=True)] == \
        tensors["input_lengths"].reshape(-1).tolist()


@pytest.mark.parametrize("extra,name", [
    ({"decoder_text_input": text("Translate to German: good morning")}, "decoder_input_ids"),
])
def test_real_uses_through_the_ensemble_are_refused(preprocess, extra, name):
    tensors = ensemble_llm_tensors(preprocess, {**E2E_CLIENT, **extra})
    with pytest.raises(ValueError, match=rf"^{name}\b.*not supported by this backend"):
        convert_request(tensors, decoupled=True)


# BLS: inputs as the BLS model sees them (reshape [] inputs are (B,))
BLS_PLAIN = {"text_input": text("What is the capital of France?"), "max_tokens": i32([8]),
             "stream": np.array([[False]]), "beam_width": i32([1]), "temperature": f32([1.0]),
             "exclude_input_in_output": np.array([False]), "num_return_sequences": np.array([1], np.int32)}

BLS_USED = {  # (images: refused by a BLS without multimodal_encoders_name, i.e. over a text-only model)
    "image_input": np.ones((1, 1, 3, 2, 2), np.float16),
    "image_bytes_input": np.ones((1, 1, 2, 2, 3), np.uint8),
    "image_url_input": text("https://example.com/cat.jpg"),
    "video_bytes_input": np.ones((1, 1, 2, 2, 3), np.uint8),
}


def test_every_bls_input_of_a_missing_feature_has_a_case():
    from serving.bls import UNSUPPORTED_FEATURES

    assert set(BLS_USED) == {name for feature in UNSUPPORTED_FEATURES for name in feature.inputs}


@pytest.mark.parametrize("name", list(BLS_USED))
def test_bls_refuses_a_used_input_by_its_own_name(name):
    with pytest.raises(ValueError) as raised:
        validate({**BLS_PLAIN, name: BLS_USED[name]})
    named, _, rest = str(raised.value).partition(": ")
    assert named.split(", ") == [name] and "not supported by this backend; " in rest


def test_bls_keeps_its_texts():
    with pytest.raises(ValueError, match=r"^cannot perform speculative decoding without draft model"):
        validate({**BLS_PLAIN, "num_draft_tokens": i32([2])})
    with pytest.raises(ValueError, match="text_input is required"):
        validate({"max_tokens": i32([4]), "lora_task_id": np.array([3], np.uint64)})


BLS_NEUTRAL = {
    "lora_weights": np.zeros((1, 0, 16), np.float16),
    "prompt_embedding_table": np.zeros((1, 0, 8), np.float16),
    "prompt_table_extra_id": np.array([[0]], np.uint64), "prompt_vocab_size": i32([0]),
    "guided_decoding_guide_type": text(""), "guided_decoding_guide": text(""),
    "num_draft_tokens": i32([0]), "use_draft_logits": np.array([False]), "decoder_text_input": text(""),
    "image_url_input": text(""), "image_bytes_input": np.zeros((1, 0, 2, 2, 3), np.uint8),
}


def test_plain_and_neutral_bls_requests_pass_through_to_tensorrt_llm(preprocess):
    for bls in (BLS_PLAIN, {**BLS_PLAIN, **BLS_NEUTRAL}):
        validate(bls)
        # what tensorrt_llm_bls's _llm_inputs sends to tensorrt_llm
        pre_inputs = {PREPROCESSING_INPUTS[k]: v for k, v in bls.items() if k in PREPROCESSING_INPUTS}
        pre_out = preprocess(pre_inputs)
        llm = {llm: pre_out[name] for name, llm in LLM_INPUTS_FROM_PREPROCESSING.items() if name in pre_out}
        llm.update({llm_name: with_batch_dim(bls[name], 1)
                    for name, llm_name in LLM_INPUTS_FROM_REQUEST.items() if name in bls})
        llm["streaming"] = np.full((1, 1), False)
        [spec] = convert_request(llm, decoupled=True)
        assert spec.max_tokens == 8


def test_bls_decoder_text_input_reaches_tensorrt_llm_as_the_ensembles_does(preprocess):
    """The BLS forwards preprocessing's decoder prompt as the ensemble maps it: the same tensors reach
    tensorrt_llm, which refuses a real decoder prompt on a decoder-only engine naming decoder_input_ids."""
    bls = {**BLS_PLAIN, "decoder_text_input": text("Translate: good morning")}
    validate(bls)
    pre_out = preprocess({PREPROCESSING_INPUTS[k]: v for k, v in bls.items() if k in PREPROCESSING_INPUTS})
    llm = {llm: pre_out[name] for name, llm in LLM_INPUTS_FROM_PREPROCESSING.items() if name in pre_out}
    ensemble = ensemble_llm_tensors(preprocess, {**E2E_CLIENT, "decoder_text_input": bls["decoder_text_input"]})
    for name in ("decoder_input_ids", "decoder_input_lengths"):
        np.testing.assert_array_equal(llm[name], ensemble[name])
    with pytest.raises(ValueError, match=r"^decoder_input_ids\b.*not supported by this backend"):
        convert_request({**llm, "streaming": np.full((1, 1), False)}, decoupled=True)
