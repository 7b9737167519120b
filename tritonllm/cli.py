"""``tritonllm``: the project's command line, installed by ``pip install`` (a wheel or ``-e .``).

    tritonllm serve [CHECKPOINT] [options]     build (once) and serve a model: tritonserver with the
                                               five-model repository, and the OpenAI API on :9000;
                                               no CHECKPOINT: the embedded SmolLM2 (`make serve`)
    tritonllm launch --model_repo=DIR [...]    start tritonserver on a filled repository
                                               (scripts/launch_triton_server.py's flags)
    tritonllm fill-template [-i] FILE K:V,...  fill a config.pbtxt template (tools/fill_template.py)
    tritonllm templates [DEST] [--llmapi]      copy the model-repository templates (all_models) to
                                               DEST, or print where they are installed

``tritonllm COMMAND --help`` gives each command's options. The usual way by hand, as in
tensorrtllm_backend's docs: ``tritonllm templates repo``, ``tritonllm fill-template -i
repo/tensorrt_llm/config.pbtxt engine_dir:...`` (each model), ``tritonllm launch --model_repo=repo``.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

USAGE = "usage: tritonllm {serve,launch,fill-template,templates} ...   (tritonllm COMMAND --help: its options)"
COMMANDS = ("serve", "launch", "fill-template", "templates")


def serve(argv: list[str]) -> None:
    from tritonllm.serve import main

    if argv and not argv[0].startswith("-"):  # the checkpoint, positional as in `vllm serve MODEL`
        argv = ["--model", argv[0], *argv[1:]]
    main(argv, prog="tritonllm serve")


def launch(argv: list[str]) -> None:
    from tritonllm.launcher import main

    main(argv, prog="tritonllm launch")


def fill_template(argv: list[str]) -> None:
    from tritonllm.fill_template import main

    main(argv, prog="tritonllm fill-template")


def templates(argv: list[str]) -> None:
    from tritonllm.paths import FIVE_MODELS, model_templates_dir

    parser = argparse.ArgumentParser(prog="tritonllm templates", description=(
        "Copy the model-repository templates (config.pbtxt with ${placeholders}, and each model's "
        "1/model.py) to DEST, to fill with `tritonllm fill-template`; without DEST, print where they are."))
    parser.add_argument("dest", nargs="?", help="a directory to create (it must not exist)")
    parser.add_argument("--llmapi", action="store_true",
                        help="the LLM-API repository (one tensorrt_llm model configured by model.yaml) "
                             "instead of the five-model one (ensemble, preprocessing, tensorrt_llm, "
                             "postprocessing, tensorrt_llm_bls)")
    args = parser.parse_args(argv)
    source = model_templates_dir() / "llmapi" if args.llmapi else model_templates_dir()
    if args.dest is None:
        print(source)
        return
    if Path(args.dest).exists():
        sys.exit(f"tritonllm templates: {args.dest} exists; give a new directory")
    wanted = None if args.llmapi else set(FIVE_MODELS)
    shutil.copytree(source, args.dest, ignore=lambda folder, names: [
        name for name in names
        if name == "__pycache__" or (wanted is not None and Path(folder) == source and name not in wanted)])
    print(f"tritonllm templates: copied {source} to {args.dest}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.exit(f"tritonllm: unknown command {command!r}; commands: {', '.join(COMMANDS)}\n{USAGE}")
    {"serve": serve, "launch": launch, "fill-template": fill_template, "templates": templates}[command](rest)


if __name__ == "__main__":
    main()
