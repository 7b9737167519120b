"""Fixtures of the engine tests; helpers live in engine_testing.py (conftest modules share one name)."""
import pytest

from engine_testing import FAMILIES


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_gloo_ranks():
    """At the session's end, stop the gloo ranks the tensor-parallel tests shared (gloo_ranks.py),
    if any were started."""
    yield
    from gloo_ranks import close_shared

    close_shared()
