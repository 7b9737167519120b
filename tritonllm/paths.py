"""Where the files beside the code are, in a source checkout and in an installed wheel.

A checkout keeps the model-repository templates in ``all_models/`` at its root (NVIDIA's docs
and clients use that path); a wheel installs the same files as package data,
``tritonllm/all_models/`` (setup.py maps the one folder into the package), since site-packages
has no room of its own for them.
"""
from __future__ import annotations

import os
import sys
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


def state_dir() -> Path:
    """Where `tritonllm serve` keeps what it builds and fills when no folder is given: the
    checkout (engines/, build/, as `make serve` always did), else $TRITONLLM_CACHE (default
    ~/.cache/tritonllm), since an installed package must not write into site-packages."""
    root = checkout_root()
    if root is not None:
        return root
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm"))


def subprocess_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which ``python -m openai_frontend`` / ``-m engine...`` find this
    project's packages: PACKAGES_ROOT goes on PYTHONPATH unless this interpreter already finds
    them there by itself (an installed wheel: site-packages), i.e. for a checkout, installed in
    editable mode (an import hook the child would also have) or not installed at all."""
    env = dict(os.environ if base is None else base)
    if str(PACKAGES_ROOT) not in {os.path.abspath(p) for p in sys.path if p}:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGES_ROOT), env.get("PYTHONPATH")) if p)
    return env
