"""LoRA adapters served by model name (``--lora_modules``): the flag's two forms and its errors,
/v1/models, and the three inputs a request for an adapter sends, read back from the gRPC request
the real TritonClient builds (its stub replaced by a fake Triton that records the requests)."""
import asyncio
import json
import math
import zlib

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from openai_frontend.__main__ import config_from_arguments, main, parse_arguments
from openai_frontend.app import FRONTEND, FrontendConfig, create_app
from openai_frontend.lora_modules import LoraModule, lora_id, parse_lora_modules

BASE = "base"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = [{"role": "user", "content": "Hi"}]
LORA_INPUTS = ("lora_id", "lora_name", "lora_path")


def adapter_dir(root, name):
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return path


@pytest.fixture
def adapters(tmp_path):
    return adapter_dir(tmp_path, "sql"), adapter_dir(tmp_path, "chat")


# ----------------------------------------------------------------------------- the flag

def test_ids_are_stable_and_above_user_task_ids():
    assert lora_id("sql") == (1 << 62) | zlib.crc32(b"sql") == lora_id("sql")
    assert 2**62 <= lora_id("sql") < 2**63 and lora_id("sql") != lora_id("chat")


def test_both_forms_in_flag_order(adapters):
    sql, chat = adapters
    json_item = json.dumps({"name": "chat-lora", "path": str(chat), "base_model_name": BASE})
    modules = parse_lora_modules([f"sql-lora={sql}", json_item], BASE)
    assert list(modules) == ["sql-lora", "chat-lora"]
    assert modules["sql-lora"] == LoraModule("sql-lora", str(sql), lora_id("sql-lora"))
    assert modules["chat-lora"].path == str(chat)
    assert parse_lora_modules([], BASE) == {}


def test_relative_paths_become_absolute(adapters, monkeypatch):
    sql, _ = adapters
    monkeypatch.chdir(sql.parent)
    assert parse_lora_modules(["a=sql"], BASE)["a"].path == str(sql)


@pytest.mark.parametrize("items,words", [
    (["sql"], "expected name=path"),
    (["={sql}"], "name is empty"),
    (["a="], "path is empty"),
    (["a={sql}", "a={chat}"], "'a' is given twice"),
    ([f"{BASE}={{sql}}"], "the served model's"),
    (["a={sql}/missing"], "is not a directory"),
    (["a={sql}/.."], "no adapter_config.json"),
    (['{{"name": "a"'], "not valid JSON"),
    (['{{"name": "a", "path": "{sql}", "rank": 8}}'], "unknown key 'rank'"),
    (['{{"name": "a", "path": 1}}'], "path must be a string"),
    (['{{"name": "a", "path": "{sql}", "base_model_name": "other"}}'], "not the served model 'base'"),
])
def test_bad_items_name_the_flag_and_the_item(adapters, items, words):
    sql, chat = adapters
    items = [item.format(sql=sql, chat=chat) for item in items]
    with pytest.raises(ValueError) as raised:
        parse_lora_modules(items, BASE)
    message = str(raised.value)
    assert message.startswith("--lora_modules ") and repr(items[-1]) in message and words in message


def test_the_command_line_fills_the_config_and_refuses_a_bad_item(adapters, engine_dir):
    sql, _ = adapters
    args = parse_arguments(["--tokenizer_dir", engine_dir, "--served_model_name", BASE,
                            "--lora_modules", f"sql={sql}", json.dumps({"name": "j", "path": str(sql)})])
    assert list(config_from_arguments(args).lora_modules) == ["sql", "j"]
    with pytest.raises(SystemExit) as raised:
        main(["--tokenizer_dir", engine_dir, "--served_model_name", BASE, "--lora_modules", f"{BASE}={sql}"])
    assert "--lora_modules" in str(raised.value.code) and "served model" in str(raised.value.code)


# ----------------------------------------------------------------------------- through the app

class FakeStream:
    """One ModelStreamInfer call: records the request, answers ``responses`` and the final one."""

    def __init__(self, requests, sink: list, responses: list):
        self.requests, self.sink, self.responses = requests, sink, responses

    async def _answers(self):
        self.sink.append(await anext(self.requests))
        await self.requests.aclose()
        for response in self.responses:
            yield response
        final = service_pb2.ModelStreamInferResponse()
        final.infer_response.parameters["triton_final_response"].bool_param = True
        yield final

    def __aiter__(self):
        return self._answers()

    def cancel(self):
        pass


class FakeStub:
    def __init__(self, responses: list):
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.responses = responses

    def ModelStreamInfer(self, requests):  # noqa: N802 (the gRPC method's name)
        return FakeStream(requests, self.requests, self.responses)


def response_of(outputs: dict[str, np.ndarray]) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelStreamInferResponse()
    for name, array in outputs.items():
        datatype = "BYTES" if array.dtype == object else {np.int32: "INT32", np.float32: "FP32"}[array.dtype.type]
        response.infer_response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        raw = serialize_byte_tensor(array).item() if array.dtype == object else array.tobytes()
        response.infer_response.raw_output_contents.append(raw)
    return response


def canned_reply(direct: bool, tokenizer) -> list:
    """"Paris." as the entry model streams it: ids on the direct path, text (and one log-prob per
    token, the frontend's token count) from the BLS or the ensemble."""
    ids = tokenizer.encode("Paris.", add_special_tokens=False)
    if direct:
        return [response_of({"output_ids": np.array([[ids]], np.int32)})]
    return [response_of({"text_output": np.array([[b"Paris."]], dtype=object),
                         "output_log_probs": np.zeros((1, 1, len(ids)), np.float32)})]


