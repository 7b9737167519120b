#!/usr/bin/env python3
"""Assemble a filled Triton model repository from the templates in all_models/, for one kind of model:

    python3 tools/assemble_repository.py --kind text|multimodal|llmapi --engine_dir ENGINE --output REPO \
        [--set MODEL:KEY=VALUE ...]

all_models/ holds the five text models at its top (a plain copy of them is the text repository) and,
in folders of their own that are not models, the other repositories' parts:
- text: ensemble, preprocessing, tensorrt_llm, postprocessing, tensorrt_llm_bls;
- multimodal: the text models with multimodal/ensemble in place of the text ensemble, plus
  multimodal/multimodal_encoders (a vision-language engine from engine.build, whose
  vision_encoder/ the preprocessing and multimodal_encoders models read);
- llmapi: llmapi/tensorrt_llm (TensorRT-LLM's LLM-API model; its model.yaml is edited, not filled).
Every config.pbtxt is filled as tritonllm serve fills the text repository (tritonllm/serve.py
default_substitutions), plus each kind's own values; ``--set`` overrides any of them. Then launch:

    python3 scripts/launch_triton_server.py --model_repo REPO --tensorrt_llm_model_name tensorrt_llm,multimodal_encoders
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's packages

from tritonllm.fill_template import fill_template  # noqa: E402
from tritonllm.paths import FIVE_MODELS, model_templates_dir  # noqa: E402

# kind -> (model name in the repository, its template folder under all_models/)
LAYOUTS = {
    "text": [(name, name) for name in FIVE_MODELS],
    "multimodal": [(name, name) for name in FIVE_MODELS if name != "ensemble"]
                  + [("ensemble", "multimodal/ensemble"), ("multimodal_encoders", "multimodal/multimodal_encoders")],
    "llmapi": [("tensorrt_llm", "llmapi/tensorrt_llm")],
}
VISION_ENCODER_DIR = "vision_encoder"  # engine/vision/encoder_dir.py: where engine.build writes it


def kind_substitutions(kind: str, engine_dir: str, max_batch_size: int) -> dict[str, dict[str, str]]:
    """Per-model values of ``kind`` besides tritonllm serve's text ones."""
    if kind != "multimodal":
        return {}
    encoder_dir = os.path.join(engine_dir, VISION_ENCODER_DIR)
    return {
        "preprocessing": {"multimodal_model_path": encoder_dir, "max_num_images": "1"},
        # The prompt holds image placeholders (ids past the vocabulary): outputs carry only new tokens.
        "tensorrt_llm": {"exclude_input_in_output": "True"},
        "tensorrt_llm_bls": {"multimodal_encoders_name": "multimodal_encoders"},
        "multimodal_encoders": {"triton_max_batch_size": str(max_batch_size), "multimodal_model_path": encoder_dir,
                                "hf_model_path": engine_dir, "encoder_input_features_data_type": "TYPE_FP16",
                                "max_queue_delay_microseconds": "0"},
    }


def substitutions(kind: str, engine_dir: str, max_batch_size: int = 8,
                  overrides: dict[str, dict[str, str]] | None = None) -> dict[str, dict[str, str]]:
    from tritonllm.serve import default_substitutions

    values = default_substitutions(engine_dir, max_batch_size=max_batch_size)
    for source in (kind_substitutions(kind, engine_dir, max_batch_size), overrides or {}):
        for model, pairs in source.items():
            values.setdefault(model, {}).update(pairs)
    return values


def assemble_repository(kind: str, engine_dir: str, output: str, *, max_batch_size: int = 8,
                        overrides: dict[str, dict[str, str]] | None = None) -> str:
    """Copy ``kind``'s templates to ``output`` (replacing it) and fill them; returns ``output``."""
    if kind not in LAYOUTS:
        raise ValueError(f"--kind {kind!r} is not a repository kind; allowed: {', '.join(LAYOUTS)}")
    engine_dir = os.path.abspath(engine_dir)
    if kind == "multimodal" and not os.path.isfile(os.path.join(engine_dir, VISION_ENCODER_DIR, "config.json")):
        raise ValueError(f"{engine_dir} has no {VISION_ENCODER_DIR}/: build a vision-language checkpoint "
                         "(LlavaForConditionalGeneration) with python -m engine.build")
    values = substitutions(kind, engine_dir, max_batch_size, overrides)
    repo, templates = Path(output), model_templates_dir()
    if repo.exists():
        shutil.rmtree(repo)
    for name, folder in LAYOUTS[kind]:
        shutil.copytree(templates / folder, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        config = repo / name / "config.pbtxt"
        text = config.read_text()
        # fill_template refuses keys a file lacks: the shared defaults name every model's keys
        pairs = {k: v for k, v in values.get(name, {}).items() if "${" + k + "}" in text}
        config.write_text(fill_template(text, ",".join(f"{k}:{_escape(v)}" for k, v in pairs.items()), str(config)))
    return str(repo)


def _escape(value: str) -> str:
    """fill_template escaping: `\\,` for a comma; `\\\\:` for a colon (two split levels)."""
    return value.replace("\\", "\\\\\\\\").replace(",", "\\,").replace(":", "\\\\:")


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
