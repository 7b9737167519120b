"""LoRA adapters through a real tritonserver serving SmolLM2, the three ways users know:

1. the backend's lora_task_id / lora_weights / lora_config (FP16 rows as TensorRT-LLM's
   hf_lora_convert.py writes them; here tools/hf_lora_convert.py), sent as NVIDIA's
   inflight_batcher_llm_client.py (--lora-path --lora-task-id) and end_to_end_grpc_client.py send
   them: the first request all three, later ones the id alone;
2. a PEFT directory named by lora_id / lora_name / lora_path (TensorRT-LLM's LLM-API inputs);
3. the OpenAI frontend's --lora_modules, selected by model name.

The same adapter must give the same greedy tokens every way, other than the base model's; base
requests sent alongside keep the base model's tokens. The engine-level equality with
transformers + PEFT is tests/engine/test_lora_executor.py's. The session server has LoRA on
(scripts/serve_default.py: 4 slots, rank up to 64).
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from triton_helpers import grpc_inputs, wait_for, write_peft_adapter

pytestmark = pytest.mark.integration

PROMPT = [1, 504, 3458, 282, 4649, 314]  # SmolLM2 ids; any prompt does
# The adapters' greedy tokens part from the base's (and each other's) at the second token of PROMPT (12
# until 2026-11-30: every request's tokens are decode steps of the session engine).
NEW_TOKENS = 6
# "The capital of France is": the base and both session adapters answer " Paris.\n\nThe" alike and part
# at the sixth token, so 8 tokens (3 where they differ).
FRANCE, FRANCE_TOKENS = "The capital of France is", 8


def infer(grpc_url: str, model: str, tensors: dict[str, np.ndarray], output: str = "output_ids"):
    """One request over a gRPC stream, as NVIDIA's clients send it; (the output of its responses
    concatenated, error text or None)."""
    client = grpcclient.InferenceServerClient(grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer(model, grpc_inputs(tensors), outputs=[grpcclient.InferRequestedOutput(output)])
    client.stop_stream()
    client.close()
    errors = [str(error) for _, error in results if error is not None]
    if errors:
        return None, errors[0]
    arrays = [result.as_numpy(output) for result, _ in results if result is not None]
    if output == "output_ids":
        return [int(t) for a in arrays for t in a.reshape(-1) if t >= 0], None
    return "".join(a.reshape(-1)[0].decode() for a in arrays), None


def llm_tensors(**extra) -> dict[str, np.ndarray]:
    """inflight_batcher_llm_client.py's tensors (gRPC, streaming, greedy: top-k 1), plus ``extra``."""
    tensors = {"input_ids": np.array([PROMPT], np.int32), "input_lengths": np.array([[len(PROMPT)]], np.int32),
               "request_output_len": np.array([[NEW_TOKENS]], np.int32), "beam_width": np.array([[1]], np.int32),
               "temperature": np.array([[1.0]], np.float32), "streaming": np.array([[True]]),
               "end_id": np.array([[-1]], np.int32), "pad_id": np.array([[2]], np.int32),
               "runtime_top_k": np.array([[1]], np.int32), "runtime_top_p": np.array([[0.0]], np.float32),
               "exclude_input_in_output": np.array([[True]])}
    tensors.update(extra)
    return tensors


def task_id(value: int) -> dict[str, np.ndarray]:
    return {"lora_task_id": np.array([[value]], np.uint64)}


def peft_inputs(lora_id: int, path, name: str) -> dict[str, np.ndarray]:
    return {"lora_id": np.array([[lora_id]], np.uint64), "lora_name": np.array([[name.encode()]], dtype=object),
            "lora_path": np.array([[str(path).encode()]], dtype=object)}


def test_the_three_ways_in_give_the_same_tokens(triton_server, lora_adapters):
    peft_dirs, converted = lora_adapters
    url = triton_server.grpc_url
    weights = np.load(converted / "model.lora_weights.npy")
    config = np.load(converted / "model.lora_config.npy")
    assert weights.dtype == np.float16 and weights.ndim == 3 and config.shape[2] == 3
    # The base, 1. --lora-path --lora-task-id (the first request sends all three) and 2. the PEFT directory
    # the rows came from, at once (they wait on nothing of each other's)
    with ThreadPoolExecutor(3) as pool:
        (base, base_error), (first, first_error), (via_path, path_error) = pool.map(
            lambda extra: infer(url, "tensorrt_llm", llm_tensors(**extra)),
            [{}, {**task_id(101), "lora_weights": weights, "lora_config": config},
             peft_inputs(102, peft_dirs[0], "r8")])
    assert base_error is None and len(base) == NEW_TOKENS
    assert first_error is None and first != base
    # its float32 weights; the rows are float16 and still agree
    assert path_error is None and via_path == first
    # later requests send the id alone (results[1] and [4]); another adapter answers differently, and base
    # requests in the same batches stay the base's
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(infer, url, "tensorrt_llm", llm_tensors(**extra)) for extra in
                   [{}, task_id(101), peft_inputs(103, peft_dirs[1], "r16"), {}, task_id(101), {}]]
        results = [f.result() for f in futures]
    assert all(error is None for _, error in results), results
    tokens = [t for t, _ in results]
    assert tokens[0] == tokens[3] == tokens[5] == base and tokens[1] == tokens[4] == first
    assert tokens[2] not in (base, first)


