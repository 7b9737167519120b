"""Guided decoding in the serving layer: `guided_decoding_guide_type` / `guided_decoding_guide`
become the engine request's GuidedDecodingParams, every bad pair gets its own per-request error,
the BLS forwards both, and the `tensorrt_llm` parameters guided_decoding_backend, tokenizer_dir
and grammar_cache_size reach the ExecutorConfig. No server, no engine: plain functions."""
import dataclasses
import os
import re

import numpy as np
import pytest

from engine.executor.request import GUIDE_TYPES, GuidedDecodingParams
from serving.bls import LLM_INPUTS_FROM_REQUEST, validate
from serving.executor_config import (GUIDED_DECODING_BACKENDS, NEEDS_TOKENIZER, executor_settings,
                                     guided_decoding_settings, to_executor_config)
from serving.requests import GUIDED_INPUTS, conversion_error_message, convert_request, to_executor_request
from test_unsupported_inputs import (BLS_PLAIN, E2E_CLIENT, ROOT, ensemble_llm_tensors, i32,  # noqa: F401
                                     minimal, preprocess, text)

SCHEMA = '{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}'
GUIDES = {"json": None, "json_schema": SCHEMA, "regex": r"\d+", "ebnf_grammar": "root ::= [0-9]+",
          "structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'}


def guided(guide_type, guide=None, **extra):
    tensors = minimal(guided_decoding_guide_type=text(guide_type), **extra)
    if guide is not None:
        tensors["guided_decoding_guide"] = text(guide)
    return tensors


def error_of(tensors, **options):
    with pytest.raises(ValueError) as raised:
        convert_request(tensors, decoupled=True, **options)
    return str(raised.value)


def test_the_guide_types_are_the_engines():
    assert set(GUIDES) == set(GUIDE_TYPES)


@pytest.mark.parametrize("guide_type", list(GUIDES))
def test_every_guide_type_becomes_the_requests_guided_decoding(guide_type):
    [spec] = convert_request(guided(guide_type, GUIDES[guide_type]), decoupled=True)
    assert spec.guided_decoding == (guide_type, GUIDES[guide_type])
    request = to_executor_request(spec)
    assert request.guided_decoding == GuidedDecodingParams(guide_type, GUIDES[guide_type])
    assert request.input_token_ids == [5, 6, 7] and request.max_tokens == 4


def test_json_needs_no_guide_and_passes_one_it_gets():
    [spec] = convert_request(guided("json"), decoupled=True)
    assert to_executor_request(spec).guided_decoding == GuidedDecodingParams("json", None)
    [spec] = convert_request(guided("json", "{}"), decoupled=True)
    assert spec.guided_decoding == ("json", "{}")


@pytest.mark.parametrize("extra", [
    {},
    {"guided_decoding_guide_type": text(""), "guided_decoding_guide": text("")},
    {"guided_decoding_guide_type": text("")},
    {"guided_decoding_guide": text("")},
    {"guided_decoding_guide_type": np.zeros((1, 0), object), "guided_decoding_guide": np.zeros((1, 0), object)},
])
def test_absent_or_empty_inputs_are_no_guide(extra):
    [spec] = convert_request(minimal(**extra), decoupled=True)
    assert spec.guided_decoding is None and to_executor_request(spec).guided_decoding is None


def test_strings_arrive_as_bytes_or_str_and_one_dimensional():
    tensors = minimal(guided_decoding_guide_type=np.array([["regex"]], object),
                      guided_decoding_guide=np.array([r"[a-z]+".encode()], object))
    [spec] = convert_request(tensors, decoupled=True)
    assert spec.guided_decoding == ("regex", "[a-z]+")
    # non-ASCII guides stay intact
    [spec] = convert_request(guided("regex", "(oui|non|ja|nein|是|否)"), decoupled=True)
    assert spec.guided_decoding == ("regex", "(oui|non|ja|nein|是|否)")


def test_an_unknown_guide_type_names_the_input_the_value_and_the_allowed_ones():
    message = error_of(guided("yaml", "a: 1"))
    assert message == ("guided_decoding_guide_type value of 'yaml' is not supported; allowed: "
                       "json, json_schema, regex, ebnf_grammar, structural_tag")
    assert "'yaml'" in conversion_error_message("r1", ValueError(message))
    for wrong in ("JSON", " json", "json-schema", "grammar"):
        assert error_of(guided(wrong)).startswith(f"guided_decoding_guide_type value of '{wrong}' is not supported")
    long = "x" * 500  # a huge value is cut in the message
    assert len(error_of(guided(long))) < 250


@pytest.mark.parametrize("guide_type,what", [("json_schema", "a JSON schema"), ("regex", "a regular expression"),
                                             ("ebnf_grammar", "an EBNF grammar"),
                                             ("structural_tag", "a structural tag")])
def test_a_type_that_needs_a_guide_without_one_names_guided_decoding_guide(guide_type, what):
    for tensors in (guided(guide_type), guided(guide_type, "")):
        message = error_of(tensors)
        assert message.startswith(f"guided_decoding_guide is empty; guide type '{guide_type}' needs one ("), message
        assert what in message


def test_a_guide_without_a_type_is_refused_not_ignored():
    message = error_of(minimal(guided_decoding_guide=text(SCHEMA)))
    assert message.startswith("guided_decoding_guide was sent without guided_decoding_guide_type; ")
    assert "json, json_schema, regex, ebnf_grammar, structural_tag" in message
    message = error_of(minimal(guided_decoding_guide_type=text(""), guided_decoding_guide=text(r"\d+")))
    assert message.startswith("guided_decoding_guide was sent without")


def test_malformed_string_tensors():
    assert error_of(minimal(guided_decoding_guide_type=np.array([[b"regex", b"json"]], object),
                            guided_decoding_guide=text("a"))) == \
        "guided_decoding_guide_type holds 2 strings for item 0; send one string per item"
    assert "guided_decoding_guide of item 0 is not valid UTF-8" in error_of(
        minimal(guided_decoding_guide_type=text("regex"), guided_decoding_guide=np.array([[b"\xff\xfe"]], object)))


def test_each_batch_item_has_its_own_guide():
    tensors = {"input_ids": i32([5, 6], [7, 8]), "request_output_len": i32([4], [4]),
               "guided_decoding_guide_type": text("regex", ""),
               "guided_decoding_guide": text("[ab]+", "")}
    first, second = convert_request(tensors, decoupled=True)
    assert first.guided_decoding == ("regex", "[ab]+") and second.guided_decoding is None
    tensors["guided_decoding_guide_type"] = text("regex", "csv")
    assert error_of(tensors).startswith("guided_decoding_guide_type value of 'csv'")
    tensors["guided_decoding_guide_type"] = text("regex")  # one row for a batch of two
    assert error_of(tensors) == ("Expected batch size doesn't match batch size for tensor "
                                 "guided_decoding_guide_type. Expected 2 got 1")


def test_a_guided_request_through_the_ensemble(preprocess):
    client = {**E2E_CLIENT, "guided_decoding_guide_type": text("json_schema"), "guided_decoding_guide": text(SCHEMA)}
    tensors = ensemble_llm_tensors(preprocess, client)
    [spec] = convert_request(tensors, decoupled=True)
    assert spec.guided_decoding == ("json_schema", SCHEMA) and spec.stop_words


# ----------------------------------------------------------------------------- BLS


def test_the_bls_forwards_both_inputs_and_checks_them_first():
    assert all(LLM_INPUTS_FROM_REQUEST[name] == name for name in GUIDED_INPUTS)
    validate({**BLS_PLAIN, "guided_decoding_guide_type": text("json")})
    validate({**BLS_PLAIN, "guided_decoding_guide_type": text("regex"), "guided_decoding_guide": text("[0-9]+")})
    validate({**BLS_PLAIN, "guided_decoding_guide_type": text(""), "guided_decoding_guide": text("")})
    with pytest.raises(ValueError, match=r"^guided_decoding_guide_type value of 'xml' is not supported; allowed: json"):
        validate({**BLS_PLAIN, "guided_decoding_guide_type": text("xml")})
    with pytest.raises(ValueError, match=r"^guided_decoding_guide is empty; guide type 'ebnf_grammar'"):
        validate({**BLS_PLAIN, "guided_decoding_guide_type": text("ebnf_grammar")})


def _inputs(model):
    config = open(os.path.join(ROOT, f"all_models/{model}/config.pbtxt")).read().split("output [")[0]
    return {match.group(1): match.group(0) for match in re.finditer(r'\{\s*name: "(\w+)"[^}]*\}', config)}


@pytest.mark.parametrize("model,ragged", [("tensorrt_llm", True), ("ensemble", True), ("tensorrt_llm_bls", False)])
def test_configs_declare_the_references_inputs(model, ragged):
    """STRING [1], optional; ragged in tensorrt_llm and the ensemble, not in the BLS (as the reference)."""
    inputs = _inputs(model)
    for name in GUIDED_INPUTS:
        block = inputs[name]
        assert "data_type: TYPE_STRING" in block and re.search(r"dims: \[ 1 \]", block) and "optional: true" in block
        assert ("allow_ragged_batch: true" in block) == ragged, (model, name)


def test_the_ensemble_maps_both_inputs_to_tensorrt_llm():
    config = open(os.path.join(ROOT, "all_models/ensemble/config.pbtxt")).read()
    for name in GUIDED_INPUTS:
        assert re.search(rf'key: "{name}"\s*value: "{name}"', config)


# ----------------------------------------------------------------------------- executor parameters


def test_tensorrt_llm_template_has_the_parameters():
    config = open(os.path.join(ROOT, "all_models/tensorrt_llm/config.pbtxt")).read()
    for name in ("guided_decoding_backend", "tokenizer_dir", "grammar_cache_size", "xgrammar_tokenizer_info_path"):
        assert re.search(rf'key: "{name}"\s*value: \{{\s*string_value: "\$\{{{name}\}}"', config), name


@pytest.mark.parametrize("value", [None, "", "  ", "${guided_decoding_backend}"])
def test_unset_backend_leaves_guided_decoding_off(value):
    params = {"tokenizer_dir": "/tok", "grammar_cache_size": "8"}
    if value is not None:
        params["guided_decoding_backend"] = value
    assert guided_decoding_settings(params) == {}
    settings = executor_settings(params, {})
    assert not {"guided_decoding_backend", "tokenizer_dir", "grammar_cache_size"} & set(settings)


def test_xgrammar_turns_it_on_with_the_tokenizer_and_cache_size(tmp_path):
    params = {"guided_decoding_backend": "XGrammar", "tokenizer_dir": str(tmp_path), "grammar_cache_size": "64"}
    assert executor_settings(params, {}) == {"guided_decoding_backend": "xgrammar", "tokenizer_dir": str(tmp_path),
                                             "grammar_cache_size": 64}
    # tokenizer_dir left unset: the engine directory's tokenizer (None here), cache size the default
    assert guided_decoding_settings({"guided_decoding_backend": "xgrammar", "tokenizer_dir": "${tokenizer_dir}"}) == \
        {"guided_decoding_backend": "xgrammar", "tokenizer_dir": None, "grammar_cache_size": None}


@pytest.mark.parametrize("value", ["outlines", "lm-format-enforcer", "true"])
def test_another_backend_fails_the_load_naming_the_allowed_one(value):
    with pytest.raises(ValueError) as raised:
        executor_settings({"guided_decoding_backend": value}, {})
    assert str(raised.value) == (f"guided_decoding_backend value of '{value}' is not supported; allowed: xgrammar "
                                 "(or leave it unset: no guided decoding)")
    assert GUIDED_DECODING_BACKENDS == ("xgrammar",)


def test_no_tokenizer_anywhere_fails_the_load_with_the_references_text(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    params = {"guided_decoding_backend": "xgrammar", "gpt_model_path": str(engine)}
    with pytest.raises(ValueError) as raised:
        guided_decoding_settings(params)
    assert str(raised.value).startswith(NEEDS_TOKENIZER) and str(engine) in str(raised.value)
    (engine / "tokenizer.json").write_text("{}")
    assert guided_decoding_settings(params)["tokenizer_dir"] is None  # the engine's own files serve


def test_settings_reach_the_executor_config(tmp_path):
    from engine.executor.executor import ExecutorConfig

    fields = {field.name for field in dataclasses.fields(ExecutorConfig)}
    assert {"guided_decoding_backend", "tokenizer_dir", "grammar_cache_size"} <= fields
    settings = executor_settings({"guided_decoding_backend": "xgrammar", "tokenizer_dir": str(tmp_path),
                                  "grammar_cache_size": "32"}, {})
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert (config.guided_decoding_backend, config.tokenizer_dir, config.grammar_cache_size) == \
        ("xgrammar", str(tmp_path), 32)
    assert ignored == []
    config, _ = to_executor_config(ExecutorConfig, executor_settings({}, {}))
    assert config.guided_decoding_backend is None and config.tokenizer_dir is None
    assert config.grammar_cache_size == 512


def test_make_serve_and_the_test_servers_turn_it_on(tmp_path):
    """scripts/serve_default.py fills the repository of `make serve` and of the integration tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_default_under_test",
                                                  os.path.join(ROOT, "scripts", "serve_default.py"))
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    values = serve.default_substitutions(str(tmp_path))["tensorrt_llm"]
    assert values["guided_decoding_backend"] == "xgrammar" and values["tokenizer_dir"] == str(tmp_path)
