"""``python -m openai_frontend``: serve the OpenAI-compatible API in front of a running tritonserver.

    python -m openai_frontend --grpc_url 127.0.0.1:8001 --model_repo build/triton_repo \
        [--host 127.0.0.1 --port 9000 --served_model_name smollm2] [--lora_modules sql=/adapters/sql]

The tokenizer (chat template, token counts) comes from ``--tokenizer_dir``, else from the
repository's ``preprocessing`` config. A vision-language engine (one with ``vision_encoder/``)
takes ``image_url`` parts in chat messages, its encoder run in this process (vision.py), with the
repository's ``preprocessing`` image limits. The frontend may start before Triton is ready: it answers
503 until the models are.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile

# (openai_frontend.app is imported in main, after PROMETHEUS_MULTIPROC_DIR is set for --workers:
# prometheus_client picks its value storage when it is first imported.)
from openai_frontend.lora_modules import parse_lora_modules
from openai_frontend.repository import lora_off_reason, tokenizer_settings, vision_settings
from openai_frontend.reasoning_parsers import NONE as NO_REASONING
from openai_frontend.reasoning_parsers import PARSERS as REASONING_PARSERS
from openai_frontend.tool_parsers import PARSERS
from openai_frontend.workers import serve, worker


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc_url", default="127.0.0.1:8001", help="tritonserver's gRPC endpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model_repo", default=None, help="filled model repository (for the tokenizer)")
    parser.add_argument("--tokenizer_dir", default=None, help="engine/tokenizer directory (overrides the repo's)")
    parser.add_argument("--served_model_name", default=None,
                        help="the model name clients use (default: the tokenizer directory's name)")
    parser.add_argument("--triton_model", default=None,
                        help="the model requests go to: the engine's own model (the default: --llm_model; "
                             "the frontend tokenizes the prompt and decodes the ids itself, one hop per token) "
                             "or a tensorrt_llm_bls (text in and out, through preprocessing and postprocessing "
                             "calls; slower at many streams). Not the ensemble: its streamed text splits "
                             "multi-byte characters when log-probs are on")
    parser.add_argument("--llm_model", default="tensorrt_llm", help="the model that holds the engine")
    parser.add_argument("--audio_model", default=None,
                        help="a Whisper engine's whisper_bls model: serves /v1/audio/transcriptions and "
                             "/v1/audio/translations (docs/features/encoder-decoder.md)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes serving the port (SO_REUSEPORT; the kernel spreads connections): one "
                             "Python process is saturated at about 7,000 streamed tokens a second; /metrics sums "
                             "every worker's")
    parser.add_argument("--tool_call_parser", default=None, choices=sorted(PARSERS),
                        help="how tool calls are read from the model's text with tool_choice auto: hermes "
                             "(<tool_call>{...}</tool_call>), llama3_json ({\"name\", \"parameters\"}, optionally "
                             "after <|python_tag|>), mistral ([TOOL_CALLS][{...}]), openai or harmony (gpt-oss's "
                             "harmony messages to=functions.NAME; vLLM's name); default: the format the chat "
                             "template uses (<tool_call> -> hermes, [TOOL_CALLS] -> mistral, <|python_tag|> -> "
                             "llama3_json, <|channel|> -> openai), else hermes")
    parser.add_argument("--reasoning_parser", default=None, choices=sorted(REASONING_PARSERS) + [NO_REASONING],
                        help="how a reasoning model's chat text is split into reasoning_content and content: "
                             "deepseek_r1 (the output starts inside <think>, ends it at </think>), qwen3 "
                             "(<think>...</think> before the answer; off per request with chat_template_kwargs "
                             "{\"enable_thinking\": false}), gpt_oss (harmony's analysis channel), none; default: "
                             "the chat template's (<think> -> qwen3, or deepseek_r1 in DeepSeek's templates; "
                             "<|channel|> -> gpt_oss), else none")
    parser.add_argument("--lora_modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served as models of their own (as vLLM's flag): each name=path, or "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; path is a PEFT "
                             "directory (adapter_config.json + weights) the server can read. A request whose "
                             "model is the name runs the base engine with that adapter (loaded on first use)")
    parser.add_argument("--allowed_local_media_path", default=None, metavar="DIR",
                        help="a vision-language model's image_url parts may be file: URLs of files under DIR "
                             "(as vLLM's flag); default: none")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


def config_from_arguments(args: argparse.Namespace):
    add_special_tokens = True
    tokenizer_dir = args.tokenizer_dir
    # A repository without preprocessing (the whisper one) leaves the tokenizer to --tokenizer_dir.
    if args.model_repo and (not tokenizer_dir or os.path.isdir(os.path.join(args.model_repo, "preprocessing"))):
        repo_tokenizer_dir, add_special_tokens = tokenizer_settings(args.model_repo)
        tokenizer_dir = tokenizer_dir or repo_tokenizer_dir
    if not tokenizer_dir:
        raise ValueError("pass --model_repo or --tokenizer_dir (the engine directory)")
    name = args.served_model_name or os.path.basename(os.path.normpath(tokenizer_dir))
    lora_modules = parse_lora_modules(args.lora_modules, name)
    if lora_modules and args.model_repo:  # without the repository, the frontend cannot tell
        reason = lora_off_reason(args.model_repo, args.llm_model)
        if reason is not None:
            raise ValueError(reason)
    from openai_frontend.app import FrontendConfig

    return FrontendConfig(grpc_url=args.grpc_url, tokenizer_dir=tokenizer_dir, served_model_name=name,
                          triton_model=args.triton_model or args.llm_model, llm_model=args.llm_model,
                          add_special_tokens=add_special_tokens, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          lora_modules=lora_modules, audio_model=args.audio_model,
                          vision=vision_settings(args.model_repo, tokenizer_dir, args.allowed_local_media_path))


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO, format="openai_frontend: %(message)s")
    metrics_dir = None
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="openai_frontend_metrics_")
    try:
        config = config_from_arguments(args)
    except ValueError as error:
        sys.exit(f"openai_frontend: {error}")
    spawn = multiprocessing.get_context("spawn")
    others = [spawn.Process(target=worker, args=(config, args.host, args.port, os.getpid()), daemon=True)
              for _ in range(args.workers - 1)]
    for process in others:
        process.start()
    print(f"openai_frontend: serving {config.served_model_name} on http://{args.host}:{args.port}/v1 "
          f"(Triton {config.triton_model} at {config.grpc_url}; {args.workers} worker(s))", flush=True)
    for module in config.lora_modules.values():
        print(f"openai_frontend: serving LoRA adapter {module.name} ({module.path}, lora_id {module.id})", flush=True)
    try:
        serve(config, args.host, args.port, reuse_port=args.workers > 1)
    finally:
        for process in others:
            process.terminate()
        for process in others:
            process.join(timeout=5)
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