def test_end_to_end_grpc_client_with_a_task_id(triton_server, lora_adapters):
    """end_to_end_grpc_client.py -p ... --lora-path DIR --lora-task-id N: its tensors to the ensemble
    and to the BLS; both give the text of the same tokens."""
    _, converted = lora_adapters
    weights = np.load(converted / "model.lora_weights.npy")
    config = np.load(converted / "model.lora_config.npy")
    tensors = {"text_input": np.array([[FRANCE]], dtype=object), "max_tokens": np.array([[FRANCE_TOKENS]], np.int32),
               "stream": np.array([[False]]), "beam_width": np.array([[1]], np.int32),
               "temperature": np.array([[1.0]], np.float32), "top_k": np.array([[1]], np.int32),
               "exclude_input_in_output": np.array([[True]]), "lora_task_id": np.array([[201]], np.uint64),
               "lora_weights": weights, "lora_config": config}
    with_adapter, error = infer(triton_server.grpc_url, "ensemble", tensors, output="text_output")
    assert error is None, error
    base_tensors = {k: v for k, v in tensors.items() if not k.startswith("lora")}
    by_id = {**base_tensors, "lora_task_id": np.array([[201]], np.uint64)}
    # the base and the id alone to each model, at once (once the adapter is in the cache)
    with ThreadPoolExecutor(3) as pool:
        (base, error), *again = pool.map(lambda job: infer(triton_server.grpc_url, job[0], job[1], output="text_output"),
                                         [("ensemble", base_tensors), ("ensemble", by_id), ("tensorrt_llm_bls", by_id)])
    assert error is None and base != with_adapter
    for model, (text, error) in zip(("ensemble", "tensorrt_llm_bls"), again):
        assert error is None and text == with_adapter, model


def test_bad_lora_inputs_fail_only_their_request(triton_server, lora_adapters, tmp_path):
    url = triton_server.grpc_url
    _, error = infer(url, "tensorrt_llm", llm_tensors(**task_id(999)))
    assert "lora_task_id 999 is not in the LoRA cache" in error
    _, error = infer(url, "tensorrt_llm", llm_tensors(**peft_inputs(998, tmp_path / "missing", "x")))
    assert "does not exist" in error
    (tmp_path / "big").mkdir()
    write_peft_adapter_config = lora_adapters[0][1] / "adapter_config.json"
    big = json.loads(write_peft_adapter_config.read_text())
    big["r"] = 128
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps(big))
    _, error = infer(url, "tensorrt_llm", llm_tensors(**peft_inputs(997, tmp_path / "big", "big")))
    assert "max_lora_rank 64" in error
    _, error = infer(url, "tensorrt_llm", llm_tensors(**task_id(996), lora_config=np.array([[[1, 0, 8]]], np.int32)))
    assert "lora_config was sent without lora_weights" in error
    tokens, error = infer(url, "tensorrt_llm", llm_tensors())
    assert error is None and len(tokens) == NEW_TOKENS


# Rank 16: these adapters' greedy tokens part from each other's within 6 tokens of PROMPT (7 of the first 8
# distinct; rank-4 ones of these seeds needed 12 tokens, two of them agreeing up to the tenth). Five adapters
# for the four slots: one waits for an eviction (eight until 2026-11-30, 11.8 s of CI's fresh clone).
CYCLE_RANK, CYCLE_TOKENS, CYCLE_ADAPTERS = 16, 6, 5


