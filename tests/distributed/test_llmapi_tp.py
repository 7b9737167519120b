"""The LLM-API repository (all_models/llmapi) with tensor_parallel_size 2 through the launcher's
leader mode: scripts/launch_triton_server.py --world_size 2 (mpirun, oversubscribed on the 2-core
CI machine; gloo) reads model.yaml, builds the checkpoint's engine with --tp_size 2 into the
cache, and starts the worker rank on it; rank 0's LLM-API model finds the same cache entry and
leads. Its greedy text equals one rank's on the same weights. A world size that is not
tensor_parallel_size is refused by name.

The checkpoint is a tiny random Llama with a byte-level BPE tokenizer trained here on a few
sentences (94 tokens, every split even for 2 ranks), so the whole test takes well under a minute.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tp_driver import GreedyDecoder
from tp_testing import TINY_LLAMA, build_tiny_engine, free_port, tiny_llama

pytestmark = [
    pytest.mark.integration,
    # `make test-all`: make test serves the LLM-API repository on one rank (test_llmapi_repository.py) and
    # leader-mode TP through the launcher (test_tp_serving.py); this is the two together.
    pytest.mark.extended,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="leader mode needs OpenMPI's mpirun"),
]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "Name three primary colors:"]
MAX_TOKENS = 12
SENTENCES = ["The capital of France is Paris. The sea is blue and the sky is wide.",
             "Name three primary colors: red, green and blue."]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_llmapi_tp", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(SENTENCES * 10, trainers.BpeTrainer(vocab_size=128, special_tokens=["<|endoftext|>"],
                                                                 show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, its model, its tokenizer): save_pretrained's files plus the tokenizer's."""
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) % 2 == 0
    TINY_LLAMA["vocab_size"], saved = len(tokenizer), TINY_LLAMA["vocab_size"]
    try:
        model = tiny_llama(seed=3)
    finally:
        TINY_LLAMA["vocab_size"] = saved
    folder = tmp_path_factory.mktemp("llmapi_tp") / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def one_rank_texts(model, tokenizer, work: Path) -> list[str]:
    """Greedy decoding on a tp-1 engine of the same weights, in this process, cut at the end id
    and decoded as the LLM-API model decodes (prompt left out, special tokens skipped)."""
    from engine.tensor_parallel.distributed import make_runner

    engine = build_tiny_engine(model, str(work / "tp1"), tp_size=1)
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    tokens, _ = GreedyDecoder(make_runner(engine, device="cpu", environ={}), prompts, MAX_TOKENS).run()
    texts = []
    for ids in tokens:
        if tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def model_yaml(checkpoint: Path, tp: int) -> str:
    return (f"model: {checkpoint}\ntensor_parallel_size: {tp}\npipeline_parallel_size: 1\ndtype: float32\n"
            "max_batch_size: 4\nmax_seq_len: 128\nmax_num_tokens: 256\n"
            "triton_config:\n  max_batch_size: 0\n  decoupled: true\n")


def launch_arguments(launcher, repo: Path, ports: list[str], work: Path, world_size: int):
    return launcher.parse_arguments([f"--model_repo={repo}", "--host=127.0.0.1", "--force",
                                     f"--http_port={ports[0]}", f"--grpc_port={ports[1]}",
                                     f"--metrics_port={ports[2]}", f"--cache_dir={work / 'cache'}",
                                     f"--world_size={world_size}", "--oversubscribe"])


def llmapi_repo(work: Path, yaml_text: str) -> Path:
    repo = work / "repo"
    shutil.copytree(ROOT / "all_models" / "llmapi", repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(yaml_text)
    return repo


def generate(http: str, prompt: str) -> requests.Response:
    return requests.post(f"{http}/v2/models/tensorrt_llm/generate", timeout=60,
                         json={"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS})


def pids_matching(text: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", "--", text], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def test_tensor_parallel_size_2_on_two_ranks_answers_like_one(checkpoint, tmp_path, monkeypatch):
    folder, model, tokenizer = checkpoint
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path / "tritonllm_cache"))
    monkeypatch.setenv("TRITONLLM_DIST_TIMEOUT_S", "20")
    expected = one_rank_texts(model, tokenizer, tmp_path)
    launcher, serve = load_script("launch_triton_server"), load_script("serve_default")
    repo = llmapi_repo(tmp_path, model_yaml(folder, 2))
    ports = [str(free_port()) for _ in range(3)]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = launcher.launch(launch_arguments(launcher, repo, ports, tmp_path, 2), stdout=log, stderr=log)
    try:
        engines = [p for p in (tmp_path / "tritonllm_cache" / "engines").iterdir() if (p / "config.json").exists()]
        assert len(engines) == 1 and json.loads((engines[0] / "config.json").read_text())["build"]["tp_size"] == 2
        if not serve.wait_until_ready(process, ports[0], timeout=120):
            pytest.fail(f"the world-size-2 LLM-API server did not become ready:\n{log_path.read_text()[-5000:]}")
        workers = pids_matching(f"engine.tensor_parallel.worker --engine_dir={engines[0]}")
        assert workers, log_path.read_text()[-3000:]
        texts = []
        for prompt in PROMPTS:
            response = generate(f"http://127.0.0.1:{ports[0]}", prompt)
            assert response.status_code == 200, f"{response.text}\n{log_path.read_text()[-3000:]}"
            texts.append(response.json()["text_output"])
        assert texts == expected and all(expected), (texts, expected)
        assert "reusing the cached engine" in log_path.read_text()  # rank 0's model found the launcher's build
    finally:
        # SIGKILL, not a graceful stop: mpirun holds a SIGTERM 10 s before it forwards it (the launcher's
        # odls_base_sigkill_timeout), then the ranks stop; stopping the ranks by SIGTERM to mpirun is
        # test_tp_serving.py's. The ranks and stubs (found by the repository and cache paths) go too.
        process.kill()
        process.wait()
        time.sleep(1)
        for pid in pids_matching(str(repo)) + pids_matching(str(tmp_path / "tritonllm_cache")):
            try:
                subprocess.run(["kill", "-9", str(pid)], check=False)
            except OSError:
                pass


def test_a_world_size_other_than_tensor_parallel_size_is_refused_by_name(checkpoint, tmp_path, monkeypatch):
    folder, _, _ = checkpoint
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path / "tritonllm_cache"))
    launcher = load_script("launch_triton_server")
    repo = llmapi_repo(tmp_path, model_yaml(folder, 1))
    with pytest.raises(RuntimeError) as error:
        launcher.launch(launch_arguments(launcher, repo, ["0", "0", "0"], tmp_path, 2))
    message = str(error.value)
    assert "tensor_parallel_size: 1, but the server runs with world size 2" in message
    assert "--world_size 1" in message and "model.yaml" in message
    assert not (tmp_path / "tritonllm_cache" / "engines").exists()  # nothing built