def tensors(request: service_pb2.ModelInferRequest) -> dict[str, tuple[str, list[int], list]]:
    """name -> (datatype, shape, values) of every input of a built request."""
    out = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents):
        if tensor.datatype == "BYTES":
            values = deserialize_bytes_tensor(raw).tolist()
        else:
            values = np.frombuffer(raw, triton_to_np_dtype(tensor.datatype)).tolist()
        out[tensor.name] = (tensor.datatype, list(tensor.shape), values)
    return out


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, byte_level_tokenizer):
    path = tmp_path_factory.mktemp("lora_engine")
    byte_level_tokenizer.chat_template = CHATML
    byte_level_tokenizer.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"build": {"max_input_len": 4096, "max_seq_len": 8192}}))
    return str(path)


def serve(engine_dir, adapters, body, triton_model="tensorrt_llm"):
    """Runs ``body(client, stub)`` against the app, its real TritonClient talking to a FakeStub."""
    sql, chat = adapters
    lora_modules = parse_lora_modules([f"sql-lora={sql}", f"chat-lora={chat}"], BASE)

    async def run():
        config = FrontendConfig(grpc_url="127.0.0.1:1", tokenizer_dir=engine_dir, served_model_name=BASE,
                                triton_model=triton_model, lora_modules=lora_modules)
        app = create_app(config)
        async with TestClient(TestServer(app)) as client:
            frontend = app[FRONTEND]
            stub = FakeStub(canned_reply(frontend.client.direct, frontend.prompts.tokenizer))
            frontend.client._stub = stub
            frontend.client._ready_until = math.inf  # no readiness calls to a server that is not there
            return await body(client, stub)
    return asyncio.run(run())


def test_models_lists_the_base_then_each_adapter(engine_dir, adapters):
    sql, chat = adapters

    async def body(client, stub):
        listed = await (await client.get("/v1/models")).json()
        one = await (await client.get("/v1/models/sql-lora")).json()
        base = await (await client.get(f"/v1/models/{BASE}")).json()
        missing = await client.get("/v1/models/nope")
        return listed, one, base, missing.status, await missing.json()
    listed, one, base, status, missing = serve(engine_dir, adapters, body)
    cards = listed["data"]
    assert [card["id"] for card in cards] == [BASE, "sql-lora", "chat-lora"]
    assert set(cards[0]) == {"id", "object", "created", "owned_by"} and cards[0] == base
    assert cards[1] == {**base, "id": "sql-lora", "root": str(sql), "parent": BASE} == one
    assert cards[2]["root"] == str(chat) and cards[2]["parent"] == BASE
    assert status == 404 and missing["error"]["code"] == "model_not_found"


def test_an_unknown_model_is_a_404_listing_every_served_model(engine_dir, adapters):
    async def body(client, stub):
        response = await client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"})
        return response.status, await response.json(), stub.requests
    status, body, sent = serve(engine_dir, adapters, body)
    error = body["error"]
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert "`gpt-4o`" in error["message"] and all(f"`{name}`" in error["message"]
                                                  for name in (BASE, "sql-lora", "chat-lora"))
    assert sent == []


@pytest.mark.parametrize("triton_model", ["tensorrt_llm", "tensorrt_llm_bls", "ensemble"])
def test_an_adapter_request_sends_its_three_inputs_and_echoes_its_name(engine_dir, adapters, triton_model):
    sql, _ = adapters

    async def body(client, stub):
        completion = await (await client.post("/v1/completions", json={
            "model": "sql-lora", "prompt": "The capital of France is", "max_tokens": 8, "n": 2})).json()
        chat = await (await client.post("/v1/chat/completions", json={"model": "sql-lora", "messages": USER,
                                                                      "max_tokens": 8})).json()
        base = await (await client.post("/v1/completions", json={"model": BASE, "prompt": "x",
                                                                  "max_tokens": 8})).json()
        return completion, chat, base, stub.requests
    completion, chat, base, sent = serve(engine_dir, adapters, body, triton_model)
    assert completion["model"] == chat["model"] == "sql-lora" and base["model"] == BASE
    assert [c["text"] for c in completion["choices"]] == ["Paris."] * 2
    assert chat["choices"][0]["message"]["content"] == "Paris."
    assert [request.model_name for request in sent] == [triton_model] * 4
    expected = {"lora_id": ("UINT64", [1, 1], [lora_id("sql-lora")]),
                "lora_name": ("BYTES", [1, 1], [b"sql-lora"]),
                "lora_path": ("BYTES", [1, 1], [str(sql).encode()])}
    for request in sent[:3]:  # both choices of the completion, then the chat
        inputs = tensors(request)
        assert {name: inputs[name] for name in LORA_INPUTS} == expected
    assert not set(LORA_INPUTS) & set(tensors(sent[3]))  # the base model: no adapter


def test_a_streamed_chat_for_an_adapter_names_it_in_every_chunk(engine_dir, adapters):
    async def body(client, stub):
        response = await client.post("/v1/chat/completions", json={
            "model": "chat-lora", "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
        return await response.text(), stub.requests
    text, sent = serve(engine_dir, adapters, body)
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and all(chunk["model"] == "chat-lora" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Paris."
    assert tensors(sent[0])["lora_name"][2] == [b"chat-lora"]