def test_more_lora_adapters_than_slots_cycle(triton_server, smollm2_engine_dir, tmp_path):
    """Five lora_adapters through the four device slots, two requests each, all at once: none fails, and an
    adapter's two requests agree. (Sent together, an adapter's two requests are served from the same slot; an
    adapter evicted and loaded again answering as before is tests/engine/test_lora_executor.py's
    test_twice_as_many_adapters_as_slots_cycle_without_errors.)"""
    n = CYCLE_ADAPTERS
    dirs = [write_peft_adapter(smollm2_engine_dir, tmp_path / f"a{i}", CYCLE_RANK, seed=100 + i) for i in range(n)]
    tokens = {"request_output_len": np.array([[CYCLE_TOKENS]], np.int32)}
    with ThreadPoolExecutor(2 * n) as pool:
        futures = [pool.submit(infer, triton_server.grpc_url, "tensorrt_llm",
                               llm_tensors(**peft_inputs(300 + i, dirs[i], f"a{i}"), **tokens))
                   for _ in range(2) for i in range(n)]
        results = [f.result() for f in futures]
    assert all(error is None for _, error in results), [e for _, e in results if e]
    assert [t for t, _ in results[:n]] == [t for t, _ in results[n:]]
    assert len({tuple(t) for t, _ in results[:n]}) >= n - 1


def test_openai_clients_select_adapters_by_name(triton_server, frontend, smollm2_engine_dir, lora_adapters):
    from openai import OpenAI

    peft_dirs, _ = lora_adapters
    # the session frontend serves both adapters (conftest.py: --lora_modules sql=... chat16=...)
    client = OpenAI(base_url=f"{frontend}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"smollm2", "sql", "chat16"}
    assert models["sql"].model_extra.get("parent") == "smollm2"

    def complete(model):
        return client.completions.create(model=model, prompt=FRANCE, max_tokens=FRANCE_TOKENS, temperature=0)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_engine_dir)
    ids = tokenizer(FRANCE).input_ids
    # the six completions, the same adapter directory by lora_path and a chat, all at once
    with ThreadPoolExecutor(8) as pool:
        by_path = pool.submit(infer, triton_server.grpc_url, "tensorrt_llm",
                              llm_tensors(**peft_inputs(104, peft_dirs[0], "r8"), input_ids=np.array([ids], np.int32),
                                          input_lengths=np.array([[len(ids)]], np.int32),
                                          request_output_len=np.array([[FRANCE_TOKENS]], np.int32)))
        chat = pool.submit(client.chat.completions.create, model="chat16", messages=[{"role": "user", "content": "Hi"}],
                           max_tokens=8, temperature=0)
        answers = list(pool.map(complete, ["sql", "smollm2", "chat16", "sql", "smollm2", "chat16"]))
        (first, error), chat = by_path.result(), chat.result()
    texts = [a.choices[0].text for a in answers]
    assert [a.model for a in answers] == ["sql", "smollm2", "chat16", "sql", "smollm2", "chat16"]
    assert texts[0] == texts[3] and texts[1] == texts[4] and texts[2] == texts[5]
    assert len({texts[0], texts[1], texts[2]}) == 3
    assert error is None, error
    assert texts[0] == tokenizer.decode(first, skip_special_tokens=True)
    assert chat.model == "chat16" and chat.choices[0].message.content
    with pytest.raises(Exception, match="model_not_found|does not exist|not found"):
        complete("nope")
    metrics = requests.get(f"{triton_server.metrics}/metrics", timeout=10).text
    assert wait_for(lambda: 'tritonllm_lora_requests_total{' in requests.get(f"{triton_server.metrics}/metrics",
                                                                            timeout=10).text, timeout=10), metrics


REFERENCE_CLIENTS = os.environ.get("TRITONLLM_REFERENCE_CLIENTS")  # tensorrtllm_backend's inflight_batcher_llm/client


@pytest.mark.skipif(not REFERENCE_CLIENTS, reason="set TRITONLLM_REFERENCE_CLIENTS to the folder of "
                    "tensorrtllm_backend's inflight_batcher_llm/client to run NVIDIA's clients themselves")
def test_nvidias_clients_with_lora_path_and_task_id(triton_server, smollm2_engine_dir, lora_adapters):
    """inflight_batcher_llm_client.py and end_to_end_grpc_client.py, unchanged, with --lora-path
    (the two .npy files tools/hf_lora_convert.py wrote) and --lora-task-id; then the id alone."""
    _, converted = lora_adapters
    common = ["-u", triton_server.grpc_url, "--lora-path", str(converted), "--lora-task-id", "501"]
    runs = [
        [os.path.join(REFERENCE_CLIENTS, "inflight_batcher_llm_client.py"), *common, "--tokenizer-dir",
         smollm2_engine_dir, "--streaming", "--request-output-len", "12", "--end-id", "2", "--pad-id", "2"],
        [os.path.join(REFERENCE_CLIENTS, "end_to_end_grpc_client.py"), *common, "-p", "The capital of France is",
         "-o", "12", "--model-name", "ensemble"],
    ]
    for command in runs:
        run = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "error" not in run.stdout.lower(), run.stdout
