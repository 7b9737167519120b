"""Fixtures of the engine tests; helpers live in engine_testing.py (conftest modules share one name)."""
import pytest

from engine_testing import FAMILIES


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param
