from types import SimpleNamespace

import numpy as np
import pytest

from serving.requests import (IGNORED_INPUTS, conversion_error_message, convert_request, request_type_of,
                              is_stop_request, to_executor_request)
from serving.responses import PERF_OUTPUTS, result_tensors


def i32(*rows):
    return np.array(rows, dtype=np.int32)


def minimal(**extra):
    tensors = {"input_ids": i32([5, 6, 7]), "request_output_len": i32([4])}
    tensors.update(extra)
    return tensors


def test_minimal_request_defaults():
    [spec] = convert_request(minimal(), decoupled=False)
    assert spec.input_token_ids == [5, 6, 7] and spec.max_tokens == 4
    assert spec.streaming is False and spec.end_id is None and spec.stop_words is None
    assert spec.sampling == {"beam_width": 1, "num_return_sequences": 1}
    assert spec.output == {"return_log_probs": False, "return_context_logits": False,
                           "return_generation_logits": False, "return_perf_metrics": False,
                           "exclude_input_from_output": False}


def test_full_single_request_maps_every_field():
    tensors = minimal(
        end_id=i32([2]), pad_id=i32([0]), streaming=np.array([True]), beam_width=i32([0]),
        runtime_top_k=i32([3]), runtime_top_p=np.array([0.0], np.float32),
        temperature=np.array([0.7], np.float32), len_penalty=np.array([1.5], np.float32),
        seed=np.array([9], np.uint64), min_tokens=i32([1]), num_return_sequences=i32([2]),
        return_log_probs=np.array([True]), return_perf_metrics=np.array([True]),
        stop_words_list=np.array([[[24044, 76, 1230], [2, 3, -1]]], np.int32),
        embedding_bias=np.ones((1, 8), np.float32))
    [spec] = convert_request(tensors, decoupled=True, exclude_input_default=True)
    assert (spec.end_id, spec.pad_id, spec.streaming) == (2, 0, True)
    assert spec.sampling["top_k"] == 3 and "top_p" not in spec.sampling  # top_p 0 -> unset
    assert spec.sampling["temperature"] == pytest.approx(0.7)
    assert spec.sampling["length_penalty"] == 1.5 and spec.sampling["seed"] == 9
    assert spec.beam_width == 1 and spec.num_return_sequences == 2
    assert spec.output["return_log_probs"] and spec.output["exclude_input_from_output"]
    assert spec.stop_words == [[24044, 76], [1230]] and spec.embedding_bias.shape == (8,)


def test_request_value_overrides_exclude_parameter():
    [spec] = convert_request(minimal(exclude_input_in_output=np.array([False])), decoupled=False,
                             exclude_input_default=True)
    assert spec.output["exclude_input_from_output"] is False


def test_batched_rows_are_trimmed_and_keep_their_values():
    tensors = {"input_ids": i32([1, 2, 3, 4], [1, 2, 0, 0]), "input_lengths": i32([4], [2]),
               "request_output_len": i32([3], [5]),
               "stop_words_list": np.array([[[9, 0], [1, -1]], [[7, 8], [1, 2]]], np.int32)}
    specs = convert_request(tensors, decoupled=False)
    assert [s.input_token_ids for s in specs] == [[1, 2, 3, 4], [1, 2]]
    assert [s.max_tokens for s in specs] == [3, 5] and [s.batch_index for s in specs] == [0, 1]
    assert specs[1].stop_words == [[7], [8]]


