"""Qwen (v1)'s tiktoken tokenizer, converted at build from the directory's ``qwen.tiktoken`` (its
remote code is not run, engine/tiktoken_vocab.py), and served through the `preprocessing` and
`postprocessing` models as `tritonllm serve` fills them (tokenizer_dir = the engine directory).

The vocabulary is a tiny one made here by byte-pair training (tests/engine/tiktoken_testing.py),
and the oracle is tiktoken's encoding written out in plain Python: ids equal for English, digits
(one per piece in Qwen's pattern), runs of whitespace and newlines, CJK, emoji, text that NFC
changes, and special tokens inside text."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest

from decoder_testing import write_qwen1_checkpoint
from tiktoken_testing import tiktoken_encode, train_ranks, write_tiktoken

from engine.tiktoken_vocab import QWEN_SPECIAL_TOKENS, TiktokenVocabError, qwen1_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["The quick brown fox jumps over the lazy dog 2026!!", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>",
         "混合文本：你好，世界。 🙂🙂 café", "cafe\u0301 e\u0301", "   indented\n\n\nlines  \t tabs", "it's THE dog'S 12345",
         "<|endoftext|><|extra_204|>"]


@pytest.fixture(scope="module")
def ranks():
    return train_ranks()


@pytest.fixture(scope="module")
def engine_dir(ranks, tmp_path_factory):
    """A Qwen (v1) directory as the hub ships it (remote-code config and tokenizer_config naming
    QWenTokenizer, qwen.tiktoken beside them) built by engine.build's command line."""
    from engine.build import main

    checkpoint = tmp_path_factory.mktemp("qwen1_ckpt")
    write_qwen1_checkpoint(checkpoint)
    write_tiktoken(checkpoint / "qwen.tiktoken", ranks)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "QWenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    engine = tmp_path_factory.mktemp("qwen1_engine")
    assert main(["--checkpoint", str(checkpoint), "--output", str(engine), "--dtype", "float32"]) == 0
    return str(engine)


def test_the_converted_vocabulary_encodes_as_tiktoken_does(ranks, tmp_path):
    write_tiktoken(tmp_path / "qwen.tiktoken", ranks)
    tokenizer = qwen1_tokenizer(str(tmp_path))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == tiktoken_encode(text, ranks), text
        assert tokenizer.decode(ids) == tiktoken_decode(ids, ranks)
    assert [tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS] == \
        list(range(len(ranks), len(ranks) + len(QWEN_SPECIAL_TOKENS)))
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token_id == len(ranks)
    assert qwen1_tokenizer(str(tmp_path / "elsewhere")) is None  # no qwen.tiktoken: not this tokenizer


def tiktoken_decode(ids, ranks) -> str:
    by_id = {rank: token for token, rank in ranks.items()}
    by_id.update({len(ranks) + i: t.encode() for i, t in enumerate(QWEN_SPECIAL_TOKENS)})
    return b"".join(by_id[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("line,message", [(b"not-base64!! 0\n", "line 1"), (b"YQ== 0\nYg== 0\n", "not 0 .. 1"),
                                          (b"YQ==\n", "line 1: expected two fields")])
def test_a_malformed_tiktoken_file_is_named(tmp_path, line, message):
    (tmp_path / "qwen.tiktoken").write_bytes(line)
    with pytest.raises(TiktokenVocabError, match=message) as raised:
        qwen1_tokenizer(str(tmp_path))
    assert "qwen.tiktoken" in str(raised.value)


def _triton_model(name: str, engine_dir: str, monkeypatch, **parameters):
    """all_models/<name>/1/model.py initialized as Triton would, its tokenizer_dir the engine
    directory (tritonllm serve's repository), under a stand-in for triton_python_backend_utils."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.get_input_tensor_by_name = lambda request, key: (
        types.SimpleNamespace(as_numpy=lambda: request[key]) if key in request else None)
    stub.triton_string_to_numpy = lambda kind: {"TYPE_INT32": np.int32, "TYPE_STRING": np.object_,
                                                "TYPE_FP32": np.float32}[kind]
    stub.get_output_config_by_name = lambda config, key: {"data_type": "TYPE_FP32" if key in (
        "EMBEDDING_BIAS", "PIXEL_VALUES") else "TYPE_INT32"}
    stub.Tensor = lambda key, value: (key, value)
    stub.InferenceResponse = lambda output_tensors=(), error=None: types.SimpleNamespace(
        outputs=dict(output_tensors), error=error)
    stub.TritonError = str
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    spec = importlib.util.spec_from_file_location(f"{name}_model_under_test",
                                                  os.path.join(ROOT, "all_models", name, "1", "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "start_server_watchdog", lambda: None)  # no server process to watch here
    model = module.TritonPythonModel()
    params = {"tokenizer_dir": engine_dir, **parameters}
    model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})})
    return model


def test_served_text_goes_through_preprocessing_and_postprocessing(engine_dir, ranks, tmp_path, monkeypatch):
    from tritonllm.serve import prepare_model_repo

    repo = prepare_model_repo(engine_dir, str(tmp_path / "repo"))
    for name in ("preprocessing", "postprocessing"):  # tritonllm serve points both at the engine directory
        assert f'string_value: "{engine_dir}"' in open(os.path.join(repo, name, "config.pbtxt")).read()
    pre = _triton_model("preprocessing", engine_dir, monkeypatch, add_special_tokens="True")
    post = _triton_model("postprocessing", engine_dir, monkeypatch, skip_special_tokens="True")
    queries = [TEXTS[0], TEXTS[2], TEXTS[4]]
    response, = pre.execute([{"QUERY": np.array([[q.encode()] for q in queries], dtype=object),
                              "REQUEST_OUTPUT_LEN": np.array([[8]] * 3, dtype=np.int32)}])
    assert response.error is None, response.error
    ids, lengths = response.outputs["INPUT_ID"], response.outputs["REQUEST_INPUT_LEN"][:, 0]
    for row, query in enumerate(queries):
        assert ids[row, :lengths[row]].tolist() == tiktoken_encode(query, ranks)
    assert response.outputs["OUT_END_ID"].ravel().tolist() == [len(ranks)] * 3  # <|endoftext|>
    # The generated ids come back as text: an <|endoftext|> and padding after them are dropped.
    generated = [ids[row, :lengths[row]].tolist() + [len(ranks)] for row in range(3)]
    width = max(map(len, generated))
    tokens = np.array([[g + [len(ranks)] * (width - len(g))] for g in generated], dtype=np.int32)
    response, = post.execute([types.SimpleNamespace(
        inputs=lambda: [types.SimpleNamespace(name=lambda n=n: n, as_numpy=lambda v=v: v) for n, v in (
            ("TOKENS_BATCH", tokens), ("SEQUENCE_LENGTH", np.array([[len(g)] for g in generated], dtype=np.int32)))])])
    assert response.error is None, response.error
    assert [text.decode() for text in response.outputs["OUTPUT"]] == queries
