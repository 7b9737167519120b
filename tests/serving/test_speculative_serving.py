"""Speculative decoding on the serving side: tensorrt_llm's draft inputs -> Request.external_draft,
the decoding_mode / max_draft_len / max_matching_ngram_size / draft_model_path parameters, the
perf outputs, and the BLS's draft/target loop (with fake models) and its refusals."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from engine.executor.executor import ExecutorConfig, SpeculativeConfig
from engine.executor.request import ExternalDraftTokens, RequestLimits, validate_request
from serving.bls import (NO_DRAFT_MODEL, NO_SPECULATIVE_CONTEXT_LOGITS, NO_SPECULATIVE_STREAMING, round_inputs,
                         speculative_generate, validate)
from serving.executor_config import executor_settings, to_executor_config
from serving.llmapi_params import perf_values
from serving.requests import conversion_error_message, convert_request, to_executor_request
from serving.responses import result_tensors


def i32(*rows):
    return np.array(rows, dtype=np.int32)


def minimal(**extra):
    return {"input_ids": i32([5, 6, 7]), "request_output_len": i32([4]), **extra}


def executor_request(**extra):
    [spec] = convert_request(minimal(**extra), decoupled=False)
    return to_executor_request(spec)


# ----------------------------------------------------------------------------- tensorrt_llm inputs

def test_draft_inputs_become_the_requests_external_draft():
    logits = np.arange(2 * 16, dtype=np.float16).reshape(1, 2, 16)
    request = executor_request(draft_input_ids=i32([8, 9]), draft_logits=logits,
                               draft_acceptance_threshold=np.array([0.25], np.float32))
    draft = request.external_draft
    assert isinstance(draft, ExternalDraftTokens) and draft.token_ids == [8, 9]
    assert draft.acceptance_threshold == 0.25
    assert tuple(draft.logits.shape) == (2, 16) and str(draft.logits.dtype) == "torch.float32"
    assert draft.logits[1, 3].item() == 19.0


def test_no_draft_input_means_no_external_draft_and_empty_tensors_are_not_sent():
    assert executor_request().external_draft is None
    empty = executor_request(draft_input_ids=np.zeros((1, 0), np.int32), draft_logits=np.zeros((1, 0, 16), np.float32),
                             draft_acceptance_threshold=np.zeros((1, 0), np.float32))
    assert empty.external_draft is None
    threshold_only = executor_request(draft_acceptance_threshold=np.array([0.5], np.float32))
    assert threshold_only.external_draft == ExternalDraftTokens(token_ids=[], logits=None, acceptance_threshold=0.5)


def test_each_batch_row_gets_its_own_drafts():
    tensors = {"input_ids": i32([5, 6, 7], [1, 2, 3]), "request_output_len": i32([4], [4]),
               "draft_input_ids": i32([8, 9], [10, 11])}
    specs = convert_request(tensors, decoupled=False)
    assert [s.external_draft["token_ids"] for s in specs] == [[8, 9], [10, 11]]


@pytest.mark.parametrize("extra,named", [
    ({"draft_logits": np.ones((1, 2, 16), np.float32)}, "draft_logits was sent without draft_input_ids"),
    ({"draft_input_ids": i32([8, 9]), "draft_logits": np.ones((1, 32), np.float32)}, "draft_logits has shape (1, 32)"),
    ({"draft_input_ids": i32([8, 9], [1, 2])}, "Expected batch size doesn't match batch size for tensor draft_input_ids"),
    ({"draft_input_ids": i32([8, 9]), "draft_acceptance_threshold": np.array([0.1, 0.2], np.float32)},
     "Expected a scalar tensor for tensor draft_acceptance_threshold"),
])
def test_bad_draft_layouts_are_refused_by_name(extra, named):
    with pytest.raises(ValueError) as raised:
        convert_request(minimal(**extra), decoupled=False)
    assert named in str(raised.value)
    assert named in conversion_error_message("7", raised.value)


LIMITS = RequestLimits(vocab_size=16, max_seq_len=64, max_beam_width=2, max_num_tokens=64,
                       enable_chunked_context=False, num_kv_blocks=32, tokens_per_block=4, max_draft_len=3)


@pytest.mark.parametrize("extra,named", [
    ({"draft_input_ids": i32([8, 99])}, "draft_input_ids contains token id 99 outside the vocabulary"),
    ({"draft_input_ids": i32([8, 9, 10, 11])}, "draft_input_ids has 4 tokens; allowed: at most 3"),
    ({"draft_input_ids": i32([8, 9]), "draft_logits": np.ones((1, 2, 15), np.float32)}, "draft_logits has shape (2, 15)"),
    ({"draft_input_ids": i32([8]), "draft_acceptance_threshold": np.array([1.5], np.float32)},
     "draft_acceptance_threshold must be in [0, 1]"),
    ({"draft_input_ids": i32([8]), "beam_width": i32([2])}, "draft_input_ids are not supported with beam search"),
])
def test_the_executor_names_the_input_of_a_bad_draft_value(extra, named):
    """Values are the executor's to check (its error becomes the request's error response)."""
    assert named in validate_request(executor_request(**extra), LIMITS)


# ----------------------------------------------------------------------------- parameters

def test_decoding_mode_ngram_and_its_parameters_make_a_speculative_config():
    settings = executor_settings({"decoding_mode": "ngram", "max_draft_len": "5", "max_matching_ngram_size": "2"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config.speculative == SpeculativeConfig(mode="ngram", max_draft_len=5, max_matching_ngram_size=2)
    assert config.max_draft_len == 5 and ignored == []
    config.validate()


def test_draft_target_names_the_draft_engine():
    settings = executor_settings({"decoding_mode": "draft_target", "draft_model_path": "/engines/draft"}, {})
    config, _ = to_executor_config(ExecutorConfig, settings)
    assert config.speculative.mode == "draft_model" and config.speculative.draft_engine_dir == "/engines/draft"
    assert executor_settings({"decoding_mode": "DRAFT_MODEL", "draft_model_path": "/d"}, {})["speculative_mode"] == "draft_model"
    with pytest.raises(ValueError, match="draft_model_path"):
        executor_settings({"decoding_mode": "draft_target"}, {})


def test_decoding_mode_medusa_names_its_heads_and_tree():
    settings = executor_settings({"decoding_mode": "medusa", "medusa_model_path": "/heads", "max_draft_len": "8",
                                  "medusa_choices": "{0}, {0, 0}, {1}"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config.speculative == SpeculativeConfig(mode="medusa", max_draft_len=8, medusa_model_path="/heads",
                                                   medusa_choices=[[0], [0, 0], [1]])
    assert ignored == []
    config.validate()


def test_decoding_mode_lookahead_takes_the_three_sizes_and_requests_their_own():
    params = {"decoding_mode": "lookahead", "lookahead_window_size": "4", "lookahead_ngram_size": "3",
              "lookahead_verification_set_size": "2"}
    config, ignored = to_executor_config(ExecutorConfig, executor_settings(params, {}))
    assert config.speculative == SpeculativeConfig(mode="lookahead", lookahead_window_size=4, lookahead_ngram_size=3,
                                                   lookahead_verification_set_size=2)
    assert ignored == [] and config.validate().speculative.max_draft_len == 12  # (N-1)*(W+G)
    with pytest.raises(ValueError, match="decoding_mode lookahead needs lookahead_verification_set_size"):
        executor_settings({**params, "lookahead_verification_set_size": "${lookahead_verification_set_size}"}, {})
    sizes = {"lookahead_window_size": i32([2]), "lookahead_ngram_size": i32([2]), "lookahead_verification_set_size": i32([1])}
    assert tuple(vars(executor_request(**sizes).lookahead_config).values()) == (2, 2, 1)
    with pytest.raises(ValueError, match="^lookahead_ngram_size: lookahead_window_size, lookahead_ngram_size and "
                                         "lookahead_verification_set_size go together"):
        convert_request(minimal(lookahead_window_size=i32([2]), lookahead_verification_set_size=i32([1])),
                        decoupled=False)


def test_decoding_mode_eagle_names_its_heads_and_tree():
    settings = executor_settings({"decoding_mode": "eagle", "eagle_model_path": "/heads",
                                  "eagle_choices": "{0}, {0, 0}, {1}"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config.speculative == SpeculativeConfig(mode="eagle", eagle_model_path="/heads",
                                                   eagle_choices=[[0], [0, 0], [1]])
    assert ignored == []
    settings = executor_settings({"decoding_mode": "eagle", "use_dynamic_tree": "true", "dynamic_tree_max_topK": "10",
                                  "num_eagle_layers": "6", "max_draft_len": "60", "eagle_fp8_head": "true"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config.speculative == SpeculativeConfig(mode="eagle", max_draft_len=60, eagle_dynamic_tree=True,
                                                   eagle_dynamic_top_k=10, eagle_dynamic_depth=6, eagle_fp8_head=True)
    assert ignored == []


@pytest.mark.parametrize("mode", ["redrafter", "explicit_draft_tokens"])
def test_decoding_mode_redrafter_names_its_drafter_and_beams(mode):
    settings = executor_settings({"decoding_mode": mode, "redrafter_model_path": "/drafter",
                                  "redrafter_num_beams": "3", "redrafter_draft_len_per_beam": "4"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config.speculative == SpeculativeConfig(mode="redrafter", redrafter_model_path="/drafter",
                                                   redrafter_num_beams=3, redrafter_draft_len_per_beam=4)
    assert ignored == []


def test_other_decoding_modes_and_unfilled_parameters_leave_speculation_off():
    for params in ({"decoding_mode": "top_k"}, {"decoding_mode": "${decoding_mode}", "max_draft_len": "${max_draft_len}",
                                                "max_matching_ngram_size": "${max_matching_ngram_size}",
                                                "draft_model_path": "${draft_engine_dir}"}):
        config, _ = to_executor_config(ExecutorConfig, executor_settings(params, {}))
        assert config.speculative is None and config.max_draft_len == ExecutorConfig().max_draft_len
    # max_draft_len alone bounds the drafts a request may send
    config, _ = to_executor_config(ExecutorConfig, executor_settings({"max_draft_len": "3"}, {}))
    assert config.speculative is None and config.max_draft_len == 3
    with pytest.raises(ValueError, match=r"^decoding_mode value of 'ngrams' is not supported\.$"):
        executor_settings({"decoding_mode": "ngrams"}, {})


def test_the_template_declares_the_parameters():
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "all_models/tensorrt_llm/config.pbtxt")).read()
    for key, placeholder in (("max_draft_len", "max_draft_len"), ("max_matching_ngram_size", "max_matching_ngram_size"),
                             ("draft_model_path", "draft_engine_dir")):
        assert f'key: "{key}"\n  value: {{\n    string_value: "${{{placeholder}}}"' in text


# ----------------------------------------------------------------------------- outputs

def test_perf_outputs_carry_the_executors_draft_counts():
    perf = SimpleNamespace(total_draft_tokens=8, total_accepted_draft_tokens=6, acceptance_rate=0.75)
    out = result_tensors(SimpleNamespace(output_token_ids=[[1, 2]], perf=perf), batch_index=0, batch_size=1,
                         num_return_sequences=1, want_perf=True)
    assert out["total_draft_tokens"].tolist() == [[8]] and out["total_accepted_draft_tokens"].tolist() == [[6]]
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"].item() == 0.75
    values = perf_values(out, prompt_tokens=3, tokens_per_block=16)  # the LLM-API model's
    assert values["total_draft_tokens"] == (8, np.int32) and values["total_accepted_draft_tokens"] == (6, np.int32)
    assert values["acceptance_rate"][0] == pytest.approx(0.75)


# ----------------------------------------------------------------------------- BLS

PLAIN_BLS = {"text_input": np.array([[b"hi"]], object), "max_tokens": i32([8])}


def test_bls_speculative_refusals_keep_the_references_texts():
    k = {"num_draft_tokens": i32([3])}
    with pytest.raises(ValueError, match=NO_SPECULATIVE_STREAMING):
        validate({**PLAIN_BLS, **k, "stream": np.array([[True]])}, "draft")
    with pytest.raises(ValueError, match=NO_SPECULATIVE_CONTEXT_LOGITS):
        validate({**PLAIN_BLS, **k, "return_context_logits": np.array([True])}, "draft")
    with pytest.raises(ValueError, match=NO_DRAFT_MODEL):
        validate({**PLAIN_BLS, **k}, None)
    with pytest.raises(ValueError, match="one text_input per request"):
        validate({"text_input": np.array([[b"a"], [b"b"]], object), "max_tokens": i32([8], [8]), **k}, "draft")
    validate({**PLAIN_BLS, **k}, "draft")
    validate({**PLAIN_BLS, "num_draft_tokens": i32([0]), "stream": np.array([[True]])}, None)  # 0: off


VOCAB = 12


def greedy_next(ids):
    """A toy target: the next token is a function of the ids so far."""
    return (ids[-1] * 5 + len(ids) * 3 + 1) % VOCAB


class FakeModels:
    """A draft and a target as tensorrt_llm answers a non-streamed call (prompt included in the
    output); the target keeps the drafts that equal its own next token, then generates on."""

    def __init__(self, draft_is_right=lambda position: True, end_at=None):
        self.draft_is_right, self.end_at = draft_is_right, end_at  # end_at: the length where end_id comes
        self.draft_calls, self.target_calls = [], []

    def _run(self, ids, max_new, choose):
        out = list(ids)
        for _ in range(max_new):
            if len(out) == self.end_at:
                break
            out.append(choose(out))
        return out

    @staticmethod
    def _response(ids, **extra):
        return {"output_ids": np.array([[ids]], np.int32), "sequence_length": np.array([[len(ids)]], np.int32), **extra}

    async def draft(self, inputs):
        self.draft_calls.append(inputs)
        ids = inputs["input_ids"][0].tolist()
        k = int(inputs["request_output_len"][0, 0])
        out = self._run(ids, k, lambda seq: greedy_next(seq) if self.draft_is_right(len(seq)) else (greedy_next(seq) + 1) % VOCAB)
        logits = np.zeros((1, 1, len(out) - len(ids), VOCAB), np.float32)
        return self._response(out, generation_logits=logits)

    async def target(self, inputs):
        self.target_calls.append(inputs)
        ids = inputs["input_ids"][0].tolist()
        drafts = inputs["draft_input_ids"][0].tolist() if "draft_input_ids" in inputs else []
        max_new = int(inputs["request_output_len"][0, 0])
        out = list(ids)
        accepted = 0
        for token in drafts:
            if token != greedy_next(out) or len(out) - len(ids) >= max_new or len(out) == self.end_at:
                break
            out.append(token)
            accepted += 1
        out = self._run(out, max_new - (len(out) - len(ids)), greedy_next)
        perf = {"total_draft_tokens": np.array([[len(drafts)]], np.int32),
                "total_accepted_draft_tokens": np.array([[accepted]], np.int32),
                "acceptance_rate": np.array([[accepted / max(len(drafts), 1)]], np.float32),
                "arrival_time_ns": np.array([[len(self.target_calls)]], np.int64)}
        return self._response(out, **perf)


def run_loop(models, max_tokens=10, k=3, prompt=(1, 2, 3), **extra):
    llm_inputs = {"input_ids": i32(list(prompt) + [0, 0]), "input_lengths": i32([len(prompt)]),
                  "request_output_len": i32([max_tokens]), "end_id": i32([-1]), "streaming": np.array([[False]]),
                  **extra.pop("llm", {})}
    options = {"max_tokens": max_tokens, "num_draft_tokens": k, "use_draft_logits": False, "exclude_input": False,
               "want_perf": True, **extra}
    return asyncio.run(speculative_generate(llm_inputs, call_draft=models.draft, call_target=models.target, **options))


def plain(prompt, n, end_at=None):
    return FakeModels(end_at=end_at)._run(list(prompt), n, greedy_next)


@pytest.mark.parametrize("draft_is_right", [lambda p: True, lambda p: False, lambda p: p % 2 == 0])
def test_bls_loop_gives_the_targets_tokens_whatever_the_draft_says(draft_is_right):
    models = FakeModels(draft_is_right)
    out = run_loop(models, max_tokens=10, k=3)
    assert out["output_ids"][0, 0].tolist() == plain([1, 2, 3], 10) and out["sequence_length"].tolist() == [[13]]
    for call in models.target_calls:  # max k + 1 new tokens, with the draft's tokens as draft_input_ids
        assert int(call["request_output_len"][0, 0]) == call.get("draft_input_ids", np.zeros((1, 0))).shape[1] + 1
        assert not call["exclude_input_in_output"].any() and not call["streaming"].any()
    assert int(out["total_draft_tokens"][0, 0]) == sum(c["draft_input_ids"].shape[1] for c in models.target_calls
                                                        if "draft_input_ids" in c)
    assert out["arrival_time_ns"].item() == 1  # the first target call's


def test_bls_loop_with_a_right_draft_takes_few_rounds_and_reports_full_acceptance():
    models = FakeModels()
    out = run_loop(models, max_tokens=9, k=4)
    assert out["output_ids"][0, 0].tolist() == plain([1, 2, 3], 9)
    assert len(models.target_calls) == 2 and len(models.draft_calls) == 2  # 5 + 4 tokens
    assert out["acceptance_rate"].item() == 1.0 and out["total_accepted_draft_tokens"].item() == 7


def test_bls_loop_stops_when_the_target_ends_and_excludes_the_prompt_when_asked():
    models = FakeModels(end_at=3 + 5)  # end_id after 5 tokens: 4 in the first round, 1 of 2 in the second
    out = run_loop(models, max_tokens=20, k=3, exclude_input=True)
    assert out["output_ids"][0, 0].tolist() == plain([1, 2, 3], 5)[3:]
    assert len(models.target_calls) == 2


def test_bls_loop_with_max_tokens_one_never_calls_the_draft():
    models = FakeModels()
    out = run_loop(models, max_tokens=1, k=4)
    assert models.draft_calls == [] and len(models.target_calls) == 1
    assert out["output_ids"][0, 0].tolist() == plain([1, 2, 3], 1)


def test_bls_loop_sends_draft_logits_with_use_draft_logits_and_carries_min_tokens():
    models = FakeModels()
    run_loop(models, max_tokens=8, k=3, use_draft_logits=True, llm={"min_tokens": i32([5])})
    first_draft, first_target = models.draft_calls[0], models.target_calls[0]
    assert first_draft["return_generation_logits"].all()
    assert first_target["draft_logits"].shape == (1, 3, VOCAB)
    assert int(first_target["min_tokens"][0, 0]) == 5 and int(models.target_calls[1]["min_tokens"][0, 0]) == 1
    assert "min_tokens" not in round_inputs({"min_tokens": i32([5])}, np.array([1], np.int32), 2, min_tokens=0)
