"""The LLM-API model repository (all_models/llmapi) on a real tritonserver: model.yaml points at the
session's SmolLM2 engine directory (``python -m engine.build`` of the embedded .gguf: tests/conftest.py),
served as it is, nothing built, and the anchor's documented requests answer (generate with sampling_param_max_tokens, with perf
metrics, generate_stream), stop strings cut the text, unsupported inputs are refused by name, and
a bad model.yaml value fails the load naming the key."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import threading
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

from triton_helpers import ROOT, Server, chat, free_port, load_script, stop, write_peft_adapter

PROMPT = chat("What is the capital of France?")
ENGINE_OPTIONS = "dtype: float32\nmax_batch_size: 4\nmax_seq_len: 1024\nmax_num_tokens: 2048\n"


LORA = "enable_lora: true\nlora_config:\n  max_lora_rank: 8\n  max_loras: 2\n"
# n-gram drafts (greedy ids stay plain decoding's, so every text check below still holds)
NGRAM = "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n  max_matching_ngram_size: 3\n"


def model_yaml(model: str, extra: str = "") -> str:
    """model.yaml of `model`; the build options (ENGINE_OPTIONS) only for a checkpoint (an engine
    directory is served with the options it was built with)."""
    options = "" if os.path.isdir(model) else ENGINE_OPTIONS
    return (f"model: {model}\nbackend: pytorch\ntensor_parallel_size: 1\npipeline_parallel_size: 1\n"
            f"{options}kv_cache_config:\n  enable_block_reuse: true\n{extra}"
            "triton_config:\n  max_batch_size: 0\n  decoupled: true\n")


def instances(count: int, gpu_device_ids: str | None = None):
    """config.pbtxt with `count` instances (and gpu_device_ids when given)."""
    def edit(text: str) -> str:
        group = "instance_group [\n  {\n    count: "
        assert group + "1\n" in text
        text = text.replace(group + "1\n", f"{group}{count}\n", 1)
        if gpu_device_ids is not None:
            text += f'parameters: {{ key: "gpu_device_ids" value: {{ string_value: "{gpu_device_ids}" }} }}\n'
        return text
    return edit


@contextmanager
def llmapi_server(work: Path, yaml_text: str, expect_ready: bool = True, edit_config=None, beside=None):
    """Serve a copy of all_models/llmapi with `yaml_text` as model.yaml (and config.pbtxt passed
    through `edit_config`, a text -> text function, when given); yields (Server, process). `beside`:
    {model name: (yaml_text, edit_config)}, more copies of the LLM-API model in the same repository."""
    serve, launcher = load_script("serve_default"), load_script("launch_triton_server")
    repo = work / "repo"
    shutil.copytree(ROOT / "all_models" / "llmapi", repo, ignore=shutil.ignore_patterns("__pycache__"))
    for name in beside or {}:
        shutil.copytree(repo / "tensorrt_llm", repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "tensorrt_llm"', f'name: "{name}"', 1))
    for name, (text, edit) in {"tensorrt_llm": (yaml_text, edit_config), **(beside or {})}.items():
        (repo / name / "1" / "model.yaml").write_text(text)
        if edit is not None:
            config = repo / name / "config.pbtxt"
            config.write_text(edit(config.read_text()))
    ports = [str(free_port()) for _ in range(3)]
    args = launcher.parse_arguments([f"--model_repo={repo}", "--no-mpi", "--host=127.0.0.1", "--force",
                                     f"--http_port={ports[0]}", f"--grpc_port={ports[1]}",
                                     f"--metrics_port={ports[2]}", f"--cache_dir={work / 'cache'}"])
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = launcher.launch(args, stdout=log, stderr=log)
    try:
        if expect_ready and not serve.wait_until_ready(process, ports[0], timeout=300):
            pytest.fail(f"tritonserver did not become ready:\n{log_path.read_text()[-5000:]}")
        yield Server(http=f"http://127.0.0.1:{ports[0]}", grpc_url=f"127.0.0.1:{ports[1]}",
                     metrics=f"http://127.0.0.1:{ports[2]}", log_path=log_path, pid=process.pid), process
    finally:
        stop(process)


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    """An empty engine cache the module's servers inherit: nothing may be built into it (the engine
    directory is served as it is), and were anything built, it would land in tmp."""
    cache = tmp_path_factory.mktemp("tritonllm_cache")
    old = os.environ.get("TRITONLLM_CACHE")
    os.environ["TRITONLLM_CACHE"] = str(cache)
    yield cache
    if old is None:
        del os.environ["TRITONLLM_CACHE"]
    else:
        os.environ["TRITONLLM_CACHE"] = old


@pytest.fixture(scope="module")
def llmapi(smollm2_engine_dir, engine_cache, tmp_path_factory):
    """The module's server: two instances without gpu_device_ids (they share one engine), so every
    request below goes through whichever instance Triton picks (a stop request may reach the other
    one). One server for what took two (~12 s of CI). model.yaml names the session's engine directory:
    until 2026-12-01 it named the .gguf and the server built its engine into the cache at load (~8 s
    of a quiet 2-core machine, 25-43 worker-s of make test under load); the command line's GGUF build is
    now the session engine's own (tests/conftest.py smollm2_engine_dir), and a checkpoint built into the
    cache at load and reused by a second start is test_serve_checkpoint.py's (the same
    serving/engine_cache.py ensure_checkpoint_engine)."""
    with llmapi_server(tmp_path_factory.mktemp("llmapi"), model_yaml(smollm2_engine_dir, LORA + NGRAM),
                       edit_config=instances(2)) as (server, _):
        yield server


def generate(server, body, stream=False):
    response = server.generate("tensorrt_llm", body, stream=stream)
    if stream:
        assert response.status_code == 200, response.text
        events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
        errors = [event for event in events if "error" in event]
        assert not errors, errors
        return events
    return response


REPEATED = "one two three four five six seven eight nine ten"
SHORT = {"text_input": PROMPT, "sampling_param_max_tokens": 8}  # "Paris" comes within 8 tokens
STOP = "Paris"
LORA_BODY = {"text_input": "Once upon a time", "sampling_param_max_tokens": 4, "return_cumulative_logprob": True}
UNSUPPORTED = {"image_url": {"image_url": ["https://example.com/cat.png"]},
               "sampling_param_best_of": {"sampling_param_best_of": 2}}


@pytest.fixture(scope="module")
def replies(llmapi):
    """The requests of the tests below that end by themselves and are checked each on its own or against
    each other's text (not their log-probs), sent at once when the first test asks, all answered before it
    reads its own (so none runs beside the stop request's stream or the two instances' requests): {test:
    [answers]}. Either instance takes any of them (one engine). One after another (each test's own
    requests at once), they took ~8 s of CI's make test (2026-11-30)."""
    stopped = {**SHORT, "sampling_param_stop": [STOP]}
    sends = {
        "documented": [partial(generate, llmapi, {**SHORT, "return_finish_reason": True, "return_stop_reason": True})],
        "perf": [partial(generate, llmapi, {**SHORT, "sampling_param_return_perf_metrics": True})],
        "ngram": [partial(generate, llmapi, {"text_input": chat(f"Repeat exactly, three times: {REPEATED}"),
                                             "sampling_param_max_tokens": 48,
                                             "sampling_param_return_perf_metrics": True})],
        "stream": [partial(generate, llmapi, SHORT),
                   partial(generate, llmapi, {**SHORT, "streaming": True, "return_finish_reason": True}, stream=True)],
        "stop": [partial(generate, llmapi, SHORT),
                 partial(generate, llmapi, {**stopped, "return_finish_reason": True, "return_stop_reason": True}),
                 partial(generate, llmapi, {**stopped, "streaming": True, "return_stop_reason": True}, stream=True)],
        "ours": [partial(generate, llmapi, SHORT)],
        **{f"unsupported_{name}": [partial(generate, llmapi, {**SHORT, "sampling_param_max_tokens": 4, **extra})]
           for name, extra in UNSUPPORTED.items()},
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
        futures = {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}
        return {test: [future.result() for future in test_futures] for test, test_futures in futures.items()}


def test_generate_answers_the_documented_request_from_the_engine_directory_as_it_is(replies, llmapi, engine_cache,
                                                                                     smollm2_engine_dir):
    response, = replies["documented"]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "tensorrt_llm"
    assert "Paris" in body["text_output"], body
    assert not body["text_output"].startswith("<|im_start|>")  # generated text only
    assert body["finish_reason"] in ("stop", "length") and body["stop_reason"] == "None"
    assert not (engine_cache / "engines").exists()  # nothing built: the engine directory as it is
    assert f"serving {smollm2_engine_dir} with engine {smollm2_engine_dir}" in llmapi.log(), llmapi.log()[-3000:]


def test_perf_metrics_come_from_the_executor(replies):
    body = replies["perf"][0].json()
    for name in ("kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks",
                 "kv_cache_alloc_total_blocks", "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns",
                 "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
                 "total_draft_tokens"):
        assert name in body, (name, body)
    value = {name: body[name][0] if isinstance(body[name], list) else body[name] for name in body}
    assert 0 < value["arrival_time_ns"] <= value["first_scheduled_time_ns"] <= value["first_token_time_ns"] \
        <= value["last_token_time_ns"]
    assert value["kv_cache_alloc_total_blocks"] >= 1
    assert value["kv_cache_reused_block"] + value["kv_cache_missed_block"] >= 1
    # speculative_config NGram: the executor's draft counts come through (8 tokens: drafts only where
    # the answer repeats a span; the counts must agree with the rate whatever they are)
    drafted, accepted = value["total_draft_tokens"], value["total_accepted_draft_tokens"]
    assert 0 <= accepted <= drafted
    assert value["acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)


def test_ngram_drafts_from_speculative_config_are_verified_and_counted(replies):
    """A prompt whose answer copies it (REPEATED, three times): n-gram drafts are proposed and accepted."""
    body = replies["ngram"][0].json()
    value = {name: body[name][0] if isinstance(body[name], list) else body[name] for name in body}
    assert value["total_draft_tokens"] > 0 and value["total_accepted_draft_tokens"] > 0, body


def test_stream_adds_up_to_the_unary_text(replies):
    unary, events = replies["stream"]  # (as true at 8 tokens as at 24)
    unary = unary.json()["text_output"]
    assert len(events) > 2
    assert "".join(event["text_output"] for event in events) == unary
    assert events[-1]["finish_reason"] in ("stop", "length")
    assert all(event["finish_reason"] == "None" for event in events[:-1])


def test_stop_string_ends_the_text_before_it(replies):
    stop = STOP
    unary, stopped, events = replies["stop"]
    unary, stopped = unary.json()["text_output"], stopped.json()
    assert stop in unary
    expected = unary[:unary.index(stop)]
    assert stopped["text_output"] == expected
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert "".join(event["text_output"] for event in events) == expected
    assert events[-1]["stop_reason"] == stop


def test_greedy_text_equals_the_ensembles(replies, triton_server):
    """The five-model repository (the session's server, on the same engine directory) gives the same
    greedy text for the same prompt (its preprocessing/postprocessing tokenize and detokenize; here the
    LLM-API model does, with the engine directory's tokenizer). Until 2026-11-30 a second tritonserver of its own served the
    cached engine for this one request (~9-11 s of CI's make test)."""
    ours = replies["ours"][0].json()["text_output"]
    theirs = triton_server.generate("ensemble", {"text_input": PROMPT, "max_tokens": 8,
                                                 "exclude_input_in_output": True}).json()["text_output"]
    assert ours == theirs


def test_a_stop_request_ends_a_stream_and_cumulative_logprob_comes_back(llmapi):
    events, first = [], threading.Event()

    def read():
        response = llmapi.generate("tensorrt_llm", {"id": "llmapi-stop", "text_input": PROMPT, "streaming": True,
                                                    "sampling_param_max_tokens": 400, "sampling_param_temperature": 1.0,
                                                    "sampling_param_top_k": 50, "return_finish_reason": True,
                                                    "return_cumulative_logprob": True}, stream=True)
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
                first.set()
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    stop = llmapi.generate("tensorrt_llm", {"id": "llmapi-stop", "text_input": "", "stop": True})
    assert stop.status_code == 200, stop.text
    reader.join(60)
    assert not reader.is_alive() and events and len(events) < 400
    assert events[-1]["finish_reason"] == "cancelled", events[-1]
    assert all(event["cumulative_logprob"] <= 0 for event in events if "cumulative_logprob" in event)


def test_a_lora_adapter_named_by_lora_id_name_and_path_changes_the_text(llmapi, smollm2_engine_dir, tmp_path):
    adapter = write_peft_adapter(smollm2_engine_dir, tmp_path / "r8", rank=8, seed=8)
    # 4 tokens: a random rank-8 adapter moves the logprob from the first token on. The base request runs
    # alone, as the adapted one does (not among replies' twelve): in a step of another batch size its logprob
    # could differ in the last bits without any adapter, and the test would pass with the adapter ignored.
    body = LORA_BODY
    base = generate(llmapi, body).json()
    lora = {"lora_id": 7, "lora_name": "r8", "lora_path": str(adapter)}
    adapted = generate(llmapi, {**body, **lora})
    assert adapted.status_code == 200, adapted.text
    adapted = adapted.json()
    assert (adapted["text_output"], adapted["cumulative_logprob"]) != (base["text_output"], base["cumulative_logprob"])
    refused = generate(llmapi, {**body, **lora, "lora_ckpt_source": "nemo"})
    assert refused.status_code != 200 and "lora_ckpt_source" in refused.json()["error"]


@pytest.mark.parametrize("named", list(UNSUPPORTED))
def test_unsupported_inputs_are_refused_by_name(replies, named):
    response, = replies[f"unsupported_{named}"]
    assert response.status_code != 200
    assert named in response.json()["error"]


def test_two_instances_without_gpu_device_ids_share_one_engine_and_answer(llmapi):
    """Triton names them tensorrt_llm_0_0 and tensorrt_llm_0_1 (the names gpu_device_ids is
    matched by); without gpu_device_ids both relay one engine's responses (no stub holds torch: the
    stub test below)."""
    bodies = [{"text_input": PROMPT, "sampling_param_max_tokens": 8} for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda body: generate(llmapi, body), bodies))
    assert all(response.status_code == 200 for response in responses), [r.text for r in responses]
    texts = {response.json()["text_output"] for response in responses}
    assert len(texts) == 1 and "Paris" in texts.pop()
    log = llmapi.log()
    for name in ("tensorrt_llm_0_0", "tensorrt_llm_0_1"):
        assert f"tensorrt_llm (LLM-API) instance {name}: serving" in log, log[-3000:]
    assert "on GPU(s)" not in log  # no gpu_device_ids: the shared engine


def test_the_llmapi_stub_served_everything_above_without_torch(llmapi):
    """model.yaml names its dtype, so the stub never asks torch for CUDA; the engine runs in its own
    process: no torch in the stub (~1.5 CPU-s and ~250 MiB per instance at start), and none imported
    later by a response, stats or LoRA message (an import on the stub's reader thread held streamed
    tokens back for seconds, commit dc8bee8). Runs after the requests above, in this module's order."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, stubs = [llmapi.pid], {}
    while tree:
        pid = tree.pop()
        tree += children.get(pid, [])
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a short-lived child gone since the scan above (make test saw one): not a stub
            continue
        if "triton_python_backend_stub" in command and "/tensorrt_llm/" in command:
            stubs[pid] = Path(f"/proc/{pid}/maps").read_text()
    assert len(stubs) == 2, stubs.keys()  # the module server's two instances
    assert not [pid for pid, maps in stubs.items() if "libtorch" in maps]


@pytest.fixture(scope="module")
def failed_loads_log(smollm2_gguf, engine_cache, tmp_path_factory) -> str:
    """The log of one server whose two LLM-API models both fail to load (a model that fails at start
    ends tritonserver once every load has ended): `tensorrt_llm` with tensor_parallel_size 2 on a
    server started without --world_size 2, and `tensorrt_llm_placed` with two instances and
    gpu_device_ids for three. One failed start for the two refusals."""
    tp2 = model_yaml(smollm2_gguf).replace("tensor_parallel_size: 1", "tensor_parallel_size: 2")
    beside = {"tensorrt_llm_placed": (model_yaml(smollm2_gguf), instances(2, "0;1;2"))}
    with llmapi_server(tmp_path_factory.mktemp("failed_loads"), tp2, expect_ready=False,
                       beside=beside) as (server, process):
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        return server.log()


def test_a_bad_model_yaml_value_fails_the_load_naming_the_key(failed_loads_log):
    """(triton_config differing from config.pbtxt fails the same way: tests/serving/test_llmapi.py)
    Here tensor_parallel_size 2 on a server started without --world_size 2: refused before any build."""
    log = failed_loads_log
    assert "model.yaml: tensor_parallel_size: 2, but the server runs with world size 1" in log, log[-3000:]
    assert "scripts/launch_triton_server.py --world_size 2" in log


def test_gpu_device_ids_that_do_not_place_every_instance_fail_the_load(failed_loads_log):
    log = failed_loads_log
    assert "gpu_device_ids: '0;1;2' places 3 instance(s), but instance_group has 2" in log, log[-3000:]
