"""Where the files beside the code are, in a source checkout and in an installed wheel.

A checkout keeps the model-repository templates in ``all_models/`` at its root (NVIDIA's docs
and clients use that path); a wheel installs the same files as package data,
``tritonllm/all_models/`` (setup.py maps the one folder into the package), since site-packages
has no room of its own for them.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The folder holding the project's packages (tritonllm, engine, serving, ...): the checkout's
# root, or site-packages for an installed wheel.
PACKAGES_ROOT = PACKAGE_DIR.parent
# The five models `tritonllm serve` fills; all_models/llmapi is a repository of its own.
FIVE_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


def checkout_root() -> Path | None:
    """The source checkout this package runs from (``pip install -e .`` or not installed at all);
    None for an installed wheel."""
    if (PACKAGES_ROOT / "all_models").is_dir() and (PACKAGES_ROOT / "pyproject.toml").is_file():
        return PACKAGES_ROOT
    return None


def model_templates_dir() -> Path:
    """The model-repository templates: the checkout's all_models/, else the wheel's copy."""
    root = checkout_root()
    return root / "all_models" if root is not None else PACKAGE_DIR / "all_models"


def cache_dir() -> Path:
    """$TRITONLLM_CACHE (default ~/.cache/tritonllm): where an installed package keeps what it
    builds, since it must not write into site-packages."""
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm"))


def default_engine_dir() -> Path:
    """Where `tritonllm serve` builds the embedded SmolLM2's engine: engines/smollm2 of a checkout
    (as `make serve` always did), else in the cache."""
    root = checkout_root()
    return (root if root is not None else cache_dir()) / "engines" / "smollm2"


def default_repo_dir() -> Path:
    """Where `tritonllm serve` fills its model repository: build/triton_repo of a checkout, else
    triton_repo in the cache."""
    root = checkout_root()
    return root / "build" / "triton_repo" if root is not None else cache_dir() / "triton_repo"
