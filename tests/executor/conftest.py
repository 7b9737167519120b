"""Shared fixtures: one tiny random-weight Llama engine per session (tests/executor/tiny_engines.py)."""
from __future__ import annotations

import pytest
import transformers

from tiny_engines import build_tiny_engine, tiny_hf_model


@pytest.fixture(scope="session")
def tiny_hf() -> transformers.LlamaForCausalLM:
    return tiny_hf_model()


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_hf) -> str:
    return build_tiny_engine(tmp_path_factory.mktemp("tiny_engine"), tiny_hf)