@pytest.mark.parametrize("tensors,message", [
    ({"request_output_len": i32([4])}, "A value is required for input_ids"),
    ({"input_ids": np.zeros((1, 0), np.int32), "request_output_len": i32([4])},
     "Invalid format for input_ids"),
    ({"input_ids": i32([1, 2]), "input_lengths": i32([0]), "request_output_len": i32([1])},
     "Invalid format for input_ids"),
    ({"input_ids": i32([1, 2])}, "A value is required for request_output_len"),
    ({"input_ids": i32([1, 2]), "input_lengths": i32([40]), "request_output_len": i32([1])},
     "input_lengths is 40 but the input_ids row holds 2 ids; allowed: 1..2"),
    (minimal(streaming=np.array([True])), "Streaming is only supported in decoupled mode."),
    (minimal(end_id=i32([1], [2])), "Expected a scalar tensor for tensor end_id"),
    (minimal(embedding_bias=np.ones((2, 3), np.float32)),
     "Expected batch size doesn't match batch size for tensor embedding_bias. Expected 1 got 2"),
    (minimal(stop_words_list=np.array([[[1, 2], [5, -1]]], np.int32)), "Invalid format for word list"),
])
def test_invalid_requests_raise_reference_texts(tensors, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        convert_request(tensors, decoupled=False)


def test_prompt_longer_than_max_input_len_is_rejected():
    with pytest.raises(ValueError, match="input length 3 exceeds the engine's max_input_len 2"):
        convert_request(minimal(), decoupled=False, max_input_len=2)
    assert len(convert_request(minimal(), decoupled=False, max_input_len=3)) == 1


def test_retention_hints_are_ignored_and_unsupported_features_refused():
    # only the KV-cache retention hints are accepted and ignored (test_unsupported_inputs.py has
    # the rule of every refused input)
    tensors = minimal(**{name: np.zeros((1, 1), np.int32) for name in IGNORED_INPUTS})
    assert convert_request(tensors, decoupled=False) == convert_request(minimal(), decoupled=False)
    with pytest.raises(ValueError, match="^runtime_top_p_decay: top-p decay is not supported by this backend"):
        convert_request(minimal(runtime_top_p_decay=np.full((1, 1), 0.9, np.float32),
                                runtime_top_p=np.full((1, 1), 0.8, np.float32)), decoupled=False)


def test_request_type_and_context_phase_params_reach_the_executor_request():
    """Disaggregated serving: the Triton parameter request_type and the UINT8 blob per item."""
    assert request_type_of("") == request_type_of('{"other": 1}') == "context_and_generation"
    assert request_type_of('{"request_type": "context_only"}') == "context_only"
    with pytest.raises(ValueError, match="^request_type: 'prefill' is not supported; allowed: context_and_generation, "
                                         "context_only, generation_only$"):
        request_type_of('{"request_type": "prefill"}')
    [spec] = convert_request(minimal(context_phase_params=np.arange(8, dtype=np.uint8)[None]), decoupled=False,
                             request_type="generation_only")
    request = to_executor_request(spec)
    assert (request.request_type, request.context_phase_params) == ("generation_only", bytes(range(8)))
    [plain] = convert_request(minimal(context_phase_params=np.zeros((1, 0), np.uint8)), decoupled=False)
    assert (plain.request_type, plain.context_phase_params) == ("context_and_generation", None)
    result = SimpleNamespace(output_token_ids=[[1, 2]], context_phase_params=b"\x01\x02")
    tensors = result_tensors(result, batch_index=0, batch_size=1, num_return_sequences=1, want_perf=False)
    assert tensors["context_phase_params"].dtype == np.uint8 and tensors["context_phase_params"].tolist() == [[1, 2]]


def test_stop_detection_and_error_wrapping():
    assert is_stop_request({"stop": np.array([[True]])})
    assert not is_stop_request({"stop": np.array([False])}) and not is_stop_request({})
    assert conversion_error_message("7", ValueError("boom")) == (
        "An error occurred when processing the input values for request id 7, the error was 'boom'")


def test_full_result_conversion():
    perf = SimpleNamespace(kv_cache_alloc_new_blocks=4, kv_cache_reused_blocks=0,
                           kv_cache_alloc_total_blocks=4, arrival_time_ns=10, first_scheduled_time_ns=11,
                           first_token_time_ns=12, last_token_time_ns=13)
    result = SimpleNamespace(output_token_ids=[[1, 2, 3], [4]], cum_log_probs=[-1.0, -2.0],
                             log_probs=[[-0.1, -0.2, -0.3], [-0.5]], context_logits=np.ones((2, 5)),
                             generation_logits=None, sequence_index=1, perf=perf)
    out = result_tensors(result, batch_index=2, batch_size=3, num_return_sequences=2, want_perf=True)
    assert out["output_ids"].tolist() == [[[1, 2, 3], [4, -1, -1]]]
    assert out["sequence_length"].tolist() == [[3, 1]]
    assert out["cum_log_probs"].shape == (1, 2) and out["output_log_probs"].shape == (1, 2, 3)
    assert out["context_logits"].shape == (1, 2, 5) and "generation_logits" not in out
    assert out["batch_index"].tolist() == [[2]] and out["sequence_index"].tolist() == [[1]]
    assert set(PERF_OUTPUTS) <= set(out)
    assert out["arrival_time_ns"].dtype == np.int64 and out["kv_cache_alloc_new_blocks"].item() == 4
    assert out["acceptance_rate"].dtype == np.float32 and out["total_draft_tokens"].item() == 0


def test_minimal_result_has_no_optional_tensors():
    result = SimpleNamespace(output_token_ids=[[7]], cum_log_probs=None, log_probs=None)
    out = result_tensors(result, batch_index=0, batch_size=1, num_return_sequences=1, want_perf=False)
    assert set(out) == {"output_ids", "sequence_length"}


def test_num_top_log_probs_is_read_and_checked_by_name():
    [spec] = convert_request(minimal(num_top_log_probs=i32([3])), decoupled=False)
    assert spec.output["num_top_log_probs"] == 3
    [off] = convert_request(minimal(num_top_log_probs=i32([0])), decoupled=False)
    assert "num_top_log_probs" not in off.output  # 0: the request is what it was without the input
    for bad in (21, -1):
        with pytest.raises(ValueError, match=r"num_top_log_probs must be an integer in 0\.\.20 \(0: off\), got "
                                             + str(bad)):
            convert_request(minimal(num_top_log_probs=i32([bad])), decoupled=False)


def test_top_log_probs_become_beams_by_tokens_by_k_tensors():
    result = SimpleNamespace(output_token_ids=[[4, 9]], cum_log_probs=[-0.3], log_probs=[[-0.1, -0.2]],
                             top_log_prob_ids=[[[4, 1], [9, 2]]], top_log_probs=[[[-0.1, -2.5], [-0.2, -1.9]]])
    out = result_tensors(result, batch_index=0, batch_size=1, num_return_sequences=1, want_perf=False)
    assert out["top_log_prob_ids"].dtype == np.int32 and out["top_log_prob_ids"].tolist() == [[[[4, 1], [9, 2]]]]
    assert out["top_log_probs"].dtype == np.float32 and out["top_log_probs"].shape == (1, 1, 2, 2)
    np.testing.assert_allclose(out["top_log_probs"][0, 0, :, 0], [-0.1, -0.2])
