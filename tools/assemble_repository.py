#!/usr/bin/env python3
"""Assemble a filled Triton model repository from the templates in all_models/, for one kind of model:

    python3 tools/assemble_repository.py --kind text|multimodal|llmapi|whisper|disaggregated \
        --engine_dir ENGINE --output REPO [--set MODEL:KEY=VALUE ...]

The layouts and values are tritonllm/repository.py's (``tritonllm serve`` assembles the same way):
text (the five models of all_models/), multimodal (with multimodal/ensemble and
multimodal/multimodal_encoders), llmapi (llmapi/tensorrt_llm), whisper (whisper/whisper_bls),
disaggregated (context/ and generation/ copies of tensorrt_llm behind disaggregated_serving_bls).
``--set`` overrides any value. Then launch:

    python3 scripts/launch_triton_server.py --model_repo REPO --tensorrt_llm_model_name tensorrt_llm,multimodal_encoders
    python3 scripts/launch_triton_server.py --model_repo REPO --tensorrt_llm_model_name context,generation
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's packages

from tritonllm.repository import LAYOUTS  # noqa: E402
from tritonllm.repository import assemble_repository as assemble_kind  # noqa: E402


def assemble_repository(kind: str, engine_dir: str, output: str, *, max_batch_size: int = 8,
                        overrides: dict[str, dict[str, str]] | None = None) -> str:
    """Copy ``kind``'s templates to ``output`` (replacing it) and fill them (tritonllm/repository.py)
    over tritonllm serve's text values; returns ``output``."""
    from tritonllm.serve import default_substitutions

    base = default_substitutions(os.path.abspath(engine_dir), max_batch_size=max_batch_size)
    return assemble_kind(kind, engine_dir, output, base, max_batch_size=max_batch_size, overrides=overrides)


def _overrides(items: list[str]) -> dict[str, dict[str, str]]:
    overrides: dict[str, dict[str, str]] = {}
    for item in items:
        model, sep, pair = item.partition(":")
        key, eq, value = pair.partition("=")
        if not sep or not eq or not model or not key:
            raise SystemExit(f"--set {item!r}: expected MODEL:KEY=VALUE, e.g. preprocessing:max_num_images=2")
        overrides.setdefault(model, {})[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=sorted(LAYOUTS))
    parser.add_argument("--engine_dir", required=True, help="the engine directory (engine.build's output)")
    parser.add_argument("--output", required=True, help="the repository to write (replaced if present)")
    parser.add_argument("--max_batch_size", type=int, default=8, help="triton_max_batch_size of every model")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL:KEY=VALUE",
                        help="a template value of one model (repeatable)")
    args = parser.parse_args(argv)
    try:
        repo = assemble_repository(args.kind, args.engine_dir, args.output, max_batch_size=args.max_batch_size,
                                   overrides=_overrides(args.set))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.kind} repository written to {repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
